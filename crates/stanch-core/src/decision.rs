//! What the engine reports: every change it made and the rule behind it.
//!
//! Decisions are the audit trail. Each names its model (when it has one), says what
//! happened in one line ([`fmt::Display`]) and serializes with the thresholds that
//! made it, so that an engineer reading the history can tell why.

use std::fmt;

use serde::{Deserialize, Serialize};
use stanch_api::alerts::AlertSource;
use stanch_api::routes::PoolShare;
use stanch_api::{Fingerprint, HumanDuration, Rung, Timestamp};

use crate::mapping::Condition;

/// How an alert stopped being active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResolvedBy {
    /// A resolved notification.
    Notification,
    /// A pushed alert reached its `endsAt` without a refresh.
    Expired,
    /// Alertmanager no longer lists it.
    Reconciliation,
}

/// The rule behind a rung change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Rule {
    /// Conditions need a higher rung: move at once.
    Escalate {
        /// The rung the conditions require.
        required: Rung,
        /// Rungs passed over because their target was unhealthy.
        unviable: Vec<Rung>,
        /// The conditions, for humans.
        conditions: Vec<String>,
    },
    /// The higher rung's conditions stayed clear long enough: one step down.
    Deescalate {
        /// How long they have been clear.
        clear_for: HumanDuration,
        /// The stabilization window in force (after backoff).
        recover_after: HumanDuration,
        /// How long the previous rung was held.
        held_for: HumanDuration,
        /// The least time a rung is held.
        min_dwell: HumanDuration,
        /// Rungs passed over because their target was unhealthy.
        unviable: Vec<Rung>,
    },
    /// An operator forced the rung.
    Forced {
        /// The operator's reason.
        reason: String,
    },
    /// The flap guard raised the model to the highest rung of its window.
    FlapHold,
}

/// An operator's override, as decisions, the history and metrics name it
/// (`force`, `unblock-all`, `dry-run`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OverrideAction {
    /// A model pinned at a rung.
    Force,
    /// A pinned model handed back to automation.
    Release,
    /// Automation stopped for a model or for every model.
    Freeze,
    /// A freeze ended.
    Thaw,
    /// An endpoint blocked by hand.
    Block,
    /// A block lifted.
    Unblock,
    /// Every block lifted.
    UnblockAll,
    /// Dry-run turned on or off.
    DryRun,
    /// A fail-back skipped to its end.
    FailbackSkip,
    /// A fail-back aborted.
    FailbackAbort,
}

impl OverrideAction {
    /// Its name: `force`, `release`, `freeze`, `thaw`, `block`, `unblock`,
    /// `unblock-all`, `dry-run`, `failback-skip`, `failback-abort`.
    pub fn as_str(self) -> &'static str {
        match self {
            OverrideAction::Force => "force",
            OverrideAction::Release => "release",
            OverrideAction::Freeze => "freeze",
            OverrideAction::Thaw => "thaw",
            OverrideAction::Block => "block",
            OverrideAction::Unblock => "unblock",
            OverrideAction::UnblockAll => "unblock-all",
            OverrideAction::DryRun => "dry-run",
            OverrideAction::FailbackSkip => "failback-skip",
            OverrideAction::FailbackAbort => "failback-abort",
        }
    }
}

impl fmt::Display for OverrideAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One thing the engine did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decision {
    /// An alert became active (or was refreshed into a different meaning).
    AlertActive {
        /// Its fingerprint.
        fingerprint: Fingerprint,
        /// Its `alertname`.
        alertname: Option<String>,
        /// What it maps to.
        condition: Option<Condition>,
        /// Why it maps to nothing.
        unmapped: Option<String>,
    },
    /// An alert stopped being active.
    AlertResolved {
        /// Its fingerprint.
        fingerprint: Fingerprint,
        /// Its `alertname`.
        alertname: Option<String>,
        /// How.
        by: ResolvedBy,
    },
    /// A notification was recognised as stale and changed nothing.
    AlertIgnored {
        /// Its fingerprint.
        fingerprint: Fingerprint,
        /// Why.
        why: String,
    },
    /// New alerts found the engine holding `alerts.max_active` alerts, or
    /// `alerts.max_bytes` of them, already. One decision per source and step however
    /// many alerts it turned away, so that a flood from a high-cardinality rule is one
    /// entry, not thousands.
    AlertLimit {
        /// Who sent the new alerts.
        source: AlertSource,
        /// `alerts.max_active` in force.
        limit: usize,
        /// `alerts.max_bytes` in force (0 in entries written before it was kept).
        #[serde(default)]
        max_bytes: usize,
        /// New alerts not taken: the notification is answered 503.
        refused: usize,
        /// Alerts that map to nothing, dropped to make room for new ones that map to a
        /// condition.
        displaced: usize,
        /// The distinct `alertname`s of the alerts refused or dropped, at most
        /// [`Decision::NAMES_KEPT`]: which rule to look at.
        alertnames: Vec<String>,
    },
    /// A model changed rung.
    Transition {
        /// The model.
        model: String,
        /// From.
        from: Rung,
        /// To.
        to: Rung,
        /// The pool after.
        pool: String,
        /// The split across pools after, if the traffic is split.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        shares: Vec<PoolShare>,
        /// The alias after.
        alias: Option<String>,
        /// Why.
        #[serde(flatten)]
        rule: Rule,
    },
    /// A model moved pool on the same rung.
    PoolChanged {
        /// The model.
        model: String,
        /// From.
        from: String,
        /// To.
        to: String,
        /// Why.
        why: String,
    },
    /// A model's traffic moved between pools by share on the same rung.
    SharesChanged {
        /// The model.
        model: String,
        /// Each pool's share before (empty: `from_pool` took it all).
        from: Vec<PoolShare>,
        /// Each pool's share after (empty: `to_pool` takes it all).
        to: Vec<PoolShare>,
        /// The pool before.
        from_pool: String,
        /// The pool after.
        to_pool: String,
        /// True when traffic moved away from the primary, false when back toward it.
        away: bool,
        /// Why.
        why: String,
    },
    /// A fail-back moved a step: this much of the model's traffic is back where the
    /// lower rung sends it.
    FailbackStep {
        /// The model.
        model: String,
        /// The rung being left.
        from: Rung,
        /// The rung the traffic returns to.
        to: Rung,
        /// The percentage back now.
        percent: u8,
        /// The outcomes the step's gate was judged by, where the traffic returns:
        /// (successes, failures); `None` for the first step, or when the controller
        /// knows no endpoints there.
        outcomes: Option<(u64, u64)>,
        /// Why it moved.
        why: String,
    },
    /// A fail-back was given up: all of the traffic is back where it was.
    FailbackAborted {
        /// The model.
        model: String,
        /// The rung it stays on.
        from: Rung,
        /// The rung the traffic was returning to.
        to: Rung,
        /// The percentage that had returned.
        percent: u8,
        /// Why.
        why: String,
    },
    /// The flap guard pinned a model.
    FlapPinned {
        /// The model.
        model: String,
        /// The floor rung.
        rung: Rung,
        /// Until.
        until: Timestamp,
        /// Rung changes in the window.
        transitions: usize,
        /// The window.
        window: HumanDuration,
    },
    /// The flap guard's hold ended.
    PinEnded {
        /// The model.
        model: String,
    },
    /// The policy changed: a new configuration is in force.
    Configured {
        /// Models new to it (they start on the normal rung).
        added: Vec<String>,
        /// Models no longer in it (gone from the table).
        removed: Vec<String>,
        /// Models whose active pool is gone from their pools: back on the normal rung
        /// in their new primary, and re-evaluated at once.
        reset: Vec<String>,
    },
    /// An endpoint was soft-blocked.
    Blocked {
        /// The endpoint.
        endpoint: String,
        /// Its model, or all.
        model: Option<String>,
        /// Until.
        until: Timestamp,
        /// The block's length, after backoff and jitter.
        ttl: HumanDuration,
        /// Backoff level.
        strikes: u32,
        /// Why.
        reason: String,
    },
    /// A block was asked for and not made.
    BlockSkipped {
        /// The endpoint.
        endpoint: String,
        /// Its model, or all.
        model: Option<String>,
        /// Why not.
        why: String,
    },
    /// New blocks found the engine holding `blocking.max_blocks` already. One decision
    /// per step however many blocks it turned away, so that a flood of reports is one
    /// entry, not thousands.
    BlockLimit {
        /// The limit in force.
        limit: usize,
        /// Blocks not made.
        refused: usize,
        /// Blocks that gave way to blocks from a more trusted source.
        displaced: usize,
        /// The distinct endpoints of the blocks refused, at most
        /// [`Decision::NAMES_KEPT`]: where to look.
        endpoints: Vec<String>,
    },
    /// A block ended.
    Unblocked {
        /// The endpoint.
        endpoint: String,
        /// Its model, or all.
        model: Option<String>,
        /// Why.
        why: String,
    },
    /// An operator's override took effect.
    Override {
        /// Which override.
        action: OverrideAction,
        /// The model, if one.
        model: Option<String>,
        /// What it did.
        detail: String,
        /// The operator's reason.
        reason: String,
    },
    /// An override reached its TTL.
    OverrideEnded {
        /// `Force`, `Freeze` or `DryRun`.
        action: OverrideAction,
        /// The model, if one.
        model: Option<String>,
    },
    /// A new route version was published.
    Published {
        /// The version.
        version: u64,
        /// True when only leases were renewed.
        lease_renewal: bool,
    },
}

/// Shares as people read them: `dc-a 25% dc-b 75%`.
struct Split<'a>(&'a [PoolShare]);

impl fmt::Display for Split<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{} {}%", s.pool, s.percent)?;
        }
        Ok(())
    }
}

impl Decision {
    /// The most `alertnames` an [`Decision::AlertLimit`] lists, and the most
    /// `endpoints` a [`Decision::BlockLimit`] lists.
    pub const NAMES_KEPT: usize = 8;

    /// The model the decision is about, if one.
    pub fn model(&self) -> Option<&str> {
        match self {
            Decision::Transition { model, .. }
            | Decision::PoolChanged { model, .. }
            | Decision::SharesChanged { model, .. }
            | Decision::FailbackStep { model, .. }
            | Decision::FailbackAborted { model, .. }
            | Decision::FlapPinned { model, .. }
            | Decision::PinEnded { model } => Some(model),
            Decision::Blocked { model, .. }
            | Decision::BlockSkipped { model, .. }
            | Decision::Unblocked { model, .. }
            | Decision::Override { model, .. }
            | Decision::OverrideEnded { model, .. } => model.as_deref(),
            Decision::AlertActive { condition, .. } => {
                condition.as_ref().and_then(Condition::model)
            }
            Decision::AlertResolved { .. }
            | Decision::AlertIgnored { .. }
            | Decision::AlertLimit { .. }
            | Decision::BlockLimit { .. }
            | Decision::Configured { .. }
            | Decision::Published { .. } => None,
        }
    }

    /// A short stable name of the decision's kind, for history and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Decision::AlertActive { .. } => "alert_active",
            Decision::AlertResolved { .. } => "alert_resolved",
            Decision::AlertIgnored { .. } => "alert_ignored",
            Decision::AlertLimit { .. } => "alert_limit",
            Decision::Transition { .. } => "transition",
            Decision::PoolChanged { .. } => "pool_changed",
            Decision::SharesChanged { .. } => "shares_changed",
            Decision::FailbackStep { .. } => "failback_step",
            Decision::FailbackAborted { .. } => "failback_aborted",
            Decision::FlapPinned { .. } => "flap_pinned",
            Decision::PinEnded { .. } => "pin_ended",
            Decision::Configured { .. } => "configured",
            Decision::Blocked { .. } => "blocked",
            Decision::BlockSkipped { .. } => "block_skipped",
            Decision::BlockLimit { .. } => "block_limit",
            Decision::Unblocked { .. } => "unblocked",
            Decision::Override { .. } => "override",
            Decision::OverrideEnded { .. } => "override_ended",
            Decision::Published { .. } => "published",
        }
    }
}

fn or_all(model: &Option<String>) -> &str {
    model.as_deref().unwrap_or("all models")
}

impl fmt::Display for Decision {
    // Size: one arm per kind of decision, each its line of the audit trail.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::AlertActive {
                fingerprint,
                alertname,
                condition,
                unmapped,
            } => {
                let name = alertname.as_deref().unwrap_or("alert");
                match (condition, unmapped) {
                    (Some(c), _) => write!(f, "{name} {fingerprint} active: {c}"),
                    (None, Some(why)) => write!(f, "{name} {fingerprint} active, unmapped: {why}"),
                    (None, None) => write!(f, "{name} {fingerprint} active"),
                }
            }
            Decision::AlertResolved {
                fingerprint,
                alertname,
                by,
            } => {
                let name = alertname.as_deref().unwrap_or("alert");
                let by = match by {
                    ResolvedBy::Notification => "resolved",
                    ResolvedBy::Expired => "expired (no refresh before endsAt)",
                    ResolvedBy::Reconciliation => "resolved (Alertmanager no longer lists it)",
                };
                write!(f, "{name} {fingerprint} {by}")
            }
            Decision::AlertIgnored { fingerprint, why } => {
                write!(f, "alert {fingerprint} ignored: {why}")
            }
            Decision::AlertLimit {
                source,
                limit,
                max_bytes,
                refused,
                displaced,
                alertnames,
            } => {
                let source = match source {
                    AlertSource::Alertmanager => "Alertmanager",
                    AlertSource::Prometheus => "Prometheus",
                };
                write!(
                    f,
                    "alert limit ({limit} active or {} KiB held) reached:",
                    max_bytes / 1024
                )?;
                if *refused > 0 {
                    write!(f, " refused {refused} new from {source}")?;
                }
                if *displaced > 0 {
                    let and = if *refused > 0 { ";" } else { "" };
                    write!(
                        f,
                        "{and} dropped {displaced} unmapped for mapped ones from {source}"
                    )?;
                }
                if !alertnames.is_empty() {
                    write!(f, " ({})", alertnames.join(", "))?;
                }
                Ok(())
            }
            Decision::Transition {
                model,
                from,
                to,
                pool,
                shares,
                alias,
                rule,
            } => {
                write!(f, "{model}: {from} -> {to} (pool {pool}")?;
                if !shares.is_empty() {
                    write!(f, ", {}", Split(shares))?;
                }
                if let Some(a) = alias {
                    write!(f, ", alias {a}")?;
                }
                f.write_str(") ")?;
                match rule {
                    Rule::Escalate { conditions, .. } => {
                        write!(f, "escalated: {}", conditions.join("; "))
                    }
                    Rule::Deescalate {
                        clear_for,
                        recover_after,
                        ..
                    } => {
                        write!(
                            f,
                            "recovered: clear for {clear_for} (window {recover_after})"
                        )
                    }
                    Rule::Forced { reason } => write!(f, "forced by operator: {reason}"),
                    Rule::FlapHold => f.write_str("held by the flap guard"),
                }
            }
            Decision::PoolChanged {
                model,
                from,
                to,
                why,
            } => {
                write!(f, "{model}: pool {from} -> {to}: {why}")
            }
            Decision::SharesChanged {
                model,
                from,
                to,
                from_pool,
                to_pool,
                why,
                ..
            } => {
                let side = |shares: &[PoolShare], pool: &str| {
                    if shares.is_empty() {
                        format!("{pool} 100%")
                    } else {
                        Split(shares).to_string()
                    }
                };
                write!(
                    f,
                    "{model}: shares {} -> {}: {why}",
                    side(from, from_pool),
                    side(to, to_pool)
                )
            }
            Decision::FailbackStep {
                model,
                to,
                percent,
                why,
                ..
            } => write!(f, "{model}: failing back to {to}, {percent}% back: {why}"),
            Decision::FailbackAborted {
                model,
                from,
                to,
                percent,
                why,
            } => write!(
                f,
                "{model}: fail-back to {to} aborted at {percent}%: {why}; all of it back on {from}"
            ),
            Decision::FlapPinned {
                model,
                rung,
                until,
                transitions,
                window,
            } => write!(
                f,
                "{model}: flapping ({transitions} transitions in {window}); pinned at {rung} until {until}"
            ),
            Decision::PinEnded { model } => write!(f, "{model}: flap hold ended"),
            Decision::Configured {
                added,
                removed,
                reset,
            } => {
                let list = |v: &[String]| {
                    if v.is_empty() {
                        "-".to_owned()
                    } else {
                        v.join(", ")
                    }
                };
                write!(
                    f,
                    "configuration changed: added {}; removed {}; reset (active pool gone) {}",
                    list(added),
                    list(removed),
                    list(reset)
                )
            }
            Decision::Blocked {
                endpoint,
                model,
                ttl,
                strikes,
                reason,
                ..
            } => write!(
                f,
                "blocked {endpoint} for {} for {ttl} (strike {strikes}): {reason}",
                or_all(model)
            ),
            Decision::BlockSkipped {
                endpoint,
                model,
                why,
            } => {
                write!(f, "not blocking {endpoint} for {}: {why}", or_all(model))
            }
            Decision::BlockLimit {
                limit,
                refused,
                displaced,
                endpoints,
            } => {
                write!(f, "block limit ({limit} blocks) reached:")?;
                if *refused > 0 {
                    write!(f, " refused {refused} new")?;
                }
                if *displaced > 0 {
                    let and = if *refused > 0 { ";" } else { "" };
                    write!(
                        f,
                        "{and} {displaced} fleet or alert blocks gave way to more trusted ones"
                    )?;
                }
                if !endpoints.is_empty() {
                    write!(f, " ({})", endpoints.join(", "))?;
                }
                Ok(())
            }
            Decision::Unblocked {
                endpoint,
                model,
                why,
            } => {
                write!(f, "unblocked {endpoint} for {}: {why}", or_all(model))
            }
            Decision::Override {
                action,
                detail,
                reason,
                ..
            } => {
                write!(f, "{action}: {detail} (reason: {reason})")
            }
            Decision::OverrideEnded { action, model } => match model {
                Some(m) => write!(f, "{action} of {m} ended (ttl)"),
                None => write!(f, "{action} ended (ttl)"),
            },
            Decision::Published {
                version,
                lease_renewal: false,
            } => write!(f, "published version {version}"),
            Decision::Published {
                version,
                lease_renewal: true,
            } => {
                write!(f, "published version {version} (lease renewal)")
            }
        }
    }
}

//! `Input::Command`: an operator's overrides, checked at the edge
//! ([`check_command`]), applied, and ended when their time is up.

use stanch_api::admin::MAX_TTL;
use stanch_api::status::{ForceInfo, OverrideInfo};
use stanch_api::{HumanDuration, Rung, Timestamp};

use super::{Command, Engine, MAX_ENDPOINT_BYTES};
use crate::blocks::NewBlock;
use crate::config::Config;
use crate::decision::{Decision, OverrideAction};
use crate::mapping::Condition;
use crate::state::{BlockKey, BlockSource};

/// An override that cannot be applied as asked, before it is journaled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct BadCommand {
    /// The request's field at fault (`model`, `ttl`, `endpoint`, `rung`).
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

fn bad(field: &'static str, problem: impl Into<String>) -> BadCommand {
    BadCommand {
        field,
        problem: problem.into(),
    }
}

/// Checks an override against `config` before it is journaled: unknown models, a
/// degraded rung without a fallback, empty endpoints and zero TTLs are refused with
/// the field named. The engine itself accepts anything.
pub fn check_command(config: &Config, command: &Command) -> Result<(), BadCommand> {
    let model_known = |m: &str| {
        if config.models.contains_key(m) {
            Ok(())
        } else {
            Err(bad("model", format!("{m:?} is not configured")))
        }
    };
    let any_model = |m: &Option<String>| m.as_deref().map_or(Ok(()), model_known);
    let endpoint = |v: &str| {
        if v.trim().is_empty() {
            Err(bad("endpoint", "must not be empty"))
        } else if !stanch_api::routes::valid_endpoint(v) {
            Err(bad(
                "endpoint",
                format!("at most {MAX_ENDPOINT_BYTES} bytes, no control characters"),
            ))
        } else {
            Ok(())
        }
    };
    let positive = |ttl: &Option<HumanDuration>| match ttl {
        Some(d) if d.0.is_zero() => Err(bad("ttl", "must be longer than 0s")),
        Some(d) if *d > MAX_TTL => Err(bad(
            "ttl",
            format!("at most {MAX_TTL} (leave ttl out for an override that lasts until lifted)"),
        )),
        _ => Ok(()),
    };
    match command {
        Command::Force {
            model, rung, ttl, ..
        } => {
            model_known(model)?;
            positive(ttl)?;
            if *rung == Rung::Degraded && config.models[model].fallback.is_none() {
                return Err(bad(
                    "rung",
                    format!("{model} has no fallback model to degrade to"),
                ));
            }
            Ok(())
        }
        Command::Release { model, .. } => model_known(model),
        Command::Freeze { model, ttl, .. } => {
            any_model(model)?;
            positive(ttl)
        }
        Command::Thaw { model, .. } => any_model(model),
        Command::Block {
            endpoint: e,
            model,
            ttl,
            ..
        } => {
            endpoint(e)?;
            any_model(model)?;
            positive(ttl)
        }
        Command::Unblock { endpoint: e, .. } => endpoint(e),
        Command::Failback { model, .. } => model_known(model),
        Command::UnblockAll { .. } | Command::DryRun { .. } => Ok(()),
    }
}

/// What an override did, for the step's decision.
struct Done {
    action: OverrideAction,
    model: Option<String>,
    detail: String,
}

impl Engine {
    /// Applies `command`; an override that changes nothing (a release of a model not
    /// forced, a thaw of one not frozen) decides nothing.
    pub(super) fn command(&mut self, command: Command, now: Timestamp, out: &mut Vec<Decision>) {
        let info = |reason: &str, ttl: Option<HumanDuration>| OverrideInfo {
            reason: reason.to_owned(),
            since: now,
            until: ttl.map(|d| now + d.0),
        };
        let (done, reason) = match command {
            Command::Force {
                model,
                rung,
                ttl,
                reason,
            } => (self.force(&model, rung, info(&reason, ttl), ttl), reason),
            Command::Release { model, reason } => (self.release(&model, now), reason),
            Command::Freeze { model, ttl, reason } => (
                self.freeze(model.as_deref(), info(&reason, ttl), ttl),
                reason,
            ),
            Command::Thaw { model, reason } => (self.thaw(model.as_deref()), reason),
            Command::Block {
                endpoint,
                model,
                ttl,
                reason,
            } => {
                let key = BlockKey { endpoint, model };
                return self.operator_block(key, ttl, reason, now, out);
            }
            Command::Unblock {
                endpoint,
                model,
                reason,
            } => {
                let key = BlockKey { endpoint, model };
                return self.unblock(key, reason, out);
            }
            Command::UnblockAll { reason } => return self.unblock_all(reason, out),
            Command::Failback {
                model,
                order,
                reason,
            } => (self.order_failback(&model, order, &reason), reason),
            Command::DryRun { enabled, reason } => (
                self.set_dry_run(enabled.then(|| info(&reason, None))),
                reason,
            ),
        };
        if let Some(done) = done {
            out.push(override_decision(done, reason));
        }
    }

    fn force(
        &mut self,
        model: &str,
        rung: Rung,
        info: OverrideInfo,
        ttl: Option<HumanDuration>,
    ) -> Option<Done> {
        let st = self.state.models.get_mut(model)?;
        st.force = Some(ForceInfo { rung, info });
        let detail = format!("{model} pinned at {rung}{}", for_ttl(ttl));
        Some(Done::of(OverrideAction::Force, detail).about(model))
    }

    fn release(&mut self, model: &str, now: Timestamp) -> Option<Done> {
        let st = self.state.models.get_mut(model)?;
        st.force.take()?;
        // Automation resumes from the forced rung, which it must hold a full dwell.
        st.since = now;
        let detail = format!("{model} released to automation");
        Some(Done::of(OverrideAction::Release, detail).about(model))
    }

    fn freeze(
        &mut self,
        model: Option<&str>,
        info: OverrideInfo,
        ttl: Option<HumanDuration>,
    ) -> Option<Done> {
        match model {
            Some(model) => {
                let st = self.state.models.get_mut(model)?;
                st.freeze = Some(info);
                let detail = format!("{model} frozen{}", for_ttl(ttl));
                Some(Done::of(OverrideAction::Freeze, detail).about(model))
            }
            None => {
                self.state.global_freeze = Some(info);
                let detail = format!("every model frozen{}", for_ttl(ttl));
                Some(Done::of(OverrideAction::Freeze, detail))
            }
        }
    }

    fn thaw(&mut self, model: Option<&str>) -> Option<Done> {
        match model {
            Some(model) => {
                self.state.models.get_mut(model)?.freeze.take()?;
                Some(Done::of(OverrideAction::Thaw, format!("{model} thawed")).about(model))
            }
            None => {
                self.state.global_freeze.take()?;
                Some(Done::of(
                    OverrideAction::Thaw,
                    "global freeze ended".to_owned(),
                ))
            }
        }
    }

    /// An operator's word on a model's fail-back, carried out as the step evaluates the
    /// model; nothing when none is under way.
    fn order_failback(
        &mut self,
        model: &str,
        action: stanch_api::admin::FailbackAction,
        reason: &str,
    ) -> Option<Done> {
        use stanch_api::admin::FailbackAction;
        let fb = self.state.models.get_mut(model)?.failback.as_mut()?;
        fb.order = Some((action, reason.to_owned()));
        let (action, detail) = match action {
            FailbackAction::Skip => (
                OverrideAction::FailbackSkip,
                format!("{model}: the rest of its traffic returns to {} now", fb.to),
            ),
            FailbackAction::Abort => (
                OverrideAction::FailbackAbort,
                format!("{model}: its fail-back to {} given up", fb.to),
            ),
        };
        Some(Done::of(action, detail).about(model))
    }

    /// Dry-run on with `on`'s account, or off with `None`; nothing if already so.
    fn set_dry_run(&mut self, on: Option<OverrideInfo>) -> Option<Done> {
        let detail = match (on, self.state.dry_run.is_some()) {
            (Some(info), false) => {
                self.state.dry_run = Some(info);
                "dry-run on: decisions are reported, not published"
            }
            (None, true) => {
                self.state.dry_run = None;
                "dry-run off: decisions are published again"
            }
            _ => return None,
        };
        Some(Done::of(OverrideAction::DryRun, detail.to_owned()))
    }

    /// An operator's block, for `ttl` or the configured TTL. At the block limit with
    /// only operators' blocks held, nothing is done and the step's block-limit
    /// decision says so.
    fn operator_block(
        &mut self,
        key: BlockKey,
        ttl: Option<HumanDuration>,
        reason: String,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        let done = override_decision(
            Done {
                action: OverrideAction::Block,
                model: key.model.clone(),
                detail: format!("{key} blocked by operator"),
            },
            reason.clone(),
        );
        let fixed = Some(ttl.map_or(self.config.blocking.ttl.0, |d| d.0));
        let new = NewBlock {
            key,
            reason,
            source: BlockSource::Operator,
            fixed,
        };
        let at = out.len();
        if self.block(new, now, out) {
            out.insert(at, done);
        }
    }

    fn unblock(&mut self, key: BlockKey, reason: String, out: &mut Vec<Decision>) {
        if self.state.blocks.remove(&key).is_none() {
            return;
        }
        self.state.strikes.remove(&key);
        self.suppress_block_alerts(|k| *k == key);
        let done = Done {
            action: OverrideAction::Unblock,
            model: key.model.clone(),
            detail: format!("{key} unblocked"),
        };
        out.push(override_decision(done, reason.clone()));
        out.push(Decision::Unblocked {
            endpoint: key.endpoint,
            model: key.model,
            why: format!("operator: {reason}"),
        });
    }

    fn unblock_all(&mut self, reason: String, out: &mut Vec<Decision>) {
        let lifted = std::mem::take(&mut self.state.blocks);
        self.state.strikes.clear();
        self.suppress_block_alerts(|_| true);
        let detail = format!("{} block(s) lifted", lifted.len());
        out.push(override_decision(
            Done::of(OverrideAction::UnblockAll, detail),
            reason.clone(),
        ));
        for key in lifted.into_keys() {
            out.push(Decision::Unblocked {
                endpoint: key.endpoint,
                model: key.model,
                why: format!("operator unblock-all: {reason}"),
            });
        }
    }

    /// Marks the block alerts for matching keys as handled, so an operator's unblock is
    /// not undone until the alert resolves and fires anew.
    fn suppress_block_alerts(&mut self, matches: impl Fn(&BlockKey) -> bool) {
        for record in self.state.alerts.values_mut() {
            if let Some(Condition::BlockEndpoint { endpoint, model }) = &record.condition
                && matches(&BlockKey {
                    endpoint: endpoint.clone(),
                    model: model.clone(),
                })
            {
                record.block_applied = true;
            }
        }
    }

    /// Ends the overrides and flap pins whose time is up at `now`.
    pub(super) fn expire_overrides(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let due = |until: Option<Timestamp>| until.is_some_and(|u| u <= now);
        let ended = |action, model: Option<&String>| Decision::OverrideEnded {
            action,
            model: model.cloned(),
        };
        for (name, st) in &mut self.state.models {
            if st.force.as_ref().is_some_and(|f| due(f.info.until)) {
                st.force = None;
                st.since = now;
                out.push(ended(OverrideAction::Force, Some(name)));
            }
            if st.freeze.as_ref().is_some_and(|f| due(f.until)) {
                st.freeze = None;
                out.push(ended(OverrideAction::Freeze, Some(name)));
            }
            if st.pin.as_ref().is_some_and(|p| p.until <= now) {
                st.pin = None;
                out.push(Decision::PinEnded {
                    model: name.clone(),
                });
            }
        }
        for (slot, action) in [
            (&mut self.state.global_freeze, OverrideAction::Freeze),
            (&mut self.state.dry_run, OverrideAction::DryRun),
        ] {
            if slot.as_ref().is_some_and(|o| due(o.until)) {
                *slot = None;
                out.push(ended(action, None));
            }
        }
    }

    /// Why automation is held for `model` (or for every model), if it is.
    pub(super) fn frozen(&self, model: Option<&str>) -> Option<String> {
        if let Some(g) = &self.state.global_freeze {
            return Some(format!("global freeze: {}", g.reason));
        }
        let st = self.state.models.get(model?)?;
        st.freeze.as_ref().map(|f| f.reason.clone())
    }
}

impl Done {
    fn of(action: OverrideAction, detail: String) -> Done {
        Done {
            action,
            model: None,
            detail,
        }
    }

    /// The same record, about `model`.
    fn about(self, model: &str) -> Done {
        Done {
            model: Some(model.to_owned()),
            ..self
        }
    }
}

fn override_decision(done: Done, reason: String) -> Decision {
    Decision::Override {
        action: done.action,
        model: done.model,
        detail: done.detail,
        reason,
    }
}

/// ` for 10m`, or nothing for an override without a TTL.
fn for_ttl(ttl: Option<HumanDuration>) -> String {
    ttl.map_or_else(String::new, |d| format!(" for {d}"))
}

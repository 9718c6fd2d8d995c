//! The engine: one writer that turns inputs into decisions and a route table.
//!
//! [`Engine::step`] takes an [`Input`] and the current time, and returns the
//! [`Decision`]s it made. It never fails and never does IO; the same state, inputs
//! and times always give the same decisions, which is what makes the state store's
//! journal replayable.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use stanch_api::admin::MAX_TTL;
use stanch_api::alerts::{AlertSource, AlertStatus, IncomingAlert};
use stanch_api::routes::{BlockedEndpoint, ModelRoute};
use stanch_api::status::{
    BlockOrigin, BlockStatus, ConditionStatus, ForceInfo, ModelStatus, OverrideInfo, StepDown,
};
use stanch_api::{Fingerprint, HumanDuration, RouteTable, Rung, Timestamp};

use crate::blocks::{self, NewBlock};
use crate::config::{AlertPolicy, Config};
use crate::decision::{Decision, ResolvedBy};
use crate::ladder::{self, Ctx, Health};
use crate::mapping::{Condition, Mapper};

mod fleet;

use crate::state::{
    AlertRecord, BlockKey, BlockSource, EngineState, ModelState, Published, Tombstone,
};
pub use fleet::{Admitted, ReportRefusals};

pub use stanch_api::routes::MAX_ENDPOINT_BYTES;

/// Resolved alerts remembered at most, whatever their age.
const MAX_TOMBSTONES: usize = 10_000;

/// Something that happened, for the engine to act on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Input {
    /// A batch of alerts from a notification.
    Alerts {
        /// The alerts, validated.
        alerts: Vec<IncomingAlert>,
    },
    /// Alertmanager's list of active alerts for our receiver, fetched at `as_of`.
    Reconcile {
        /// Every alert Alertmanager lists as active.
        alerts: Vec<IncomingAlert>,
        /// When the list was asked for: alerts received after it are not resolved by it.
        as_of: Timestamp,
    },
    /// A gateway's outcome counts since its previous report.
    Reports {
        /// The gateway.
        gateway: String,
        /// Per (endpoint, model).
        endpoints: Vec<stanch_api::reports::EndpointReport>,
    },
    /// An operator's override.
    Command {
        /// The override.
        command: Command,
    },
    /// Time passed: expire what is due.
    Tick,
    /// A new configuration, validated: the policy changed (a policy resource was
    /// edited, the file was reloaded). Journaled like any input, so a replay reaches
    /// the same state under the same configurations in the same order.
    Configure {
        /// The configuration from now on.
        config: Box<Config>,
    },
}

/// An operator's override, validated at the edge by [`Engine::check_command`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum Command {
    /// Pin a model's rung.
    Force {
        /// The model.
        model: String,
        /// The rung.
        rung: Rung,
        /// Optional end.
        ttl: Option<HumanDuration>,
        /// Why.
        reason: String,
    },
    /// End a pin.
    Release {
        /// The model.
        model: String,
        /// Why.
        reason: String,
    },
    /// Stop automation for a model, or for everything.
    Freeze {
        /// The model, or `None` for all.
        model: Option<String>,
        /// Optional end.
        ttl: Option<HumanDuration>,
        /// Why.
        reason: String,
    },
    /// End a freeze.
    Thaw {
        /// The model, or `None` for the global freeze.
        model: Option<String>,
        /// Why.
        reason: String,
    },
    /// Block an endpoint by hand.
    Block {
        /// The endpoint.
        endpoint: String,
        /// The model, or `None` for all.
        model: Option<String>,
        /// Its length; the configured block time when `None`.
        ttl: Option<HumanDuration>,
        /// Why.
        reason: String,
    },
    /// Lift a block.
    Unblock {
        /// The endpoint.
        endpoint: String,
        /// The model, or `None` for the endpoint-wide block.
        model: Option<String>,
        /// Why.
        reason: String,
    },
    /// Lift every block.
    UnblockAll {
        /// Why.
        reason: String,
    },
    /// Turn dry-run on or off.
    DryRun {
        /// On or off.
        enabled: bool,
        /// Why.
        reason: String,
    },
}

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// Everything decided, in order.
    pub decisions: Vec<Decision>,
    /// True when the state changed, so the input must be journaled.
    pub changed: bool,
}

/// The decision engine. Owns the state; see the module docs.
#[derive(Debug, Clone)]
pub struct Engine {
    config: Config,
    mapper: Mapper,
    /// The endpoints the configuration lists per model, for admitting reports.
    topology: fleet::Topology,
    state: EngineState,
    /// The bytes the active alerts hold (`IncomingAlert::held_bytes`), counted when
    /// the engine is made and kept where alerts are added, replaced and removed.
    alert_bytes: usize,
    overflow: Overflow,
}

/// What the alert limit turned away during one step's input, reported when the input
/// is done as one [`Decision::AlertLimit`] per source.
#[derive(Debug, Clone, Default)]
struct Overflow {
    /// [`Decision::AlertLimit`]s, at most one per source, and at most one
    /// [`Decision::BlockLimit`].
    limits: Vec<Decision>,
    /// Set once a search for an unmapped alert to drop found none, so that the rest
    /// of a full step need not search again; cleared when one is taken in.
    none_unmapped: bool,
}

/// How the alert limit treated an alert.
#[derive(Debug, Clone, Copy)]
enum Overflowed {
    /// A new alert, not taken.
    Refused,
    /// An unmapped alert, dropped for a new mapped one.
    Displaced,
}

impl Overflow {
    fn record(
        &mut self,
        source: AlertSource,
        policy: &AlertPolicy,
        alertname: Option<&str>,
        how: Overflowed,
    ) {
        let slot = self.slot(
            |d| matches!(d, Decision::AlertLimit { source: s, .. } if *s == source),
            || Decision::AlertLimit {
                source,
                limit: policy.max_active,
                max_bytes: policy.max_bytes,
                refused: 0,
                displaced: 0,
                alertnames: Vec::new(),
            },
        );
        let Decision::AlertLimit {
            refused,
            displaced,
            alertnames,
            ..
        } = slot
        else {
            unreachable!("found as an alert-limit decision")
        };
        match how {
            Overflowed::Refused => *refused += 1,
            Overflowed::Displaced => *displaced += 1,
        }
        if let Some(name) = alertname {
            keep_name(alertnames, name);
        }
    }

    /// Counts a block refused (`refused`) or displaced at the block limit.
    fn record_block(&mut self, limit: usize, endpoint: &str, refused: bool) {
        let slot = self.slot(
            |d| matches!(d, Decision::BlockLimit { .. }),
            || Decision::BlockLimit {
                limit,
                refused: 0,
                displaced: 0,
                endpoints: Vec::new(),
            },
        );
        let Decision::BlockLimit {
            refused: r,
            displaced,
            endpoints,
            ..
        } = slot
        else {
            unreachable!("found as a block-limit decision")
        };
        if refused {
            *r += 1;
            keep_name(endpoints, endpoint);
        } else {
            *displaced += 1;
        }
    }

    /// The step's decision that `is` finds, added as `new` makes it if there is none.
    fn slot(
        &mut self,
        is: impl Fn(&Decision) -> bool,
        new: impl FnOnce() -> Decision,
    ) -> &mut Decision {
        let at = match self.limits.iter().position(is) {
            Some(at) => at,
            None => {
                self.limits.push(new());
                self.limits.len() - 1
            }
        };
        &mut self.limits[at]
    }

    /// The step's decisions, and a clean slate for the next step.
    fn take(&mut self) -> Vec<Decision> {
        self.none_unmapped = false;
        std::mem::take(&mut self.limits)
    }
}

/// Adds `name` to `names` unless it is there or [`Decision::NAMES_KEPT`] are.
fn keep_name(names: &mut Vec<String>, name: &str) {
    if names.len() < Decision::NAMES_KEPT && !names.iter().any(|n| n == name) {
        names.push(name.to_owned());
    }
}

impl Engine {
    /// A state with no history, under a new `epoch`.
    pub fn fresh_state(epoch: String, now: Timestamp) -> EngineState {
        EngineState {
            epoch,
            version: 0,
            generated_at: now,
            alerts: Default::default(),
            tombstones: Default::default(),
            models: Default::default(),
            blocks: Default::default(),
            strikes: Default::default(),
            fleet: Default::default(),
            global_freeze: None,
            dry_run: None,
            published: Published::default(),
            config: None,
        }
    }

    /// An engine over `state` (fresh or restored), for a validated `config`. Models
    /// the config no longer has are dropped, new ones start healthy; alerts are
    /// re-mapped under the current config.
    pub fn new(config: Config, mut state: EngineState, now: Timestamp) -> Engine {
        let mapper = Mapper::new(&config);
        fit(&mut state, &config, &mapper, now);
        state.config = Some(Box::new(config.clone()));
        if config.dry_run && state.dry_run.is_none() {
            state.dry_run = Some(OverrideInfo {
                reason: "dry_run: true in the configuration".to_owned(),
                since: now,
                until: None,
            });
        }
        let alert_bytes = state.alerts.values().map(|r| r.alert.held_bytes()).sum();
        Engine {
            topology: fleet::Topology::of(&config),
            config,
            mapper,
            state,
            alert_bytes,
            overflow: Overflow::default(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The state, for snapshots and status.
    pub fn state(&self) -> &EngineState {
        &self.state
    }

    /// Whether dry-run is on.
    pub fn dry_run(&self) -> bool {
        self.state.dry_run.is_some()
    }

    /// Checks an override before it is journaled: the engine itself accepts anything.
    pub fn check_command(&self, command: &Command) -> Result<(), String> {
        check_command(&self.config, command)
    }

    /// Acts on one input at time `now`: [`Engine::admit`]s it, then steps it.
    pub fn step(&mut self, input: Input, now: Timestamp) -> Step {
        let (admitted, _) = self.admit(input);
        self.step_admitted(admitted, now)
    }

    /// Acts on an input [`Engine::admit`] took. A writer that journals calls `admit`
    /// itself, keeps what it took, and steps it here, so a report is trimmed once.
    pub fn step_admitted(&mut self, admitted: Admitted, now: Timestamp) -> Step {
        let input = admitted.0;
        let mut out = Vec::new();
        let is_tick = matches!(input, Input::Tick);
        // An input that brings nothing is journaled only if the step it makes does.
        let inert =
            is_tick || matches!(&input, Input::Reports { endpoints, .. } if endpoints.is_empty());
        self.expire_overrides(now, &mut out);
        match input {
            Input::Alerts { alerts } => {
                for alert in alerts {
                    self.receive(alert, now, &mut out);
                }
            }
            Input::Reconcile { alerts, as_of } => self.reconcile(alerts, as_of, now, &mut out),
            Input::Reports { gateway, endpoints } => {
                self.reports(gateway, endpoints, now, &mut out)
            }
            Input::Command { command } => self.command(command, now, &mut out),
            Input::Configure { config } => self.configure(*config, now, &mut out),
            Input::Tick => {}
        }
        self.expire_alerts(now, &mut out);
        self.evaluate_blocks(now, &mut out);
        // What the limits turned away in this step, alerts and blocks alike.
        out.append(&mut self.overflow.take());
        self.evaluate_models(now, &mut out);
        self.publish(now, &mut out);
        if is_tick {
            self.prune(now);
        }
        Step {
            changed: !inert || !out.is_empty(),
            decisions: out,
        }
    }

    /// Puts `config` in force. Models it no longer has leave the table; new ones start
    /// on the normal rung; a model whose active pool is gone starts over on the normal
    /// rung in its new primary (and the evaluation that follows escalates it at once
    /// if its alerts say so); every other model keeps its place, and moves by its new
    /// timings from now. Alerts are mapped again under the new rules.
    fn configure(&mut self, config: Config, now: Timestamp, out: &mut Vec<Decision>) {
        let mapper = Mapper::new(&config);
        let fitted = fit(&mut self.state, &config, &mapper, now);
        self.state.config = Some(Box::new(config.clone()));
        self.topology = fleet::Topology::of(&config);
        self.config = config;
        self.mapper = mapper;
        out.push(Decision::Configured {
            added: fitted.added,
            removed: fitted.removed,
            reset: fitted.reset,
        });
    }

    /// The published route table.
    pub fn route_table(&self) -> RouteTable {
        let p = &self.state.published;
        RouteTable {
            version: self.state.version,
            epoch: self.state.epoch.clone(),
            hash: RouteTable::content_hash(&p.models, &p.blocked),
            generated_at: self.state.generated_at,
            models: p.models.clone(),
            blocked: p.blocked.clone(),
        }
    }

    /// When the engine next has something to do without new input.
    pub fn next_wakeup(&self) -> Option<Timestamp> {
        let s = &self.state;
        let lease_half = self.config.ladder.lease.0 / 2;
        let renew_at = s.published.lease_until - lease_half;
        let alerts = s.alerts.values().filter_map(|r| match r.alert.source {
            AlertSource::Prometheus => r.alert.ends_at,
            AlertSource::Alertmanager => None,
        });
        let blocks = s.blocks.values().map(|b| b.until);
        let models = s.models.values().flat_map(|m| {
            [
                m.wake_at,
                m.pin.as_ref().map(|p| p.until),
                m.force.as_ref().and_then(|f| f.info.until),
                m.freeze.as_ref().and_then(|f| f.until),
            ]
            .into_iter()
            .flatten()
        });
        let global = [&s.global_freeze, &s.dry_run]
            .into_iter()
            .flatten()
            .filter_map(|o| o.until);
        alerts
            .chain(blocks)
            .chain(models)
            .chain(global)
            .chain([renew_at])
            .min()
    }

    /// The rung the active conditions point `model` at (the verified ladder's target),
    /// whatever the ladder's timers allow right now.
    pub fn target(&self, model: &str) -> Option<Rung> {
        let config = self.config.models.get(model)?;
        let health = Health::from_alerts(&self.state.alerts);
        Some(ladder::plan(model, config, &health, &self.config.models).target)
    }

    /// Status per model, as published and as decided, at `now`.
    pub fn model_status(&self, now: Timestamp) -> std::collections::BTreeMap<String, ModelStatus> {
        let health = Health::from_alerts(&self.state.alerts);
        self.state
            .models
            .iter()
            .map(|(name, st)| {
                let model = self.config.models.get(name);
                let policy = model.map_or_else(
                    || self.config.ladder.clone(),
                    |m| m.ladder_policy(&self.config.ladder),
                );
                let automated = st.force.is_none() && self.frozen(Some(name)).is_none();
                let step_down = model.filter(|_| automated).and_then(|model| {
                    let plan = ladder::plan(name, model, &health, &self.config.models);
                    let cx = Ctx {
                        name,
                        model,
                        policy: &policy,
                        plan: &plan,
                        now,
                    };
                    ladder::step_down(st, &cx).map(|(to, at)| StepDown { to, at })
                });
                let published = self.state.published.models.get(name);
                let status = ModelStatus {
                    rung: published.map_or(st.rung, |p| p.rung),
                    decided_rung: st.rung,
                    pool: published.map_or_else(|| st.pool.clone(), |p| p.pool.clone()),
                    alias: published.map_or_else(|| st.alias.clone(), |p| p.alias.clone()),
                    since: published.map_or(st.since, |p| p.since),
                    reason: st.reason.clone(),
                    lease_until: self.state.published.lease_until,
                    force: st.force.clone(),
                    freeze: st.freeze.clone(),
                    pinned: st.pin.clone(),
                    recover_after: HumanDuration(
                        policy
                            .backoff
                            .scaled(policy.recover_after.0, st.backoff_level),
                    ),
                    unhealthy_pools: st.unhealthy_pools.clone(),
                    alerts: st.alerts.clone(),
                    conditions: self.conditions(st),
                    step_down,
                };
                (name.clone(), status)
            })
            .collect()
    }

    /// The alerts acting on a model, each with what it means there.
    fn conditions(&self, st: &ModelState) -> Vec<ConditionStatus> {
        st.alerts
            .iter()
            .filter_map(|fp| self.state.alerts.get(fp))
            .map(|r| ConditionStatus {
                fingerprint: r.alert.fingerprint,
                alertname: r.alertname().map(str::to_owned),
                labels: r.alert.labels.clone(),
                starts_at: r.alert.starts_at,
                effect: r
                    .condition
                    .as_ref()
                    .map_or_else(String::new, ToString::to_string),
            })
            .collect()
    }

    /// Active blocks with their time left at `now`.
    pub fn block_status(&self, now: Timestamp) -> Vec<BlockStatus> {
        self.state
            .blocks
            .iter()
            .map(|(key, b)| {
                let (source, alert) = match b.source {
                    BlockSource::Alert(fp) => (BlockOrigin::Alert, Some(fp)),
                    BlockSource::Fleet => (BlockOrigin::Fleet, None),
                    BlockSource::Operator => (BlockOrigin::Operator, None),
                };
                BlockStatus {
                    endpoint: key.endpoint.clone(),
                    model: key.model.clone(),
                    until: b.until,
                    seconds_left: b.until.since(now).as_secs(),
                    strikes: b.strikes,
                    reason: b.reason.clone(),
                    source,
                    alert,
                    since: b.since,
                }
            })
            .collect()
    }

    fn expire_overrides(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let due = |until: Option<Timestamp>| until.is_some_and(|u| u <= now);
        for (name, st) in &mut self.state.models {
            if st.force.as_ref().is_some_and(|f| due(f.info.until)) {
                st.force = None;
                st.since = now;
                out.push(Decision::OverrideEnded {
                    action: "force".into(),
                    model: Some(name.clone()),
                });
            }
            if st.freeze.as_ref().is_some_and(|f| due(f.until)) {
                st.freeze = None;
                out.push(Decision::OverrideEnded {
                    action: "freeze".into(),
                    model: Some(name.clone()),
                });
            }
            if st.pin.as_ref().is_some_and(|p| p.until <= now) {
                st.pin = None;
                out.push(Decision::PinEnded {
                    model: name.clone(),
                });
            }
        }
        for (slot, action) in [
            (&mut self.state.global_freeze, "freeze"),
            (&mut self.state.dry_run, "dry-run"),
        ] {
            if slot.as_ref().is_some_and(|o| due(o.until)) {
                *slot = None;
                out.push(Decision::OverrideEnded {
                    action: action.into(),
                    model: None,
                });
            }
        }
    }

    fn receive(&mut self, mut alert: IncomingAlert, now: Timestamp, out: &mut Vec<Decision>) {
        let fp = alert.fingerprint;
        match alert.status {
            AlertStatus::Firing => {
                if let Some(t) = self.state.tombstones.get(&fp)
                    && t.starts_at >= alert.starts_at
                {
                    out.push(Decision::AlertIgnored {
                        fingerprint: fp,
                        why: format!(
                            "already resolved at {}; a late or repeated firing notification",
                            t.resolved_at
                        ),
                    });
                    return;
                }
                if alert.source == AlertSource::Prometheus && alert.ends_at.is_none() {
                    alert.ends_at = Some(now + self.config.alerts.resolve_timeout.0);
                }
                let mapped = self.mapper.map(&alert.labels);
                let (condition, unmapped) = match mapped {
                    Ok(c) => (Some(c), None),
                    Err(u) => (None, Some(u.0)),
                };
                let bytes = alert.held_bytes();
                let held_before = self.state.alerts.get(&fp).map(|r| r.alert.held_bytes());
                let grows = held_before.map_or(0, |was| bytes.saturating_sub(was));
                if grows > 0 && self.alert_bytes + grows > self.config.alerts.max_bytes {
                    // A refresh that would pass alerts.max_bytes: still firing, so
                    // still held, with its last content.
                    if let Some(record) = self.state.alerts.get_mut(&fp) {
                        record.received_at = now;
                    }
                    return self.refuse(&alert);
                }
                match self.state.alerts.get_mut(&fp) {
                    Some(record) => {
                        let meaning_changed = record.condition != condition;
                        // A refresh: keep the earliest start, take the newest end.
                        alert.starts_at = alert.starts_at.min(record.alert.starts_at);
                        self.alert_bytes = self.alert_bytes + bytes - held_before.unwrap_or(0);
                        record.alert = alert;
                        record.received_at = now;
                        if meaning_changed {
                            record.condition.clone_from(&condition);
                            record.unmapped.clone_from(&unmapped);
                            record.block_applied = false;
                            out.push(Decision::AlertActive {
                                fingerprint: fp,
                                alertname: record.alertname().map(str::to_owned),
                                condition,
                                unmapped,
                            });
                        }
                    }
                    None => {
                        if !self.make_room(&alert, bytes, condition.is_some()) {
                            // Its tombstone, if any, stays: a late duplicate of an
                            // earlier firing is still recognised.
                            return self.refuse(&alert);
                        }
                        self.state.tombstones.remove(&fp);
                        if condition.is_none() {
                            // One to drop, should the engine fill up again this step.
                            self.overflow.none_unmapped = false;
                        }
                        self.alert_bytes += bytes;
                        let record = AlertRecord {
                            alert,
                            condition: condition.clone(),
                            unmapped: unmapped.clone(),
                            received_at: now,
                            block_applied: false,
                        };
                        out.push(Decision::AlertActive {
                            fingerprint: fp,
                            alertname: record.alertname().map(str::to_owned),
                            condition,
                            unmapped,
                        });
                        self.state.alerts.insert(fp, record);
                    }
                }
            }
            AlertStatus::Resolved => match self.state.alerts.get(&fp) {
                // Alertmanager merges overlapping alerts, so a genuine resolution may
                // carry an earlier startsAt; only one that ended before the current
                // instance began belongs to an older instance.
                Some(record)
                    if alert
                        .ends_at
                        .is_some_and(|end| end < record.alert.starts_at) =>
                {
                    out.push(Decision::AlertIgnored {
                        fingerprint: fp,
                        why: "resolution of an older instance of an alert that fired again"
                            .to_owned(),
                    });
                }
                Some(_) => self.resolve(fp, ResolvedBy::Notification, now, out),
                None => {
                    let newer = self
                        .state
                        .tombstones
                        .get(&fp)
                        .is_none_or(|t| t.starts_at <= alert.starts_at);
                    if newer {
                        let tomb = Tombstone {
                            starts_at: alert.starts_at,
                            resolved_at: now,
                        };
                        self.state.tombstones.insert(fp, tomb);
                    }
                }
            },
        }
    }

    /// Counts `alert` refused at the alert limits.
    fn refuse(&mut self, alert: &IncomingAlert) {
        self.overflow.record(
            alert.source,
            &self.config.alerts,
            alert.labels.get("alertname").map(String::as_str),
            Overflowed::Refused,
        );
    }

    /// Whether `alert`, new and holding `needs` bytes, fits within `alerts.max_active`
    /// and `alerts.max_bytes`,
    /// making room if it must: only an alert that maps to a condition may take a
    /// place, that of the unmapped alerts refreshed longest ago (unmapped alerts change
    /// nothing in the table; they are kept to be shown). A scan of the active alerts
    /// for each unmapped one dropped: such arrivals are few (a notification is at most
    /// `intake.max_body_bytes`), and once none is left to drop the step stops looking.
    fn make_room(&mut self, alert: &IncomingAlert, needs: usize, mapped: bool) -> bool {
        let (max_active, max_bytes) = (self.config.alerts.max_active, self.config.alerts.max_bytes);
        loop {
            let fits =
                self.state.alerts.len() < max_active && self.alert_bytes + needs <= max_bytes;
            if fits {
                return true;
            }
            if !mapped || self.overflow.none_unmapped {
                return false;
            }
            let oldest = self
                .state
                .alerts
                .iter()
                .filter(|(_, r)| r.condition.is_none())
                .min_by_key(|(fp, r)| (r.received_at, **fp))
                .map(|(fp, _)| *fp);
            let Some(record) = oldest.and_then(|fp| self.state.alerts.remove(&fp)) else {
                self.overflow.none_unmapped = true;
                return false;
            };
            self.alert_bytes -= record.alert.held_bytes();
            self.overflow.record(
                alert.source,
                &self.config.alerts,
                record.alertname(),
                Overflowed::Displaced,
            );
        }
    }

    fn resolve(
        &mut self,
        fp: Fingerprint,
        by: ResolvedBy,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        if let Some(record) = self.state.alerts.remove(&fp) {
            self.alert_bytes -= record.alert.held_bytes();
            self.state.tombstones.insert(
                fp,
                Tombstone {
                    starts_at: record.alert.starts_at,
                    resolved_at: now,
                },
            );
            out.push(Decision::AlertResolved {
                fingerprint: fp,
                alertname: record.alertname().map(str::to_owned),
                by,
            });
        }
    }

    fn reconcile(
        &mut self,
        alerts: Vec<IncomingAlert>,
        as_of: Timestamp,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        let listed: BTreeSet<Fingerprint> = alerts.iter().map(|a| a.fingerprint).collect();
        for alert in alerts {
            // Only alerts we have not seen: a listed alert we know needs no refresh.
            if !self.state.alerts.contains_key(&alert.fingerprint) {
                self.receive(alert, now, out);
            }
        }
        let gone: Vec<Fingerprint> = self
            .state
            .alerts
            .iter()
            .filter(|(fp, r)| {
                r.alert.source == AlertSource::Alertmanager
                    && r.received_at < as_of
                    && !listed.contains(fp)
            })
            .map(|(fp, _)| *fp)
            .collect();
        for fp in gone {
            self.resolve(fp, ResolvedBy::Reconciliation, now, out);
        }
    }

    fn expire_alerts(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let expired: Vec<Fingerprint> = self
            .state
            .alerts
            .iter()
            .filter(|(_, r)| {
                r.alert.source == AlertSource::Prometheus
                    && r.alert.ends_at.is_some_and(|e| e <= now)
            })
            .map(|(fp, _)| *fp)
            .collect();
        for fp in expired {
            self.resolve(fp, ResolvedBy::Expired, now, out);
        }
    }

    fn frozen(&self, model: Option<&str>) -> Option<String> {
        if let Some(g) = &self.state.global_freeze {
            return Some(format!("global freeze: {}", g.reason));
        }
        let st = self.state.models.get(model?)?;
        st.freeze.as_ref().map(|f| f.reason.clone())
    }

    /// Makes a block within `blocking.max_blocks` (see [`blocks::block`]), counting
    /// what the limit refused or displaced. True when the block is in place.
    fn block(&mut self, new: NewBlock, now: Timestamp, out: &mut Vec<Decision>) -> bool {
        let endpoint = new.key.endpoint.clone();
        let limit = self.config.blocking.max_blocks;
        match blocks::block(&mut self.state, &self.config.blocking, new, now, out) {
            blocks::Made::Blocked => true,
            blocks::Made::Displaced => {
                self.overflow.record_block(limit, &endpoint, false);
                true
            }
            blocks::Made::Refused => {
                self.overflow.record_block(limit, &endpoint, true);
                false
            }
        }
    }

    fn evaluate_blocks(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let expired: Vec<BlockKey> = self
            .state
            .blocks
            .iter()
            .filter(|(_, b)| b.until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            let Some(record) = self.state.blocks.remove(&key) else {
                continue;
            };
            out.push(Decision::Unblocked {
                endpoint: key.endpoint.clone(),
                model: key.model.clone(),
                why: "block time ended".to_owned(),
            });
            let BlockSource::Alert(fp) = record.source else {
                continue;
            };
            let still_firing = self.state.alerts.get(&fp).is_some_and(|r| {
                matches!(&r.condition, Some(Condition::BlockEndpoint { endpoint, model })
                    if *endpoint == key.endpoint && *model == key.model)
            });
            if !still_firing {
                continue;
            }
            let refusal = if blocks::only_endpoint(&self.config, &key) {
                Some("it is the only endpoint of its pool; not extending the block".to_owned())
            } else {
                self.frozen(key.model.as_deref())
                    .map(|why| format!("frozen ({why})"))
            };
            match refusal {
                Some(why) => out.push(Decision::BlockSkipped {
                    endpoint: key.endpoint.clone(),
                    model: key.model.clone(),
                    why,
                }),
                None => {
                    let reason = format!("{} still failing; extended", key.endpoint);
                    let new = NewBlock {
                        key,
                        reason,
                        source: record.source,
                        fixed: None,
                    };
                    self.block(new, now, out);
                }
            }
        }
        let pending: Vec<(Fingerprint, BlockKey, String)> = self
            .state
            .alerts
            .iter()
            .filter(|(_, r)| !r.block_applied)
            .filter_map(|(fp, r)| match &r.condition {
                Some(c @ Condition::BlockEndpoint { endpoint, model }) => Some((
                    *fp,
                    BlockKey {
                        endpoint: endpoint.clone(),
                        model: model.clone(),
                    },
                    format!("{} ({c})", r.alertname().unwrap_or("alert")),
                )),
                _ => None,
            })
            .collect();
        for (fp, key, reason) in pending {
            if self.frozen(key.model.as_deref()).is_some() {
                // Applied once the freeze ends, if the alert is still firing.
                continue;
            }
            if let Some(record) = self.state.alerts.get_mut(&fp) {
                record.block_applied = true;
            }
            if let Some(pattern) = blocks::never_block(&self.config.blocking, &key.endpoint) {
                out.push(Decision::BlockSkipped {
                    endpoint: key.endpoint,
                    model: key.model,
                    why: format!("matches never-block pattern {pattern:?}"),
                });
            } else if !self.state.blocks.contains_key(&key) {
                let new = NewBlock {
                    key,
                    reason,
                    source: BlockSource::Alert(fp),
                    fixed: None,
                };
                self.block(new, now, out);
            }
        }
    }

    fn evaluate_models(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let health = Health::from_alerts(&self.state.alerts);
        for (name, model) in &self.config.models {
            let plan = ladder::plan(name, model, &health, &self.config.models);
            let frozen = self.frozen(Some(name));
            let Some(st) = self.state.models.get_mut(name) else {
                continue;
            };
            let policy = model.ladder_policy(&self.config.ladder);
            let cx = Ctx {
                name,
                model,
                policy: &policy,
                plan: &plan,
                now,
            };
            ladder::evaluate(st, frozen.as_deref(), &cx, out);
        }
    }

    fn content(&self, lease_until: Timestamp) -> Published {
        let models = self
            .state
            .models
            .iter()
            .map(|(name, st)| {
                let config = &self.config.models[name];
                let route = ModelRoute {
                    rung: st.rung,
                    pool: st.pool.clone(),
                    alias: st.alias.clone(),
                    alias_exempt: config.alias_exempt.clone(),
                    faq: (st.rung == Rung::Static)
                        .then(|| config.faq.clone().unwrap_or_else(|| "default".to_owned())),
                    since: st.since,
                    lease_until,
                    reason: st.reason.clone(),
                    alerts: st.alerts.clone(),
                    overridden: st.force.is_some(),
                };
                (name.clone(), route)
            })
            .collect();
        let blocked = self
            .state
            .blocks
            .iter()
            .map(|(key, b)| BlockedEndpoint {
                endpoint: key.endpoint.clone(),
                model: key.model.clone(),
                until: b.until,
                reason: b.reason.clone(),
            })
            .collect();
        Published {
            models,
            blocked,
            lease_until,
        }
    }

    fn publish(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let lease = self.config.ladder.lease.0;
        let current = &self.state.published;
        let renew_due = now >= current.lease_until - lease / 2;
        let changed = match self.state.dry_run {
            Some(_) => None,
            None => Some(self.content(current.lease_until)).filter(|c| c != current),
        };
        if changed.is_none() && !renew_due {
            return;
        }
        let lease_renewal = changed.is_none();
        let mut published = changed.unwrap_or_else(|| self.state.published.clone());
        let lease_until = now + lease;
        published.lease_until = lease_until;
        for route in published.models.values_mut() {
            route.lease_until = lease_until;
        }
        self.state.published = published;
        self.state.version = match self.state.version.checked_add(1) {
            Some(next) => next,
            None => {
                // Versions are exhausted: a new epoch tells every gateway that the
                // numbers start again, rather than reusing them for new content.
                self.state.epoch = format!("{}+", self.state.epoch);
                1
            }
        };
        self.state.generated_at = now;
        out.push(Decision::Published {
            version: self.state.version,
            lease_renewal,
        });
    }

    fn prune(&mut self, now: Timestamp) {
        let keep = self.config.alerts.remember_resolved.0;
        self.state
            .tombstones
            .retain(|_, t| now.since(t.resolved_at) <= keep);
        if self.state.tombstones.len() > MAX_TOMBSTONES {
            let mut by_age: Vec<(Timestamp, Fingerprint)> = self
                .state
                .tombstones
                .iter()
                .map(|(fp, t)| (t.resolved_at, *fp))
                .collect();
            by_age.sort_unstable();
            let excess = by_age.len() - MAX_TOMBSTONES;
            for (_, fp) in by_age.into_iter().take(excess) {
                self.state.tombstones.remove(&fp);
            }
        }
        self.prune_fleet(now);
        let reset = self.config.blocking.backoff.reset_after.0;
        let blocks = &self.state.blocks;
        self.state
            .strikes
            .retain(|k, s| blocks.contains_key(k) || now.since(s.last) <= reset);
    }

    fn command(&mut self, command: Command, now: Timestamp, out: &mut Vec<Decision>) {
        let info = |reason: &str, ttl: Option<HumanDuration>| OverrideInfo {
            reason: reason.to_owned(),
            since: now,
            until: ttl.map(|d| now + d.0),
        };
        let until_text =
            |ttl: Option<HumanDuration>| ttl.map_or_else(String::new, |d| format!(" for {d}"));
        let mut record = |action: &str, model: Option<&str>, detail: String, reason: &str| {
            out.push(Decision::Override {
                action: action.to_owned(),
                model: model.map(str::to_owned),
                detail,
                reason: reason.to_owned(),
            });
        };
        match command {
            Command::Force {
                model,
                rung,
                ttl,
                reason,
            } => {
                let Some(st) = self.state.models.get_mut(&model) else {
                    return;
                };
                st.force = Some(ForceInfo {
                    rung,
                    info: info(&reason, ttl),
                });
                record(
                    "force",
                    Some(&model),
                    format!("{model} pinned at {rung}{}", until_text(ttl)),
                    &reason,
                );
            }
            Command::Release { model, reason } => {
                let Some(st) = self.state.models.get_mut(&model) else {
                    return;
                };
                if st.force.take().is_some() {
                    // Automation resumes from the forced rung, which it must hold a full dwell.
                    st.since = now;
                    record(
                        "release",
                        Some(&model),
                        format!("{model} released to automation"),
                        &reason,
                    );
                }
            }
            Command::Freeze {
                model: Some(model),
                ttl,
                reason,
            } => {
                let Some(st) = self.state.models.get_mut(&model) else {
                    return;
                };
                st.freeze = Some(info(&reason, ttl));
                record(
                    "freeze",
                    Some(&model),
                    format!("{model} frozen{}", until_text(ttl)),
                    &reason,
                );
            }
            Command::Freeze {
                model: None,
                ttl,
                reason,
            } => {
                self.state.global_freeze = Some(info(&reason, ttl));
                record(
                    "freeze",
                    None,
                    format!("every model frozen{}", until_text(ttl)),
                    &reason,
                );
            }
            Command::Thaw {
                model: Some(model),
                reason,
            } => {
                let Some(st) = self.state.models.get_mut(&model) else {
                    return;
                };
                if st.freeze.take().is_some() {
                    record("thaw", Some(&model), format!("{model} thawed"), &reason);
                }
            }
            Command::Thaw {
                model: None,
                reason,
            } => {
                if self.state.global_freeze.take().is_some() {
                    record("thaw", None, "global freeze ended".to_owned(), &reason);
                }
            }
            Command::Block {
                endpoint,
                model,
                ttl,
                reason,
            } => {
                let key = BlockKey { endpoint, model };
                let done = Decision::Override {
                    action: "block".to_owned(),
                    model: key.model.clone(),
                    detail: format!("{key} blocked by operator"),
                    reason: reason.clone(),
                };
                let fixed = Some(ttl.map_or(self.config.blocking.ttl.0, |d| d.0));
                let new = NewBlock {
                    key,
                    reason,
                    source: BlockSource::Operator,
                    fixed,
                };
                // At the block limit with only operators' blocks held, nothing is done
                // and the step's block-limit decision says so.
                let at = out.len();
                if self.block(new, now, out) {
                    out.insert(at, done);
                }
            }
            Command::Unblock {
                endpoint,
                model,
                reason,
            } => {
                let key = BlockKey { endpoint, model };
                if self.state.blocks.remove(&key).is_some() {
                    self.state.strikes.remove(&key);
                    self.suppress_block_alerts(|k| *k == key);
                    record(
                        "unblock",
                        key.model.as_deref(),
                        format!("{key} unblocked"),
                        &reason,
                    );
                    out.push(Decision::Unblocked {
                        endpoint: key.endpoint,
                        model: key.model,
                        why: format!("operator: {reason}"),
                    });
                }
            }
            Command::UnblockAll { reason } => {
                let lifted = std::mem::take(&mut self.state.blocks);
                self.state.strikes.clear();
                self.suppress_block_alerts(|_| true);
                record(
                    "unblock-all",
                    None,
                    format!("{} block(s) lifted", lifted.len()),
                    &reason,
                );
                for key in lifted.into_keys() {
                    out.push(Decision::Unblocked {
                        endpoint: key.endpoint,
                        model: key.model,
                        why: format!("operator unblock-all: {reason}"),
                    });
                }
            }
            Command::DryRun { enabled, reason } => {
                let was = self.state.dry_run.is_some();
                if enabled && !was {
                    self.state.dry_run = Some(info(&reason, None));
                    record(
                        "dry-run",
                        None,
                        "dry-run on: decisions are reported, not published".into(),
                        &reason,
                    );
                } else if !enabled && was {
                    self.state.dry_run = None;
                    record(
                        "dry-run",
                        None,
                        "dry-run off: decisions are published again".into(),
                        &reason,
                    );
                }
            }
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
}

/// Checks an override against `config` before it is journaled: unknown models, a
/// degraded rung without a fallback, empty endpoints and zero TTLs are refused with
/// the field named. The engine itself accepts anything.
pub fn check_command(config: &Config, command: &Command) -> Result<(), String> {
    let model_known = |m: &str| {
        if config.models.contains_key(m) {
            Ok(())
        } else {
            Err(format!("model: {m:?} is not configured"))
        }
    };
    let non_empty = |what: &str, v: &str| {
        if v.trim().is_empty() {
            Err(format!("{what}: must not be empty"))
        } else if !stanch_api::routes::valid_endpoint(v) {
            Err(format!(
                "{what}: at most {MAX_ENDPOINT_BYTES} bytes, no control characters"
            ))
        } else {
            Ok(())
        }
    };
    let positive = |ttl: &Option<HumanDuration>| match ttl {
        Some(d) if d.0.is_zero() => Err("ttl: must be longer than 0s".to_owned()),
        Some(d) if *d > MAX_TTL => Err(format!(
            "ttl: at most {MAX_TTL} (leave ttl out for an override that lasts until lifted)"
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
                return Err(format!("rung: {model} has no fallback model to degrade to"));
            }
            Ok(())
        }
        Command::Release { model, .. } => model_known(model),
        Command::Freeze { model, ttl, .. } => {
            model.as_deref().map_or(Ok(()), model_known)?;
            positive(ttl)
        }
        Command::Thaw { model, .. } => model.as_deref().map_or(Ok(()), model_known),
        Command::Block {
            endpoint,
            model,
            ttl,
            ..
        } => {
            non_empty("endpoint", endpoint)?;
            model.as_deref().map_or(Ok(()), model_known)?;
            positive(ttl)
        }
        Command::Unblock { endpoint, .. } => non_empty("endpoint", endpoint),
        Command::UnblockAll { .. } | Command::DryRun { .. } => Ok(()),
    }
}

/// What fitting the state to a configuration changed.
struct Fitted {
    added: Vec<String>,
    removed: Vec<String>,
    reset: Vec<String>,
}

/// Fits `state` to `config`: models it no longer has are dropped, new ones start
/// healthy, one whose active pool is gone starts over in its primary; alerts are
/// mapped again under `mapper`.
fn fit(state: &mut EngineState, config: &Config, mapper: &Mapper, now: Timestamp) -> Fitted {
    let mut fitted = Fitted {
        added: Vec::new(),
        removed: Vec::new(),
        reset: Vec::new(),
    };
    state.models.retain(|name, _| {
        let kept = config.models.contains_key(name);
        if !kept {
            fitted.removed.push(name.clone());
        }
        kept
    });
    for (name, model) in &config.models {
        let primary = model.pools.first().map(|p| p.name()).unwrap_or_default();
        match state.models.get_mut(name) {
            None => {
                state
                    .models
                    .insert(name.clone(), ModelState::new(primary, now));
                fitted.added.push(name.clone());
            }
            Some(st) if !model.pools.iter().any(|p| p.name() == st.pool) => {
                *st = ModelState::new(primary, now);
                fitted.reset.push(name.clone());
            }
            Some(_) => {}
        }
    }
    for record in state.alerts.values_mut() {
        let mapped = mapper.map(&record.alert.labels);
        record.unmapped = mapped.as_ref().err().map(|u| u.0.clone());
        record.condition = mapped.ok();
    }
    fitted
}

//! The engine: one writer that turns inputs into decisions and a route table.
//!
//! [`Engine::step`] takes an [`Input`] and the current time, and returns the
//! [`Decision`]s it made. It never fails and never does IO; the same state, inputs
//! and times always give the same decisions, which is what makes the state store's
//! journal replayable.
//!
//! One entry, [`Engine::step`]; a module per kind of input: `alerts` (alerts and
//! Alertmanager's list), `fleet` (gateways' reports), `command` (overrides),
//! `configure` (a new policy). What every step then does is in `blocking` (blocks
//! ended or taken in), `publish` (each model's ladder, the table) and `overflow` (what
//! the limits turned away, told once); `status` answers questions without changing
//! anything.

mod alerts;
mod blocking;
mod command;
mod configure;
mod fleet;
mod overflow;
mod publish;
mod status;

use serde::{Deserialize, Serialize};
use stanch_api::alerts::IncomingAlert;
use stanch_api::status::OverrideInfo;
use stanch_api::{HumanDuration, Rung, Timestamp};

pub use command::{BadCommand, check_command};
pub use fleet::{Admitted, ReportRefusals};
pub use stanch_api::routes::MAX_ENDPOINT_BYTES;

use crate::config::Config;
use crate::decision::Decision;
use crate::mapping::Mapper;
use crate::state::{EngineState, Published};
use overflow::Overflow;

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
    /// Skip to the end of a model's fail-back, or abort it.
    Failback {
        /// The model.
        model: String,
        /// Skip or abort. (`order`, as `action` tags the command.)
        order: stanch_api::admin::FailbackAction,
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
        configure::fit(&mut state, &config, &mapper, now);
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
    pub fn check_command(&self, command: &Command) -> Result<(), BadCommand> {
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
}

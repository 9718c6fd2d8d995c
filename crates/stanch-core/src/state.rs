//! The engine's state: everything a restart must get back, and nothing derivable.
//!
//! It serializes to JSON for the state store's snapshots. Maps keyed by something
//! other than a string serialize as lists of pairs.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use stanch_api::alerts::IncomingAlert;
use stanch_api::routes::{BlockedEndpoint, ModelRoute, PoolShare};
use stanch_api::status::{ForceInfo, OverrideInfo, PinInfo};
use stanch_api::{Fingerprint, Rung, Timestamp};

use crate::mapping::Condition;

/// The whole engine state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineState {
    /// Identity of this state history; a new one means versions restarted.
    pub epoch: String,
    /// The published route version.
    pub version: u64,
    /// When the published version was made.
    pub generated_at: Timestamp,
    /// Active alerts.
    pub alerts: BTreeMap<Fingerprint, AlertRecord>,
    /// Recently resolved alerts, to recognise late duplicates of their firing.
    pub tombstones: BTreeMap<Fingerprint, Tombstone>,
    /// Ladder state per configured model.
    pub models: BTreeMap<String, ModelState>,
    /// Active endpoint blocks.
    #[serde(with = "pairs")]
    pub blocks: BTreeMap<BlockKey, BlockRecord>,
    /// Recent block counts per key, for backoff of repeat offenders.
    #[serde(with = "pairs")]
    pub strikes: BTreeMap<BlockKey, Strikes>,
    /// Gateways' outcome reports per (endpoint, model), within the fleet window.
    #[serde(with = "pairs", default)]
    pub fleet: BTreeMap<BlockKey, FleetStats>,
    /// Set while automation moves nothing at all.
    pub global_freeze: Option<OverrideInfo>,
    /// Set while decisions are reported but not published.
    pub dry_run: Option<OverrideInfo>,
    /// What gateways were last given.
    pub published: Published,
    /// The configuration in force: a restart replays the journal after a snapshot
    /// under the configuration the snapshot was taken under, as its inputs were first
    /// stepped, whatever configuration the restart is given. (`None` in a snapshot
    /// written before this was kept: the restart's own is used.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<Box<crate::Config>>,
}

/// The content of the last published route table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Published {
    /// Per model.
    pub models: BTreeMap<String, ModelRoute>,
    /// Blocks.
    pub blocked: Vec<BlockedEndpoint>,
    /// The lease of every entry.
    pub lease_until: Timestamp,
}

/// An active alert and what it means.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlertRecord {
    /// The alert as last received.
    pub alert: IncomingAlert,
    /// The condition it maps to, if any.
    pub condition: Option<Condition>,
    /// Why it maps to nothing, if so.
    pub unmapped: Option<String>,
    /// When it was last received (for reconciliation).
    pub received_at: Timestamp,
    /// For `block-endpoint` alerts: the alert has had its block (or was refused one),
    /// so it does not block again until it resolves and fires anew.
    pub block_applied: bool,
}

impl AlertRecord {
    /// The alert's `alertname` label, if it has one.
    pub fn alertname(&self) -> Option<&str> {
        self.alert.labels.get("alertname").map(String::as_str)
    }
}

/// A resolved alert, remembered for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    /// The resolved instance's start.
    pub starts_at: Timestamp,
    /// When stanch learned it resolved.
    pub resolved_at: Timestamp,
}

/// One model's ladder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelState {
    /// The rung automation (or an override) decided.
    pub rung: Rung,
    /// The pool serving the model: the largest share when its traffic is split.
    pub pool: String,
    /// The model's traffic across its pools while a pool is slow; empty when `pool`
    /// takes it all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<PoolShare>,
    /// When the shares last moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares_since: Option<Timestamp>,
    /// Since when the conditions have let shares move back toward the primary, while
    /// the move waits for the stabilization window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares_back_since: Option<Timestamp>,
    /// Every move the flap guard counts within its window, rung changes and share
    /// moves alike, in order: when, and whether up the ladder or away from the
    /// primary. (Empty in a state kept before shares existed: `transitions` then
    /// holds them all.)
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub moves: VecDeque<(Timestamp, bool)>,
    /// A fail-back under way: the traffic returning to a lower rung in steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failback: Option<Failback>,
    /// The alias while degraded.
    pub alias: Option<String>,
    /// When the rung last changed.
    pub since: Timestamp,
    /// Why the model is where it is.
    pub reason: String,
    /// The alerts acting on this model.
    pub alerts: Vec<Fingerprint>,
    /// Per rung (index 1 to 3): since when no condition has needed that rung or higher.
    pub clear_since: [Option<Timestamp>; 4],
    /// Rung changes within the flap window: when, from, to.
    pub transitions: VecDeque<(Timestamp, Rung, Rung)>,
    /// The flap guard's hold.
    pub pin: Option<PinInfo>,
    /// How many times `recover_after` has been doubled (re-degradations).
    pub backoff_level: u32,
    /// The last step down, for backoff.
    pub last_deescalation: Option<Timestamp>,
    /// The last step up, for backoff.
    pub last_escalation: Option<Timestamp>,
    /// An operator's pin.
    pub force: Option<ForceInfo>,
    /// An operator's freeze of this model.
    pub freeze: Option<OverrideInfo>,
    /// Pools the current alerts say are unhealthy.
    pub unhealthy_pools: Vec<String>,
    /// When the next step down becomes possible, if one is pending.
    pub wake_at: Option<Timestamp>,
}

impl ModelState {
    /// A model on its primary pool, healthy.
    pub fn new(primary: &str, now: Timestamp) -> ModelState {
        ModelState {
            rung: Rung::Normal,
            pool: primary.to_owned(),
            shares: Vec::new(),
            shares_since: None,
            shares_back_since: None,
            moves: VecDeque::new(),
            failback: None,
            alias: None,
            since: now,
            reason: "healthy".to_owned(),
            alerts: Vec::new(),
            clear_since: [None, Some(now), Some(now), Some(now)],
            transitions: VecDeque::new(),
            pin: None,
            backoff_level: 0,
            last_deescalation: None,
            last_escalation: None,
            force: None,
            freeze: None,
            unhealthy_pools: Vec::new(),
            wake_at: None,
        }
    }
}

/// A fail-back under way: the model stays on `from` while a growing part of its
/// traffic goes where `to` sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failback {
    /// The rung being left.
    pub from: Rung,
    /// The rung the traffic returns to.
    pub to: Rung,
    /// The step reached: an index into `ladder.failback.steps`.
    pub step: usize,
    /// When that step began.
    pub since: Timestamp,
    /// Where `from` sent the traffic when the fail-back began: its pool...
    pub from_pool: String,
    /// ...and its split, if any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from_shares: Vec<PoolShare>,
    /// An operator's word on it, carried out at the model's next evaluation: skip to
    /// the end, or abort, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<(stanch_api::admin::FailbackAction, String)>,
}

/// What a block applies to: an endpoint, for one model or for all.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockKey {
    /// The endpoint as gateways name it.
    pub endpoint: String,
    /// The model, or `None` for every model.
    pub model: Option<String>,
}

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.model {
            Some(m) => write!(f, "{} ({m})", self.endpoint),
            None => write!(f, "{} (all models)", self.endpoint),
        }
    }
}

/// What the gateways reported of one (endpoint, model).
///
/// Bounded whatever the reports: `samples` holds at most one entry per slot of the
/// window ([`FleetStats::SLOTS`] slots, reports within a slot added together), and
/// `streaks` at most [`FleetStats::MAX_STREAKS`] gateways, each forgotten once it
/// has not reported the pair for a window.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetStats {
    /// (when last added to, successes, failures) per slot of the window.
    pub samples: VecDeque<(Timestamp, u64, u64)>,
    /// The gateways whose latest run of failures is not zero, with that run.
    pub streaks: BTreeMap<String, Streak>,
}

impl FleetStats {
    /// Slots the counting window is divided into.
    pub const SLOTS: u64 = 60;
    /// Gateways with a run of failures kept per pair: the longest runs, which are
    /// the ones a trigger reads.
    pub const MAX_STREAKS: usize = 16;
}

/// One gateway's run of failures at one (endpoint, model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Streak {
    /// Failures in a row.
    pub run: u32,
    /// When the gateway last reported the pair.
    pub at: Timestamp,
}

impl<'de> Deserialize<'de> for Streak {
    /// Also reads a bare run, as snapshots written before runs had a time held them:
    /// such a run is dated from the epoch, so the next prune forgets it (a gateway
    /// then counts its run again from its next report).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Dated { run: u32, at: Timestamp },
            Bare(u32),
        }
        Ok(match Either::deserialize(d)? {
            Either::Dated { run, at } => Streak { run, at },
            Either::Bare(run) => Streak {
                run,
                at: Timestamp::from_millis(0),
            },
        })
    }
}

/// Who asked for a block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockSource {
    /// A `block-endpoint` alert.
    Alert(Fingerprint),
    /// An operator through the admin API.
    Operator,
    /// The gateways' merged outcome reports.
    Fleet,
}

/// An active block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    /// When it ends on its own.
    pub until: Timestamp,
    /// When it began.
    pub since: Timestamp,
    /// Why.
    pub reason: String,
    /// Its backoff level (1 for a first offence).
    pub strikes: u32,
    /// Who asked.
    pub source: BlockSource,
}

/// A key's recent blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Strikes {
    /// Blocks in a row, each within the backoff's `reset_after` of the last.
    pub count: u32,
    /// When the last one began.
    pub last: Timestamp,
}

/// Serializes a map with non-string keys as a list of `[key, value]` pairs.
mod pairs {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S, K, V>(map: &BTreeMap<K, V>, s: S) -> Result<S::Ok, S::Error>
    where
        S: Serializer,
        K: Serialize,
        V: Serialize,
    {
        s.collect_seq(map.iter())
    }

    pub fn deserialize<'de, D, K, V>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        D: Deserializer<'de>,
        K: Deserialize<'de> + Ord,
        V: Deserialize<'de>,
    {
        Ok(Vec::<(K, V)>::deserialize(d)?.into_iter().collect())
    }
}

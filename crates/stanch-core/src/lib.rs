//! The pure stanch decision engine.
//!
//! Owns: the configuration model and its validation, the mapping of alerts to
//! conditions, the per-model degradation ladder, endpoint soft-blocks, operator
//! overrides, and building the route table. Does not own: any IO, any clock, any
//! networking or persistence. Time comes in as an argument; the engine is total
//! (it returns decisions, not errors) and deterministic, so its inputs can be
//! journaled and replayed.

pub mod blocks;
pub mod config;
pub mod decision;
pub mod engine;
mod failback;
mod ladder;
pub mod mapping;
pub mod rules;
pub mod state;

pub use config::{Config, ConfigError, Problem};
pub use decision::{Decision, OverrideAction, ResolvedBy, Rule};
pub use engine::{Command, Engine, Input, Step};
pub use mapping::Condition;
pub use rules::Action;
pub use state::EngineState;

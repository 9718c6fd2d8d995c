//! Integration tests of the engine: scenarios, properties, and the purity guard.

mod fleet;
mod harness;
mod limits;
mod properties;
mod purity;
mod scenarios;

//! What stanch's tests share, in one place rather than copied between suites. A
//! dev-dependency only: nothing shipped links it.
//!
//! - [`deps`]: the workspace's dependency graph, for tests of the crates' layers.

pub mod deps;

//! What stanch's tests share, in one place rather than copied between suites. A
//! dev-dependency only: nothing shipped links it (`tests/it/deps.rs`).
//!
//! - [`deps`]: the workspace's dependency graph, for tests of the crates' layers.
//! - [`files`]: the workspace's sources, for tests that read the code.
//! - [`net`]: free ports, slow senders, and reading an answer to its end.

pub mod deps;
pub mod files;
pub mod net;

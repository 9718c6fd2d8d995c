//! The ports of the stanch controller: the seams its adapters implement or drive.
//!
//! The controller shell (`stanch-server`) runs the engine behind these traits, and
//! the adapters (the file store in the shell, the Kubernetes store, election and
//! resources in `stanch-kube`) depend on them and on the pure core, never on the
//! shell; the binary wires them together.
//!
//! - [`clock`]: the wall clock, the one place that reads it; tests set the time.
//! - [`store`]: where the engine's inputs and snapshots survive a restart.
//! - [`leadership`]: whether this replica decides.
//! - [`history`]: the audit history as adapters subscribe to it.
//! - [`control`]: the running controller as adapters read and steer it.

pub mod clock;
pub mod control;
pub mod history;
pub mod leadership;
pub mod store;

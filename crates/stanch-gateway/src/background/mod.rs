//! What runs beside the requests: probing the endpoints that get no traffic, reporting
//! outcomes to the controller, and sweeping idle upstream connections.

mod probe;
mod report;
mod sweep;

pub use probe::probe_loop;
pub use report::report_loop;
pub(crate) use sweep::Sweeper;

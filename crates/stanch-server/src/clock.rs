//! The wall clock: see [`stanch_net::clock`], shared with the gateway.

pub use stanch_net::clock::{Clock, ManualClock, SystemClock};

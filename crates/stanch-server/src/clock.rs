//! The wall clock: see [`stanch_api::clock`], shared with the gateway.

pub use stanch_api::clock::{Clock, ManualClock, SystemClock};

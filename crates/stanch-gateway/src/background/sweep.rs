//! Closing idle upstream connections that their upstream closed or that aged out.

use std::sync::Arc;
use std::time::Duration;

use crate::Gateway;

/// Every second, closes the idle upstream connections that their upstream has closed
/// or that have aged out: nothing else reads an idle connection, so without this one
/// the upstream closed would stay half-open until its endpoint's next request. It runs
/// while the gateway serves, and stops when serving ends, however it ends.
pub(crate) struct Sweeper(tokio::task::JoinHandle<()>);

impl Sweeper {
    pub(crate) fn start(gateway: &Arc<Gateway>) -> Sweeper {
        let gateway = gateway.clone();
        Sweeper(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_secs(1));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                for endpoint in gateway.endpoints() {
                    endpoint.conns.sweep();
                }
            }
        }))
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

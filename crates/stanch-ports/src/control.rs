//! The controller as an adapter drives it.
//!
//! An adapter that tells of the controller's work elsewhere (the Kubernetes
//! resources' status and Events, the route-table resource) or that feeds it a policy
//! reads and steers it through [`Control`], not through the controller shell's
//! types: `stanch-server` implements it, the binary hands it to the adapters.

use std::future::Future;
use std::sync::Arc;

use stanch_api::RouteTable;
use stanch_api::status::ModelStatus;
use stanch_core::Config;
use tokio::sync::{broadcast, watch};

use crate::history::Recorded;
use crate::leadership::Leadership;

/// A published route table, as adapters read it.
pub trait Publication: Send + Sync {
    /// The table.
    fn table(&self) -> &RouteTable;
    /// The table as the JSON every transport serves, serialized once.
    fn table_json(&self) -> &[u8];
    /// One model's status, if the table has the model.
    fn model_status(&self, model: &str) -> Option<&ModelStatus>;
}

/// What adapters need of a running controller.
pub trait Control: Send + Sync {
    /// What [`Control::published`] gives.
    type Published: Publication;
    /// Why [`Control::configure`] did not put a policy in force.
    type ConfigureError: std::error::Error + Send + Sync + 'static;

    /// What is published now.
    fn published(&self) -> Arc<Self::Published>;
    /// Wakes on every new published version.
    fn versions(&self) -> watch::Receiver<u64>;
    /// Every batch of decisions made durable from now on, as the history records it.
    fn decisions(&self) -> broadcast::Receiver<Arc<Recorded>>;
    /// Whether this replica decides.
    fn leadership(&self) -> &Arc<Leadership>;
    /// Puts a new policy in force: durable when this returns `Ok`; an invalid policy
    /// changes nothing.
    fn configure(
        &self,
        config: Config,
    ) -> impl Future<Output = Result<(), Self::ConfigureError>> + Send;
}

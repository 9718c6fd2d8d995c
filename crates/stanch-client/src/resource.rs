//! Following the route-table resource (`StanchRouteTable`, feature `kubernetes`)
//! instead of the controller's watch API: a gateway in the cluster needs no network
//! path to the controller, only to the API server.
//!
//! The resource's status holds the table exactly as `GET /v1/routes` serves it (the
//! leader writes it), and it is applied by the same rules as a table from the watch:
//! only a newer version of the same epoch, or any version of another; the validator
//! may refuse it (logged; there is no channel to report a refusal to the controller
//! here, so `X-Stanch-Rejected-Version` is the watch API's alone); the last-known-good
//! copy is kept on disk and served at start. Lease expiry stays the gateway's, per
//! request. A deleted resource, or an API server out of reach, leaves the table in
//! force: the gateway fails open on what it has.

use std::path::PathBuf;

use futures_util::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use tracing::{Instrument, info_span, warn};

use crate::{Applier, Routes, Validator};

/// Where the route-table resource is.
#[derive(Clone)]
pub struct ResourceConfig {
    /// A client of the API server (in-cluster, or from a kubeconfig).
    pub client: kube::Client,
    /// The resource's namespace (the controller's).
    pub namespace: String,
    /// The resource's name (the controller's Lease name, `stanch` by default).
    pub name: String,
    /// Where the last-known-good table is kept; `None` keeps nothing.
    pub state_file: Option<PathBuf>,
}

/// Starts following the resource. Loads the last-known-good table first, so the
/// gateway has routes before the API server answers (or while it is down).
pub fn start_from_resource(
    config: ResourceConfig,
    validator: Option<Validator>,
) -> (Routes, tokio::task::JoinHandle<()>) {
    let (routes, applier) = Applier::restore(config.state_file.clone(), validator);
    let span = info_span!("route_resource", namespace = %config.namespace, name = %config.name);
    let task = tokio::spawn(follow(config, applier).instrument(span));
    (routes, task)
}

/// The route-table resource's kind, without linking stanch's controller crates.
fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("stanch.dev", "v1alpha1", "StanchRouteTable"),
        "stanchroutetables",
    )
}

async fn follow(config: ResourceConfig, mut applier: Applier) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(config.client, &config.namespace, &resource());
    let selector = watcher::Config::default().fields(&format!("metadata.name={}", config.name));
    // The watcher lists, then watches, and lists again after an error or a `410`,
    // backing off between tries.
    let mut events = watcher(api, selector).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object))
                if object.metadata.name.as_deref() == Some(config.name.as_str()) =>
            {
                apply(&mut applier, &object);
            }
            Ok(watcher::Event::Delete(object))
                if object.metadata.name.as_deref() == Some(config.name.as_str()) =>
            {
                warn!("the route-table resource was deleted; the gateway keeps its current table");
            }
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "watching the route-table resource; the gateway keeps its current table")
            }
        }
    }
}

/// Applies the table in `object`'s status, if it holds one.
fn apply(applier: &mut Applier, object: &DynamicObject) {
    let Some(table) = object.data.get("status").and_then(|s| s.get("table")) else {
        return; // Created, not written yet.
    };
    let bytes = serde_json::to_vec(table).expect("JSON values serialize");
    if let Err(e) = applier.receive(&bytes) {
        warn!(error = %e, "the route-table resource holds an unreadable table; the gateway keeps its current table");
    }
}

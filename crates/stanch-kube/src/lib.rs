//! stanch in Kubernetes: an adapter around the engine, like the HTTP intake. It owns
//! the custom resources ([`crd`]): a policy per model, whose spec becomes the model's
//! configuration ([`policy`]) and whose status shows its place on the ladder, and the
//! route-table resource, whose status is the published table; [`merge`] decides the
//! policy in force when the configuration file and resources are used together.
//! With several replicas, [`election`] runs leader election on a Lease ([`lease`]) and
//! [`store`] keeps the state in ConfigMaps, fenced so that only the leader writes.
//! stanch-core never sees a Kubernetes type.
//!
//! The CRDs are generated from these types ([`crds`], `stanch crdgen`) and committed
//! under `charts/stanch/crds/`; a test fails when the committed files differ from what
//! the types generate.

pub mod adapter;
pub mod crd;
pub mod election;
pub mod events;
pub mod lease;
pub mod merge;
pub mod policy;
pub mod publish;
pub mod shards;
pub mod status;
pub mod store;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use kube::CustomResourceExt;
use stanch_api::Timestamp;

/// Every CRD stanch uses, each with the file it is committed as under
/// `charts/stanch/crds/`.
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    vec![
        ("stanchpolicies.stanch.dev.yaml", crd::StanchPolicy::crd()),
        (
            "stanchroutetables.stanch.dev.yaml",
            crd::StanchRouteTable::crd(),
        ),
    ]
}

/// A CRD as committed: a header saying where it comes from, then its YAML.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> String {
    let yaml = serde_yaml::to_string(crd).expect("a CRD serializes");
    format!(
        "# Generated from crates/stanch-kube/src/crd.rs by `stanch crdgen`; do not edit.\n{yaml}"
    )
}

/// `text` cut to at most `max` bytes at a character boundary, marked `...` where cut:
/// for the API server's limits on condition messages and Event notes.
pub(crate) fn cut(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max.saturating_sub(3);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

/// A Kubernetes `MicroTime` (Leases, Events).
pub(crate) fn micro_time(t: Timestamp) -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::from_millisecond(t.as_millis()).unwrap_or_default())
}

/// A Kubernetes `Time`, to the second as the API server keeps it (conditions).
pub(crate) fn time(t: Timestamp) -> Time {
    let seconds = t.as_millis().div_euclid(1000);
    Time(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap_or_default())
}

//! The route-table resource, written from each published table: its status is the
//! table exactly as `GET /v1/routes` serves it, so `kubectl get stanchroutetable -o
//! yaml` and a gateway following the resource see what the HTTP watch serves.
//!
//! Written by server-side apply under field manager [`FIELD_MANAGER`], the resource
//! first (an empty spec), then its status; a table already written (same epoch and
//! version) is not written again, so renewals of nothing do not reach the API server.

use kube::Api;
use kube::api::{Patch, PatchParams};
use serde::Serialize;
use serde_json::json;
use serde_json::value::RawValue;
use stanch_api::RouteTable;
use stanch_ports::control::{Control, Publication};

use crate::crd::StanchRouteTable;
#[cfg(doc)]
use crate::crd::StanchRouteTableStatus;

/// The field manager of everything stanch writes.
pub const FIELD_MANAGER: &str = "stanch";

/// Writes published tables to one route-table resource.
pub struct RouteTableWriter {
    api: Api<StanchRouteTable>,
    name: String,
    /// The epoch and version last written.
    written: Option<(String, u64)>,
}

impl RouteTableWriter {
    /// A writer of the resource `name` through `api` (its namespace).
    pub fn new(api: Api<StanchRouteTable>, name: impl Into<String>) -> RouteTableWriter {
        RouteTableWriter {
            api,
            name: name.into(),
            written: None,
        }
    }

    /// Writes `table` unless it is the one last written: `true` when it wrote.
    pub async fn write(&mut self, table: &RouteTable) -> Result<bool, kube::Error> {
        let json = serde_json::to_vec(table).expect("route tables serialize");
        self.write_rendered(&table.epoch, table.version, &json)
            .await
    }

    /// Writes the table of `epoch` and `version`, given as the JSON it was published
    /// as ([`Publication::table_json`]), unless it is the one last written: the table (megabytes
    /// with a large incident's alerts) is not cloned or serialized again.
    pub async fn write_rendered(
        &mut self,
        epoch: &str,
        version: u64,
        json: &[u8],
    ) -> Result<bool, kube::Error> {
        if self
            .written
            .as_ref()
            .is_some_and(|(e, v)| e == epoch && *v == version)
        {
            return Ok(false);
        }
        let params = PatchParams::apply(FIELD_MANAGER).force();
        if self.written.is_none() {
            let resource = json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchRouteTable",
                                  "metadata": {"name": self.name}, "spec": {}});
            self.api
                .patch(&self.name, &params, &Patch::Apply(&resource))
                .await?;
        }
        let table = std::str::from_utf8(json)
            .ok()
            .and_then(|text| RawValue::from_string(text.to_owned()).ok())
            .expect("a published table is JSON");
        let patch = StatusPatch {
            api_version: "stanch.dev/v1alpha1",
            kind: "StanchRouteTable",
            status: RenderedStatus { table: &table },
        };
        self.api
            .patch_status(&self.name, &params, &Patch::Apply(&patch))
            .await?;
        self.written = Some((epoch.to_owned(), version));
        Ok(true)
    }
}

/// The status written: [`StanchRouteTableStatus`] with its table already JSON.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusPatch<'a> {
    api_version: &'static str,
    kind: &'static str,
    status: RenderedStatus<'a>,
}

#[derive(Debug, Serialize)]
struct RenderedStatus<'a> {
    table: &'a RawValue,
}

/// The least time between two writes of the route-table resource: an alert storm
/// publishing hundreds of versions a second costs the API server at most this many
/// writes; the newest version is always the one written.
pub const MIN_WRITE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// Writes every table `controller` publishes to the resource while this replica
/// leads, the newest at most every [`MIN_WRITE_INTERVAL`], until `shutdown`. A failed
/// write is tried again at the next interval.
pub async fn follow_published(
    mut writer: RouteTableWriter,
    controller: &impl Control,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut versions = controller.versions();
    let mut leading = controller.leadership().subscribe();
    tokio::pin!(shutdown);
    loop {
        let mut failed = false;
        if controller.leadership().leads() {
            let published = controller.published();
            let table = published.table();
            let (epoch, version) = (&table.epoch, table.version);
            if let Err(e) = writer
                .write_rendered(epoch, version, published.table_json())
                .await
            {
                tracing::warn!(error = %e, "cannot write the route-table resource; trying again");
                failed = true;
            }
        }
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(MIN_WRITE_INTERVAL) => {}
        }
        if failed {
            // Again, whether or not a newer table came meanwhile.
            continue;
        }
        tokio::select! {
            () = &mut shutdown => return,
            Ok(()) = versions.changed() => {}
            Ok(()) = leading.changed() => {}
        }
    }
}

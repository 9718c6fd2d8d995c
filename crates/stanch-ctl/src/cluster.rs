//! `stanch ctl --kubeconfig`: what the cluster holds of the controller's state.
//!
//! Only reads, and only what the cluster has: the route table (the resource the
//! leader writes, identical to `GET /v1/routes`) and each policy's status. Overrides
//! stay on the controller's API, where they are authenticated with its tokens,
//! journaled and in its history; the history, gateways and alerts are there too.

use std::fmt::Write as _;
use std::path::Path;

use kube::ResourceExt;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;
use stanch_api::RouteTable;
use stanch_kube::crd::{StanchPolicy, StanchRouteTable};

use crate::render::{json, render_routes, table};
use crate::{CtlError, Output, ReadCmd};

/// Answers `command` from the cluster `kubeconfig` points at.
pub(crate) fn read(
    kubeconfig: &Path,
    namespace: Option<&str>,
    route_table: &str,
    command: ReadCmd,
    output: Output,
) -> Result<String, CtlError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CtlError::Runtime)?;
    runtime.block_on(async {
        let client = connect(kubeconfig).await?;
        let namespace =
            namespace.map_or_else(|| client.default_namespace().to_owned(), str::to_owned);
        match command {
            ReadCmd::Routes => {
                let table = read_table(&client, &namespace, route_table).await?;
                Ok(if output == Output::Json {
                    json(&table)
                } else {
                    render_routes(&table)
                })
            }
            ReadCmd::Status => status(&client, &namespace, route_table, output).await,
            ReadCmd::History { .. } => Err(CtlError::ClusterReadsOnly),
        }
    })
}

async fn connect(kubeconfig: &Path) -> Result<kube::Client, CtlError> {
    let unusable = |source: Box<dyn std::error::Error + Send + Sync>| CtlError::Kubeconfig {
        path: kubeconfig.to_owned(),
        source,
    };
    let config = Kubeconfig::read_from(kubeconfig).map_err(|e| unusable(e.into()))?;
    let config = kube::Config::from_custom_kubeconfig(config, &KubeConfigOptions::default())
        .await
        .map_err(|e| unusable(e.into()))?;
    kube::Client::try_from(config).map_err(|e| unusable(e.into()))
}

async fn read_table(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<RouteTable, CtlError> {
    let api: Api<StanchRouteTable> = Api::namespaced(client.clone(), namespace);
    let resource = api
        .get_opt(name)
        .await
        .map_err(|source| CtlError::Cluster {
            what: format!("read stanchroutetable {namespace}/{name}"),
            source,
        })?
        .ok_or_else(|| CtlError::NoRouteTable {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })?;
    resource
        .status
        .and_then(|s| s.table)
        .ok_or_else(|| CtlError::EmptyRouteTable {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
}

async fn status(
    client: &kube::Client,
    namespace: &str,
    route_table: &str,
    output: Output,
) -> Result<String, CtlError> {
    let api: Api<StanchPolicy> = Api::namespaced(client.clone(), namespace);
    let policies = api
        .list(&Default::default())
        .await
        .map_err(|source| CtlError::Cluster {
            what: format!("list stanchpolicies in {namespace}"),
            source,
        })?
        .items;
    let table_read = read_table(client, namespace, route_table).await;
    if output == Output::Json {
        let listed: Vec<_> = policies
            .iter()
            .map(|p| json!({"name": p.name_any(), "model": p.spec.model, "status": p.status}))
            .collect();
        let routes = table_read.as_ref().ok();
        return Ok(json(
            &json!({"namespace": namespace, "policies": listed, "routeTable": routes}),
        ));
    }
    let rows: Vec<Vec<String>> = policies
        .iter()
        .map(|p| {
            let s = p.status.as_ref();
            let ready = s
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
                .map_or_else(
                    || "-".to_owned(),
                    |c| format!("{} ({})", c.status, c.reason),
                );
            vec![
                p.name_any(),
                p.spec.model.clone(),
                s.and_then(|s| s.rung)
                    .map_or_else(|| "-".into(), |r| r.to_string()),
                s.and_then(|s| s.active_pool.clone())
                    .unwrap_or_else(|| "-".into()),
                ready,
                s.and_then(|s| s.reason.clone())
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let mut out = format!("policies in {namespace} (from the cluster):\n");
    out.push_str(&table(
        &["POLICY", "MODEL", "RUNG", "POOL", "READY", "REASON"],
        &rows,
    ));
    match table_read {
        Ok(t) => writeln!(
            out,
            "route table {route_table}: version {} epoch {}, {} models, {} blocked",
            t.version,
            t.epoch,
            t.models.len(),
            t.blocked.len()
        )
        .ok(),
        Err(e) => writeln!(out, "route table: {}", crate::error::chain(&e)).ok(),
    };
    out.push_str("gateways, alerts, overrides and the history: stanch ctl status against the controller (--server)\n");
    Ok(out)
}

//! `stanch ctl`: a client for the status and override APIs, for humans (tables) and
//! scripts (`--output json`).
#![expect(
    clippy::print_stdout,
    reason = "a command-line client prints its results"
)]

use std::borrow::Cow;
use std::fmt::Write as _;
use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use serde::de::DeserializeOwned;
use stanch_api::admin::{
    AdminResponse, BlockRequest, DryRunRequest, ForceRequest, FreezeRequest, ReleaseRequest,
    ThawRequest, UnblockAllRequest, UnblockRequest,
};
use stanch_api::status::{HistoryEntry, StatusReport};
use stanch_api::{ErrorBody, HumanDuration, RouteTable, Rung, Timestamp};

#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The controller's URL.
    #[arg(
        long,
        env = "STANCH_URL",
        default_value = "http://127.0.0.1:9797",
        global = true
    )]
    server: String,
    /// Bearer token (admin for overrides, read or admin otherwise).
    #[arg(long, env = "STANCH_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Output format.
    #[arg(long, short, value_enum, default_value = "table", global = true)]
    output: Output,
    /// Read from the cluster instead of the controller's API, with this kubeconfig:
    /// `routes` (the route-table resource) and `status` (the policies' statuses).
    /// Overrides and history are the controller's API's alone.
    #[arg(long, global = true)]
    kubeconfig: Option<std::path::PathBuf>,
    /// With --kubeconfig: the controller's namespace (default: the context's).
    #[arg(long, global = true)]
    namespace: Option<String>,
    /// With --kubeconfig: the route-table resource's name (the controller's Lease name).
    #[arg(long, global = true, default_value = "stanch")]
    route_table: String,
    #[command(subcommand)]
    command: CtlCmd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

/// A watch transport, as `stanch ctl watch --transport` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WatchVia {
    Sse,
    LongPoll,
    Grpc,
}

#[derive(Debug, Subcommand)]
enum CtlCmd {
    /// Models, blocks, overrides and gateways at a glance.
    Status,
    /// The audit history, newest last.
    History {
        /// Entries to show.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Only this model.
        #[arg(long)]
        model: Option<String>,
    },
    /// The published route table.
    Routes,
    /// Follow the route table as a gateway does, printing each version as it arrives.
    Watch {
        /// How: sse, long-poll or grpc.
        #[arg(long, value_enum, default_value = "sse")]
        transport: WatchVia,
        /// The identity to watch as (status lists it among the gateways).
        #[arg(long, default_value = "stanch-ctl")]
        id: String,
        /// Stop after this many versions (default: follow until interrupted).
        #[arg(long)]
        count: Option<usize>,
    },
    /// Pin a model to a rung.
    Force {
        model: String,
        /// normal, failover, degraded or static.
        rung: Rung,
        #[arg(long)]
        ttl: Option<HumanDuration>,
        #[arg(long)]
        reason: String,
    },
    /// Hand a pinned model back to automation.
    Release {
        model: String,
        #[arg(long)]
        reason: String,
    },
    /// Stop automation for one model (or every model).
    Freeze {
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        ttl: Option<HumanDuration>,
        #[arg(long)]
        reason: String,
    },
    /// End a freeze.
    Thaw {
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        reason: String,
    },
    /// Soft-block an endpoint.
    Block {
        endpoint: String,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        ttl: Option<HumanDuration>,
        #[arg(long)]
        reason: String,
    },
    /// Lift a block.
    Unblock {
        endpoint: String,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        reason: String,
    },
    /// Lift every block.
    UnblockAll {
        #[arg(long)]
        reason: String,
    },
    /// Decide and report without publishing (on), or publish again (off).
    DryRun {
        #[arg(value_parser = ["on", "off"])]
        state: String,
        #[arg(long)]
        reason: String,
    },
}

struct Client {
    http: reqwest::blocking::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    fn request(
        &self,
        req: reqwest::blocking::RequestBuilder,
    ) -> Result<reqwest::blocking::Response, String> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let response = req
            .send()
            .map_err(|e| format!("cannot reach {}: {e}", self.base))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        match response.json::<ErrorBody>() {
            Ok(body) => Err(format!("{status}: {}: {}", body.error, body.detail)),
            Err(_) => Err(format!("{status}")),
        }
    }

    fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let response = self.request(self.http.get(format!("{}{path}", self.base)))?;
        response
            .json()
            .map_err(|e| format!("unexpected answer: {e}"))
    }

    fn post<B: Serialize>(&self, path: &str, body: &B) -> Result<AdminResponse, String> {
        let response = self.request(self.http.post(format!("{}{path}", self.base)).json(body))?;
        response
            .json()
            .map_err(|e| format!("unexpected answer: {e}"))
    }
}

pub fn run(args: CtlArgs) -> ExitCode {
    if let Some(kubeconfig) = &args.kubeconfig {
        let read = cluster::execute(
            kubeconfig,
            args.namespace.as_deref(),
            &args.route_table,
            args.command,
            args.output,
        );
        return finish(read);
    }
    let token = args
        .token
        .or_else(|| std::env::var("STANCH_ADMIN_TOKEN").ok())
        .filter(|t| !t.is_empty());
    if let CtlCmd::Watch {
        transport,
        id,
        count,
    } = args.command
    {
        return watch(&args.server, token, transport, &id, count, args.output);
    }
    let http = match reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(15))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let client = Client {
        http,
        base: args.server.trim_end_matches('/').to_owned(),
        token,
    };
    finish(execute(&client, args.command, args.output))
}

/// `stanch ctl watch`: one line per version applied (the table itself with `-o json`,
/// one per line), until `count` versions or an interrupt. A table the controller
/// serves is applied whatever it holds: there is no gateway here to refuse it.
fn watch(
    server: &str,
    token: Option<String>,
    via: WatchVia,
    id: &str,
    count: Option<usize>,
    output: Output,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = stanch_client::WatchConfig::new(server, id);
    config.token = token.map(secrecy::SecretString::from);
    config.transport = match via {
        WatchVia::Sse => stanch_client::Transport::Sse,
        WatchVia::LongPoll => stanch_client::Transport::LongPoll,
        WatchVia::Grpc => stanch_client::Transport::Grpc,
    };
    let name = via
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned());
    runtime.block_on(async {
        let (mut routes, _task) = stanch_client::start(config, None);
        let mut seen = 0;
        let mut version = 0;
        let interrupted = stanch_server::net::shutdown_signal();
        tokio::pin!(interrupted);
        while count.is_none_or(|n| seen < n) {
            let table = tokio::select! {
                t = routes.changed_from(version) => t,
                () = &mut interrupted => break,
            };
            let Some(table) = table else { break };
            version = table.version;
            seen += 1;
            let line = match output {
                Output::Json => serde_json::to_string(&*table).unwrap_or_default(),
                Output::Table => format!(
                    "{} version {} epoch {} hash {} via {name}: {} model(s), {} blocked",
                    table.generated_at,
                    table.version,
                    table.epoch,
                    table.hash,
                    table.models.len(),
                    table.blocked.len()
                ),
            };
            println!("{line}");
        }
        ExitCode::SUCCESS
    })
}

/// Prints what a command made, or why it failed.
fn finish(result: Result<String, String>) -> ExitCode {
    // Whatever a value from outside holds, it cannot drive the terminal: every control
    // character but the renderers' own line ends is written as an escape.
    let safe = |text: &str| -> String {
        text.split('\n')
            .map(|line| printable(line).into_owned())
            .collect::<Vec<_>>()
            .join("\n")
    };
    match result {
        Ok(text) => {
            print!("{}", safe(&text));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", safe(&e));
            ExitCode::FAILURE
        }
    }
}

/// `s` with every control character written as an escape (`\n`, `\u{1b}`): a value
/// from outside (an alert's label, a reason, a gateway's name) stays on its own line
/// of the output, as text.
fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default() + "\n"
}

fn execute(client: &Client, command: CtlCmd, output: Output) -> Result<String, String> {
    let admin = |path: &str, response: Result<AdminResponse, String>| -> Result<String, String> {
        let r = response?;
        if output == Output::Json {
            return Ok(json(&r));
        }
        let mut out = String::new();
        if !r.changed {
            writeln!(out, "{path}: nothing changed (already so)").ok();
        }
        for effect in &r.effects {
            writeln!(out, "{}", printable(effect)).ok();
        }
        writeln!(out, "route version {}", r.version).ok();
        Ok(out)
    };
    match command {
        CtlCmd::Status => {
            let s: StatusReport = client.get("/v1/status")?;
            Ok(if output == Output::Json {
                json(&s)
            } else {
                render_status(&s)
            })
        }
        CtlCmd::History { limit, model } => {
            let mut path = format!("/v1/history?limit={limit}");
            if let Some(m) = model {
                path.push_str(&format!("&model={m}"));
            }
            let entries: Vec<HistoryEntry> = client.get(&path)?;
            Ok(if output == Output::Json {
                json(&entries)
            } else {
                render_history(&entries)
            })
        }
        // Follows the watch rather than asking once: `run` sends it to `watch`.
        CtlCmd::Watch { .. } => Err("watch follows the route table with its own client".into()),
        CtlCmd::Routes => {
            let t: RouteTable = client.get("/v1/routes")?;
            Ok(if output == Output::Json {
                json(&t)
            } else {
                render_routes(&t)
            })
        }
        CtlCmd::Force {
            model,
            rung,
            ttl,
            reason,
        } => admin(
            "force",
            client.post(
                "/v1/admin/force",
                &ForceRequest {
                    model,
                    rung,
                    ttl,
                    reason,
                },
            ),
        ),
        CtlCmd::Release { model, reason } => admin(
            "release",
            client.post("/v1/admin/release", &ReleaseRequest { model, reason }),
        ),
        CtlCmd::Freeze { model, ttl, reason } => admin(
            "freeze",
            client.post("/v1/admin/freeze", &FreezeRequest { model, ttl, reason }),
        ),
        CtlCmd::Thaw { model, reason } => admin(
            "thaw",
            client.post("/v1/admin/thaw", &ThawRequest { model, reason }),
        ),
        CtlCmd::Block {
            endpoint,
            model,
            ttl,
            reason,
        } => admin(
            "block",
            client.post(
                "/v1/admin/block",
                &BlockRequest {
                    endpoint,
                    model,
                    ttl,
                    reason,
                },
            ),
        ),
        CtlCmd::Unblock {
            endpoint,
            model,
            reason,
        } => admin(
            "unblock",
            client.post(
                "/v1/admin/unblock",
                &UnblockRequest {
                    endpoint,
                    model,
                    reason,
                },
            ),
        ),
        CtlCmd::UnblockAll { reason } => admin(
            "unblock-all",
            client.post("/v1/admin/unblock-all", &UnblockAllRequest { reason }),
        ),
        CtlCmd::DryRun { state, reason } => {
            let enabled = state == "on";
            admin(
                "dry-run",
                client.post("/v1/admin/dry-run", &DryRunRequest { enabled, reason }),
            )
        }
    }
}

/// Renders rows as aligned columns, each cell on its row whatever it holds.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<Cow<'_, str>>> = rows
        .iter()
        .map(|row| row.iter().map(|cell| printable(cell)).collect())
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: Vec<&str>| {
        let last = cells.len() - 1;
        for (i, cell) in cells.iter().enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                write!(out, "{cell:<w$}  ", w = widths[i]).ok();
            }
        }
        out.push('\n');
    };
    line(&mut out, header.to_vec());
    for row in &rows {
        line(&mut out, row.iter().map(|c| c.as_ref()).collect());
    }
    out
}

fn ago(now: Timestamp, t: Timestamp) -> String {
    format!("{} ago", duration(now.since(t).as_secs()))
}

fn duration(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{}s", secs / 60, secs % 60),
        _ => format!("{}h{}m", secs / 3600, (secs % 3600) / 60),
    }
}

fn render_status(s: &StatusReport) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "route version {} (epoch {}), store {}{}",
        s.version,
        s.epoch,
        s.store.kind,
        if s.store.healthy { "" } else { " FAILING" }
    )
    .ok();
    if let Some(why) = &s.store.recovered_from_corruption {
        writeln!(
            out,
            "WARNING: state was unreadable at start and began anew: {why}"
        )
        .ok();
    }
    if let Some(d) = &s.dry_run {
        let reason = printable(&d.reason);
        writeln!(out, "DRY-RUN since {}: {reason}", ago(s.now, d.since)).ok();
    }
    if let Some(f) = &s.global_freeze {
        writeln!(
            out,
            "FROZEN (all models) since {}: {}",
            ago(s.now, f.since),
            printable(&f.reason)
        )
        .ok();
    }
    out.push('\n');
    let rows: Vec<Vec<String>> = s
        .models
        .iter()
        .map(|(name, m)| {
            let mut flags = Vec::new();
            if let Some(f) = &m.force {
                flags.push(format!("forced({})", f.info.reason));
            }
            if m.freeze.is_some() {
                flags.push("frozen".to_owned());
            }
            if let Some(p) = &m.pinned {
                flags.push(format!("flap-pinned≥{}", p.rung));
            }
            if m.decided_rung != m.rung {
                flags.push(format!("would be {}", m.decided_rung));
            }
            vec![
                name.clone(),
                m.rung.to_string(),
                m.pool.clone(),
                m.alias.clone().unwrap_or_else(|| "-".into()),
                ago(s.now, m.since),
                if flags.is_empty() {
                    "-".into()
                } else {
                    flags.join(" ")
                },
                m.step_down.map_or("-".into(), |d| {
                    format!("{} in {}", d.to, duration(d.at.since(s.now).as_secs()))
                }),
                m.reason.clone(),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "MODEL",
            "RUNG",
            "POOL",
            "ALIAS",
            "SINCE",
            "OVERRIDES",
            "STEPS DOWN",
            "REASON",
        ],
        &rows,
    ));
    let conditions: Vec<Vec<String>> = s
        .models
        .iter()
        .flat_map(|(name, m)| {
            m.conditions.iter().map(move |c| {
                let labels: Vec<String> = c
                    .labels
                    .iter()
                    .filter(|(k, _)| k.as_str() != "alertname")
                    .map(|(k, v)| format!("{k}={v:?}"))
                    .collect();
                vec![
                    name.clone(),
                    c.alertname
                        .clone()
                        .unwrap_or_else(|| c.fingerprint.to_string()),
                    ago(s.now, c.starts_at),
                    c.effect.clone(),
                    labels.join(","),
                ]
            })
        })
        .collect();
    if !conditions.is_empty() {
        out.push('\n');
        out.push_str(&table(
            &["MODEL", "ALERT", "STARTED", "MEANS", "LABELS"],
            &conditions,
        ));
    }
    if !s.blocked.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .blocked
            .iter()
            .map(|b| {
                vec![
                    b.endpoint.clone(),
                    b.model.clone().unwrap_or_else(|| "(all)".into()),
                    b.source.as_str().to_owned(),
                    format!("{}s", b.seconds_left),
                    b.strikes.to_string(),
                    b.reason.clone(),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "BLOCKED ENDPOINT",
                "MODEL",
                "SOURCE",
                "LEFT",
                "STRIKES",
                "REASON",
            ],
            &rows,
        ));
    }
    if !s.gateways.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .gateways
            .iter()
            .map(|g| {
                let state = if g.stale {
                    "STALE"
                } else if g.converged {
                    "converged"
                } else {
                    "BEHIND"
                };
                vec![
                    g.id.clone(),
                    g.transport.as_str().to_owned(),
                    g.applied_version.map_or("-".into(), |v| v.to_string()),
                    g.lag.map_or("-".into(), |l| l.to_string()),
                    state.to_owned(),
                    if g.connected {
                        "connected".into()
                    } else {
                        format!("{}s ago", g.age_seconds)
                    },
                    g.rejected
                        .as_ref()
                        .map_or("-".into(), |(v, why)| format!("v{v}: {why}")),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "GATEWAY",
                "TRANSPORT",
                "APPLIED",
                "LAG",
                "STATE",
                "LAST SEEN",
                "LAST NACK",
            ],
            &rows,
        ));
    }
    writeln!(
        out,
        "\n{} active alert(s), {} unmapped",
        s.alerts.active, s.alerts.unmapped
    )
    .ok();
    out
}

fn render_history(entries: &[HistoryEntry]) -> String {
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                e.seq.to_string(),
                e.at.to_string(),
                e.kind.clone(),
                if e.dry_run {
                    format!("(dry-run) {}", e.summary)
                } else {
                    e.summary.clone()
                },
            ]
        })
        .collect();
    table(&["SEQ", "AT", "KIND", "WHAT"], &rows)
}

fn render_routes(t: &RouteTable) -> String {
    let mut out = format!(
        "version {} epoch {} hash {} generated {}\n\n",
        t.version, t.epoch, t.hash, t.generated_at
    );
    let rows: Vec<Vec<String>> = t
        .models
        .iter()
        .map(|(name, m)| {
            vec![
                name.clone(),
                m.rung.to_string(),
                m.pool.clone(),
                m.alias.clone().unwrap_or_else(|| "-".into()),
                m.faq.clone().unwrap_or_else(|| "-".into()),
                m.lease_until.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(
        &["MODEL", "RUNG", "POOL", "ALIAS", "FAQ", "LEASE UNTIL"],
        &rows,
    ));
    for b in &t.blocked {
        writeln!(
            out,
            "blocked {} ({}) until {}: {}",
            printable(&b.endpoint),
            b.model.as_deref().unwrap_or("all"),
            b.until,
            printable(&b.reason)
        )
        .ok();
    }
    out
}

/// `stanch ctl --kubeconfig`: what the cluster holds of the controller's state.
///
/// Only reads, and only what the cluster has: the route table (the resource the
/// leader writes, identical to `GET /v1/routes`) and each policy's status. Overrides
/// stay on the controller's API, where they are authenticated with its tokens,
/// journaled and in its history; the history, gateways and alerts are there too.
mod cluster {
    use std::fmt::Write as _;
    use std::path::Path;

    use kube::ResourceExt;
    use kube::api::Api;
    use kube::config::{KubeConfigOptions, Kubeconfig};
    use serde_json::json;
    use stanch_api::RouteTable;
    use stanch_kube::crd::{StanchPolicy, StanchRouteTable};

    use super::{CtlCmd, Output, json, render_routes, table};

    pub(super) fn execute(
        kubeconfig: &Path,
        namespace: Option<&str>,
        route_table: &str,
        command: CtlCmd,
        output: Output,
    ) -> Result<String, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the runtime: {e}"))?;
        runtime.block_on(async {
            let config = Kubeconfig::read_from(kubeconfig)
                .map_err(|e| format!("{}: {e}", kubeconfig.display()))?;
            let config =
                kube::Config::from_custom_kubeconfig(config, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| format!("{}: {e}", kubeconfig.display()))?;
            let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
            let namespace =
                namespace.map_or_else(|| client.default_namespace().to_owned(), str::to_owned);
            match command {
                CtlCmd::Routes => {
                    let table = read_table(&client, &namespace, route_table).await?;
                    Ok(if output == Output::Json {
                        json(&table)
                    } else {
                        render_routes(&table)
                    })
                }
                CtlCmd::Status => status(&client, &namespace, route_table, output).await,
                _ => Err(
                    "--kubeconfig reads only (routes, status): overrides and the history are \
                     the controller's API (--server), where they are authenticated with its \
                     tokens and audited"
                        .into(),
                ),
            }
        })
    }

    async fn read_table(
        client: &kube::Client,
        namespace: &str,
        name: &str,
    ) -> Result<RouteTable, String> {
        let api: Api<StanchRouteTable> = Api::namespaced(client.clone(), namespace);
        let resource = api
            .get_opt(name)
            .await
            .map_err(|e| format!("cannot read stanchroutetable {namespace}/{name}: {e}"))?
            .ok_or_else(|| {
                format!("no stanchroutetable {namespace}/{name}: is a controller with --store kubernetes running there?")
            })?;
        resource
            .status
            .and_then(|s| s.table)
            .ok_or_else(|| format!("stanchroutetable {namespace}/{name} holds no table yet"))
    }

    async fn status(
        client: &kube::Client,
        namespace: &str,
        route_table: &str,
        output: Output,
    ) -> Result<String, String> {
        let api: Api<StanchPolicy> = Api::namespaced(client.clone(), namespace);
        let policies = api
            .list(&Default::default())
            .await
            .map_err(|e| format!("cannot list stanchpolicies in {namespace}: {e}"))?
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
            Err(e) => writeln!(out, "route table: {e}").ok(),
        };
        out.push_str("gateways, alerts, overrides and the history: stanch ctl status against the controller (--server)\n");
        Ok(out)
    }
}

//! `stanch-gateway`: run the reference data plane.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use stanch_gateway::Gateway;
use stanch_gateway::config::{GatewayConfig, secret};
use stanch_ports::clock::SystemClock;

/// The stanch reference gateway: OpenAI-compatible, applies stanch's route table.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The YAML configuration.
    #[arg(long, env = "STANCH_GATEWAY_CONFIG")]
    config: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "STANCH_GATEWAY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Log format: text or json (JSON lines, for log shippers).
    #[arg(long, env = "STANCH_GATEWAY_LOG_FORMAT", default_value = "text")]
    log_format: stanch_log::Format,
    /// Validate the configuration and exit (64 with every problem, 0 when valid).
    #[arg(long)]
    check: bool,
    /// Serve the status (`/v1/status`, `/status`) and the metrics on this address
    /// instead of the callers' (`--listen`), which then does not answer them.
    #[arg(long, env = "STANCH_GATEWAY_STATUS_LISTEN")]
    status_listen: Option<SocketAddr>,
    /// Threads serving callers (0: one per core). Each serves its share of the
    /// connections whole, with its own upstream connections.
    #[arg(long, env = "STANCH_GATEWAY_WORKER_THREADS", default_value_t = 0)]
    worker_threads: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Held to the end of main, so what is buffered is written out.
    let logging = stanch_log::init(args.log_format);
    // A caller is a connection, and an upstream another.
    if let Some((before, after)) = stanch_net::raise_open_file_limit()
        && before < after
    {
        tracing::info!(before, after, "open-file limit raised to the hard limit");
    }
    let config = match std::fs::read_to_string(&args.config)
        .map_err(|e| e.to_string())
        .and_then(|t| GatewayConfig::from_yaml(&t).map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: {e}", args.config.display());
            return ExitCode::from(64);
        }
    };
    if args.check {
        let models = config.models.keys().cloned().collect::<Vec<_>>().join(", ");
        eprintln!(
            "{}: ok ({} model(s): {models})",
            args.config.display(),
            config.models.len()
        );
        return ExitCode::SUCCESS;
    }
    let threads = match args.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    // Callers are served on the workers; this thread accepts their connections and
    // runs the background work: the controller's watch, reports, probes, signals.
    let started = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .and_then(|runtime| Ok((runtime, stanch_net::Workers::start(threads, "stanch-gw")?)));
    let (runtime, workers) = match started {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let listen = (args.listen, args.status_listen);
    match runtime.block_on(run(config, listen, &workers, logging.dropped())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stanch-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the gateway on (the callers' address, the status listener's, if apart).
// Size: the gateway's wiring, in the order its parts must start.
async fn run(
    config: GatewayConfig,
    (listen, status_listen): (SocketAddr, Option<SocketAddr>),
    workers: &stanch_net::Workers,
    log_drops: stanch_log::Dropped,
) -> anyhow::Result<()> {
    let routes = match &config.controller {
        Some(c) => {
            let id = c
                .gateway_id
                .clone()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| listen.to_string());
            let validator = Some(Gateway::validator(&config));
            let state_file = c.state_file.as_ref().map(PathBuf::from);
            match (&c.route_table, &c.url) {
                (Some(resource), _) => {
                    Some(follow_resource(resource, state_file, validator).await?)
                }
                (None, Some(url)) => {
                    let mut watch = stanch_client::WatchConfig::new(url, &id);
                    watch.token = secret(c.token_env.as_ref(), c.token_file.as_ref(), None)
                        .map_err(anyhow::Error::msg)?;
                    watch.state_file = state_file;
                    watch.transport = c.watch.into();
                    if let Some(path) = &config.tls.ca_file {
                        let pem =
                            std::fs::read(path).with_context(|| format!("tls.ca_file: {path}"))?;
                        watch.ca_pem = Some(pem);
                    }
                    let (routes, _task) = stanch_client::start(watch, validator);
                    Some(routes)
                }
                (None, None) => None, // Refused by validation.
            }
        }
        None => None,
    };
    let reporting = config
        .controller
        .as_ref()
        .filter(|c| !c.report_interval.0.is_zero())
        .map(|c| {
            let id = c
                .gateway_id
                .clone()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| listen.to_string());
            let (env, file) = c.report_token_source();
            let token = secret(env, file, None);
            (c.url.clone(), token, id, c.report_interval.0)
        })
        .and_then(|(url, token, id, interval)| Some((url?, token, id, interval)));
    let gateway = Arc::new(Gateway::new(config, routes, Arc::new(SystemClock))?);
    gateway.count_log_drops(log_drops);
    if gateway.config_probing() {
        tokio::spawn(stanch_gateway::probe_loop(gateway.clone()));
    }
    if let Some((url, token, id, interval)) = reporting {
        let token = token.map_err(anyhow::Error::msg)?;
        tokio::spawn(stanch_gateway::report_loop(
            gateway.clone(),
            url,
            token,
            id,
            interval,
        ));
    }
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let status = match status_listen {
        Some(at) => Some(
            tokio::net::TcpListener::bind(at)
                .await
                .with_context(|| format!("--status-listen {at}"))?,
        ),
        None => None,
    };
    match status_listen {
        Some(status) => {
            tracing::info!(%listen, %status, workers = workers.len(), "stanch-gateway listening; status and metrics apart")
        }
        None => tracing::info!(%listen, workers = workers.len(), "stanch-gateway listening"),
    }
    let shutdown = stanch_net::shutdown_signal();
    stanch_gateway::serve_on(workers, listener, status, gateway, shutdown).await?;
    Ok(())
}

/// Follows the route-table resource (in-cluster configuration, or KUBECONFIG).
#[cfg(feature = "kubernetes")]
async fn follow_resource(
    resource: &stanch_gateway::config::RouteTableRef,
    state_file: Option<PathBuf>,
    validator: Option<stanch_client::Validator>,
) -> anyhow::Result<stanch_client::Routes> {
    let client = kube::Client::try_default()
        .await
        .context("controller.route_table: cannot find the Kubernetes API (in-cluster configuration or KUBECONFIG)")?;
    let config = stanch_client::ResourceConfig {
        client,
        namespace: resource.namespace.clone(),
        name: resource.name.clone(),
        state_file,
    };
    let (routes, _task) = stanch_client::start_from_resource(config, validator);
    Ok(routes)
}

#[cfg(not(feature = "kubernetes"))]
async fn follow_resource(
    _: &stanch_gateway::config::RouteTableRef,
    _: Option<PathBuf>,
    _: Option<stanch_client::Validator>,
) -> anyhow::Result<stanch_client::Routes> {
    anyhow::bail!("controller.route_table: this gateway was built without feature `kubernetes`")
}

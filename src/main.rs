//! The `stanch` binary: arguments, logging, wiring. Behaviour lives in the crates.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use stanch_ports::clock::SystemClock;
use stanch_server::auth::Tokens;
use stanch_server::config::{ConfigFile, ServerConfig};
use stanch_server::net::ConnLimits;
use stanch_server::{Controller, Settings, Storage};

/// Exit code for a configuration that cannot be used (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

/// stanch: a self-healing control plane for LLM API gateways.
#[derive(Debug, Parser)]
#[command(version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the controller.
    Serve(ServeArgs),
    /// Validate a configuration file offline; lists every problem with its path.
    CheckConfig {
        /// The YAML configuration file.
        file: PathBuf,
    },
    /// Inspect and override a running controller.
    Ctl(stanch_ctl::CtlArgs),
    /// Watch stanch heal a simulated outage: everything in one process, on loopback
    /// (in a build with `--features demo`).
    Demo {
        /// How long to run (the script needs about 70 s).
        #[arg(long, default_value_t = 75)]
        seconds: u64,
        /// Send stanch the alerts itself, even when Prometheus and Alertmanager are installed.
        #[arg(long)]
        simulate_alerts: bool,
    },
    /// Print the custom resource definitions (YAML), or write each to a directory.
    Crdgen {
        /// Write one file per CRD here (as committed under charts/stanch/crds/).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StoreKind {
    /// Snapshot and journal under --data-dir; survives restarts.
    File,
    /// In memory only; state is lost on restart.
    Memory,
    /// In ConfigMaps of the namespace, shared by replicas: the one holding the Lease
    /// decides, the others serve its table (in-cluster configuration, or KUBECONFIG).
    Kubernetes,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// The YAML configuration; without it, the embedded default configuration.
    #[arg(long, env = "STANCH_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "STANCH_LISTEN", default_value = "127.0.0.1:9797")]
    listen: SocketAddr,
    /// Directory for state, journal and history.
    #[arg(long, env = "STANCH_DATA_DIR", default_value = "./stanch-data")]
    data_dir: PathBuf,
    /// Where state is kept.
    #[arg(long, env = "STANCH_STORE", value_enum, default_value = "file")]
    store: StoreKind,
    /// Log format.
    #[arg(long, env = "STANCH_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// PEM certificate chain: serve HTTPS.
    #[arg(long, env = "STANCH_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "STANCH_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Threads running the controller's async work. One is plenty for thousands of
    /// watchers and keeps memory flat (see docs/benchmarks.md); fsync runs on its own.
    #[arg(long, env = "STANCH_WORKER_THREADS", default_value_t = 1)]
    worker_threads: usize,
    /// Take model policies from StanchPolicy resources too, merged over the file (a
    /// resource wins for its model): the cluster's in-cluster configuration, or
    /// KUBECONFIG.
    #[arg(long, env = "STANCH_KUBERNETES_POLICIES")]
    kubernetes_policies: bool,
    /// The namespace of the state, the Lease and the policies taken: by default the
    /// pod's own (or the kubeconfig context's); policies then come from every
    /// namespace unless this is given.
    #[arg(long, env = "STANCH_KUBERNETES_NAMESPACE")]
    kubernetes_namespace: Option<String>,
    /// With `--store kubernetes`: the Lease replicas elect their leader on.
    #[arg(long, env = "STANCH_KUBERNETES_LEASE", default_value = "stanch")]
    kubernetes_lease: String,
    /// With `--store kubernetes`: the ConfigMap holding the state (its shards are
    /// named after it).
    #[arg(long, env = "STANCH_KUBERNETES_STATE", default_value = "stanch-state")]
    kubernetes_state: String,
    /// With `--store kubernetes`: how long a lease lasts unrenewed; a leader killed
    /// outright is replaced within about this.
    #[arg(long, env = "STANCH_LEASE_DURATION", default_value = "15s", value_parser = humantime_secs)]
    lease_duration: Duration,
}

/// A whole number of seconds (`15s`, `1m`): Lease durations are in seconds.
fn humantime_secs(text: &str) -> Result<Duration, String> {
    let d: stanch_api::HumanDuration = text.parse().map_err(|e| format!("{text}: {e}"))?;
    let d = d.0;
    if d < Duration::from_secs(2) || d > Duration::from_secs(300) || d.subsec_nanos() != 0 {
        return Err(format!(
            "{text}: a lease lasts whole seconds, from 2s to 5m"
        ));
    }
    Ok(d)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::CheckConfig { file } => check_config(&file),
        Cmd::Serve(args) => serve(args),
        Cmd::Ctl(args) => stanch_ctl::run(args),
        Cmd::Crdgen { out } => crdgen(out.as_deref()),
        Cmd::Demo {
            seconds,
            simulate_alerts,
        } => demo(seconds, simulate_alerts),
    }
}

#[cfg(feature = "demo")]
fn demo(seconds: u64, simulate_alerts: bool) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(stanch_demo::run(seconds, simulate_alerts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "demo"))]
fn demo(_seconds: u64, _simulate_alerts: bool) -> ExitCode {
    eprintln!(
        "demo: this stanch was built without the demo, which links the gateway and mock model \
         servers: run `cargo run --release --features demo -- demo`"
    );
    ExitCode::FAILURE
}

fn load_config(path: Option<&Path>) -> Result<ConfigFile, String> {
    match path {
        None => Ok(ConfigFile::default_file()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            ConfigFile::from_yaml(&text).map_err(|e| format!("{}: {e}", path.display()))
        }
    }
}

/// The CRDs, to standard output as one YAML stream, or one file each under `out`.
#[expect(clippy::print_stdout, reason = "the CRDs are the command's output")]
fn crdgen(out: Option<&Path>) -> ExitCode {
    let crds = stanch_kube::crds();
    let Some(dir) = out else {
        let docs: Vec<String> = crds.iter().map(|(_, c)| stanch_kube::crd_yaml(c)).collect();
        print!("{}", docs.join("---\n"));
        return ExitCode::SUCCESS;
    };
    for (file, crd) in &crds {
        let path = dir.join(file);
        if let Err(e) = std::fs::write(&path, stanch_kube::crd_yaml(crd)) {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}

fn check_config(file: &Path) -> ExitCode {
    match load_config(Some(file)) {
        Ok(ConfigFile { policy, .. }) => {
            let models = policy.models.keys().cloned().collect::<Vec<_>>().join(", ");
            eprintln!(
                "{}: ok ({} model(s): {models})",
                file.display(),
                policy.models.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// A role's token: the environment wins, else the file named in the configuration.
fn token(env: &str, file: Option<&String>) -> Result<Option<String>, String> {
    if let Ok(v) = std::env::var(env)
        && !v.trim().is_empty()
    {
        return Ok(Some(v));
    }
    match file {
        None => Ok(None),
        Some(path) => std::fs::read_to_string(path)
            .map(|t| Some(t.trim().to_owned()))
            .map_err(|e| {
                format!("cannot read the token file {path} named in the configuration: {e}")
            }),
    }
}

/// Raises the open-file limit (a watcher is a connection) and says what it is.
fn open_file_limit() {
    match stanch_server::net::raise_open_file_limit() {
        Some((before, after)) if before < after => {
            tracing::info!(before, after, "open-file limit raised to the hard limit");
        }
        Some((_, limit)) => tracing::info!(limit, "open-file limit"),
        None => tracing::warn!("cannot read or raise the open-file limit"),
    }
}

// Size: the flags read and checked in the order `stanch serve --help` lists them.
fn serve(args: ServeArgs) -> ExitCode {
    // Held to the end, so what is buffered is written out.
    let _logging = init_logging(args.log_format);
    open_file_limit();
    let ConfigFile { policy, server } = match load_config(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("{e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let auth = &server.auth;
    let tokens = (|| {
        Ok::<_, String>(Tokens::new(
            token("STANCH_INGEST_TOKEN", auth.ingest_token_file.as_ref())?,
            token("STANCH_ADMIN_TOKEN", auth.admin_token_file.as_ref())?,
            token("STANCH_READ_TOKEN", auth.read_token_file.as_ref())?,
        ))
    })();
    let am_token = token(
        "STANCH_ALERTMANAGER_TOKEN",
        server
            .alertmanager
            .as_ref()
            .and_then(|a| a.token_file.as_ref()),
    );
    let (tokens, am_token) = match (tokens, am_token) {
        (Ok(t), Ok(a)) => (t, a.map(Into::into)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let open = tokens.open_roles();
    if !open.is_empty() && !args.listen.ip().is_loopback() {
        let roles = open.iter().map(|r| r.name()).collect::<Vec<_>>().join(", ");
        eprintln!(
            "refusing to listen on {} without a token for role(s) {roles}: set STANCH_INGEST_TOKEN, \
             STANCH_ADMIN_TOKEN and STANCH_READ_TOKEN (or auth.*_token_file), or listen on loopback",
            args.listen
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let settings = Settings {
        config: policy,
        server,
        storage: match args.store {
            StoreKind::File => Storage::Dir(args.data_dir),
            // Replaced by the cluster's store once connected.
            StoreKind::Memory | StoreKind::Kubernetes => Storage::Memory,
        },
        tokens,
        tls: args.tls_cert.zip(args.tls_key),
        alertmanager_token: am_token,
        limits: ConnLimits::default(),
        // One process, without a cluster: it decides.
        leadership: stanch_ports::leadership::Leadership::single(),
    };
    let runtime = if args.worker_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.worker_threads)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shared_store = matches!(args.store, StoreKind::Kubernetes).then(|| ClusterStore {
        lease: args.kubernetes_lease.clone(),
        state: args.kubernetes_state.clone(),
        lease_duration: args.lease_duration,
    });
    let kubernetes = (args.kubernetes_policies || shared_store.is_some()).then(|| Kubernetes {
        namespace: args.kubernetes_namespace.clone(),
        policies: args.kubernetes_policies,
        store: shared_store,
    });
    match runtime.block_on(run(settings, args.listen, args.config, kubernetes)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("stanch: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// What is taken from the cluster.
struct Kubernetes {
    /// Given: the namespace of everything; else the pod's (or the context's) for the
    /// state and the Lease, and every namespace for policies.
    namespace: Option<String>,
    /// StanchPolicy resources are merged over the file.
    policies: bool,
    /// State in the cluster, with leader election.
    store: Option<ClusterStore>,
}

/// `--store kubernetes`.
struct ClusterStore {
    lease: String,
    state: String,
    lease_duration: Duration,
}

/// Clock skew allowed between replicas: a leader stops this much before its lease
/// could expire by another replica's clock.
const LEASE_SKEW: Duration = Duration::from_secs(2);
/// The longest one call of the state store may take.
const STORE_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// This replica's name in the Lease and the state object: the pod's name (`POD_NAME`
/// from the downward API, else `HOSTNAME`, which Kubernetes sets to it).
fn replica_identity() -> String {
    ["POD_NAME", "HOSTNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|n| !n.trim().is_empty()))
        .unwrap_or_else(|| format!("stanch-{}", std::process::id()))
}

/// Puts the state in the cluster: the store in `settings`; the election that decides
/// which replica writes it, and the writer of the route-table resource (named as the
/// Lease), to be run.
async fn cluster_store(
    settings: &mut Settings,
    options: &ClusterStore,
    namespace: Option<&str>,
) -> anyhow::Result<(
    stanch_kube::election::Election,
    stanch_kube::publish::RouteTableWriter,
)> {
    let mut config = kube::Config::infer()
        .await
        .context("cannot find the Kubernetes API (in-cluster configuration or KUBECONFIG)")?;
    // The store and the election bound each call and retry in their own loops: a
    // call never waits on a hidden backoff.
    config.default_retry = false;
    let client = kube::Client::try_from(config).context("cannot build a Kubernetes client")?;
    let namespace = namespace.map_or_else(|| client.default_namespace().to_owned(), str::to_owned);
    let identity = replica_identity();
    let clock: Arc<dyn stanch_ports::clock::Clock> = Arc::new(SystemClock);
    let leadership = stanch_ports::leadership::Leadership::following(None);
    let election = stanch_kube::election::Election::new(
        kube::Api::namespaced(client.clone(), &namespace),
        &options.lease,
        stanch_kube::lease::Elector::new(&identity, options.lease_duration, LEASE_SKEW),
        clock,
        leadership.clone(),
    );
    let store = stanch_kube::store::KubeStore::new(
        kube::Api::namespaced(client.clone(), &namespace),
        &options.state,
        &identity,
        election.guard(),
        STORE_CALL_TIMEOUT,
    );
    let tables = stanch_kube::publish::RouteTableWriter::new(
        kube::Api::namespaced(client, &namespace),
        &options.lease,
    );
    tracing::info!(%namespace, %identity, lease = %options.lease, state = %options.state, "state in the cluster; electing a leader");
    settings.storage = Storage::Shared(Box::new(store));
    settings.leadership = leadership;
    Ok((election, tables))
}

// Size: the wiring of the ports' implementations, in the order they must start.
async fn run(
    mut settings: Settings,
    listen: SocketAddr,
    config: Option<PathBuf>,
    kubernetes: Option<Kubernetes>,
) -> anyhow::Result<()> {
    let listener = bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    let server = settings.server.clone();
    // With policy resources, the policy at start is the file with the resources listed
    // now merged over it, so that a restart replays and resumes under it: the state of
    // the models the resources define is kept, not dropped and made again.
    let (files, reloads) = tokio::sync::mpsc::channel(4);
    let cluster = match kubernetes
        .as_ref()
        .and_then(|k| Some((k.store.as_ref()?, k)))
    {
        Some((options, k)) => {
            Some(cluster_store(&mut settings, options, k.namespace.as_deref()).await?)
        }
        None => None,
    };
    let adapter = match kubernetes.as_ref().filter(|k| k.policies) {
        None => None,
        Some(k) => {
            let client = kube::Client::try_default().await.context(
                "cannot reach the Kubernetes API (in-cluster configuration or KUBECONFIG)",
            )?;
            let identity = replica_identity();
            let mut adapter = stanch_kube::adapter::Adapter::new(
                client,
                k.namespace.clone(),
                settings.config.clone(),
                identity,
                Arc::new(SystemClock),
            );
            settings.config = adapter
                .policy_now()
                .await
                .context("cannot list the StanchPolicy resources")?;
            adapter.reload_from(reloads);
            Some(adapter)
        }
    };
    let controller = Controller::start(settings, listener, Arc::new(SystemClock)).await?;
    let (resign, resigned) = tokio::sync::oneshot::channel::<()>();
    let (election, tables) = cluster.unzip();
    let election = election.map(|e| {
        tokio::spawn(e.run(async {
            let _ = resigned.await;
        }))
    });
    let tables = async {
        match tables {
            Some(t) => {
                stanch_kube::publish::follow_published(t, &controller, std::future::pending()).await
            }
            None => std::future::pending().await,
        }
    };
    let policies = async {
        match adapter {
            Some(a) => a.run(&controller, std::future::pending()).await,
            None => std::future::pending().await,
        }
    };
    // With resources, a reloaded file goes to the adapter, to be merged under them.
    let target = match kubernetes.as_ref().filter(|k| k.policies) {
        Some(_) => Reload::UnderResources(files),
        None => Reload::Controller(&controller),
    };
    let reload = reload_on_hangup(target, config.as_deref(), &server);
    tokio::select! {
        () = stanch_server::net::shutdown_signal() => {}
        () = reload => {}
        () = policies => {}
        () = tables => {}
    }
    tracing::info!("shutting down");
    // The engine's last snapshot is written while the lease is still held; then the
    // lease is given up, so another replica leads within a second.
    controller.shutdown().await;
    let _ = resign.send(());
    if let Some(election) = election {
        let _ = election.await;
    }
    Ok(())
}

/// On every SIGHUP, reads the configuration file again and puts its policy in force,
/// live; a file that does not parse or validate changes nothing (and says why). The
/// controller's own settings (intake, watch, history, auth, Alertmanager) are read at
/// start only: a change to them is reported, not applied.
/// Where a reloaded policy goes.
enum Reload<'c> {
    /// Straight into force.
    Controller(&'c Controller),
    /// To the policy adapter, to be merged under the resources.
    UnderResources(tokio::sync::mpsc::Sender<stanch_core::Config>),
}

async fn reload_on_hangup(target: Reload<'_>, path: Option<&Path>, server: &ServerConfig) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP: the configuration is read at start only");
        return std::future::pending().await;
    };
    while hangups.recv().await.is_some() {
        let Some(path) = path else {
            tracing::info!(
                "SIGHUP: running on the embedded default configuration; nothing to reload"
            );
            continue;
        };
        let file = match load_config(Some(path)) {
            Ok(file) => file,
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: configuration not reloaded; the one in force stays");
                continue;
            }
        };
        if &file.server != server {
            tracing::warn!(
                "SIGHUP: intake, watch, history, auth and alertmanager settings take effect at the next start"
            );
        }
        let applied = match &target {
            Reload::Controller(controller) => controller
                .configure(file.policy)
                .await
                .map_err(|e| e.to_string()),
            Reload::UnderResources(adapter) => adapter
                .send(file.policy)
                .await
                .map_err(|_| "the policy adapter has stopped".to_owned()),
        };
        match applied {
            Ok(()) => tracing::info!(file = %path.display(), "configuration reloaded"),
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: configuration not reloaded; the one in force stays")
            }
        }
    }
    std::future::pending().await
}

/// Binds with a deep accept backlog: after a controller restart, every gateway of the
/// fleet reconnects at once.
fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(4096)
}

fn init_logging(format: LogFormat) -> stanch_log::Logging {
    stanch_log::init(match format {
        LogFormat::Text => stanch_log::Format::Text,
        LogFormat::Json => stanch_log::Format::Json,
    })
}

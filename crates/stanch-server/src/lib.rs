//! The stanch controller's IO.
//!
//! Owns: the HTTP API (intake, watch, admin, status, metrics), the engine task that is
//! the one writer of state, the state stores, the audit history, Alertmanager
//! reconciliation, and the listener (plain or TLS). Does not own decisions: those are
//! `stanch-core`'s, reached only through the engine task.

pub mod api;
pub mod auth;
pub mod config;
pub mod engine_task;
pub mod error;
pub mod gateways;
pub mod history;
pub mod metrics;
/// The listener, shared with the gateway.
pub use stanch_net as net;
pub mod publish;
pub mod reconcile;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use secrecy::SecretString;
use stanch_core::Config;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tracing::{Instrument, info, info_span, warn};

use crate::auth::Tokens;
use crate::config::ServerConfig;
use crate::engine_task::{EngineHandle, EngineTask, EngineUnavailable};
use crate::history::History;
use crate::metrics::Metrics;
use crate::net::{ConnLimits, Http2Limits};
use crate::reconcile::Reconciler;
use crate::store::FileStore;
use stanch_ports::clock::Clock;
use stanch_ports::control::Control;
use stanch_ports::history::Recorded;
use stanch_ports::leadership::Leadership;
use stanch_ports::store::{MemoryStore, StateStore, StoreError};

/// How to run the controller.
#[derive(Debug)]
pub struct Settings {
    /// The validated policy.
    pub config: Config,
    /// The controller's own settings (limits, token files, Alertmanager).
    pub server: ServerConfig,
    /// Where state lives.
    pub storage: Storage,
    /// Role tokens.
    pub tokens: Tokens,
    /// TLS certificate chain and key (PEM), if the listener speaks TLS.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Bearer token for Alertmanager's API, if it needs one.
    pub alertmanager_token: Option<SecretString>,
    /// Connection limits.
    pub limits: ConnLimits,
    /// Whether this replica decides ([`Leadership::single`] without a cluster).
    pub leadership: Arc<Leadership>,
}

impl Settings {
    /// State in memory, no tokens, no TLS, default limits: a controller for
    /// loopback use (the demo, tests). Fields can be overridden afterwards.
    pub fn in_memory(config: Config) -> Self {
        Self {
            config,
            server: ServerConfig::default(),
            storage: Storage::Memory,
            tokens: Tokens::default(),
            tls: None,
            alertmanager_token: None,
            limits: ConnLimits::default(),
            leadership: Leadership::single(),
        }
    }
}

/// Where the controller keeps its state.
pub enum Storage {
    /// In memory: lost on restart.
    Memory,
    /// Snapshot, journal and history under a data directory ([`FileStore`]).
    Dir(PathBuf),
    /// A store shared by replicas (stanch-kube's): the one `Settings::leadership` says
    /// leads takes it over and decides; the others replay what it writes. The
    /// decision history is kept in memory, per replica.
    Shared(Box<dyn StateStore>),
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Memory => f.write_str("Memory"),
            Storage::Dir(dir) => f.debug_tuple("Dir").field(dir).finish(),
            Storage::Shared(store) => f.debug_tuple("Shared").field(&store.kind()).finish(),
        }
    }
}

/// Why the controller did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Roles without a token on a listener other than loopback.
    #[error(
        "listening on {addr} (not loopback) with no token for role(s) {roles}; set STANCH_<ROLE>_TOKEN or the auth.*_token_file settings"
    )]
    OpenRoles {
        /// The listen address.
        addr: SocketAddr,
        /// The roles without tokens.
        roles: String,
    },
    /// The state store could not be opened or read.
    #[error("state store")]
    Store(#[from] StoreError),
    /// The history file could not be opened.
    #[error("cannot open the history file under {dir}")]
    History {
        /// The data directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TLS certificate or key is unusable.
    #[error("TLS")]
    Tls(#[source] net::TlsError),
    /// The listener's address could not be read.
    #[error("listener")]
    Listener(#[source] std::io::Error),
}

/// A running controller.
pub struct Controller {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
    engine: EngineHandle,
    shared: Arc<api::Shared>,
}

/// Why a new policy was not put in force.
#[derive(Debug, thiserror::Error)]
pub enum ConfigureError {
    /// The policy is not valid; nothing changed.
    #[error("{0}")]
    Invalid(#[from] stanch_core::ConfigError),
    /// The engine could not take it (the store is failing, or it is stopping); nothing
    /// changed.
    #[error("the engine could not take the new policy: {0}")]
    Unavailable(#[from] EngineUnavailable),
}

impl Controller {
    /// Starts the controller on a bound listener.
    // Size: the controller's wiring: each part built and started in order, once.
    pub async fn start(
        settings: Settings,
        listener: TcpListener,
        clock: Arc<dyn Clock>,
    ) -> Result<Controller, StartError> {
        let addr = listener.local_addr().map_err(StartError::Listener)?;
        let open = settings.tokens.open_roles();
        if !open.is_empty() {
            let roles = open.iter().map(|r| r.name()).collect::<Vec<_>>().join(", ");
            if !addr.ip().is_loopback() {
                return Err(StartError::OpenRoles { addr, roles });
            }
            warn!(%addr, roles = %roles, "no token for these roles: open to anyone on this host (loopback only)");
        }
        let http2 = settings.server.watch.grpc;
        let tls = match &settings.tls {
            Some((cert, key)) => {
                Some(net::tls_acceptor(cert, key, http2).map_err(StartError::Tls)?)
            }
            None => None,
        };
        let (config, server) = (settings.config, settings.server);
        // A watcher that stops reading is disconnected after the configured timeout.
        let connections = &server.connections;
        let conns = net::Connections::new(ConnLimits {
            write_timeout: server.watch.slow_client_timeout.0,
            http2: http2.then(|| Http2Limits {
                idle_timeout: connections.http2_idle_timeout.0,
                ..settings.limits.http2.unwrap_or_default()
            }),
            max_connections: connections.max,
            max_per_source: connections.max_per_source,
            ..settings.limits
        });
        let mut metrics = Metrics::new();
        metrics.register_connections(&conns);
        let metrics = Arc::new(metrics);
        let history_size = server.history.max_entries;
        let started = match settings.storage {
            Storage::Dir(dir) => {
                let tag = clock.now().as_millis().to_string();
                let store = FileStore::open(&dir, tag)?;
                let history = History::open(&dir, history_size, server.history.max_file_bytes)
                    .map_err(|source| StartError::History {
                        dir: dir.clone(),
                        source,
                    })?;
                EngineTask::start(
                    config.clone(),
                    Box::new(store),
                    Arc::new(history),
                    metrics.clone(),
                    clock.clone(),
                )?
            }
            Storage::Memory => EngineTask::start(
                config.clone(),
                Box::new(MemoryStore::default()),
                Arc::new(History::in_memory(history_size)),
                metrics.clone(),
                clock.clone(),
            )?,
            Storage::Shared(store) => EngineTask::start_shared(
                config.clone(),
                store,
                Arc::new(History::in_memory(history_size)),
                metrics.clone(),
                clock.clone(),
                &settings.leadership,
            ),
        };
        let history = started.task.history();
        let (stop, stopped) = watch::channel(false);
        let until_stopped = move || {
            let mut rx = stopped.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let mut tasks = JoinSet::new();
        let reconcile_wake = server
            .alertmanager
            .as_ref()
            .map(|_| Arc::new(Notify::new()));
        if let (Some(am), Some(wake)) = (&server.alertmanager, &reconcile_wake) {
            let reconciler = Reconciler::new(
                &am.url,
                &am.receiver,
                settings.alertmanager_token,
                am.interval.0,
                started.handle.clone(),
                clock.clone(),
                metrics.clone(),
                wake.clone(),
            );
            wake.notify_one(); // Reconcile once at start: notifications may have been missed while down.
            tasks.spawn(reconciler.run(until_stopped()));
        }
        let shared = api::Shared::new(
            started.handle.clone(),
            started.publisher.clone(),
            history,
            metrics,
            settings.tokens,
            clock,
            Arc::new(config),
            Arc::new(server),
            started.health.clone(),
            reconcile_wake,
            settings.leadership.clone(),
        );
        let shared = Arc::new(shared);
        let app = api::router(shared.clone());
        if shared.server.watch.grpc {
            tasks.spawn(api::report_health(shared.clone(), until_stopped()));
            tasks.spawn(api::sweep_grpc(shared.clone(), until_stopped()));
        }
        tasks.spawn(started.task.run(until_stopped()));
        let scheme = if tls.is_some() { "https" } else { "http" };
        tasks.spawn(
            net::serve(
                listener,
                hyper_util::service::TowerToHyperService::new(app),
                tls,
                conns,
                until_stopped(),
            )
            .instrument(info_span!("http", %addr)),
        );
        info!(%addr, scheme, "stanch controller listening");
        Ok(Controller {
            addr,
            stop,
            tasks,
            engine: started.handle.clone(),
            shared,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What is published now: the table and the status parts.
    pub fn published(&self) -> Arc<crate::publish::Snapshot> {
        self.shared.publisher.load()
    }

    /// Every batch of decisions made durable from now on, as the history records it.
    pub fn decisions(&self) -> tokio::sync::broadcast::Receiver<Arc<Recorded>> {
        self.shared.history.subscribe()
    }

    /// Wakes on every new published version.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.publisher.subscribe()
    }

    /// Whether this replica decides, as the election sets it.
    pub fn leadership(&self) -> &Arc<Leadership> {
        &self.shared.leadership
    }

    /// Puts a new policy in force, live: validated first (an invalid one changes
    /// nothing), then applied and journaled like any input, so it is durable when
    /// this returns. Models keep their place on the ladder unless their active pool
    /// is gone (`Decision::Configured`).
    pub async fn configure(&self, config: Config) -> Result<(), ConfigureError> {
        let problems = config.validate();
        if !problems.is_empty() {
            return Err(stanch_core::ConfigError::Invalid(problems).into());
        }
        let shared = Arc::new(config.clone());
        self.engine
            .apply(stanch_core::Input::Configure {
                config: Box::new(config),
            })
            .await?;
        self.shared.config.store(shared);
        Ok(())
    }

    /// Stops serving, lets the engine save its state, and waits for every task.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
    }

    /// Runs until `signal` resolves, then shuts down.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) {
        signal.await;
        info!("shutting down");
        self.shutdown().await;
    }
}

/// The controller as its adapters (stanch-kube's) read and steer it.
impl Control for Controller {
    type Published = crate::publish::Snapshot;
    type ConfigureError = ConfigureError;

    fn published(&self) -> Arc<crate::publish::Snapshot> {
        Controller::published(self)
    }

    fn versions(&self) -> watch::Receiver<u64> {
        self.subscribe()
    }

    fn decisions(&self) -> tokio::sync::broadcast::Receiver<Arc<Recorded>> {
        Controller::decisions(self)
    }

    fn leadership(&self) -> &Arc<Leadership> {
        Controller::leadership(self)
    }

    async fn configure(&self, config: Config) -> Result<(), ConfigureError> {
        Controller::configure(self, config).await
    }
}

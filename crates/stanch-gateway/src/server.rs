//! Serving the gateway: callers on their listener, on the caller's runtime or on worker
//! threads, and the status and metrics with them or on a listener of their own.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::{Gateway, background, front};

/// Serves the gateway on `listener` until `shutdown`, then drains in-flight requests:
/// callers, and the status and metrics. Connections are served on the runtime this
/// runs on.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let conns = gateway.conns.clone();
    let _sweeping = background::Sweeper::start(&gateway);
    let front = front::Front::new(gateway, true);
    stanch_net::serve(listener, front, None, conns, shutdown).await;
    Ok(())
}

/// As [`serve`], with every connection served whole by one of `workers`' threads:
/// how the gateway uses several cores. With `status`, the status (`/v1/status`,
/// `/status`) and the metrics are served there instead, on this runtime, and callers'
/// port does not answer them: they show the upstreams' addresses and the traffic,
/// which callers have no need to see.
pub async fn serve_on(
    workers: &stanch_net::Workers,
    listener: TcpListener,
    status: Option<TcpListener>,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Their connection counts show in the metrics.
    let _ = gateway.workers.set(workers.load());
    let conns = gateway.conns.clone();
    let _sweeping = background::Sweeper::start(&gateway);
    let front = front::Front::new(gateway.clone(), status.is_none());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let status = status.map(|listener| {
        let app = hyper_util::service::TowerToHyperService::new(front::status_router(gateway));
        // Prometheus and an operator's curl: a few connections.
        let limits = stanch_net::ConnLimits {
            max_connections: 256,
            ..stanch_net::ConnLimits::default()
        };
        let conns = stanch_net::Connections::new(limits);
        tokio::spawn(stanch_net::serve(
            listener,
            app,
            None,
            conns,
            until_stopped(),
        ))
    });
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    stanch_net::serve_on(workers, listener, front, None, conns, until_stopped()).await;
    if let Some(status) = status {
        let _ = status.await;
    }
    Ok(())
}

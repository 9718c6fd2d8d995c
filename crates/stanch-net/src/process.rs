//! What a server process asks of its host: file descriptors, and the signals that stop
//! it.

/// Raises this process's soft limit on open files to its hard limit, as a server that
/// holds a connection per client should (the Go runtime does the same at start):
/// some container runtimes start processes at a soft limit of 1024 under a far
/// higher hard one. Returns (before, after); `None` where the limit cannot be read or
/// set, which leaves it as it was.
pub fn raise_open_file_limit() -> Option<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let before = limit.current.unwrap_or(u64::MAX);
    let after = limit.maximum.unwrap_or(u64::MAX);
    if before >= after {
        return Some((before, before));
    }
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised).ok()?;
    Some((before, after))
}

/// Resolves on SIGINT or SIGTERM (what Kubernetes sends before killing a pod).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

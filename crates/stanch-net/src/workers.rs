//! Worker threads, a single-threaded runtime each, that serve whole connections.

use std::future::Future;
use std::io;
use std::sync::Arc;

std::thread_local! {
    /// Which worker thread this is, on a [`Workers`] thread.
    static WORKER: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The index of the [`Workers`] thread this code runs on; `None` on any other thread.
/// Per-thread resources (an upstream's idle connections, say) use it to stay with the
/// thread whose runtime drives them.
pub fn worker_index() -> Option<usize> {
    WORKER.with(std::cell::Cell::get)
}

/// Threads that each run a single-threaded tokio runtime and serve whole connections:
/// a connection, its requests and the tasks they spawn stay on one thread, so nothing
/// is stolen, woken or locked across cores on the way (the multi-threaded runtime's
/// work stealing cost about a third more CPU per proxied request). Dropping it stops
/// the threads; tasks still running on them are cancelled.
pub struct Workers {
    threads: Vec<Worker>,
    load: Load,
    /// Where the search for the least busy worker starts next, so ties rotate.
    next: std::sync::atomic::AtomicUsize,
}

struct Worker {
    runtime: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The connections each of a [`Workers`]' threads is serving, readable from anywhere
/// (for metrics): a connection is counted from when it is handed to a worker until it
/// ends, however it ends.
#[derive(Debug, Clone)]
pub struct Load(Arc<[std::sync::atomic::AtomicUsize]>);

impl Load {
    /// Connections each worker is serving now, by worker.
    pub fn connections(&self) -> Vec<usize> {
        self.0
            .iter()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }
}

impl Workers {
    /// Starts `count` threads (at least one) named `name-0`, `name-1`, ...
    pub fn start(count: usize, name: &str) -> io::Result<Workers> {
        let mut threads = Vec::new();
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    WORKER.with(|w| w.set(Some(i)));
                    // Its tasks run while this waits; then dropping it cancels the rest.
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            threads.push(Worker {
                runtime: handle,
                stop: Some(stop),
                thread: Some(thread),
            });
        }
        let load = Load(
            (0..threads.len())
                .map(|_| std::sync::atomic::AtomicUsize::new(0))
                .collect(),
        );
        Ok(Workers {
            threads,
            load,
            next: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// How many worker threads there are.
    pub fn len(&self) -> usize {
        self.threads.len()
    }

    /// Never: there is at least one.
    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Connections each worker is serving now, by worker.
    pub fn connections(&self) -> Vec<usize> {
        self.load.connections()
    }

    /// A handle on the workers' connection counts, for metrics.
    pub fn load(&self) -> Load {
        self.load.clone()
    }

    /// Runs `task` on `worker`'s thread.
    pub fn spawn_on<F>(&self, worker: usize, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.threads[worker % self.threads.len()]
            .runtime
            .spawn(task)
    }

    /// Serves a connection on the worker serving the fewest; counted while it runs.
    pub(crate) fn spawn_connection(&self, serve: impl Future<Output = ()> + Send + 'static) {
        use std::sync::atomic::Ordering;
        let n = self.threads.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let chosen = (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.load.0[i].load(Ordering::Relaxed))
            .expect("at least one worker");
        /// Counts a connection down however it ends: served, cancelled, or dropped
        /// unpolled by a runtime shutting down (it is the task's, made before it).
        struct Done(Load, usize);
        impl Drop for Done {
            fn drop(&mut self) {
                (self.0).0[self.1].fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.load.0[chosen].fetch_add(1, Ordering::Relaxed);
        let done = Done(self.load.clone(), chosen);
        self.threads[chosen].runtime.spawn(async move {
            let _done = done;
            serve.await;
        });
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.threads {
            if let Some(stop) = w.stop.take() {
                let _ = stop.send(());
            }
        }
        for w in &mut self.threads {
            if let Some(thread) = w.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

//! The IO the controller and the gateway share: reading request bodies ([`body`]),
//! cheap deadlines ([`timer`]),
//! and the listener: plain or TLS, one task per
//! connection, TCP_NODELAY, and limits that keep a misbehaving client from holding
//! resources: a header read timeout (slowloris) and a write deadline (a client that
//! stops reading is disconnected, which is how slow SSE watchers and streaming callers
//! are closed without ever blocking the writer). Connections are bounded in number, in
//! all and per source address ([`admission`]); an HTTP/2 connection with no stream open
//! is closed after an idle timeout ([`Http2Limits::idle_timeout`]); a connection the
//! server closes first lingers, so that an answer given before the request's body was
//! read reaches the client ([`linger`]). At shutdown, in-flight requests get a bounded
//! time to finish.
//!
//! Connections are served on the caller's runtime ([`serve`]), or spread over
//! [`Workers`]: threads with a single-threaded runtime each, one connection wholly on
//! one thread ([`serve_on`]), as nginx spreads connections over worker processes.
pub mod admission;
pub mod body;
mod drain;
pub mod exposition;
mod idle;
pub mod linger;
mod listen;
mod process;
pub mod throttle;
pub mod timer;
mod tls;
mod workers;
mod write_deadline;

pub use admission::{Connections, Refused};
pub use linger::Linger;
pub use listen::{App, CloseConnection, ConnLimits, Http2Limits, serve, serve_on};
pub use process::{raise_open_file_limit, shutdown_signal};
pub use tls::{TlsError, certificates, crypto_provider, tls_acceptor};
pub use workers::{Load, Workers, worker_index};
pub use write_deadline::WriteDeadline;

#[cfg(test)]
mod tests;

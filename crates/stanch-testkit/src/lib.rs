//! What stanch's tests share, in one place rather than copied between suites. A
//! dev-dependency only: nothing shipped links it (`tests/it/deps.rs`).
//!
//! - [`process`]: child processes that end with the test ([`process::Running`]).
//! - [`wait`]: waiting for a condition, bounded by a deadline, instead of sleeping.
//! - `time` (feature `clock`): tokio's clock paused, and the controller's `Clock` port
//!   moving with it.
//! - [`http`]: clients that go straight to loopback, and readiness.
//! - [`net`]: free ports, slow senders, and reading an answer to its end.
//! - [`files`]: the workspace's sources, for tests that read the code.
//! - [`deps`]: the workspace's dependency graph, for tests of the crates' layers.
//!
//! # Time in tests
//!
//! A test whose only clock is tokio's runs on the paused clock
//! (`#[tokio::test(start_paused = true)]`): its timers fire in order at no cost in
//! real time, and the waits of [`wait`] advance with it. Code that also reads the wall
//! clock through the `Clock` port (the election's terms, the controller's TTLs) runs
//! on `time::Paused` where it talks to nothing outside the test's runtime: one clock,
//! paused, that both read, so a lease renewed every second is renewed at the second
//! by both (`crates/stanch-kube/tests/it/sequence.rs`). A controller serving real
//! sockets cannot pause tokio's clock, so its suites move a hand-held clock instead
//! (`stanch_ports::clock::ManualClock`, driven by the harness in
//! `crates/stanch-server/tests/it/support.rs`): leases, TTLs and hold times pass in
//! a call, and the engine task notices a stepped clock within a second.
//!
//! The suites in `tests/` folders cannot pause time where they drive real processes
//! (the binaries, Prometheus, Alertmanager, nginx, a container) or real sockets
//! served from other threads: tokio's paused clock jumps ahead whenever its runtime
//! idles, before a peer has answered, and no clock of ours reaches another process.
//! There a test waits for what it needs with [`wait`], never for a fixed time. The
//! real sleeps that remain are of four kinds, each with a bound:
//!
//! - **a negative**: "and nothing happens for this long" (the file is not put in
//!   force alone, a connection past the timeout is still open, no request is sent)
//!   has no event to wait for;
//! - **pacing**: load, outages and flaps on a schedule against real processes, a
//!   sample every interval, a poller's period;
//! - **a scripted peer**: a stand-in server that answers late on purpose, a client
//!   that sends late on purpose;
//! - **no signal**: a peer reaches a state it does not announce (stalled senders
//!   accepted, watchers parked, Alertmanager's first failed try, a killed
//!   controller's socket released).
//!
//! Every one is listed here, by file; `tests/it/sleeps.rs` counts them in the code
//! and fails when this list and the code differ.
//!
//! | file | sleeps | kind and why |
//! |---|---|---|
//! | `crates/stanch-client/tests/it/main.rs` | 9 | negatives: no request while the table is refused, the deadline on silence, heartbeats over a window; scripted peers: a controller answering late |
//! | `crates/stanch-gateway/tests/it/connections.rs` | 4 | pacing: pauses between bursts; no signal: the upstream's close and the idle sweep (every second) |
//! | `crates/stanch-gateway/tests/it/failures.rs` | 8 | negatives: failing probes keep a block, a pool in use is not probed; pacing: probe intervals, a request every 5 ms |
//! | `crates/stanch-gateway/tests/it/routing.rs` | 1 | pacing: a 200 ms lease running out on the gateway's own clock |
//! | `crates/stanch-gateway/tests/it/slow.rs` | 1 | no signal: stalled senders accepted |
//! | `crates/stanch-server/tests/it/grpc.rs` | 3 | negatives: still connected past the slow-client timeout, the heartbeat reader never cut off; a status poll |
//! | `crates/stanch-server/tests/it/reconcile.rs` | 1 | no signal: Alertmanager's first, failed, try |
//! | `crates/stanch-server/tests/it/slow.rs` | 1 | no signal: stalled senders accepted |
//! | `crates/stanch-server/tests/it/support.rs` | 1 | no signal: a crashed controller's sockets released |
//! | `crates/stanch-server/tests/it/watch.rs` | 1 | no signal: long-poll watchers parked |
//! | `tests/it/cli.rs` | 1 | negative: a reload the controller refuses changes nothing served |
//! | `tests/it/drill.rs` | 6 | pacing: kills at random times, senders backing off on 503, a full disk filling |
//! | `tests/it/e2e.rs` | 11 | pacing: caller traffic, steady traffic before a fault, flap cycles, samples every 100 ms, time-to-heal polls; Prometheus scraping the decisions |
//! | `tests/it/early.rs` | 1 | scripted peer: a client that sends its body late |
//! | `tests/it/flood.rs` | 1 | no signal: the last of a round's connections answered or refused |
//! | `tests/it/ha.rs` | 2 | pacing: a gateway's poll, requests through an API server outage |
//! | `tests/it/kubernetes.rs` | 1 | negative: the file is not put in force alone while the watcher lists |

pub mod deps;
pub mod files;
pub mod http;
pub mod net;
pub mod process;
#[cfg(feature = "clock")]
pub mod time;
pub mod wait;

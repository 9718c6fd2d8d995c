//! The published snapshot: one `ArcSwap` holding everything readers need, and a
//! `watch` channel that only says "a new version exists".

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use axum::http::{HeaderName, HeaderValue, header};
use bytes::Bytes;
use stanch_api::RouteTable;
use stanch_api::headers::{EPOCH, ROUTE_VERSION};
use stanch_api::status::{AlertSummary, BlockStatus, ModelStatus, OverrideInfo};
use tokio::sync::watch;

/// What readers see: the route table (pre-serialized) and the engine's status.
#[derive(Debug)]
pub struct Snapshot {
    /// The route table.
    pub table: RouteTable,
    /// `table` as JSON, serialized once for every reader.
    pub json: Bytes,
    /// `table` as one SSE event (`event`, `id`, `data`), rendered once and shared by
    /// every stream.
    pub sse_event: Bytes,
    /// `table` as the gRPC watch's message (a `WatchResponse` with it), encoded once
    /// and shared by every stream.
    pub grpc: Bytes,
    /// `"<epoch>-<version>"`, quoted, for `ETag`.
    pub etag: String,
    /// `table.epoch`, shared: what each SSE stream and gRPC session remembers
    /// sending, a reference count per delivery rather than a copy.
    pub epoch: Arc<str>,
    /// Response headers of every route answer, built once: `ETag`, epoch, version.
    pub headers: [(HeaderName, HeaderValue); 3],
    /// Per-model status.
    pub models: BTreeMap<String, ModelStatus>,
    /// Active blocks.
    pub blocks: Vec<BlockStatus>,
    /// Dry-run, when on.
    pub dry_run: Option<OverrideInfo>,
    /// The global freeze, when on.
    pub global_freeze: Option<OverrideInfo>,
    /// Alert counts.
    pub alerts: AlertSummary,
}

impl stanch_ports::control::Publication for Snapshot {
    fn table(&self) -> &RouteTable {
        &self.table
    }

    fn table_json(&self) -> &[u8] {
        &self.json
    }

    fn model_status(&self, model: &str) -> Option<&ModelStatus> {
        self.models.get(model)
    }
}

impl Snapshot {
    /// A snapshot of `table` and the status parts.
    pub fn new(
        table: RouteTable,
        models: BTreeMap<String, ModelStatus>,
        blocks: Vec<BlockStatus>,
        dry_run: Option<OverrideInfo>,
        global_freeze: Option<OverrideInfo>,
        alerts: AlertSummary,
    ) -> Snapshot {
        let json = Bytes::from(serde_json::to_vec(&table).expect("route tables serialize"));
        // Compact JSON has no newlines, so it is one `data:` line.
        let mut event = format!("event: routes\nid: {}\ndata: ", table.version).into_bytes();
        event.extend_from_slice(&json);
        event.extend_from_slice(b"\n\n");
        let etag = format!("\"{}-{}\"", table.epoch, table.version);
        let text = |s: &str| {
            HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
        };
        let headers = [
            (header::ETAG, text(&etag)),
            (HeaderName::from_static(EPOCH), text(&table.epoch)),
            (
                HeaderName::from_static(ROUTE_VERSION),
                HeaderValue::from(table.version),
            ),
        ];
        Snapshot {
            grpc: grpc_message(&table),
            epoch: Arc::from(table.epoch.as_str()),
            headers,
            table,
            json,
            sse_event: Bytes::from(event),
            etag,
            models,
            blocks,
            dry_run,
            global_freeze,
            alerts,
        }
    }
}

/// `table` as the gRPC watch sends it.
fn grpc_message(table: &RouteTable) -> Bytes {
    use stanch_proto::v1::{WatchResponse, watch_response};
    let message = WatchResponse {
        kind: Some(watch_response::Kind::Table(table.into())),
    };
    Bytes::from(prost::Message::encode_to_vec(&message))
}

/// The single place the engine task publishes to.
#[derive(Debug)]
pub struct Publisher {
    current: ArcSwap<Snapshot>,
    version: watch::Sender<u64>,
    /// `current` comes from the state: false only on a replica that has not read the
    /// leader's state yet, whose table would be one no leader made.
    held: AtomicBool,
}

impl Publisher {
    /// A publisher holding `first`.
    pub fn new(first: Snapshot) -> Publisher {
        let (version, _) = watch::channel(first.table.version);
        Publisher {
            current: ArcSwap::from_pointee(first),
            version,
            held: AtomicBool::new(true),
        }
    }

    /// A publisher with no table yet: `placeholder` stands in for status and metrics
    /// until the engine task first publishes, and [`Publisher::table`] is `None`.
    pub fn pending(placeholder: Snapshot) -> Publisher {
        let publisher = Publisher::new(placeholder);
        publisher.held.store(false, Ordering::Relaxed);
        publisher
    }

    /// The current snapshot.
    pub fn load(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// The current snapshot if it comes from the state: what may be served as the
    /// route table.
    pub fn table(&self) -> Option<Arc<Snapshot>> {
        self.held
            .load(Ordering::Acquire)
            .then(|| self.current.load_full())
    }

    /// Replaces the snapshot; wakes watchers if the version changed. Never blocks.
    /// Only the engine task publishes: nothing outside this crate can.
    pub(crate) fn publish(&self, next: Snapshot) {
        let version = next.table.version;
        let epoch_changed = self.current.load().table.epoch != next.table.epoch;
        self.current.store(Arc::new(next));
        self.held.store(true, Ordering::Release);
        self.version.send_if_modified(|v| {
            let changed = *v != version || epoch_changed;
            *v = version;
            changed
        });
    }

    /// A receiver that wakes on every new version (latest only).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

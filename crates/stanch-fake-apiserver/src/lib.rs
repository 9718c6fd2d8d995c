//! A Kubernetes API server for tests, in process, speaking the real wire protocol for
//! the namespaced resources stanch uses (its custom resources, Leases, Events,
//! ConfigMaps): no API server can be installed where these tests run.
//!
//! What it does as the real one does (checked against the API reference):
//! - objects keep `metadata.resourceVersion` (one counter for the whole store, as
//!   etcd's revision), `uid`, `creationTimestamp`, and `generation`, which moves only
//!   when something other than `metadata` and `status` changes;
//! - `PUT` with a stale `metadata.resourceVersion` is `409 Conflict`; `POST` of a name
//!   that exists is `409 AlreadyExists`; a missing object is `404 NotFound`; every
//!   error is a `Status` object with `reason` and `code`;
//! - for kinds with a status subresource, the object's own writes leave `status` as it
//!   was and `/status` writes change nothing else;
//! - `PATCH` as JSON merge patch (`application/merge-patch+json`) and as server-side
//!   apply (`application/apply-patch+yaml`, JSON being YAML), which needs a
//!   `fieldManager`, creates what is missing, and records the manager in
//!   `managedFields`;
//! - list with the collection's `resourceVersion`; watch (`?watch=true`) from a
//!   `resourceVersion`, as newline-delimited events (`ADDED`, `MODIFIED`, `DELETED`),
//!   with `BOOKMARK`s when asked (`allowWatchBookmarks`), ending at `timeoutSeconds`;
//!   a watch from a version older than the history kept gets an `ERROR` event with a
//!   `410 Expired` Status, as after etcd's compaction ([`FakeApiServer::compact`]);
//! - a write can be failed on purpose ([`FakeApiServer::plan_faults`]): refused, or
//!   stored and answered `504 Timeout` as when etcd is slow to confirm.
//! - every request is recorded as authorization sees it, group, resource (with its
//!   subresource) and verb ([`FakeApiServer::accesses`]), so that a test can compare
//!   what a client asks for with the RBAC rules granted to it (RBAC itself is not
//!   enforced).
//!
//! Where it simplifies: compaction expires every watch that has not seen the newest
//! revision (as a watch fallen behind etcd's compaction is), where a real API server's
//! watch cache keeps most of them going with bookmarks; server-side apply merges the
//! applied object into the live one and removes what the same manager applied before
//! and leaves out now (lists replaced whole), but does not track field ownership
//! between managers, so it never answers `409` for a field another manager owns; no admission, defaulting or schema
//! validation (the CRDs' schemas are tested apart); label selectors of equality terms
//! only (in lists), no field selectors; one API version per group; and
//! [`FakeApiServer::set_down`] stands in for an API server that is unreachable (it
//! answers `503`, where a real outage is a refused or hanging connection).
//!
//! Size: one API server: its store, its verbs and its watch share the same revision counter and are read together.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::watch;

/// The kinds with a status subresource, by plural.
const WITH_STATUS: [&str; 2] = ["stanchpolicies", "stanchroutetables"];

/// Watch events kept for watches that resume; older ones are compacted away.
const HISTORY: usize = 10_000;

/// A collection and an object in it: (`apis/group/version` or `api/v1`, plural,
/// namespace, name).
type Key = (String, String, String, String);

#[derive(Default)]
struct Store {
    revision: u64,
    objects: BTreeMap<Key, Value>,
    /// (revision, event type, key, object).
    history: VecDeque<(u64, &'static str, Key, Value)>,
    /// The oldest revision a watch may resume from.
    compacted: u64,
    down: bool,
    uids: u64,
    /// Decides, for each write (method, path), whether to fail it and how.
    faults: Option<FaultPlan>,
    /// What each field manager last applied to each object (and subresource): the
    /// fields it applied then and leaves out now are removed.
    applied: BTreeMap<(Key, String, String), Value>,
    /// Every kind of request served, as authorization sees it.
    accesses: BTreeSet<Access>,
}

/// A request as Kubernetes' authorization sees it: what an RBAC rule must allow for it
/// (`apiGroups`, `resources`, `verbs`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Access {
    /// The API group: `""` for the core group.
    pub group: String,
    /// The plural, with its subresource as `stanchpolicies/status`.
    pub resource: String,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: String,
    /// The object's name, where the request's path names one (as `resourceNames`
    /// sees it: not for `create`, `list` or `watch`).
    pub name: Option<String>,
}

type FaultPlan = Box<dyn FnMut(&str, &str) -> Option<WriteFault> + Send>;

/// How the fake fails a write its fault plan picks ([`FakeApiServer::plan_faults`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteFault {
    /// Refused before anything is stored: `500 InternalError`.
    Refuse,
    /// Stored, then answered `504 Timeout`: as the real API server answers when etcd
    /// is slow to confirm a write that lands all the same. The client cannot tell it
    /// from a write that did not land.
    Unconfirmed,
}

/// A running fake API server.
pub struct FakeApiServer {
    url: String,
    store: Arc<Mutex<Store>>,
    changed: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Shared {
    store: Arc<Mutex<Store>>,
    changed: watch::Sender<u64>,
}

impl FakeApiServer {
    /// Starts one on a loopback port.
    pub async fn start() -> FakeApiServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        let store = Arc::new(Mutex::new(Store::default()));
        let (changed, _) = watch::channel(0);
        let shared = Shared {
            store: store.clone(),
            changed: changed.clone(),
        };
        let app = axum::Router::new().fallback(handle).with_state(shared);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeApiServer {
            url,
            store,
            changed,
            task,
        }
    }

    /// Its base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A kubeconfig for it, its context's namespace `namespace`, written to `path`:
    /// what processes under test are given as `KUBECONFIG`.
    pub fn write_kubeconfig(&self, path: &std::path::Path, namespace: &str) -> std::io::Result<()> {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: '{}'}}}}]\n\
                 users: [{{name: u, user: {{}}}}]\n\
                 contexts: [{{name: c, context: {{cluster: fake, user: u, namespace: {namespace}}}}}]\n\
                 current-context: c\n",
                self.url
            ),
        )
    }

    /// Makes it answer every request with `503` (`down`), or serve again.
    pub fn set_down(&self, down: bool) {
        lock(&self.store).down = down;
    }

    /// Runs every later write (`POST`, `PUT`, `PATCH`, `DELETE`) by `plan`, which
    /// gets its method and path and says whether to fail it and how.
    pub fn plan_faults(&self, plan: impl FnMut(&str, &str) -> Option<WriteFault> + Send + 'static) {
        lock(&self.store).faults = Some(Box::new(plan));
    }

    /// Fails no more writes.
    pub fn clear_faults(&self) {
        lock(&self.store).faults = None;
    }

    /// The object `name` of a namespaced collection (`api/v1` or
    /// `apis/group/version`, plural, namespace), as stored.
    pub fn object(&self, prefix: &str, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (
            prefix.to_owned(),
            plural.to_owned(),
            namespace.to_owned(),
            name.to_owned(),
        );
        lock(&self.store).objects.get(&key).cloned()
    }

    /// The names of a namespaced collection's objects, in order.
    pub fn names(&self, prefix: &str, plural: &str, namespace: &str) -> Vec<String> {
        lock(&self.store)
            .objects
            .keys()
            .filter(|(p, pl, ns, _)| p == prefix && pl == plural && ns == namespace)
            .map(|(.., name)| name.clone())
            .collect()
    }

    /// Forgets the watch history, as etcd's compaction does: a watch resuming from
    /// before now gets `410 Expired`.
    pub fn compact(&self) {
        let mut store = lock(&self.store);
        store.history.clear();
        store.compacted = store.revision;
        drop(store);
        // Watches waiting on old revisions look again.
        self.changed.send_modify(|_| {});
    }

    /// Every kind of request made so far (whether it succeeded or not), as RBAC rules
    /// name them: what a Role must grant the client under test.
    pub fn accesses(&self) -> BTreeSet<Access> {
        lock(&self.store).accesses.clone()
    }

    /// The store's current revision.
    pub fn revision(&self) -> u64 {
        lock(&self.store).revision
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(store: &Mutex<Store>) -> std::sync::MutexGuard<'_, Store> {
    store.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `Status` error, as the API server writes them.
fn status(code: StatusCode, reason: &str, message: String, name: &str, plural: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason,
        "details": {"name": name, "kind": plural}, "code": code.as_u16(),
    });
    (code, axum::Json(body)).into_response()
}

/// What a path names.
struct Target {
    prefix: String,
    namespace: String,
    plural: String,
    name: Option<String>,
    subresource: Option<String>,
}

fn target(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("api/v1".to_owned(), rest),
        ["apis", group, version, rest @ ..] => (format!("apis/{group}/{version}"), rest),
        _ => return None,
    };
    match rest {
        ["namespaces", ns, plural, tail @ ..] if tail.len() <= 2 => Some(Target {
            prefix,
            namespace: (*ns).to_owned(),
            plural: (*plural).to_owned(),
            name: tail.first().map(|n| (*n).to_owned()),
            subresource: tail.get(1).map(|s| (*s).to_owned()),
        }),
        _ => None,
    }
}

/// The verb authorization would check for a request, as the API server's request info
/// names it.
fn access(method: &Method, t: &Target, query: &BTreeMap<String, String>) -> Access {
    let verb = match (method.as_str(), &t.name) {
        ("GET", None) if query.get("watch").is_some_and(|w| w == "true" || w == "1") => "watch",
        ("GET", None) => "list",
        ("GET", Some(_)) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", None) => "deletecollection",
        ("DELETE", Some(_)) => "delete",
        (other, _) => other,
    };
    Access {
        group: t
            .prefix
            .strip_prefix("apis/")
            .and_then(|gv| gv.split('/').next())
            .unwrap_or("")
            .to_owned(),
        resource: match &t.subresource {
            Some(sub) => format!("{}/{sub}", t.plural),
            None => t.plural.clone(),
        },
        verb: verb.to_ascii_lowercase(),
        name: t.name.clone(),
    }
}

async fn handle(
    State(shared): State<Shared>,
    method: Method,
    uri: Uri,
    Query(query): Query<BTreeMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if lock(&shared.store).down {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is down".into(),
            "",
            "",
        );
    }
    let Some(t) = target(uri.path()) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!(
                "the server could not find the requested resource {}",
                uri.path()
            ),
            "",
            "",
        );
    };
    lock(&shared.store)
        .accesses
        .insert(access(&method, &t, &query));
    let body: Option<Value> = if body.is_empty() {
        None
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => Some(v),
            Err(e) => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    format!("the body is not JSON: {e}"),
                    "",
                    &t.plural,
                );
            }
        }
    };
    let fault = if method == Method::GET {
        None
    } else {
        let mut store = lock(&shared.store);
        store
            .faults
            .as_mut()
            .and_then(|plan| plan(method.as_str(), uri.path()))
    };
    if fault == Some(WriteFault::Refuse) {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "an error on the server (\"injected\") has prevented the request from succeeding"
                .into(),
            t.name.as_deref().unwrap_or(""),
            &t.plural,
        );
    }
    let response = serve(shared, &method, t, &query, &headers, body);
    if fault == Some(WriteFault::Unconfirmed) && response.status().is_success() {
        return status(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            "Timeout: request did not complete within requested timeout - context deadline exceeded"
                .into(),
            "",
            "",
        );
    }
    response
}

fn serve(
    shared: Shared,
    method: &Method,
    t: Target,
    query: &BTreeMap<String, String>,
    headers: &HeaderMap,
    body: Option<Value>,
) -> Response {
    match (method.as_str(), &t.name) {
        ("GET", None) if query.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            watch_stream(shared, t, query.clone())
        }
        ("GET", None) => list(&shared, &t, query.get("labelSelector").map(String::as_str)),
        ("POST", None) => create(&shared, &t, body.unwrap_or(Value::Null)),
        ("GET", Some(name)) => get(&shared, &t, name),
        ("PUT", Some(name)) => replace(&shared, &t, name, body.unwrap_or(Value::Null)),
        ("PATCH", Some(name)) => patch(
            &shared,
            &t,
            name,
            headers,
            query,
            body.unwrap_or(Value::Null),
        ),
        ("DELETE", Some(name)) => delete(&shared, &t, name),
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} is not supported here"),
            "",
            &t.plural,
        ),
    }
}

fn key(t: &Target, name: &str) -> Key {
    (
        t.prefix.clone(),
        t.plural.clone(),
        t.namespace.clone(),
        name.to_owned(),
    )
}

/// Records a change: the object gets the next revision, and watchers are woken.
fn commit(
    shared: &Shared,
    store: &mut Store,
    event: &'static str,
    key: Key,
    mut object: Value,
) -> Value {
    store.revision += 1;
    object["metadata"]["resourceVersion"] = json!(store.revision.to_string());
    if event == "DELETED" {
        store.objects.remove(&key);
    } else {
        store.objects.insert(key.clone(), object.clone());
    }
    store
        .history
        .push_back((store.revision, event, key, object.clone()));
    if store.history.len() > HISTORY
        && let Some((rev, ..)) = store.history.pop_front()
    {
        store.compacted = rev;
    }
    shared.changed.send_replace(store.revision);
    object
}

/// Whether `object`'s labels match `selector`: equality terms (`k=v`, `k==v`) joined
/// by commas, the only form stanch uses.
fn selected(object: &Value, selector: Option<&str>) -> bool {
    let Some(selector) = selector.filter(|s| !s.is_empty()) else {
        return true;
    };
    selector.split(',').all(|term| {
        let (k, v) = term
            .split_once("==")
            .or_else(|| term.split_once('='))
            .unwrap_or((term, ""));
        object["metadata"]["labels"][k.trim()].as_str() == Some(v.trim())
    })
}

fn list(shared: &Shared, t: &Target, selector: Option<&str>) -> Response {
    let store = lock(&shared.store);
    let items: Vec<Value> = store
        .objects
        .iter()
        .filter(|((p, pl, ns, _), _)| *p == t.prefix && *pl == t.plural && *ns == t.namespace)
        .filter(|(_, v)| selected(v, selector))
        .map(|(_, v)| v.clone())
        .collect();
    let kind = items
        .first()
        .and_then(|i| i["kind"].as_str())
        .map_or_else(|| "List".to_owned(), |k| format!("{k}List"));
    axum::Json(json!({
        "apiVersion": t.prefix.trim_start_matches("apis/").trim_start_matches("api/"),
        "kind": kind,
        "metadata": {"resourceVersion": store.revision.to_string()},
        "items": items,
    }))
    .into_response()
}

fn get(shared: &Shared, t: &Target, name: &str) -> Response {
    match lock(&shared.store).objects.get(&key(t, name)) {
        Some(v) => axum::Json(v.clone()).into_response(),
        None => not_found(t, name),
    }
}

fn not_found(t: &Target, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", t.plural),
        name,
        &t.plural,
    )
}

fn create(shared: &Shared, t: &Target, mut object: Value) -> Response {
    let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name: Required value".into(),
            "",
            &t.plural,
        );
    };
    let mut store = lock(&shared.store);
    let k = key(t, &name);
    if store.objects.contains_key(&k) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", t.plural),
            &name,
            &t.plural,
        );
    }
    store.uids += 1;
    let meta = &mut object["metadata"];
    meta["namespace"] = json!(t.namespace);
    meta["uid"] = json!(format!("00000000-0000-0000-0000-{:012x}", store.uids));
    meta["creationTimestamp"] = json!("2026-11-30T00:00:00Z");
    meta["generation"] = json!(1);
    if WITH_STATUS.contains(&t.plural.as_str()) {
        // A status subresource's status is never set by a create.
        if let Some(o) = object.as_object_mut() {
            o.remove("status");
        }
    }
    let created = commit(shared, &mut store, "ADDED", k, object);
    (StatusCode::CREATED, axum::Json(created)).into_response()
}

/// Everything but `metadata` and `status`: what moves `generation`.
fn spec_of(object: &Value) -> Value {
    let mut v = object.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("metadata");
        o.remove("status");
    }
    v
}

/// Writes `new` over the object at `name`: the subresource's part only for
/// `/status`, everything but status for a kind with a status subresource.
fn write(
    shared: &Shared,
    t: &Target,
    name: &str,
    mut new: Value,
    precondition: Option<&str>,
) -> Response {
    let mut store = lock(&shared.store);
    let k = key(t, name);
    let Some(live) = store.objects.get(&k).cloned() else {
        return not_found(t, name);
    };
    let current = live["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if let Some(rv) = precondition.filter(|rv| !rv.is_empty())
        && rv != current
    {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                t.plural
            ),
            name,
            &t.plural,
        );
    }
    let with_status = WITH_STATUS.contains(&t.plural.as_str());
    let result = match t.subresource.as_deref() {
        Some("status") => {
            let mut o = live.clone();
            o["status"] = new.get("status").cloned().unwrap_or(Value::Null);
            o
        }
        _ => {
            if with_status {
                match live.get("status") {
                    Some(s) => new["status"] = s.clone(),
                    None => {
                        if let Some(o) = new.as_object_mut() {
                            o.remove("status");
                        }
                    }
                }
            }
            for field in [
                "uid",
                "creationTimestamp",
                "namespace",
                "generation",
                "managedFields",
            ] {
                new["metadata"][field] = live["metadata"][field].clone();
            }
            if new["metadata"]["managedFields"].is_null()
                && let Some(m) = new["metadata"].as_object_mut()
            {
                m.remove("managedFields");
            }
            if spec_of(&new) != spec_of(&live) {
                let generation = live["metadata"]["generation"].as_i64().unwrap_or(1);
                new["metadata"]["generation"] = json!(generation + 1);
            }
            new
        }
    };
    if result == live {
        // No change: no new revision, as the API server does for a no-op write.
        return axum::Json(live).into_response();
    }
    axum::Json(commit(shared, &mut store, "MODIFIED", k, result)).into_response()
}

fn replace(shared: &Shared, t: &Target, name: &str, object: Value) -> Response {
    let precondition = object["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned);
    write(shared, t, name, object, precondition.as_deref())
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// Removes from `live` the fields a manager applied `before` and leaves out `now`, as
/// server-side apply removes fields their manager no longer applies. Lists are
/// atomic: replaced whole by the merge.
fn unapply(live: &mut Value, before: &Value, now: &Value, top: bool) {
    let (Some(live), Some(before)) = (live.as_object_mut(), before.as_object()) else {
        return;
    };
    for (k, was) in before {
        if top && matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        match now.get(k) {
            None | Some(Value::Null) => {
                live.remove(k);
            }
            Some(is) => {
                if let Some(field) = live.get_mut(k) {
                    unapply(field, was, is, false);
                }
            }
        }
    }
}

fn patch(
    shared: &Shared,
    t: &Target,
    name: &str,
    headers: &HeaderMap,
    query: &BTreeMap<String, String>,
    body: Value,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let apply = content_type.starts_with("application/apply-patch");
    if !apply && !content_type.starts_with("application/merge-patch+json") {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format: {content_type}"),
            name,
            &t.plural,
        );
    }
    let manager = query.get("fieldManager").cloned();
    if apply && manager.as_deref().is_none_or(str::is_empty) {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch".into(), name, &t.plural);
    }
    let live = lock(&shared.store).objects.get(&key(t, name)).cloned();
    let slot = manager
        .clone()
        .filter(|_| apply)
        .map(|m| (key(t, name), m, t.subresource.clone().unwrap_or_default()));
    let previous = slot.as_ref().and_then(|slot| {
        lock(&shared.store)
            .applied
            .insert(slot.clone(), body.clone())
    });
    let Some(mut object) = live else {
        if !apply || t.subresource.is_some() {
            return not_found(t, name);
        }
        // Server-side apply creates what is missing.
        let mut object = body;
        object["metadata"]["name"] = json!(name);
        object["metadata"]["managedFields"] = json!([{"manager": manager, "operation": "Apply"}]);
        return create(shared, t, object);
    };
    let precondition = body["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned);
    if let Some(previous) = &previous {
        unapply(&mut object, previous, &body, true);
    }
    merge(&mut object, &body);
    if let Some(m) = manager.filter(|_| apply) {
        let managers: BTreeSet<String> = object["metadata"]["managedFields"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f["manager"].as_str().map(str::to_owned))
            .chain([m])
            .collect();
        object["metadata"]["managedFields"] = managers
            .into_iter()
            .map(|manager| json!({"manager": manager, "operation": "Apply"}))
            .collect();
    }
    let mut store_object = object;
    if let Some(rv) = &precondition {
        store_object["metadata"]["resourceVersion"] = json!(rv);
    }
    write(shared, t, name, store_object, precondition.as_deref())
}

fn delete(shared: &Shared, t: &Target, name: &str) -> Response {
    let mut store = lock(&shared.store);
    let k = key(t, name);
    let Some(live) = store.objects.get(&k).cloned() else {
        return not_found(t, name);
    };
    commit(shared, &mut store, "DELETED", k, live);
    axum::Json(
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
        "details": {"name": name, "kind": t.plural}}),
    )
    .into_response()
}

fn watch_stream(shared: Shared, t: Target, query: BTreeMap<String, String>) -> Response {
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| lock(&shared.store).revision);
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(30), Duration::from_secs);
    let mut changed = shared.changed.subscribe();
    let stream = async_stream(move |tx| async move {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = from;
        loop {
            let (events, expired, revision) = {
                let store = lock(&shared.store);
                let expired = seen < store.compacted;
                let events: Vec<(u64, &'static str, Value)> = store
                    .history
                    .iter()
                    .filter(|(rev, _, (p, pl, ns, _), _)| {
                        *rev > seen && *p == t.prefix && *pl == t.plural && *ns == t.namespace
                    })
                    .map(|(rev, ty, _, o)| (*rev, *ty, o.clone()))
                    .collect();
                (events, expired, store.revision)
            };
            if expired {
                let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "message": format!("too old resource version: {seen} ({revision})"),
                    "reason": "Expired", "code": 410}});
                let _ = tx.send(line(&gone)).await;
                return;
            }
            for (rev, ty, object) in events {
                seen = rev;
                if tx
                    .send(line(&json!({"type": ty, "object": object})))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let tick = tokio::time::sleep(Duration::from_millis(1000));
            tokio::select! {
                _ = changed.changed() => {}
                () = tick => {
                    if bookmarks {
                        seen = seen.max(revision);
                        let mark = json!({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": seen.to_string()}}});
                        if tx.send(line(&mark)).await.is_err() {
                            return;
                        }
                    }
                }
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(stream)
        .expect("a response")
}

fn line(v: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(v).expect("JSON serializes");
    bytes.push(b'\n');
    Bytes::from(bytes)
}

/// A streamed body fed by `produce` through a channel.
fn async_stream<F, Fut>(produce: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(produce(tx));
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|b| b.map(Ok::<_, std::io::Error>))
    });
    Body::from_stream(stream)
}

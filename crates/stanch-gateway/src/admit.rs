//! Admit: what a request must be before it is routed. It must be a `POST` to one of
//! the proxied APIs, from a known caller when every caller must be a tenant, with a
//! body that arrives within its limits and names, in JSON, a `model` this gateway
//! serves. A request that falls short is refused with a [`Refusal`]: the caller's
//! fault, never an upstream's, and never routed. One that passes becomes a [`Ctx`],
//! which carries it through routing ([`crate::route`]) to its answer: from the FAQ,
//! or from the plan that [`crate::serving`] works through.

use std::future::Future;
use std::sync::Arc;

use axum::http::header;
use axum::response::Response;
use hyper::body::Incoming;
use hyper::{Method, Request};
use secrecy::ExposeSecret;
use stanch_net::body::read_whole;
use subtle::ConstantTimeEq;
use tokio::time::Instant;

use crate::Gateway;
use crate::headers::Forward;
use crate::request::{Api, Ctx, Refusal};
use crate::route::Route;

/// Serves a request to one of the proxied APIs.
///
/// What admission needs of the request's head (the method, the caller's key) is taken
/// before anything is awaited, and the head is dropped then: its header values share
/// hyper's read buffer, and the future awaited from here on holds only the body.
pub(crate) fn handle(
    gw: Arc<Gateway>,
    api: Api,
    request: Request<Incoming>,
) -> impl Future<Output = Response> + Send + 'static {
    let (parts, body) = request.into_parts();
    let forward = Forward::from_caller(&parts.headers);
    let tenant = if parts.method == Method::POST {
        Ok(tenant(&gw, &parts.headers))
    } else {
        Err(Refusal::MethodNotAllowed(api.path()))
    };
    drop(parts);
    async move {
        let request_id = forward.request_id.clone();
        let admitted = match tenant {
            Ok(tenant) => admit(&gw, api, body, tenant, forward).await,
            Err(refusal) => Err(refusal),
        };
        let mut ctx = match admitted {
            Ok(ctx) => ctx,
            Err(refusal) => return crate::respond::refused(&gw, &refusal, request_id),
        };
        match crate::route::route(&mut ctx) {
            Route::Faq(set) => crate::respond::faq(&ctx, set.as_deref(), "static"),
            Route::Plan(targets) => crate::serving::serve(&mut ctx, targets).await,
        }
    }
}

/// Reads the body and what routing needs of it. The caller's key was looked up
/// (`tenant`) while the head was at hand, but a refused key is answered only once the
/// body has been read: a caller answered before its body is read can find the
/// connection reset under the answer, as the unread bytes make the socket's close a
/// reset (hyper does not linger to drain them).
async fn admit(
    gw: &Arc<Gateway>,
    api: Api,
    body: Incoming,
    tenant: Result<Option<usize>, Refusal>,
    forward: Forward,
) -> Result<Ctx<'_>, Refusal> {
    let raw = read_whole(body, &gw.body_limits, Some(&gw.body_budget)).await?;
    // Only the fields routing needs are read; the body is forwarded as it came.
    let peek = crate::json::peek(&raw).map_err(|_| Refusal::InvalidJson)?;
    let requested = peek
        .model
        .map(std::borrow::Cow::into_owned)
        .ok_or(Refusal::ModelRequired)?;
    let model = gw
        .resolve(&requested)
        .ok_or_else(|| Refusal::ModelNotFound(requested.clone()))?;
    let tenant = tenant?;
    let stream = api != Api::Embeddings && peek.stream.unwrap_or(false);
    let table = gw.table();
    let started = Instant::now();
    gw.budget.request(started);
    Ok(Ctx {
        gw,
        api,
        requested,
        model,
        serving: model,
        raw,
        stream,
        version: table.as_ref().map_or(0, |t| t.version),
        wall: gw.clock.now(),
        table,
        started,
        degraded: false,
        attempts: 0,
        tenant,
        forward,
    })
}

/// The caller's tenant, if its key is known; an unknown key is refused when every
/// caller must be a tenant.
fn tenant(gw: &Gateway, headers: &hyper::HeaderMap) -> Result<Option<usize>, Refusal> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant-time: how much of a key matched must not show in the answer's timing.
    let tenant = presented.and_then(|key| {
        gw.tenants
            .iter()
            .position(|t| bool::from(t.key.expose_secret().as_bytes().ct_eq(key.as_bytes())))
    });
    if gw.config.require_tenant && tenant.is_none() {
        return Err(Refusal::UnknownKey);
    }
    Ok(tenant)
}

//! The status page: `GET /` and its script and styles under `/ui/`.
//!
//! The page is three static files compiled into the binary, with no data in them: it
//! reads `/v1/status`, `/v1/history` and `/v1/routes/stream` with the token the
//! engineer types (kept in the tab's memory), so serving it needs no token. Every URL
//! it uses is relative, so it works behind a path prefix (an ingress or
//! `kubectl port-forward`) as long as the prefix ends with `/`.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use stanch_api::hash::Fnv64;

use crate::error::ApiError;

/// One embedded file.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const INDEX: Asset = Asset {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_str!("../../ui/index.html"),
};

/// What `/ui/{asset}` serves.
const ASSETS: [Asset; 3] = [
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../../ui/app.js"),
    },
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../../ui/app.css"),
    },
    Asset {
        name: "icon.svg",
        content_type: "image/svg+xml",
        body: include_str!("../../ui/icon.svg"),
    },
];

/// Scripts and styles from this origin only, no inline code, no framing, no
/// connections elsewhere: a label value that slipped into markup could run nothing.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// Each file's `ETag`, the index's first and then the assets' in order: the files
/// are fixed at build time, so their hashes are taken once.
static ETAGS: LazyLock<Vec<HeaderValue>> = LazyLock::new(|| {
    std::iter::once(&INDEX)
        .chain(&ASSETS)
        .map(|asset| {
            let mut h = Fnv64::default();
            h.write(asset.body.as_bytes());
            HeaderValue::from_str(&format!("\"{:016x}\"", h.finish()))
                .expect("hex digits in quotes")
        })
        .collect()
});

/// `GET /`
pub(super) async fn index(headers: HeaderMap) -> Response {
    serve(&INDEX, &ETAGS[0], &headers)
}

/// `GET /ui/{asset}`
pub(super) async fn asset(Path(name): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().position(|a| a.name == name) {
        Some(i) => serve(&ASSETS[i], &ETAGS[i + 1], &headers),
        None => ApiError::NotFound(format!(
            "no such file of the status page: {name:?} (it has {})",
            ASSETS.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
        ))
        .into_response(),
    }
}

fn serve(asset: &Asset, etag: &HeaderValue, headers: &HeaderMap) -> Response {
    let unchanged = headers
        .get(header::IF_NONE_MATCH)
        .is_some_and(|v| v == etag);
    let mut response = if unchanged {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        asset.body.into_response()
    };
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    h.insert(header::ETAG, etag.clone());
    // Revalidated each time: after an upgrade the page and its script never mix.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

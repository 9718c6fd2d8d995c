//! Headers that cross the gateway: the caller's to the upstream, the upstream's back.
//!
//! Going up, every caller header is forwarded except those that are the connection's
//! own (hop-by-hop, RFC 9110 §7.6.1, and any the caller's `Connection` names), those the
//! gateway sets itself (`Host`, `Content-Length`, `Content-Type`), and the caller's
//! credentials (`Authorization`, `Proxy-Authorization`, `Cookie`, `X-Api-Key`,
//! `Api-Key`): the endpoint's own key goes up instead, and `Accept-Encoding`: the
//! gateway reads answers (stream events, usage, errors), so it asks upstreams for them
//! uncoded (the OpenAI SDK asks for gzip). So W3C `traceparent` and
//! `tracestate`, `OpenAI-Organization`, `User-Agent` and custom headers reach the model
//! server as sent. Every request carries an `X-Request-Id`: the caller's when it sent a
//! usable one (1 to 128 visible ASCII characters), else a new one; it is in the access
//! log line and in the answer.
//!
//! Coming back, every upstream header is returned except the hop-by-hop ones, framing
//! (`Content-Length`, `Transfer-Encoding`, set for the caller's connection), and the
//! gateway's own `X-Stanch-*`, `X-LLM-Degraded`: so `X-Request-Id`,
//! `OpenAI-Processing-Ms` and `X-RateLimit-*` reach the caller. An upstream that sends no
//! `X-Request-Id` gets the gateway's in its answer.

use hyper::HeaderMap;
use hyper::header::{self, HeaderName, HeaderValue};

/// `X-Request-Id`.
pub(crate) static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The most caller headers forwarded; the rest are left out (hyper reads at most 100).
const MAX_FORWARDED: usize = 64;

/// Hop-by-hop headers, and framing the gateway sets for its own connections. Compared
/// as `HeaderName`s: for the standard ones, a comparison of two small integers.
const HOP_BY_HOP: [HeaderName; 10] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::CONTENT_LENGTH,
    header::HOST,
];

/// The caller's credentials, which never go upstream.
const CREDENTIALS: [HeaderName; 5] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::COOKIE,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
];

/// What a caller's request passes on upstream.
#[derive(Debug, Clone)]
pub(crate) struct Forward {
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The request's id, the caller's or a new one.
    pub(crate) request_id: HeaderValue,
}

/// Whether `name` is one the caller's `Connection` header lists (hop-by-hop too).
fn named_by_connection(headers: &HeaderMap, name: &HeaderName) -> bool {
    headers.get_all(header::CONNECTION).iter().any(|v| {
        v.to_str().is_ok_and(|list| {
            list.split(',')
                .any(|n| n.trim().eq_ignore_ascii_case(name.as_str()))
        })
    })
}

fn own(name: &HeaderName) -> bool {
    let n = name.as_str();
    n.starts_with("x-stanch-") || n == "x-llm-degraded"
}

/// A new request id: 32 hex digits.
fn new_request_id() -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = [0u8; 32];
    let random = [
        crate::endpoints::next_random(),
        crate::endpoints::next_random(),
    ];
    for (half, r) in id.chunks_exact_mut(16).zip(random) {
        for (i, d) in half.iter_mut().enumerate() {
            *d = HEX[(r >> (60 - 4 * i)) as usize & 0xf];
        }
    }
    HeaderValue::from_bytes(&id).expect("hex digits are a header value")
}

impl Forward {
    /// What of the caller's `headers` goes upstream.
    pub(crate) fn from_caller(headers: &HeaderMap) -> Forward {
        let request_id = headers
            .get(&REQUEST_ID)
            .filter(|v| {
                (1..=128).contains(&v.len()) && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
            })
            .cloned()
            .unwrap_or_else(new_request_id);
        // Most requests have no Connection header: then nothing is named by it.
        let connection = headers.contains_key(header::CONNECTION);
        let headers = headers
            .iter()
            .filter(|(name, _)| {
                let withheld = HOP_BY_HOP.contains(name)
                    || CREDENTIALS.contains(name)
                    || *name == header::CONTENT_TYPE
                    || *name == header::ACCEPT_ENCODING
                    || **name == REQUEST_ID
                    || own(name)
                    || (connection && named_by_connection(headers, name));
                !withheld
            })
            .take(MAX_FORWARDED)
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        Forward {
            headers,
            request_id,
        }
    }

    /// Adds the forwarded headers and the request id to an upstream request, which has
    /// its own `Host`, `Content-Type` and `Authorization` already.
    pub(crate) fn onto(&self, upstream: &mut HeaderMap) {
        for (name, value) in &self.headers {
            upstream.append(name.clone(), value.clone());
        }
        upstream.insert(REQUEST_ID.clone(), self.request_id.clone());
    }
}

/// The caller's headers of an upstream answer: the upstream's, without what does not go
/// back. The map is the upstream's own, with those removed: most answers lose one
/// header (`Content-Length`), and copying the rest into a new map would hash each again.
pub(crate) fn from_upstream(mut headers: HeaderMap) -> HeaderMap {
    let connection = headers.contains_key(header::CONNECTION);
    let withheld: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            HOP_BY_HOP.contains(name)
                || own(name)
                || (connection && named_by_connection(&headers, name))
        })
        .cloned()
        .collect();
    for name in &withheld {
        headers.remove(name);
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        m
    }

    #[test]
    fn callers_headers_go_up_but_never_their_credentials_or_hop_by_hop_ones() {
        let caller = map(&[
            ("authorization", "Bearer caller-key"),
            ("x-api-key", "also-secret"),
            ("cookie", "session=1"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "named by Connection"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("host", "gateway"),
            ("content-length", "12"),
            ("content-type", "application/json"),
            ("accept-encoding", "gzip, deflate"),
            ("x-stanch-route-version", "9"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("openai-organization", "org-1"),
            ("user-agent", "OpenAI/Python 1.54.0"),
            ("x-custom", "a"),
            ("x-custom", "b"),
        ]);
        let forward = Forward::from_caller(&caller);
        let mut up = map(&[
            ("host", "model-server"),
            ("authorization", "Bearer endpoint-key"),
        ]);
        forward.onto(&mut up);
        assert_eq!(
            up["authorization"], "Bearer endpoint-key",
            "the endpoint's key, not the caller's"
        );
        for gone in [
            "x-api-key",
            "cookie",
            "connection",
            "x-hop",
            "keep-alive",
            "te",
            "content-length",
            "x-stanch-route-version",
            "content-type",
            "accept-encoding",
        ] {
            assert!(!up.contains_key(gone), "{gone} went upstream");
        }
        assert_eq!(up["host"], "model-server");
        assert_eq!(
            up["traceparent"],
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        assert_eq!(up["tracestate"], "congo=t61rcWkgMzE");
        assert_eq!(up["openai-organization"], "org-1");
        assert_eq!(up["user-agent"], "OpenAI/Python 1.54.0");
        assert_eq!(up.get_all("x-custom").iter().count(), 2);
        assert_eq!(up["x-request-id"].len(), 32, "a new id");
    }

    #[test]
    fn the_callers_request_id_is_kept_when_usable() {
        let kept = Forward::from_caller(&map(&[("x-request-id", "req-abc-123")]));
        assert_eq!(kept.request_id, "req-abc-123");
        for bad in ["has space", ""] {
            let mut m = HeaderMap::new();
            m.insert(REQUEST_ID.clone(), HeaderValue::from_str(bad).unwrap());
            let fresh = Forward::from_caller(&m);
            assert_eq!(fresh.request_id.len(), 32, "{bad:?} replaced");
            assert!(
                fresh
                    .request_id
                    .as_bytes()
                    .iter()
                    .all(|b| b"0123456789abcdef".contains(b)),
                "{:?}: lower-case hex",
                fresh.request_id
            );
        }
        let long = HeaderValue::from_str(&"x".repeat(129)).unwrap();
        let mut m = HeaderMap::new();
        m.insert(REQUEST_ID.clone(), long);
        assert_eq!(Forward::from_caller(&m).request_id.len(), 32);
        assert_ne!(
            Forward::from_caller(&HeaderMap::new()).request_id,
            Forward::from_caller(&HeaderMap::new()).request_id
        );
    }

    #[test]
    fn upstream_headers_come_back_without_hop_by_hop_or_the_gateways_own() {
        let upstream = map(&[
            ("x-request-id", "req_upstream"),
            ("openai-processing-ms", "412"),
            ("x-ratelimit-remaining-tokens", "9000"),
            ("content-type", "application/json"),
            ("content-length", "100"),
            ("transfer-encoding", "chunked"),
            ("connection", "close, x-hop"),
            ("x-hop", "named by Connection"),
            ("keep-alive", "timeout=5"),
            ("x-stanch-attempts", "9"),
            ("x-llm-degraded", "true"),
        ]);
        let caller = from_upstream(upstream);
        assert_eq!(caller["x-request-id"], "req_upstream");
        assert_eq!(caller["openai-processing-ms"], "412");
        assert_eq!(caller["x-ratelimit-remaining-tokens"], "9000");
        assert_eq!(caller["content-type"], "application/json");
        for gone in [
            "content-length",
            "transfer-encoding",
            "connection",
            "x-hop",
            "keep-alive",
            "x-stanch-attempts",
            "x-llm-degraded",
        ] {
            assert!(!caller.contains_key(gone), "{gone} came back");
        }
    }
}

//! HTTP clients as tests use them, and waiting for a server to be ready.

use std::future::Future;
use std::time::Duration;

/// How long a test's request may take before it fails.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// A client that goes straight to loopback (no proxy from the environment) and gives
/// up after [`TIMEOUT`].
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(TIMEOUT)
        .build()
        .expect("the client builds")
}

/// Whether `url` answers a GET with a success status now.
pub async fn ok(http: &reqwest::Client, url: &str) -> bool {
    http.get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// Waits until `url` answers a GET with a success status; panics naming it if it does
/// not within `within`.
pub async fn ready(url: &str, within: Duration) {
    let http = client();
    crate::wait::until(&format!("{url} ready"), within, || ok(&http, url)).await;
}

/// The same for tests without a runtime.
pub mod blocking {
    use std::time::Duration;

    /// A blocking client that goes straight to loopback and gives up after
    /// [`TIMEOUT`](super::TIMEOUT).
    pub fn client() -> reqwest::blocking::Client {
        reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(super::TIMEOUT)
            .build()
            .expect("the client builds")
    }

    /// Whether `url` answers a GET with a success status now.
    pub fn ok(http: &reqwest::blocking::Client, url: &str) -> bool {
        http.get(url).send().is_ok_and(|r| r.status().is_success())
    }

    /// Waits until `url` answers a GET with a success status; false if it did not
    /// within `within`.
    pub fn ready_within(http: &reqwest::blocking::Client, url: &str, within: Duration) -> bool {
        crate::wait::blocking::holds_within(within, || ok(http, url))
    }
}

/// A request sent and its answer read in one call, panicking with what went wrong:
/// `http.get(url).fetch_json::<Value>().await` for the chain of `send`, `json` and
/// their unwraps. The status is not checked: a test that cares asserts it.
pub trait Fetch {
    /// Sends the request and reads the answer's body as JSON.
    fn fetch_json<T: serde::de::DeserializeOwned>(self) -> impl Future<Output = T> + Send;

    /// Sends the request and reads the answer's body as text.
    fn fetch_text(self) -> impl Future<Output = String> + Send;
}

impl Fetch for reqwest::RequestBuilder {
    async fn fetch_json<T: serde::de::DeserializeOwned>(self) -> T {
        let text = self.fetch_text().await;
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not the JSON expected: {e}: {text}"))
    }

    async fn fetch_text(self) -> String {
        let answer = self.send().await.unwrap_or_else(|e| panic!("{e}"));
        let url = answer.url().clone();
        answer
            .text()
            .await
            .unwrap_or_else(|e| panic!("the answer of {url}: {e}"))
    }
}

//! The watch over gRPC (`stanch.v1.RouteWatch/WatchRoutes`): a Hello naming the table
//! held, then an Ack or a Nack for every table received, by the same rules as SSE and
//! long-poll (the [`Applier`](crate::Applier)'s), and the same deadline on silence.

use std::time::Duration;

use secrecy::ExposeSecret;
use stanch_api::RouteTable;
use stanch_proto::v1::route_watch_client::RouteWatchClient;
use stanch_proto::v1::{self, watch_request, watch_response};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tracing::warn;

use crate::{HEARTBEAT_BOUNDS, MAX_EVENT_BYTES, WatchConfig, WatchError, Watcher};

/// A channel to the controller, connected when first used and again whenever the
/// connection breaks. `Err` says why the URL or the TLS settings are unusable.
pub(crate) fn channel(config: &WatchConfig) -> Result<Channel, tonic::transport::Error> {
    let mut endpoint = Endpoint::from_shared(config.url.clone())?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        // The controller's heartbeats tell a dead stream; HTTP/2 pings tell a dead
        // connection between streams.
        .http2_keep_alive_interval(config.heartbeat)
        .keep_alive_timeout(2 * config.heartbeat);
    if config.url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new().with_webpki_roots();
        if let Some(pem) = &config.ca_pem {
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        endpoint = endpoint.tls_config(tls)?;
    }
    Ok(endpoint.connect_lazy())
}

/// `Bearer <token>` for the stream's metadata, marked sensitive: kept out of debug
/// output, and sent as a never-indexed HPACK literal so that it stays out of both
/// ends' compression tables (RFC 7541, section 7.1.3), as reqwest sends it over HTTP.
fn bearer(
    token: &secrecy::SecretString,
) -> Result<tonic::metadata::MetadataValue<tonic::metadata::Ascii>, WatchError> {
    let mut value: tonic::metadata::MetadataValue<_> = format!("Bearer {}", token.expose_secret())
        .parse()
        .map_err(|_| WatchError::Token)?;
    value.set_sensitive(true);
    Ok(value)
}

/// What the gateway says of a table it was sent: every table is answered, since
/// the controller sends the next only then.
enum Answer {
    Ack,
    Nack(String),
}

impl Watcher {
    /// One gRPC stream, from the Hello until it breaks or goes silent.
    pub(crate) async fn follow_grpc(&mut self, channel: Channel) -> Result<(), WatchError> {
        let mut client = RouteWatchClient::new(channel)
            .max_decoding_message_size(MAX_EVENT_BYTES)
            .max_encoding_message_size(64 << 10);
        // Two messages in flight at most: the stream is latest-only, and an Ack waits
        // behind the last one if the controller is slow to take it.
        let (out, outbound) = mpsc::channel::<v1::WatchRequest>(2);
        let held = self.applier.current.load_full();
        let hello = v1::Hello {
            gateway_id: self.config.gateway_id.clone(),
            version: held.as_ref().map_or(0, |t| t.version),
            epoch: held.as_ref().map(|t| t.epoch.clone()).unwrap_or_default(),
        };
        out.try_send(request(watch_request::Kind::Hello(hello)))
            .expect("room for the first message");
        let mut call = tonic::Request::new(ReceiverStream::new(outbound));
        if let Some(token) = &self.config.token {
            call.metadata_mut().insert("authorization", bearer(token)?);
        }
        let mut silence = 2 * self.config.heartbeat;
        let opened = tokio::time::timeout(silence, client.watch_routes(call))
            .await
            .map_err(|_| WatchError::Silent(silence))?
            .map_err(status)?;
        let mut inbound = opened.into_inner();
        loop {
            let message = match tokio::time::timeout(silence, inbound.message()).await {
                Err(_) => return Err(WatchError::Silent(silence)),
                Ok(Err(s)) => return Err(status(s)),
                Ok(Ok(None)) => return Err(WatchError::Ended),
                Ok(Ok(Some(message))) => message,
            };
            match message.kind {
                Some(watch_response::Kind::Table(table)) => {
                    let (version, epoch) = (table.version, table.epoch.clone());
                    let answer = match self.answer(table) {
                        Answer::Ack => watch_request::Kind::Ack(v1::Ack { version, epoch }),
                        Answer::Nack(reason) => watch_request::Kind::Nack(v1::Nack {
                            version,
                            epoch,
                            reason,
                        }),
                    };
                    // A controller that takes no answer within the silence deadline
                    // is as good as silent.
                    tokio::time::timeout(silence, out.send(request(answer)))
                        .await
                        .map_err(|_| WatchError::Silent(silence))?
                        .map_err(|_| WatchError::Ended)?;
                }
                Some(watch_response::Kind::Heartbeat(beat)) => {
                    let interval = Duration::from_millis(beat.interval_ms)
                        .clamp(HEARTBEAT_BOUNDS.0, HEARTBEAT_BOUNDS.1);
                    silence = 2 * interval;
                }
                // A kind this gateway does not know: from a newer controller, ignored.
                None => {}
            }
        }
    }

    /// Applies a table from the stream, or says why not.
    fn answer(&mut self, table: v1::RouteTable) -> Answer {
        let (version, epoch) = (table.version, table.epoch.clone());
        match RouteTable::try_from(table) {
            Ok(table) => {
                if self.applier.apply(table) {
                    Answer::Ack
                } else if let Some(r) = &self.applier.rejected
                    && r.version == version
                    && r.epoch == epoch
                {
                    Answer::Nack(r.reason.clone())
                } else {
                    // Not newer than the table it holds, which it keeps (a controller
                    // sends none such to a gateway whose Hello it read).
                    let held = self.applier.current.load();
                    let held = held.as_ref().map_or(0, |t| t.version);
                    Answer::Nack(format!(
                        "not newer than the table held (version {held} of the same epoch)"
                    ))
                }
            }
            Err(e) => {
                warn!(version, epoch = %epoch, error = %e, "route table unreadable; refused, the gateway keeps its current table");
                let reason = format!("unreadable: {e}");
                self.applier.refuse(version, epoch, reason.clone());
                Answer::Nack(reason)
            }
        }
    }
}

fn request(kind: watch_request::Kind) -> v1::WatchRequest {
    v1::WatchRequest { kind: Some(kind) }
}

/// A status that ended a stream, as a watch error.
fn status(s: tonic::Status) -> WatchError {
    WatchError::Grpc(Box::new(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_is_sensitive_and_never_shown() {
        let token = secrecy::SecretString::from("rd-7f3a9c");
        let value = bearer(&token).unwrap();
        assert!(value.is_sensitive(), "sent never-indexed");
        assert_eq!(value.to_str().unwrap(), "Bearer rd-7f3a9c");
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("authorization", value);
        let shown = format!("{metadata:?}");
        assert!(!shown.contains("rd-7f3a9c"), "{shown}");
    }

    #[test]
    fn a_token_that_cannot_be_a_header_is_refused_without_showing_it() {
        let token = secrecy::SecretString::from("rd\nsecret");
        let err = bearer(&token).unwrap_err().to_string();
        assert!(err.contains("not a valid header value"), "{err}");
        assert!(!err.contains("secret"), "{err}");
    }
}

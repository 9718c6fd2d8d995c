//! Alert payloads: Alertmanager's webhook (version 4), Prometheus' own push
//! (`POST /api/v2/alerts`) and Alertmanager's alert list (`GET /api/v2/alerts`).
//!
//! Parsing is lenient where the senders are (unknown fields are ignored) and strict
//! where a mistake would change a decision (timestamps, status, label types). One bad
//! alert in a batch is reported with its index and field; the others are kept.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Invalid;
use crate::{Fingerprint, Labels, Timestamp};

/// Whether an alert is still firing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AlertStatus {
    /// The condition holds.
    Firing,
    /// The condition cleared.
    Resolved,
}

/// Who sent an alert, which decides how long it stays active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AlertSource {
    /// Alertmanager's webhook: active until a resolved notification (`endsAt` is unset).
    Alertmanager,
    /// Prometheus' push: active until its `endsAt`, unless refreshed.
    Prometheus,
}

impl AlertSource {
    /// Its name in metrics and logs, as serialized: `alertmanager`, `prometheus`.
    pub fn as_str(self) -> &'static str {
        match self {
            AlertSource::Alertmanager => "alertmanager",
            AlertSource::Prometheus => "prometheus",
        }
    }
}

/// One alert, validated and normalized, as it enters the engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingAlert {
    /// Alertmanager's fingerprint, or the one computed from `labels` the same way.
    pub fingerprint: Fingerprint,
    /// Firing or resolved.
    pub status: AlertStatus,
    /// The identifying labels.
    pub labels: Labels,
    /// Free-form annotations (summary, description).
    #[serde(default)]
    pub annotations: Labels,
    /// When the condition started.
    pub starts_at: Timestamp,
    /// When the alert ends on its own; `None` means "until resolved".
    pub ends_at: Option<Timestamp>,
    /// The sender.
    pub source: AlertSource,
}

/// A batch of alerts from one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedBatch {
    /// The alerts that passed validation, in payload order.
    pub alerts: Vec<IncomingAlert>,
    /// The alerts that did not, each with its index and what was wrong.
    pub rejected: Vec<RejectedAlert>,
    /// Alertmanager's `truncatedAlerts`: alerts it left out of this notification.
    pub truncated_alerts: u64,
}

/// An alert of a batch that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedAlert {
    /// Its position in the payload's alert list.
    pub index: usize,
    /// What was wrong and where, e.g. `alerts[3].startsAt: not an RFC 3339 timestamp`.
    pub detail: String,
}

/// The answer to an accepted alert notification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntakeResponse {
    /// Alerts recorded.
    pub accepted: usize,
    /// Alerts of the batch that were invalid, with what was wrong.
    pub rejected: Vec<RejectedAlert>,
    /// The route version after recording them.
    pub version: u64,
}

/// Why a whole payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// The body is not JSON at all.
    #[error("body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but a field of the envelope is wrong.
    #[error("{path}: {detail}")]
    Field {
        /// Where, as a JSON path.
        path: String,
        /// What was wrong.
        detail: String,
    },
    /// The body had alerts and every one of them was invalid.
    #[error("every alert was invalid; first: {}", .0.first().map(|r| r.detail.as_str()).unwrap_or(""))]
    AllRejected(Vec<RejectedAlert>),
}

impl PayloadError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PayloadError::NotJson(_) => "not_json",
            PayloadError::Field { .. } => "bad_field",
            PayloadError::AllRejected(_) => "all_rejected",
        }
    }
}

/// The alert fields every sender shares; unknown fields are ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireAlert {
    status: Option<WireStatus>,
    labels: Labels,
    #[serde(default)]
    annotations: Option<Labels>,
    starts_at: Option<String>,
    ends_at: Option<String>,
    fingerprint: Option<String>,
}

/// Alertmanager's API nests the state: `{"status": {"state": "active"}}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum WireStatus {
    Plain(AlertStatus),
    Api {
        #[serde(rename = "state")]
        _state: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WebhookEnvelope {
    version: String,
    alerts: Vec<Value>,
    #[serde(default)]
    truncated_alerts: u64,
}

fn parse_json(body: &[u8]) -> Result<Value, PayloadError> {
    serde_json::from_slice(body).map_err(|e| PayloadError::NotJson(e.to_string()))
}

fn field_error(prefix: &str, err: serde_path_to_error::Error<serde_json::Error>) -> PayloadError {
    let path = err.path().to_string();
    let path = if path == "." {
        prefix.to_owned()
    } else {
        format!("{prefix}.{path}")
    };
    let detail = err.into_inner().to_string();
    // serde_json appends "at line 1 column 42", meaningless for a `Value`.
    let detail = detail
        .split(" at line ")
        .next()
        .unwrap_or_default()
        .to_owned();
    PayloadError::Field {
        path: path.trim_start_matches('.').to_owned(),
        detail,
    }
}

/// How a sender's alerts are read.
#[derive(Debug, Clone, Copy)]
enum Dialect {
    /// Webhook v4: `status` is required and says firing or resolved.
    Webhook,
    /// Prometheus push: no `status`; resolved when `endsAt` is not after `now`.
    Push { now: Timestamp },
    /// Alertmanager's list: every listed alert is active.
    ApiList,
}

/// The most labels one alert may carry (Prometheus' own default limit is 30 per series).
pub const MAX_LABELS: usize = 64;
/// The longest label or annotation name, in bytes.
pub const MAX_LABEL_NAME: usize = 256;
/// The longest label value, in bytes.
pub const MAX_LABEL_VALUE: usize = 4096;
/// The most bytes of label names and values one alert may carry: labels name an
/// alert, so one past this is refused, never cut.
pub const MAX_LABEL_BYTES: usize = 8 * 1024;
/// The most annotations one alert may carry.
pub const MAX_ANNOTATIONS: usize = 64;
/// The bytes of annotation names and values kept per alert. Annotations describe an
/// alert and decide nothing, so past this they are cut rather than refused: kept in
/// name order, the value that does not fit cut short and ending in [`CUT`], the rest
/// dropped, and the annotation [`TRUNCATED_ANNOTATION`] added saying how much went.
pub const MAX_ANNOTATION_BYTES: usize = 4 * 1024;
/// What ends a value cut short.
pub const CUT: &str = "…[truncated]";
/// The annotation that says annotations were cut.
pub const TRUNCATED_ANNOTATION: &str = "stanch_truncated";
/// What keeping a label or an annotation costs beyond its bytes, in
/// [`IncomingAlert::held_bytes`] (two strings and a map entry).
pub const ENTRY_OVERHEAD: usize = 64;
/// What keeping an alert costs beyond its labels and annotations.
pub const ALERT_OVERHEAD: usize = 256;

impl IncomingAlert {
    /// The bytes holding this alert costs, as `alerts.max_bytes` counts them: its
    /// label and annotation names and values, [`ENTRY_OVERHEAD`] per entry and
    /// [`ALERT_OVERHEAD`]. At most about 20 KiB, by the limits above.
    pub fn held_bytes(&self) -> usize {
        let entries = |set: &Labels| -> usize {
            set.iter()
                .map(|(k, v)| k.len() + v.len() + ENTRY_OVERHEAD)
                .sum()
        };
        ALERT_OVERHEAD + entries(&self.labels) + entries(&self.annotations)
    }
}

/// Checks a label set's size: `what` is `labels` or `annotations`; an error is the
/// problem, under the alert's `prefix` (`alerts[3]`).
fn check_sizes(
    prefix: &str,
    what: &str,
    set: &Labels,
    max_entries: usize,
    max_value: usize,
) -> Result<(), Invalid> {
    let invalid = |field: String, problem: String| Invalid { field, problem };
    if set.len() > max_entries {
        return Err(invalid(
            format!("{prefix}.{what}"),
            format!("{} entries, at most {max_entries}", set.len()),
        ));
    }
    for (name, value) in set {
        let shown: String = name.chars().take(32).collect();
        if name.len() > MAX_LABEL_NAME {
            return Err(invalid(
                format!("{prefix}.{what}"),
                format!("name {shown:?}… is longer than {MAX_LABEL_NAME} bytes"),
            ));
        }
        if value.len() > max_value {
            return Err(invalid(
                format!("{prefix}.{what}.{shown}"),
                format!("value longer than {max_value} bytes"),
            ));
        }
    }
    Ok(())
}

/// The bytes of a set's names and values.
fn set_bytes(set: &Labels) -> usize {
    set.iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// `annotations` within [`MAX_ANNOTATION_BYTES`] (see there).
fn keep_annotations(annotations: Labels) -> Labels {
    let total = set_bytes(&annotations);
    if total <= MAX_ANNOTATION_BYTES {
        return annotations;
    }
    // Room for the note, whose value is at most this long.
    const NOTE: usize = 80;
    let mut room = MAX_ANNOTATION_BYTES - TRUNCATED_ANNOTATION.len() - NOTE;
    let mut kept = Labels::new();
    for (name, value) in annotations {
        let cost = name.len() + value.len();
        if cost <= room {
            room -= cost;
            kept.insert(name, value);
        } else if room > name.len() + CUT.len() {
            let mut end = room - name.len() - CUT.len();
            while !value.is_char_boundary(end) {
                end -= 1;
            }
            let cut = format!("{}{CUT}", &value[..end]);
            room -= name.len() + cut.len();
            kept.insert(name, cut);
        }
    }
    let dropped = total.saturating_sub(set_bytes(&kept));
    kept.insert(
        TRUNCATED_ANNOTATION.to_owned(),
        format!("{dropped} bytes of annotations cut (at most {MAX_ANNOTATION_BYTES} kept)"),
    );
    kept
}

// Size: one alert's checks in the order its fields come on the wire, each refusing with its path.
fn parse_alert(
    index: usize,
    value: Value,
    dialect: Dialect,
) -> Result<IncomingAlert, RejectedAlert> {
    let prefix = format!("alerts[{index}]");
    let reject = |detail: String| RejectedAlert { index, detail };
    let wire: WireAlert = serde_path_to_error::deserialize(value)
        .map_err(|e| reject(field_error(&prefix, e).to_string()))?;
    if wire.labels.is_empty() {
        return Err(reject(format!(
            "{prefix}.labels: an alert needs at least one label"
        )));
    }
    if let Some((name, _)) = wire.labels.iter().find(|(k, _)| k.is_empty()) {
        return Err(reject(format!(
            "{prefix}.labels: empty label name {name:?}"
        )));
    }
    check_sizes(&prefix, "labels", &wire.labels, MAX_LABELS, MAX_LABEL_VALUE)
        .map_err(|e| reject(e.to_string()))?;
    let label_bytes = set_bytes(&wire.labels);
    if label_bytes > MAX_LABEL_BYTES {
        return Err(reject(format!(
            "{prefix}.labels: {label_bytes} bytes of names and values, at most {MAX_LABEL_BYTES}"
        )));
    }
    if let Some(annotations) = &wire.annotations {
        check_sizes(
            &prefix,
            "annotations",
            annotations,
            MAX_ANNOTATIONS,
            usize::MAX,
        )
        .map_err(|e| reject(e.to_string()))?;
    }
    let time = |field: &str, raw: &Option<String>| -> Result<Option<Timestamp>, RejectedAlert> {
        match raw.as_deref() {
            None | Some("") => Ok(None),
            Some(s) => Timestamp::parse_rfc3339(s)
                .map(|t| (!t.is_unset()).then_some(t))
                .map_err(|_| {
                    reject(format!(
                        "{prefix}.{field}: not an RFC 3339 timestamp: {s:?}"
                    ))
                }),
        }
    };
    let starts_at = time("startsAt", &wire.starts_at)?;
    let ends_at = time("endsAt", &wire.ends_at)?;
    let computed = Fingerprint::of(&wire.labels);
    let fingerprint = match wire.fingerprint.as_deref() {
        None | Some("") => computed,
        Some(s) => s
            .parse()
            .map_err(|e| reject(format!("{prefix}.fingerprint: {e}")))?,
    };
    let (status, source) = match dialect {
        Dialect::Webhook => match wire.status {
            Some(WireStatus::Plain(s)) => (s, AlertSource::Alertmanager),
            _ => {
                return Err(reject(format!(
                    "{prefix}.status: expected \"firing\" or \"resolved\""
                )));
            }
        },
        Dialect::Push { now } => {
            let resolved = ends_at.is_some_and(|e| e <= now);
            let status = if resolved {
                AlertStatus::Resolved
            } else {
                AlertStatus::Firing
            };
            (status, AlertSource::Prometheus)
        }
        Dialect::ApiList => (AlertStatus::Firing, AlertSource::Alertmanager),
    };
    let starts_at = match (starts_at, dialect) {
        (Some(t), _) => t,
        (None, Dialect::Push { now }) => now,
        (None, _) => return Err(reject(format!("{prefix}.startsAt: missing"))),
    };
    if let Some(end) = ends_at
        && end < starts_at
        && status == AlertStatus::Firing
    {
        return Err(reject(format!(
            "{prefix}.endsAt: {end} is before startsAt {starts_at}"
        )));
    }
    Ok(IncomingAlert {
        fingerprint,
        status,
        labels: wire.labels,
        annotations: keep_annotations(wire.annotations.unwrap_or_default()),
        starts_at,
        // Alertmanager's webhook and list carry its own resolve deadline in endsAt for
        // firing alerts; stanch keeps them until a resolved notification instead.
        ends_at: match (dialect, status) {
            (Dialect::Push { .. }, _) | (_, AlertStatus::Resolved) => ends_at,
            _ => None,
        },
        source,
    })
}

fn parse_alerts(values: Vec<Value>, dialect: Dialect) -> Result<ParsedBatch, PayloadError> {
    let had_alerts = !values.is_empty();
    let mut batch = ParsedBatch::default();
    for (index, value) in values.into_iter().enumerate() {
        match parse_alert(index, value, dialect) {
            Ok(alert) => batch.alerts.push(alert),
            Err(rejected) => batch.rejected.push(rejected),
        }
    }
    if had_alerts && batch.alerts.is_empty() {
        return Err(PayloadError::AllRejected(batch.rejected));
    }
    Ok(batch)
}

/// Parses an Alertmanager webhook notification (`"version": "4"`).
pub fn parse_alertmanager_webhook(body: &[u8]) -> Result<ParsedBatch, PayloadError> {
    let value = parse_json(body)?;
    let envelope: WebhookEnvelope =
        serde_path_to_error::deserialize(value).map_err(|e| field_error("", e))?;
    if envelope.version != "4" {
        return Err(PayloadError::Field {
            path: "version".into(),
            detail: format!(
                "unsupported webhook version {:?}; stanch reads version \"4\"",
                envelope.version
            ),
        });
    }
    let mut batch = parse_alerts(envelope.alerts, Dialect::Webhook)?;
    batch.truncated_alerts = envelope.truncated_alerts;
    Ok(batch)
}

/// Parses Prometheus' alert push: a JSON array of alerts, as sent to an Alertmanager's
/// `POST /api/v2/alerts`. An alert whose `endsAt` is not after `now` is resolved.
pub fn parse_prometheus_push(body: &[u8], now: Timestamp) -> Result<ParsedBatch, PayloadError> {
    let value = parse_json(body)?;
    let Value::Array(values) = value else {
        return Err(PayloadError::Field {
            path: "$".into(),
            detail: "expected a JSON array of alerts".into(),
        });
    };
    parse_alerts(values, Dialect::Push { now })
}

/// Parses Alertmanager's `GET /api/v2/alerts` answer: every listed alert is active.
pub fn parse_alertmanager_list(body: &[u8]) -> Result<ParsedBatch, PayloadError> {
    let value = parse_json(body)?;
    let Value::Array(values) = value else {
        return Err(PayloadError::Field {
            path: "$".into(),
            detail: "expected a JSON array of alerts".into(),
        });
    };
    // An empty list is a valid answer: nothing is firing.
    parse_alerts(values, Dialect::ApiList)
}

#[cfg(test)]
mod tests {
    use super::*;

    const AM_FIRING: &str = r#"{"receiver":"heal","status":"firing","alerts":[{"status":"firing","labels":{"action":"trigger-failover","alertname":"A","pool":"dc-a","target_model":"qwen-72b"},"annotations":{},"startsAt":"2026-11-30T00:06:54.148Z","endsAt":"0001-01-01T00:00:00Z","fingerprint":"7e517a555438361b","extra":1}],"version":"4","truncatedAlerts":2}"#;

    #[test]
    fn webhook_firing_has_no_end_and_keeps_fingerprint() {
        let batch = parse_alertmanager_webhook(AM_FIRING.as_bytes()).unwrap();
        assert_eq!(batch.truncated_alerts, 2);
        let a = &batch.alerts[0];
        assert_eq!(a.status, AlertStatus::Firing);
        assert_eq!(a.ends_at, None);
        assert_eq!(a.fingerprint.to_string(), "7e517a555438361b");
        assert_eq!(a.source, AlertSource::Alertmanager);
    }

    #[test]
    fn one_bad_alert_is_reported_and_the_rest_kept() {
        let body = r#"{"version":"4","alerts":[
            {"status":"firing","labels":{"a":"1"},"startsAt":"2026-11-30T00:00:00Z"},
            {"status":"firing","labels":{"a":"2"},"startsAt":"last tuesday"},
            {"status":"burning","labels":{"a":"3"},"startsAt":"2026-11-30T00:00:00Z"},
            {"status":"firing","labels":{"a":4},"startsAt":"2026-11-30T00:00:00Z"}]}"#;
        let batch = parse_alertmanager_webhook(body.as_bytes()).unwrap();
        assert_eq!(batch.alerts.len(), 1);
        let details: Vec<_> = batch.rejected.iter().map(|r| r.detail.as_str()).collect();
        assert_eq!(details.len(), 3);
        assert!(
            details[0].starts_with("alerts[1].startsAt: not an RFC 3339"),
            "{details:?}"
        );
        assert!(details[1].starts_with("alerts[2].status"), "{details:?}");
        assert!(details[2].starts_with("alerts[3].labels.a"), "{details:?}");
    }

    #[test]
    fn envelope_errors_name_the_field() {
        let err = parse_alertmanager_webhook(br#"{"version":"4","alerts":{}}"#).unwrap_err();
        assert!(err.to_string().starts_with("alerts:"), "{err}");
        let err = parse_alertmanager_webhook(br#"{"version":"3","alerts":[]}"#).unwrap_err();
        assert!(
            err.to_string().contains("unsupported webhook version"),
            "{err}"
        );
        let err = parse_alertmanager_webhook(b"{nope").unwrap_err();
        assert_eq!(err.kind(), "not_json");
    }

    #[test]
    fn prometheus_push_status_follows_ends_at() {
        let body = r#"[{"labels":{"alertname":"A"},"startsAt":"2026-11-30T00:06:54.148Z","endsAt":"2026-11-30T00:07:02.148Z"}]"#;
        let before = Timestamp::parse_rfc3339("2026-11-30T00:07:00Z").unwrap();
        let after = Timestamp::parse_rfc3339("2026-11-30T00:07:03Z").unwrap();
        let firing = parse_prometheus_push(body.as_bytes(), before).unwrap();
        assert_eq!(firing.alerts[0].status, AlertStatus::Firing);
        assert_eq!(firing.alerts[0].source, AlertSource::Prometheus);
        assert!(firing.alerts[0].ends_at.is_some());
        let resolved = parse_prometheus_push(body.as_bytes(), after).unwrap();
        assert_eq!(resolved.alerts[0].status, AlertStatus::Resolved);
        // Computed the way Alertmanager computes it.
        let mut labels = Labels::new();
        labels.insert("alertname".into(), "A".into());
        assert_eq!(firing.alerts[0].fingerprint, Fingerprint::of(&labels));
    }

    #[test]
    fn empty_labels_are_refused() {
        let err =
            parse_prometheus_push(br#"[{"labels":{}}]"#, Timestamp::from_millis(0)).unwrap_err();
        assert!(err.to_string().contains("at least one label"), "{err}");
    }

    /// An alert's webhook with these labels and annotations.
    fn webhook(labels: &Labels, annotations: &Labels) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "version": "4", "status": "firing",
            "alerts": [{"status": "firing", "labels": labels, "annotations": annotations,
                        "startsAt": "2026-11-30T00:06:54Z"}],
        }))
        .unwrap()
    }

    #[test]
    fn labels_past_their_bytes_are_refused_with_the_count() {
        let labels: Labels = (0..10)
            .map(|i| (format!("l{i}"), "v".repeat(1000)))
            .collect();
        let err = parse_alertmanager_webhook(&webhook(&labels, &Labels::new())).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("alerts[0].labels: 10020 bytes of names and values, at most 8192"),
            "{text}"
        );
    }

    proptest::proptest! {
        /// However many annotations, however long, in whatever script: what is kept is
        /// within the bound (with the note), each value kept whole or cut at a
        /// character boundary ending in the marker, and a set within the bound is
        /// kept as it came.
        #[test]
        fn annotations_are_kept_within_their_bytes(
            annotations in proptest::collection::btree_map(
                "[a-z_]{1,40}",
                proptest::prop_oneof![".{0,50}", "[a-zé語]{0,3000}"],
                0..40,
            ),
        ) {
            let mut labels = Labels::new();
            labels.insert("alertname".into(), "A".into());
            let batch = parse_alertmanager_webhook(&webhook(&labels, &annotations)).unwrap();
            let kept = &batch.alerts[0].annotations;
            let bytes = set_bytes(kept);
            proptest::prop_assert!(bytes <= MAX_ANNOTATION_BYTES, "{bytes} bytes kept");
            if set_bytes(&annotations) <= MAX_ANNOTATION_BYTES {
                proptest::prop_assert_eq!(kept, &annotations);
            } else {
                proptest::prop_assert!(kept.contains_key(TRUNCATED_ANNOTATION));
                for (name, value) in kept.iter().filter(|(k, _)| *k != TRUNCATED_ANNOTATION) {
                    let original = &annotations[name];
                    let whole = value == original;
                    let cut = value
                        .strip_suffix(CUT)
                        .is_some_and(|start| original.starts_with(start));
                    proptest::prop_assert!(whole || cut, "{name}: {value:?}");
                }
            }
        }
    }
}

//! `Input::Alerts` and `Input::Reconcile`: alerts taken in, refreshed, resolved and
//! expired, within the alert limits (`alerts.max_active`, `alerts.max_bytes`).

use std::collections::BTreeSet;

use stanch_api::alerts::{AlertSource, AlertStatus, IncomingAlert};
use stanch_api::{Fingerprint, Timestamp};

use super::Engine;
use super::overflow::Overflowed;
use crate::decision::{Decision, ResolvedBy};
use crate::mapping::Condition;
use crate::state::{AlertRecord, Tombstone};

impl Engine {
    pub(super) fn receive(
        &mut self,
        alert: IncomingAlert,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        match alert.status {
            AlertStatus::Firing => self.firing(alert, now, out),
            AlertStatus::Resolved => self.resolved(&alert, now, out),
        }
    }

    /// A firing notification: a new alert taken in within the limits, a known one
    /// refreshed, a late repeat of a resolved one ignored.
    fn firing(&mut self, mut alert: IncomingAlert, now: Timestamp, out: &mut Vec<Decision>) {
        let fp = alert.fingerprint;
        if let Some(t) = self.state.tombstones.get(&fp)
            && t.starts_at >= alert.starts_at
        {
            out.push(Decision::AlertIgnored {
                fingerprint: fp,
                why: format!(
                    "already resolved at {}; a late or repeated firing notification",
                    t.resolved_at
                ),
            });
            return;
        }
        if alert.source == AlertSource::Prometheus && alert.ends_at.is_none() {
            alert.ends_at = Some(now + self.config.alerts.resolve_timeout.0);
        }
        let bytes = alert.held_bytes();
        let held_before = self.state.alerts.get(&fp).map(|r| r.alert.held_bytes());
        let grows = held_before.map_or(0, |was| bytes.saturating_sub(was));
        if grows > 0 && self.alert_bytes + grows > self.config.alerts.max_bytes {
            // A refresh that would pass alerts.max_bytes: still firing, so still
            // held, with its last content.
            if let Some(record) = self.state.alerts.get_mut(&fp) {
                record.received_at = now;
            }
            return self.refuse(&alert);
        }
        match held_before {
            Some(was) => self.refresh(alert, was, now, out),
            None => self.take_in(alert, bytes, now, out),
        }
    }

    /// A known alert again: the earliest start kept, the newest content taken; a new
    /// decision only if what it means changed.
    fn refresh(
        &mut self,
        mut alert: IncomingAlert,
        held_before: usize,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        let fp = alert.fingerprint;
        let (condition, unmapped) = self.meaning(&alert);
        let bytes = alert.held_bytes();
        let Some(record) = self.state.alerts.get_mut(&fp) else {
            return;
        };
        let meaning_changed = record.condition != condition;
        alert.starts_at = alert.starts_at.min(record.alert.starts_at);
        self.alert_bytes = self.alert_bytes + bytes - held_before;
        record.alert = alert;
        record.received_at = now;
        if meaning_changed {
            record.condition.clone_from(&condition);
            record.unmapped.clone_from(&unmapped);
            record.block_applied = false;
            out.push(Decision::AlertActive {
                fingerprint: fp,
                alertname: record.alertname().map(str::to_owned),
                condition,
                unmapped,
            });
        }
    }

    /// A new alert, if the limits make room for it.
    fn take_in(
        &mut self,
        alert: IncomingAlert,
        bytes: usize,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        let fp = alert.fingerprint;
        let (condition, unmapped) = self.meaning(&alert);
        if !self.make_room(&alert, bytes, condition.is_some()) {
            // Its tombstone, if any, stays: a late duplicate of an earlier firing is
            // still recognised.
            return self.refuse(&alert);
        }
        self.state.tombstones.remove(&fp);
        if condition.is_none() {
            // One to drop, should the engine fill up again this step.
            self.overflow.none_unmapped = false;
        }
        self.alert_bytes += bytes;
        let record = AlertRecord {
            alert,
            condition: condition.clone(),
            unmapped: unmapped.clone(),
            received_at: now,
            block_applied: false,
        };
        out.push(Decision::AlertActive {
            fingerprint: fp,
            alertname: record.alertname().map(str::to_owned),
            condition,
            unmapped,
        });
        self.state.alerts.insert(fp, record);
    }

    /// What `alert` means under the mapping rules: a condition, or why it has none.
    fn meaning(&self, alert: &IncomingAlert) -> (Option<Condition>, Option<String>) {
        match self.mapper.map(&alert.labels) {
            Ok(c) => (Some(c), None),
            Err(u) => (None, Some(u.0)),
        }
    }

    /// A resolved notification: the alert resolved, unless the notification is of an
    /// older instance; for an alert not held, a tombstone, so that a late firing of
    /// the same instance is recognised.
    fn resolved(&mut self, alert: &IncomingAlert, now: Timestamp, out: &mut Vec<Decision>) {
        let fp = alert.fingerprint;
        match self.state.alerts.get(&fp) {
            // Alertmanager merges overlapping alerts, so a genuine resolution may carry
            // an earlier startsAt; only one that ended before the current instance
            // began belongs to an older instance.
            Some(record)
                if alert
                    .ends_at
                    .is_some_and(|end| end < record.alert.starts_at) =>
            {
                out.push(Decision::AlertIgnored {
                    fingerprint: fp,
                    why: "resolution of an older instance of an alert that fired again".to_owned(),
                });
            }
            Some(_) => self.resolve(fp, ResolvedBy::Notification, now, out),
            None => {
                let newer = self
                    .state
                    .tombstones
                    .get(&fp)
                    .is_none_or(|t| t.starts_at <= alert.starts_at);
                if newer {
                    let tomb = Tombstone {
                        starts_at: alert.starts_at,
                        resolved_at: now,
                    };
                    self.state.tombstones.insert(fp, tomb);
                }
            }
        }
    }

    /// Counts `alert` refused at the alert limits.
    pub(super) fn refuse(&mut self, alert: &IncomingAlert) {
        self.overflow.record(
            alert.source,
            &self.config.alerts,
            alert.labels.get("alertname").map(String::as_str),
            Overflowed::Refused,
        );
    }

    /// Whether `alert`, new and holding `needs` bytes, fits within `alerts.max_active`
    /// and `alerts.max_bytes`,
    /// making room if it must: only an alert that maps to a condition may take a
    /// place, that of the unmapped alerts refreshed longest ago (unmapped alerts change
    /// nothing in the table; they are kept to be shown). A scan of the active alerts
    /// for each unmapped one dropped: such arrivals are few (a notification is at most
    /// `intake.max_body_bytes`), and once none is left to drop the step stops looking.
    pub(super) fn make_room(&mut self, alert: &IncomingAlert, needs: usize, mapped: bool) -> bool {
        let (max_active, max_bytes) = (self.config.alerts.max_active, self.config.alerts.max_bytes);
        loop {
            let fits =
                self.state.alerts.len() < max_active && self.alert_bytes + needs <= max_bytes;
            if fits {
                return true;
            }
            if !mapped || self.overflow.none_unmapped {
                return false;
            }
            let oldest = self
                .state
                .alerts
                .iter()
                .filter(|(_, r)| r.condition.is_none())
                .min_by_key(|(fp, r)| (r.received_at, **fp))
                .map(|(fp, _)| *fp);
            let Some(record) = oldest.and_then(|fp| self.state.alerts.remove(&fp)) else {
                self.overflow.none_unmapped = true;
                return false;
            };
            self.alert_bytes -= record.alert.held_bytes();
            self.overflow.record(
                alert.source,
                &self.config.alerts,
                record.alertname(),
                Overflowed::Displaced,
            );
        }
    }

    pub(super) fn resolve(
        &mut self,
        fp: Fingerprint,
        by: ResolvedBy,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        if let Some(record) = self.state.alerts.remove(&fp) {
            self.alert_bytes -= record.alert.held_bytes();
            self.state.tombstones.insert(
                fp,
                Tombstone {
                    starts_at: record.alert.starts_at,
                    resolved_at: now,
                },
            );
            out.push(Decision::AlertResolved {
                fingerprint: fp,
                alertname: record.alertname().map(str::to_owned),
                by,
            });
        }
    }

    pub(super) fn reconcile(
        &mut self,
        alerts: Vec<IncomingAlert>,
        as_of: Timestamp,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        let listed: BTreeSet<Fingerprint> = alerts.iter().map(|a| a.fingerprint).collect();
        for alert in alerts {
            // Only alerts we have not seen: a listed alert we know needs no refresh.
            if !self.state.alerts.contains_key(&alert.fingerprint) {
                self.receive(alert, now, out);
            }
        }
        let gone: Vec<Fingerprint> = self
            .state
            .alerts
            .iter()
            .filter(|(fp, r)| {
                r.alert.source == AlertSource::Alertmanager
                    && r.received_at < as_of
                    && !listed.contains(fp)
            })
            .map(|(fp, _)| *fp)
            .collect();
        for fp in gone {
            self.resolve(fp, ResolvedBy::Reconciliation, now, out);
        }
    }

    pub(super) fn expire_alerts(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let expired: Vec<Fingerprint> = self
            .state
            .alerts
            .iter()
            .filter(|(_, r)| {
                r.alert.source == AlertSource::Prometheus
                    && r.alert.ends_at.is_some_and(|e| e <= now)
            })
            .map(|(fp, _)| *fp)
            .collect();
        for fp in expired {
            self.resolve(fp, ResolvedBy::Expired, now, out);
        }
    }
}

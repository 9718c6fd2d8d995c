//! What the limits turned away during one step, told once per step: one
//! `Decision::AlertLimit` per source and one `Decision::BlockLimit`, with counts and
//! the first names.

use stanch_api::alerts::AlertSource;

use crate::config::AlertPolicy;
use crate::decision::Decision;

/// What the alert limit turned away during one step's input, reported when the input
/// is done as one [`Decision::AlertLimit`] per source.
#[derive(Debug, Clone, Default)]
pub(super) struct Overflow {
    /// [`Decision::AlertLimit`]s, at most one per source, and at most one
    /// [`Decision::BlockLimit`].
    limits: Vec<Decision>,
    /// Set once a search for an unmapped alert to drop found none, so that the rest
    /// of a full step need not search again; cleared when one is taken in.
    pub(super) none_unmapped: bool,
}

/// How the alert limit treated an alert.
#[derive(Debug, Clone, Copy)]
pub(super) enum Overflowed {
    /// A new alert, not taken.
    Refused,
    /// An unmapped alert, dropped for a new mapped one.
    Displaced,
}

impl Overflow {
    pub(super) fn record(
        &mut self,
        source: AlertSource,
        policy: &AlertPolicy,
        alertname: Option<&str>,
        how: Overflowed,
    ) {
        let slot = self.slot(
            |d| matches!(d, Decision::AlertLimit { source: s, .. } if *s == source),
            || Decision::AlertLimit {
                source,
                limit: policy.max_active,
                max_bytes: policy.max_bytes,
                refused: 0,
                displaced: 0,
                alertnames: Vec::new(),
            },
        );
        let Decision::AlertLimit {
            refused,
            displaced,
            alertnames,
            ..
        } = slot
        else {
            unreachable!("found as an alert-limit decision")
        };
        match how {
            Overflowed::Refused => *refused += 1,
            Overflowed::Displaced => *displaced += 1,
        }
        if let Some(name) = alertname {
            keep_name(alertnames, name);
        }
    }

    /// Counts a block refused (`refused`) or displaced at the block limit.
    pub(super) fn record_block(&mut self, limit: usize, endpoint: &str, refused: bool) {
        let slot = self.slot(
            |d| matches!(d, Decision::BlockLimit { .. }),
            || Decision::BlockLimit {
                limit,
                refused: 0,
                displaced: 0,
                endpoints: Vec::new(),
            },
        );
        let Decision::BlockLimit {
            refused: r,
            displaced,
            endpoints,
            ..
        } = slot
        else {
            unreachable!("found as a block-limit decision")
        };
        if refused {
            *r += 1;
            keep_name(endpoints, endpoint);
        } else {
            *displaced += 1;
        }
    }

    /// The step's decision that `is` finds, added as `new` makes it if there is none.
    pub(super) fn slot(
        &mut self,
        is: impl Fn(&Decision) -> bool,
        new: impl FnOnce() -> Decision,
    ) -> &mut Decision {
        let at = match self.limits.iter().position(is) {
            Some(at) => at,
            None => {
                self.limits.push(new());
                self.limits.len() - 1
            }
        };
        &mut self.limits[at]
    }

    /// The step's decisions, and a clean slate for the next step.
    pub(super) fn take(&mut self) -> Vec<Decision> {
        self.none_unmapped = false;
        std::mem::take(&mut self.limits)
    }
}

/// Adds `name` to `names` unless it is there or [`Decision::NAMES_KEPT`] are.
fn keep_name(names: &mut Vec<String>, name: &str) {
    if names.len() < Decision::NAMES_KEPT && !names.iter().any(|n| n == name) {
        names.push(name.to_owned());
    }
}

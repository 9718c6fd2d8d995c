//! `ladder.failback`: how traffic returns when a model steps down, and what a valid
//! one is.

use serde::{Deserialize, Serialize};
use stanch_api::HumanDuration;

use super::MAX_POLICY_DURATION;

/// Gradual fail-back: a step down from failover or degraded returns the traffic in
/// steps, each held for `hold` and then gated on the conditions staying clear and on
/// the gateways' outcomes where the traffic returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailbackPolicy {
    /// The percentage of the traffic back at each step, rising to 100. `[100]`
    /// returns it all at once.
    pub steps: Vec<u8>,
    /// How long each step is held before its gate is judged.
    pub hold: HumanDuration,
    /// The most of the outcomes where the traffic returns that may fail during a step
    /// (0 to 1); above it the fail-back is aborted.
    pub max_error_rate: f64,
    /// The outcomes a step needs to be judged by them.
    pub min_samples: u64,
    /// How long a step waits for `min_samples` before moving on the conditions alone.
    pub max_wait: HumanDuration,
}

impl Default for FailbackPolicy {
    fn default() -> Self {
        FailbackPolicy {
            steps: vec![100],
            hold: HumanDuration::secs(30),
            max_error_rate: 0.05,
            min_samples: 20,
            max_wait: HumanDuration::secs(120),
        }
    }
}

impl FailbackPolicy {
    /// Whether a step down returns the traffic in more than one step.
    pub fn gradual(&self) -> bool {
        self.steps.len() > 1
    }
}

/// The problems of `ladder.failback`: steps that rise to 100, a gate that can pass.
pub(super) fn failback_problems(f: &FailbackPolicy, problem: &mut impl FnMut(String, String)) {
    let at = "ladder.failback";
    if f.steps.last() != Some(&100) {
        problem(
            format!("{at}.steps"),
            "must end at 100 (all of the traffic back)".into(),
        );
    }
    for (i, pair) in f.steps.windows(2).enumerate() {
        if pair[0] == 0 || pair[0] >= pair[1] {
            problem(
                format!("{at}.steps[{i}]"),
                format!(
                    "{} must be above 0 and below the next step ({})",
                    pair[0], pair[1]
                ),
            );
        }
    }
    if f.hold.0.is_zero() || f.hold > MAX_POLICY_DURATION {
        problem(
            format!("{at}.hold"),
            format!("must be longer than 0s and at most {MAX_POLICY_DURATION}"),
        );
    }
    if f.max_wait < f.hold || f.max_wait > MAX_POLICY_DURATION {
        problem(
            format!("{at}.max_wait"),
            format!("must be at least the hold and at most {MAX_POLICY_DURATION}"),
        );
    }
    if !(0.0..=1.0).contains(&f.max_error_rate) {
        problem(
            format!("{at}.max_error_rate"),
            "must be between 0 and 1".into(),
        );
    }
}

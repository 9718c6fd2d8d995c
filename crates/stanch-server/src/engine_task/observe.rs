//! What the task tells of its decisions: the metrics, and the log lines an operator
//! reads.

use stanch_core::Decision;
use stanch_core::engine::ReportRefusals;
use tokio::time::Instant;
use tracing::{info, warn};

use super::EngineTask;
use crate::metrics::{ActionLabel, KindLabel, RejectLabels, TransitionLabels};

impl EngineTask {
    /// Counts what the engine left out of a report, and says so at most once a minute.
    pub(super) fn count_refused(&mut self, refused: &ReportRefusals) {
        if refused.total() == 0 {
            return;
        }
        for (kind, n) in refused.by_reason() {
            if n > 0 {
                self.metrics
                    .reports_refused
                    .get_or_create(&KindLabel { kind })
                    .inc_by(n as u64);
            }
        }
        if let Some(held) = self.reports_refused_said.ready(Instant::now()) {
            warn!(
                unknown_model = refused.unknown_model,
                unknown_endpoint = refused.unknown_endpoint,
                limit = refused.limit,
                held_back = held,
                "report entries not counted: models not managed here, endpoints outside the configured pools, or new endpoints beyond blocking.fleet.max_endpoints"
            );
        }
    }

    pub(super) fn update_metrics(&mut self, decisions: &[Decision]) {
        let m = &self.metrics;
        let s = self.engine.state();
        for d in decisions {
            m.decisions
                .get_or_create(&KindLabel { kind: d.kind() })
                .inc();
            match d {
                Decision::Transition {
                    model, from, to, ..
                } => {
                    let direction = if to > from { "up" } else { "down" };
                    m.transitions
                        .get_or_create(&TransitionLabels {
                            model: model.into(),
                            direction,
                        })
                        .inc();
                    info!(model = %model, from = %from, to = %to, decision = %d, "ladder moved");
                }
                Decision::Blocked { .. } => {
                    m.blocks.inc();
                    info!(decision = %d, "endpoint blocked");
                }
                Decision::AlertActive {
                    unmapped: Some(_), ..
                } => {
                    m.alerts_unmapped.inc();
                }
                Decision::Override { action, .. } => {
                    m.overrides
                        .get_or_create(&ActionLabel {
                            action: action.as_str().into(),
                        })
                        .inc();
                    info!(decision = %d, "override applied");
                }
                Decision::SharesChanged { model, .. } => {
                    info!(model = %model, decision = %d, "shares moved");
                }
                Decision::FailbackStep { model, .. } => {
                    info!(model = %model, decision = %d, "failing back");
                }
                Decision::FailbackAborted { model, .. } => {
                    warn!(model = %model, decision = %d, "fail-back aborted");
                }
                Decision::FlapPinned { .. } => warn!(decision = %d, "flap guard engaged"),
                Decision::AlertLimit {
                    source, refused, ..
                } => {
                    m.alerts_rejected
                        .get_or_create(&RejectLabels {
                            source: source.as_str(),
                            reason: "limit",
                        })
                        .inc_by(*refused as u64);
                    warn!(decision = %d, "alert limit reached (alerts.max_active or alerts.max_bytes)");
                }
                Decision::BlockLimit { refused, .. } => {
                    m.blocks_refused
                        .get_or_create(&KindLabel { kind: "limit" })
                        .inc_by(*refused as u64);
                    if let Some(held) = self.block_limit_said.ready(Instant::now()) {
                        warn!(decision = %d, held_back = held, "block limit reached (blocking.max_blocks)");
                    }
                }
                _ => {}
            }
        }
        m.set_state(s);
    }
}

//! Endpoint blocks: taken in within `blocking.max_blocks`, and ended when their time
//! is up or their alert resolves.

use stanch_api::{Fingerprint, Timestamp};

use super::Engine;
use crate::blocks::{self, NewBlock};
use crate::decision::Decision;
use crate::mapping::Condition;
use crate::state::{BlockKey, BlockSource};

impl Engine {
    /// Makes a block within `blocking.max_blocks` (see [`blocks::block`]), counting
    /// what the limit refused or displaced. True when the block is in place.
    pub(super) fn block(&mut self, new: NewBlock, now: Timestamp, out: &mut Vec<Decision>) -> bool {
        let endpoint = new.key.endpoint.clone();
        let limit = self.config.blocking.max_blocks;
        match blocks::block(&mut self.state, &self.config.blocking, new, now, out) {
            blocks::Made::Blocked => true,
            blocks::Made::Displaced => {
                self.overflow.record_block(limit, &endpoint, false);
                true
            }
            blocks::Made::Refused => {
                self.overflow.record_block(limit, &endpoint, true);
                false
            }
        }
    }

    // Size: expired blocks ended (or extended while their alert fires), then the
    // alerts' pending blocks applied: one pass, in that order.
    pub(super) fn evaluate_blocks(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let expired: Vec<BlockKey> = self
            .state
            .blocks
            .iter()
            .filter(|(_, b)| b.until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            let Some(record) = self.state.blocks.remove(&key) else {
                continue;
            };
            out.push(Decision::Unblocked {
                endpoint: key.endpoint.clone(),
                model: key.model.clone(),
                why: "block time ended".to_owned(),
            });
            let BlockSource::Alert(fp) = record.source else {
                continue;
            };
            let still_firing = self.state.alerts.get(&fp).is_some_and(|r| {
                matches!(&r.condition, Some(Condition::BlockEndpoint { endpoint, model })
                    if *endpoint == key.endpoint && *model == key.model)
            });
            if !still_firing {
                continue;
            }
            let refusal = if blocks::only_endpoint(&self.config, &key) {
                Some("it is the only endpoint of its pool; not extending the block".to_owned())
            } else {
                self.frozen(key.model.as_deref())
                    .map(|why| format!("frozen ({why})"))
            };
            match refusal {
                Some(why) => out.push(Decision::BlockSkipped {
                    endpoint: key.endpoint.clone(),
                    model: key.model.clone(),
                    why,
                }),
                None => {
                    let reason = format!("{} still failing; extended", key.endpoint);
                    let new = NewBlock {
                        key,
                        reason,
                        source: record.source,
                        fixed: None,
                    };
                    self.block(new, now, out);
                }
            }
        }
        let pending: Vec<(Fingerprint, BlockKey, String)> = self
            .state
            .alerts
            .iter()
            .filter(|(_, r)| !r.block_applied)
            .filter_map(|(fp, r)| match &r.condition {
                Some(c @ Condition::BlockEndpoint { endpoint, model }) => Some((
                    *fp,
                    BlockKey {
                        endpoint: endpoint.clone(),
                        model: model.clone(),
                    },
                    format!("{} ({c})", r.alertname().unwrap_or("alert")),
                )),
                _ => None,
            })
            .collect();
        for (fp, key, reason) in pending {
            if self.frozen(key.model.as_deref()).is_some() {
                // Applied once the freeze ends, if the alert is still firing.
                continue;
            }
            if let Some(record) = self.state.alerts.get_mut(&fp) {
                record.block_applied = true;
            }
            if let Some(pattern) = blocks::never_block(&self.config.blocking, &key.endpoint) {
                out.push(Decision::BlockSkipped {
                    endpoint: key.endpoint,
                    model: key.model,
                    why: format!("matches never-block pattern {pattern:?}"),
                });
            } else if !self.state.blocks.contains_key(&key) {
                let new = NewBlock {
                    key,
                    reason,
                    source: BlockSource::Alert(fp),
                    fixed: None,
                };
                self.block(new, now, out);
            }
        }
    }
}

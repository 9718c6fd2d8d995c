//! Endpoint soft-blocks: TTL with deterministic jitter, backoff for repeat offenders,
//! never-block patterns and the single-endpoint guard.

use std::time::Duration;

use stanch_api::hash::Fnv64;
use stanch_api::routes::MAX_BLOCK_REASON_CHARS;
use stanch_api::{HumanDuration, Timestamp};

use crate::config::{BlockPolicy, Config};
use crate::decision::Decision;
use crate::state::{BlockKey, BlockRecord, BlockSource, EngineState, Strikes};

pub use stanch_api::glob::matches as glob_match;

/// `d` spread by up to ±`fraction`, pseudo-randomly but deterministically from the
/// key, the strike and the time, so that replays decide the same.
pub(crate) fn jittered(
    d: Duration,
    policy: &BlockPolicy,
    key: &BlockKey,
    strikes: u32,
    now: Timestamp,
) -> Duration {
    let mut h = Fnv64::default();
    h.write(&policy.seed.to_le_bytes());
    h.write(key.endpoint.as_bytes());
    h.write(&[0xff]);
    h.write(key.model.as_deref().unwrap_or("").as_bytes());
    h.write(&strikes.to_le_bytes());
    h.write(&now.as_millis().to_le_bytes());
    let spread = stanch_api::jitter::spread(d, policy.jitter, h.finish());
    // Whole milliseconds, as times are kept.
    Duration::from_millis(spread.as_secs_f64().mul_add(1000.0, 0.5) as u64)
}

/// The never-block pattern `endpoint` matches, if one does.
pub(crate) fn never_block<'p>(policy: &'p BlockPolicy, endpoint: &str) -> Option<&'p str> {
    policy
        .never_block
        .iter()
        .map(String::as_str)
        .find(|p| glob_match(p, endpoint))
}

/// True when the endpoint is the only one of a pool it serves, so blocking it longer
/// leaves that pool nowhere to go.
pub(crate) fn only_endpoint(config: &Config, key: &BlockKey) -> bool {
    config
        .models
        .iter()
        .filter(|(name, _)| key.model.as_ref().is_none_or(|m| m == *name))
        .flat_map(|(_, m)| &m.pools)
        .any(|p| p.endpoints().len() == 1 && p.endpoints()[0] == key.endpoint)
}

/// A block to make.
pub(crate) struct NewBlock {
    /// What to block.
    pub key: BlockKey,
    /// Why.
    pub reason: String,
    /// Who asked.
    pub source: BlockSource,
    /// An exact length (an operator's), instead of the policy's with backoff and jitter.
    pub fixed: Option<Duration>,
}

/// What [`block`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Made {
    /// The block is in place.
    Blocked,
    /// The block is in place, in the place of a less trusted one (at `max_blocks`).
    Displaced,
    /// At `max_blocks`, with no block of a lower kind to give way: nothing changed.
    Refused,
}

/// How much a block's source is trusted: at the limit a block gives way only to one
/// from a more trusted source. Reports can come from any holder of a reports token;
/// alerts come from the monitoring pipeline; operators from the admin token.
fn rank(source: &BlockSource) -> u8 {
    match source {
        BlockSource::Fleet => 0,
        BlockSource::Alert(_) => 1,
        BlockSource::Operator => 2,
    }
}

/// Makes a block, with backoff from the key's recent strikes and (unless its length
/// is fixed) jitter. A new key at `policy.max_blocks` takes the place of the least
/// trusted block that ends soonest, if that is less trusted than it, or is refused.
pub(crate) fn block(
    state: &mut EngineState,
    policy: &BlockPolicy,
    new: NewBlock,
    now: Timestamp,
    out: &mut Vec<Decision>,
) -> Made {
    let NewBlock {
        key,
        reason,
        source,
        fixed,
    } = new;
    // Reasons carry text from outside (alert names, operators' words): the table
    // holds them printable and bounded, so its size is bounded by its block count.
    let reason = stanch_api::text::printable(&reason, MAX_BLOCK_REASON_CHARS);
    let mut made = Made::Blocked;
    if !state.blocks.contains_key(&key) && state.blocks.len() >= policy.max_blocks {
        let own = rank(&source);
        let victim = state
            .blocks
            .iter()
            .filter(|(_, b)| rank(&b.source) < own)
            .min_by_key(|(k, b)| (rank(&b.source), b.until, *k))
            .map(|(k, _)| k.clone());
        let Some(victim) = victim else {
            return Made::Refused;
        };
        state.blocks.remove(&victim);
        out.push(Decision::Unblocked {
            endpoint: victim.endpoint.clone(),
            model: victim.model.clone(),
            why: format!(
                "gave way at the block limit ({}) to {key}, blocked by a more trusted source",
                policy.max_blocks
            ),
        });
        made = Made::Displaced;
    }
    let strikes = match state.strikes.get(&key) {
        Some(s) if now.since(s.last) <= policy.backoff.reset_after.0 => s.count.saturating_add(1),
        _ => 1,
    };
    state.strikes.insert(
        key.clone(),
        Strikes {
            count: strikes,
            last: now,
        },
    );
    let ttl = fixed.unwrap_or_else(|| {
        jittered(
            policy.backoff.scaled(policy.ttl.0, strikes - 1),
            policy,
            &key,
            strikes,
            now,
        )
    });
    let until = now + ttl;
    out.push(Decision::Blocked {
        endpoint: key.endpoint.clone(),
        model: key.model.clone(),
        until,
        ttl: HumanDuration(ttl),
        strikes,
        reason: reason.clone(),
    });
    state.blocks.insert(
        key,
        BlockRecord {
            until,
            since: now,
            reason,
            strikes,
            source,
        },
    );
    made
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_fraction_and_is_repeatable() {
        let policy = BlockPolicy {
            jitter: 0.1,
            ..BlockPolicy::default()
        };
        let base = Duration::from_secs(300);
        let key = BlockKey {
            endpoint: "e".into(),
            model: None,
        };
        let mut distinct = std::collections::BTreeSet::new();
        for t in 0..200 {
            let d = jittered(base, &policy, &key, 1, Timestamp::from_millis(t * 7919));
            assert!(
                d >= Duration::from_secs(270) && d <= Duration::from_secs(330),
                "{d:?}"
            );
            assert_eq!(
                d,
                jittered(base, &policy, &key, 1, Timestamp::from_millis(t * 7919))
            );
            distinct.insert(d);
        }
        assert!(distinct.len() > 100, "jitter spreads: {}", distinct.len());
    }
}

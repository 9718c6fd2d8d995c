//! Choosing an endpoint: power of two choices on the cost, blocked ones last.

use std::time::Duration;

use tokio::time::Instant;

use super::cost::Look;
use super::{Endpoint, Kind};

std::thread_local! {
    /// Each thread's generator, seeded at random: replicas and threads draw different
    /// jitter, and no core waits for another's cache line to draw a number.
    static RANDOM: std::cell::Cell<u64> = std::cell::Cell::new({
        use std::hash::{BuildHasher, Hasher};
        // Never zero, which xorshift would keep forever.
        std::collections::hash_map::RandomState::new().build_hasher().finish() | 1
    });
}

/// A fast, non-cryptographic random number (xorshift), for choices and jitter.
pub fn next_random() -> u64 {
    RANDOM.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}

/// Picks among `candidates` (not yet tried for this request) for a request of `kind`;
/// `table_blocked` gives the time left on the route table's block of an endpoint.
/// Returns the endpoint and whether every candidate was blocked (so a blocked one was
/// used anyway).
pub fn choose<'a>(
    candidates: &[&'a Endpoint],
    table_blocked: impl Fn(&Endpoint) -> Option<Duration>,
    kind: Kind,
    now: Instant,
    slow_start: Duration,
) -> Option<(&'a Endpoint, bool)> {
    let open: Vec<(&Endpoint, Look)> = candidates
        .iter()
        .copied()
        .filter(|e| table_blocked(e).is_none())
        .map(|e| (e, e.look(now)))
        .filter(|(_, look)| !look.blocked && !look.suspect_busy)
        .collect();
    if open.is_empty() {
        // Blocked is lowest priority, not gone: the block ending soonest, then the best
        // success rate, is the most likely to be alive.
        let best = candidates.iter().copied().min_by(|a, b| {
            // Whichever block, this gateway's or the table's, lasts longer.
            let end = |e: &Endpoint| {
                let local = e
                    .blocked(now)
                    .map_or(Duration::ZERO, |u| u.duration_since(now));
                local.max(table_blocked(e).unwrap_or_default())
            };
            end(a)
                .cmp(&end(b))
                .then(b.success_rate().total_cmp(&a.success_rate()))
        })?;
        return Some((best, true));
    }
    if open.len() == 1 {
        return Some((open[0].0, false));
    }
    let i = (next_random() % open.len() as u64) as usize;
    let mut j = (next_random() % (open.len() as u64 - 1)) as usize;
    if j >= i {
        j += 1;
    }
    let ((a, look_a), (b, look_b)) = (&open[i], &open[j]);
    let (est_a, est_b) = (look_a.estimate(kind, now), look_b.estimate(kind, now));
    let cost_a = a.score(look_a, kind, est_b, now, slow_start);
    let cost_b = b.score(look_b, kind, est_a, now, slow_start);
    let pick = if cost_a <= cost_b { a } else { b };
    Some((pick, false))
}

//! Reading a request body whole, within a size, a deadline and a memory budget.
//!
//! A body that stalls must not hold a connection, or its bytes, for minutes. The
//! deadline works as Apache's `mod_reqtimeout` (`body=10,MinRate=65536`): a body has
//! [`BodyLimits::timeout`] to arrive, and each [`BodyLimits::min_rate`] bytes received
//! extend that by a second, so a large body sent at a fair rate is read while a trickle
//! is cut off. The bytes of bodies still arriving (held across a wait for more) count
//! against one [`BodyBudget`] per server; a body that would take it past its size is
//! refused as "busy", so a thousand slow clients cannot fill the memory. A body that
//! comes whole with its first read (most do) is never counted and costs no shared
//! write.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::timer::timeout_at;

/// How a body must arrive.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// The most bytes a body may have.
    pub max_bytes: usize,
    /// The time a body has to arrive, before any extension for bytes received.
    pub timeout: Duration,
    /// Each this many bytes received extend the deadline by a second; 0 extends
    /// nothing.
    pub min_rate: u64,
}

impl Default for BodyLimits {
    fn default() -> Self {
        BodyLimits {
            max_bytes: 1024 * 1024,
            timeout: Duration::from_secs(10),
            min_rate: 64 * 1024,
        }
    }
}

impl BodyLimits {
    /// The deadline for a body that started at `start` and has `received` bytes.
    fn deadline(&self, start: Instant, received: usize) -> Instant {
        let extension = match self.min_rate {
            0 => Duration::ZERO,
            rate => Duration::from_secs(received as u64 / rate),
        };
        start + self.timeout + extension
    }
}

/// The bytes that bodies still arriving may hold together, shared by a server's
/// connections. Clones share it.
#[derive(Debug, Clone)]
pub struct BodyBudget(Arc<Budget>);

#[derive(Debug)]
struct Budget {
    capacity: usize,
    held: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `capacity` bytes.
    pub fn new(capacity: usize) -> BodyBudget {
        BodyBudget(Arc::new(Budget {
            capacity,
            held: AtomicUsize::new(0),
        }))
    }

    /// The bytes held now, for metrics and tests.
    pub fn held(&self) -> usize {
        self.0.held.load(Ordering::Relaxed)
    }

    /// Takes `n` more bytes, or refuses if that would pass the capacity.
    fn take(&self, n: usize) -> bool {
        self.0
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(n).filter(|&t| t <= self.0.capacity)
            })
            .is_ok()
    }
}

/// Bytes taken from a [`BodyBudget`] by something that outlives a borrow of it (a
/// body read message by message), given back when dropped or released.
#[derive(Debug)]
pub struct Hold {
    budget: BodyBudget,
    bytes: usize,
}

impl Hold {
    /// Holds nothing yet.
    pub fn new(budget: &BodyBudget) -> Hold {
        Hold {
            budget: budget.clone(),
            bytes: 0,
        }
    }

    /// Holds `total` bytes in all, taking the difference; false (holding what it held)
    /// if that would pass the budget's capacity.
    pub fn grow_to(&mut self, total: usize) -> bool {
        if total <= self.bytes {
            return true;
        }
        if !self.budget.take(total - self.bytes) {
            return false;
        }
        self.bytes = total;
        true
    }

    /// Gives back everything held.
    pub fn release(&mut self) {
        if self.bytes > 0 {
            self.budget.0.held.fetch_sub(self.bytes, Ordering::AcqRel);
            self.bytes = 0;
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError<E> {
    /// Larger than [`BodyLimits::max_bytes`] (413).
    #[error("the body is larger than {0} bytes")]
    TooLarge(usize),
    /// Not whole by its deadline (408).
    #[error("the body did not arrive in time ({0:?} at the least)")]
    TimedOut(Duration),
    /// The server's budget for bodies still arriving is spent (503, retry).
    #[error("too many request bodies are arriving at once")]
    Busy,
    /// The connection broke, or the body ended before its declared length (400).
    #[error("the body could not be read")]
    Broken(#[source] E),
}

/// Reads `body` whole within `limits`, its bytes counted against `budget` (if any)
/// while it waits for more. A body that arrives as one frame, as a small one does, is
/// passed on as it came: no buffer list, no copy.
pub async fn read_whole<B>(
    mut body: B,
    limits: &BodyLimits,
    budget: Option<&BodyBudget>,
) -> Result<Bytes, BodyError<B::Error>>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    if body.size_hint().lower() > limits.max_bytes as u64 {
        return Err(BodyError::TooLarge(limits.max_bytes));
    }
    let start = Instant::now();
    let mut held = budget.map(Hold::new);
    // The first frame as it came; a second starts a copy of them all.
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    let mut len = 0;
    loop {
        if let Some(held) = held.as_mut().filter(|_| len > 0 && !body.is_end_stream())
            && !held.grow_to(len)
        {
            return Err(BodyError::Busy);
        }
        let deadline = limits.deadline(start, len);
        let frame = match timeout_at(deadline, body.frame()).await {
            Ok(Some(frame)) => frame.map_err(BodyError::Broken)?,
            Ok(None) => break,
            Err(_) => return Err(BodyError::TimedOut(limits.timeout)),
        };
        let Ok(data) = frame.into_data() else {
            // Trailers: nothing a caller or the server uses.
            continue;
        };
        len += data.len();
        if len > limits.max_bytes {
            return Err(BodyError::TooLarge(limits.max_bytes));
        }
        if len == data.len() {
            first = Some(data);
            continue;
        }
        if let Some(first) = first.take() {
            joined.reserve(len);
            joined.extend_from_slice(&first);
        }
        joined.extend_from_slice(&data);
    }
    Ok(first.unwrap_or_else(|| joined.freeze()))
}

#[cfg(test)]
mod tests;

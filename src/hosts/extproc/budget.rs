//! A process-wide budget of request-body bytes buffered by ext_proc streams. Each stream holds
//! its whole body until routing (ARCHITECTURE.md §2), so without a global bound a burst of large bodies
//! grows memory with the number of streams times `max_body_bytes`. A stream takes a
//! [`BodyLease`] from the budget as its body grows; the lease gives its bytes back when dropped,
//! so every way a stream can end (routed, rejected, Envoy or the client gone) returns them.
//! Every byte it holds is also charged to the process's memory account
//! (`crate::transport::memory_account`, kind `body`), so bodies and what the HTTP/2 layer holds share one
//! limit; a body is refused when either is full.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus::IntGauge;

use crate::transport::memory_account::{Kind, MemoryAccount};

/// Default of `--max-buffered-body-bytes`: 1 GiB over all streams.
pub const DEFAULT_BUDGET_BYTES: usize = 1 << 30;

#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
    /// Mirrors `used` for Prometheus (`kvpick_body_bytes_buffered`).
    gauge: IntGauge,
    account: Arc<MemoryAccount>,
}

impl BodyBudget {
    /// A budget of `limit` bytes whose use is reported on `gauge` and charged to `account`.
    pub fn new(limit: usize, gauge: IntGauge, account: Arc<MemoryAccount>) -> Arc<Self> {
        Arc::new(BodyBudget {
            limit,
            used: AtomicUsize::new(0),
            gauge,
            account,
        })
    }

    /// A budget reporting to a gauge nobody exports (tests, fuzzing).
    // A constant, valid metric name: `new` cannot fail here.
    #[allow(clippy::expect_used)]
    pub fn unmetered(limit: usize) -> Arc<Self> {
        Self::new(
            limit,
            IntGauge::new("kvpick_body_bytes_buffered", "unexported").expect("valid name"),
            MemoryAccount::unmetered(limit),
        )
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes currently held by leases.
    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// An empty lease on this budget.
    pub fn lease(self: &Arc<Self>) -> BodyLease {
        BodyLease {
            budget: Arc::clone(self),
            held: 0,
        }
    }

    fn try_take(&self, n: usize) -> bool {
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok();
        if !taken {
            return false;
        }
        if !self.account.try_charge(Kind::Body, n) {
            self.used.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        self.gauge.add(n as i64);
        true
    }

    fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        self.account.release(Kind::Body, n);
        self.gauge.sub(n as i64);
    }
}

/// Bytes one stream holds from the [`BodyBudget`]; returned on drop.
#[derive(Debug)]
pub struct BodyLease {
    budget: Arc<BodyBudget>,
    held: usize,
}

impl BodyLease {
    /// Takes `n` more bytes, or nothing (and `false`) when the budget cannot cover them.
    pub fn try_grow(&mut self, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        if self.budget.try_take(n) {
            self.held += n;
            true
        } else {
            false
        }
    }

    pub fn held(&self) -> usize {
        self.held
    }

    /// Gives back all but `n` bytes.
    pub fn keep_at_most(&mut self, n: usize) {
        if self.held > n {
            self.budget.give_back(self.held - n);
            self.held = n;
        }
    }

    /// An empty lease on the same budget.
    pub fn fresh(&self) -> BodyLease {
        self.budget.lease()
    }
}

impl Drop for BodyLease {
    fn drop(&mut self) {
        if self.held > 0 {
            self.budget.give_back(self.held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_share_the_limit_and_give_back_on_drop() {
        let budget = BodyBudget::unmetered(100);
        let mut a = budget.lease();
        let mut b = budget.lease();
        assert!(a.try_grow(60));
        assert!(!b.try_grow(41), "over the limit: nothing taken");
        assert_eq!(budget.in_use(), 60);
        assert!(b.try_grow(40));
        assert!(!a.try_grow(1));
        drop(a);
        assert_eq!(budget.in_use(), 40);
        assert!(b.try_grow(60));
        drop(b);
        assert_eq!(budget.in_use(), 0);
        assert!(!budget.lease().try_grow(usize::MAX), "no overflow");
    }

    #[test]
    fn keeping_at_most_gives_back_the_rest() {
        let budget = BodyBudget::unmetered(1000);
        let mut lease = budget.lease();
        assert!(lease.try_grow(300));
        lease.keep_at_most(500);
        assert_eq!(budget.in_use(), 300, "under the bound: all kept");
        lease.keep_at_most(100);
        assert_eq!((lease.held(), budget.in_use()), (100, 100));
        drop(lease);
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn a_body_is_refused_when_the_memory_account_is_full_though_the_budget_is_not() {
        let account = MemoryAccount::unmetered(100);
        let gauge = IntGauge::new("g", "g").unwrap();
        let budget = BodyBudget::new(1000, gauge, Arc::clone(&account));
        assert!(account.try_charge(Kind::PartialMessage, 50));
        let mut lease = budget.lease();
        assert!(lease.try_grow(50), "at the account's limit");
        assert!(!lease.try_grow(1), "one past it");
        assert_eq!((budget.in_use(), account.used_by(Kind::Body)), (50, 50));
        drop(lease);
        assert_eq!((budget.in_use(), account.used()), (0, 50));
    }
}

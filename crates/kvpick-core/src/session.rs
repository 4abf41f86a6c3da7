//! Session affinity (ARCHITECTURE.md §6): one table per partition mapping a session id to the rank that
//! holds its KV cache. Entries expire after an idle TTL that only starts when the session's last
//! in-flight request (its last lease) ends. The table never decides a pick by itself: the
//! partition consults it inside the same lock as the decision, which is also what makes concurrent
//! first requests of one session converge on one binding.

use std::collections::HashMap;
use std::time::Duration;

use std::time::Instant;

use crate::types::RankKey;

pub use crate::request::MAX_SESSION_ID_BYTES;
/// Session TTL bounds (1 s .. 1 year).
pub const MIN_SESSION_TTL: Duration = Duration::from_secs(1);
pub const MAX_SESSION_TTL: Duration = Duration::from_secs(31_536_000);

/// Hard: the bound rank is used whenever it is schedulable and allowed. Soft: the bound rank is
/// preferred unless it is over a busy threshold or much costlier than the best rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AffinityMode {
    #[default]
    Hard,
    Soft,
}

impl std::str::FromStr for AffinityMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hard" => Ok(AffinityMode::Hard),
            "soft" => Ok(AffinityMode::Soft),
            other => Err(format!(
                "expected hard or soft, got {:?}",
                crate::event::truncate(other, 32)
            )),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub mode: AffinityMode,
    pub ttl: Duration,
    pub max_entries: usize,
    /// Soft mode: the bound rank is kept while its cost is within this many blocks of the best.
    pub soft_margin_blocks: f64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            mode: AffinityMode::Hard,
            ttl: Duration::from_secs(300),
            max_entries: 65_536,
            soft_margin_blocks: 64.0,
        }
    }
}

impl SessionConfig {
    /// Validates the TTL range, naming the flag in the message.
    pub fn validate(&self) -> Result<(), String> {
        if self.ttl < MIN_SESSION_TTL || self.ttl > MAX_SESSION_TTL {
            return Err(format!(
                "--session-ttl must be between 1 and 31536000 seconds, got {}",
                self.ttl.as_secs_f64()
            ));
        }
        if self.max_entries == 0 {
            return Err("--session-max-entries must be at least 1".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Binding {
    rank: RankKey,
    leases: u32,
    /// When the last lease ended (or the binding was made); the idle clock.
    idle_since: Instant,
}

/// Why a binding was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalidation {
    /// The rank left the catalog.
    Gone,
    /// The rank is in the catalog but not schedulable.
    Unschedulable,
    /// The rank is outside the request's subset hint / allowed set.
    OutsideSubset,
    /// The rank does not have the requested LoRA adapter.
    Adapter,
    /// Soft mode: the cost function overrode the binding.
    SoftOverride,
}

impl Invalidation {
    pub fn as_str(self) -> &'static str {
        match self {
            Invalidation::Gone => "gone",
            Invalidation::Unschedulable => "unschedulable",
            Invalidation::OutsideSubset => "outside_subset",
            Invalidation::Adapter => "adapter",
            Invalidation::SoftOverride => "soft_override",
        }
    }
}

/// What happened to a request's session at selection time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionOutcome {
    /// First request (or rebound after an invalidation): bound to the pick.
    Created,
    /// The existing binding was used.
    Reused,
    /// The table is full: routed without affinity.
    TableFull,
}

/// Result of a binding lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    pub rank: Option<RankKey>,
    /// The entry had expired and was removed by this lookup.
    pub expired: bool,
}

impl SessionOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionOutcome::Created => "created",
            SessionOutcome::Reused => "reused",
            SessionOutcome::TableFull => "table_full",
        }
    }
}

#[derive(Debug, Default)]
pub struct SessionTable {
    entries: HashMap<String, Binding>,
}

impl SessionTable {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The live binding of `id`, if any; an idle entry past its TTL is removed (`expired`).
    pub fn bound_rank(&mut self, id: &str, now: Instant, ttl: Duration) -> Lookup {
        let expired = self
            .entries
            .get(id)
            .is_some_and(|b| b.leases == 0 && now.saturating_duration_since(b.idle_since) >= ttl);
        if expired {
            self.entries.remove(id);
            return Lookup {
                rank: None,
                expired: true,
            };
        }
        Lookup {
            rank: self.entries.get(id).map(|b| b.rank),
            expired: false,
        }
    }

    pub fn invalidate(&mut self, id: &str) -> Option<u32> {
        self.entries.remove(id).map(|b| b.leases)
    }

    /// Binds `id` to `rank` (replacing any binding, keeping its leases). Returns false when the
    /// table is full and `id` is not in it.
    pub fn bind(&mut self, id: &str, rank: RankKey, now: Instant, max_entries: usize) -> bool {
        if let Some(b) = self.entries.get_mut(id) {
            b.rank = rank;
            return true;
        }
        if self.entries.len() >= max_entries {
            return false;
        }
        self.entries.insert(
            id.to_string(),
            Binding {
                rank,
                leases: 0,
                idle_since: now,
            },
        );
        true
    }

    /// An in-flight request of the session starts.
    pub fn acquire(&mut self, id: &str) {
        if let Some(b) = self.entries.get_mut(id) {
            b.leases += 1;
        }
    }

    /// An in-flight request of the session ended: the idle clock starts when the last one does.
    pub fn release(&mut self, id: &str, now: Instant) {
        if let Some(b) = self.entries.get_mut(id) {
            b.leases = b.leases.saturating_sub(1);
            if b.leases == 0 {
                b.idle_since = now;
            }
        }
    }

    /// Drops idle entries past the TTL; returns how many.
    pub fn reap(&mut self, now: Instant, ttl: Duration) -> usize {
        let before = self.entries.len();
        self.entries
            .retain(|_, b| b.leases > 0 || now.saturating_duration_since(b.idle_since) < ttl);
        before - self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(w: u64) -> RankKey {
        RankKey {
            worker_id: w,
            dp_rank: 0,
        }
    }

    const TTL: Duration = Duration::from_secs(10);

    #[test]
    fn idle_ttl_starts_when_the_last_lease_ends() {
        let mut clock = Instant::now();
        let mut t = SessionTable::default();
        assert!(t.bind("s", rank(1), clock, 10));
        t.acquire("s");
        t.acquire("s");
        clock += Duration::from_secs(60);
        assert_eq!(
            t.bound_rank("s", clock, TTL).rank,
            Some(rank(1)),
            "leased: never idle"
        );
        t.release("s", clock);
        clock += Duration::from_secs(60);
        assert_eq!(t.reap(clock, TTL), 0, "one lease still held");
        t.release("s", clock);
        clock += Duration::from_millis(9_999);
        assert_eq!(t.bound_rank("s", clock, TTL).rank, Some(rank(1)));
        clock += Duration::from_millis(1);
        assert_eq!(t.reap(clock, TTL), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn expired_entries_are_gone_on_lookup_and_the_table_is_bounded() {
        let mut clock = Instant::now();
        let mut t = SessionTable::default();
        assert!(t.bind("a", rank(1), clock, 2));
        assert!(t.bind("b", rank(2), clock, 2));
        assert!(!t.bind("c", rank(3), clock, 2), "full");
        assert!(
            t.bind("a", rank(4), clock, 2),
            "rebinding an existing id is fine"
        );
        clock += TTL;
        let lookup = t.bound_rank("a", clock, TTL);
        assert_eq!(
            lookup,
            Lookup {
                rank: None,
                expired: true
            }
        );
        assert!(t.bind("c", rank(3), clock, 2), "room again");
    }

    #[test]
    fn config_ranges() {
        let mut c = SessionConfig::default();
        assert!(c.validate().is_ok());
        c.ttl = Duration::from_millis(500);
        assert!(c.validate().unwrap_err().contains("--session-ttl"));
        c.ttl = Duration::from_secs(31_536_001);
        assert!(c.validate().is_err());
        c.ttl = MAX_SESSION_TTL;
        assert!(c.validate().is_ok());
    }
}

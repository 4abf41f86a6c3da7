//! Session affinity (ARCHITECTURE.md §6): one table per partition mapping a session id to the rank that
//! holds its KV cache. Entries expire after an idle TTL that only starts when the session's last
//! in-flight request (its last lease) ends. The table never decides a pick by itself: the
//! partition consults it inside the same lock as the decision, which is also what makes concurrent
//! first requests of one session converge on one binding.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use std::time::Instant;

use crate::error::ConfigError;
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
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "hard" => Ok(AffinityMode::Hard),
            "soft" => Ok(AffinityMode::Soft),
            other => Err(ConfigError::AffinityMode(
                crate::event::truncate(other, 32).to_string(),
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
    /// Either mode: a child session's first pick goes to its parent's rank within this margin.
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
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.ttl < MIN_SESSION_TTL || self.ttl > MAX_SESSION_TTL {
            return Err(ConfigError::SessionTtl(self.ttl.as_secs_f64()));
        }
        if self.max_entries == 0 {
            return Err(ConfigError::SessionMaxEntries);
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
    /// Bumped each time the binding becomes idle; names its current place in the idle queue.
    idle_stamp: u64,
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
    /// The table was full: the least recently idle binding made room for a new session.
    Evicted,
    /// The session's final request (`x-dynamo-session-final: true`) was routed: the binding
    /// is released at once instead of idling out.
    Final,
}

impl Invalidation {
    pub fn as_str(self) -> &'static str {
        match self {
            Invalidation::Gone => "gone",
            Invalidation::Unschedulable => "unschedulable",
            Invalidation::OutsideSubset => "outside_subset",
            Invalidation::Adapter => "adapter",
            Invalidation::SoftOverride => "soft_override",
            Invalidation::Evicted => "evicted",
            Invalidation::Final => "final",
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
    /// The session's final request: routed on its binding when it had one, which is then
    /// released (here and, with shared state, for every replica).
    Released,
}

/// A child session's first pick with a bound parent rank ([`crate::facts::Fact::SessionParent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParentPick {
    /// The parent's rank was the best pick anyway (its cache already said so).
    Cheapest,
    /// The parent's rank went first though another cost less (within the soft margin).
    Preferred,
    /// The parent's rank was no candidate (busy, ejected, outside the subset) or cost too much.
    Declined,
}

impl ParentPick {
    /// Whether the child went to its parent's rank.
    pub fn followed(self) -> bool {
        self != ParentPick::Declined
    }
}

/// What installing a binding decided elsewhere (another replica) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// Later picks of the session follow it.
    Yes,
    /// The partition or the rank is not known here (it left this replica's catalog).
    UnknownRank,
    /// The table is full of sessions with requests in flight: nothing was installed, and the
    /// binding stays valid elsewhere.
    TableFull,
}

impl Installed {
    pub fn is_yes(self) -> bool {
        self == Installed::Yes
    }
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
            SessionOutcome::Released => "released",
        }
    }
}

#[derive(Debug, Default)]
pub struct SessionTable {
    entries: HashMap<String, Binding>,
    /// Bindings in the order they became idle, `(id, idle_stamp)`; an entry whose stamp no longer
    /// matches (the binding was leased again, re-idled or removed) is stale and skipped.
    idle: VecDeque<(String, u64)>,
    stamps: u64,
}

/// What [`SessionTable::bind`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Bound: `created` unless an existing binding was moved; `evicted` when an idle binding made
    /// room for it.
    Yes { created: bool, evicted: bool },
    /// The table is full of sessions with requests in flight.
    Full,
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

    /// Binds `id` to `rank` (replacing any binding, keeping its leases). When the table is full
    /// the least recently idle binding (no request in flight) makes room, so a flood of one-shot
    /// session ids cannot lock new sessions out; only a table full of sessions with requests in
    /// flight refuses ([`Bound::Full`]).
    pub fn bind(&mut self, id: &str, rank: RankKey, now: Instant, max_entries: usize) -> Bound {
        if let Some(b) = self.entries.get_mut(id) {
            b.rank = rank;
            return Bound::Yes {
                created: false,
                evicted: false,
            };
        }
        let mut evicted = false;
        if self.entries.len() >= max_entries {
            if !self.evict_oldest_idle() {
                return Bound::Full;
            }
            evicted = true;
        }
        let stamp = self.next_stamp();
        self.entries.insert(
            id.to_string(),
            Binding {
                rank,
                leases: 0,
                idle_since: now,
                idle_stamp: stamp,
            },
        );
        self.push_idle(id, stamp);
        Bound::Yes {
            created: true,
            evicted,
        }
    }

    fn next_stamp(&mut self) -> u64 {
        self.stamps = self.stamps.wrapping_add(1);
        self.stamps
    }

    fn push_idle(&mut self, id: &str, stamp: u64) {
        self.idle.push_back((id.to_string(), stamp));
        // Stale queue entries are dropped lazily; keep the queue within a constant factor of
        // the table.
        if self.idle.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.idle.retain(|(id, stamp)| {
                entries
                    .get(id)
                    .is_some_and(|b| b.leases == 0 && b.idle_stamp == *stamp)
            });
        }
    }

    /// Removes the binding that has been idle longest; false when every binding is leased.
    fn evict_oldest_idle(&mut self) -> bool {
        while let Some((id, stamp)) = self.idle.pop_front() {
            let current = self
                .entries
                .get(&id)
                .is_some_and(|b| b.leases == 0 && b.idle_stamp == stamp);
            if current {
                self.entries.remove(&id);
                return true;
            }
        }
        false
    }

    /// An in-flight request of the session starts.
    pub fn acquire(&mut self, id: &str) {
        if let Some(b) = self.entries.get_mut(id) {
            b.leases = b.leases.saturating_add(1);
        }
    }

    /// An in-flight request of the session ended: the idle clock starts when the last one does.
    pub fn release(&mut self, id: &str, now: Instant) {
        let stamp = self.stamps.wrapping_add(1);
        let Some(b) = self.entries.get_mut(id) else {
            return;
        };
        b.leases = b.leases.saturating_sub(1);
        if b.leases == 0 {
            b.idle_since = now;
            b.idle_stamp = stamp;
            self.stamps = stamp;
            self.push_idle(id, stamp);
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
        assert_eq!(
            t.bind("s", rank(1), clock, 10),
            Bound::Yes {
                created: true,
                evicted: false
            }
        );
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
        let yes = Bound::Yes {
            created: true,
            evicted: false,
        };
        let moved = Bound::Yes {
            created: false,
            evicted: false,
        };
        assert_eq!(t.bind("a", rank(1), clock, 2), yes);
        assert_eq!(t.bind("b", rank(2), clock, 2), yes);
        t.acquire("a");
        t.acquire("b");
        assert_eq!(
            t.bind("c", rank(3), clock, 2),
            Bound::Full,
            "full of leased sessions"
        );
        assert_eq!(
            t.bind("a", rank(4), clock, 2),
            moved,
            "rebinding an existing id is fine (and creates nothing)"
        );
        t.release("a", clock);
        t.release("b", clock);
        clock += TTL;
        let lookup = t.bound_rank("a", clock, TTL);
        assert_eq!(
            lookup,
            Lookup {
                rank: None,
                expired: true
            }
        );
        assert_eq!(t.bind("c", rank(3), clock, 2), yes, "room again");
    }

    /// A flood of one-shot sessions: the table stays bounded, new sessions still bind (the
    /// longest-idle ones make room), and leased sessions are never evicted.
    #[test]
    fn a_full_table_evicts_the_longest_idle_binding() {
        let clock = Instant::now();
        let mut t = SessionTable::default();
        t.bind("busy", rank(9), clock, 100);
        t.acquire("busy");
        for i in 0..1_000 {
            let bound = t.bind(&format!("flood-{i}"), rank(1), clock, 100);
            assert!(matches!(bound, Bound::Yes { .. }), "{i}: {bound:?}");
        }
        assert_eq!(t.len(), 100);
        assert_eq!(
            t.bound_rank("busy", clock, TTL).rank,
            Some(rank(9)),
            "a session with a request in flight is never evicted"
        );
        assert_eq!(t.bound_rank("flood-999", clock, TTL).rank, Some(rank(1)));
        assert_eq!(
            t.bound_rank("flood-0", clock, TTL).rank,
            None,
            "oldest went first"
        );
        // A session that was just active is younger than the flood before it.
        t.acquire("flood-950");
        t.release("flood-950", clock);
        for i in 0..98 {
            t.bind(&format!("late-{i}"), rank(2), clock, 100);
        }
        assert_eq!(t.bound_rank("flood-950", clock, TTL).rank, Some(rank(1)));
        assert!(
            t.idle.len() <= 2 * t.len() + 64,
            "the idle queue stays bounded"
        );
    }

    #[test]
    fn config_ranges() {
        let mut c = SessionConfig::default();
        assert!(c.validate().is_ok());
        c.ttl = Duration::from_millis(500);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--session-ttl"));
        c.ttl = Duration::from_secs(31_536_001);
        assert!(c.validate().is_err());
        c.ttl = MAX_SESSION_TTL;
        assert!(c.validate().is_ok());
    }
}

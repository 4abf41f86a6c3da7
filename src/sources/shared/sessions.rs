//! Session bindings on Redis. One key per `(partition, session id)` holds the bound rank
//! (`worker_id:dp_rank`; worker ids are stable hashes of namespace/name, the same on every
//! replica) with the session TTL.
//!
//! - A replica with a local binding routes on it: no Redis call before the pick.
//! - A replica without one looks the session up once (bounded by the timeout, skipped while Redis
//!   is down) and installs what it finds, so the pick follows it.
//! - After the pick, one compare-and-set ([`CLAIM_SCRIPT`]) runs off the request path: a new
//!   binding is written only if the key is absent (or still holds the binding it replaced);
//!   otherwise the binding already there wins and is installed locally for the next requests. A
//!   reused binding refreshes the key's TTL the same way, which also rewrites it after Redis lost
//!   it (reconciliation after an outage or a Redis restart).
//! - A session's final request (`x-dynamo-session-final: true`) deletes the key after its pick,
//!   so no replica follows the released binding.
//!
//! Must not: decide a pick (the core does, from the installed binding) or wait on Redis for
//! anything but the one lookup.

use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Instant;

use tokio::sync::mpsc;

use super::{CallError, SharedState};
use crate::selection::session::Installed;
use crate::selection::{
    PartitionKey, RankKey, Selection, SelectionCore, SessionLookupJob, SessionOutcome, SharedHooks,
};

/// Writes drained from the queue per round (sent concurrently over the multiplexed connection).
const WRITE_BATCH: usize = 256;

/// KEYS[1] = the session key; ARGV = expected (the binding this replica replaced, or ""), ours,
/// TTL in ms. Returns `{status, binding}`: 0 = was absent, written; 1 = already ours, refreshed;
/// 2 = held `expected`, replaced by ours; 3 = another replica's binding, returned unchanged.
pub const CLAIM_SCRIPT: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, cur}
end
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  if not cur then return {0, ARGV[2]} end
  return {2, ARGV[2]}
end
return {3, cur}
"#;

static CLAIM: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(CLAIM_SCRIPT));

/// A binding to write (or refresh) after a pick.
#[derive(Debug, Clone)]
pub struct SessionWrite {
    partition: PartitionKey,
    session_id: String,
    /// The binding this pick replaced (it was invalid here); written over only if Redis still
    /// holds it.
    expected: Option<RankKey>,
    ours: RankKey,
    /// The pick reused its binding (a refresh), rather than making a new one.
    reused: bool,
    /// The session's final request: the key is deleted.
    release: bool,
}

/// Redis key of a session binding. The partition is hashed (model names may hold any byte),
/// the session id kept readable.
pub fn session_key(prefix: &str, partition: &PartitionKey, session_id: &str) -> String {
    let scope = xxhash_rust::xxh3::xxh3_64(
        format!("{}\0{}", partition.model, partition.routing_group).as_bytes(),
    );
    format!("{prefix}:session:{scope:016x}:{session_id}")
}

pub fn encode_rank(rank: RankKey) -> String {
    format!("{}:{}", rank.worker_id, rank.dp_rank)
}

/// `worker_id:dp_rank`; anything else (another program's key) is not a binding.
pub fn decode_rank(text: &str) -> Option<RankKey> {
    let (worker, rank) = text.split_once(':')?;
    Some(RankKey {
        worker_id: worker.parse().ok()?,
        dp_rank: rank.parse().ok()?,
    })
}

impl SharedState {
    fn key_of(&self, partition: &PartitionKey, session_id: &str) -> String {
        session_key(&self.config.prefix, partition, session_id)
    }

    /// The binding another replica made for the session, if Redis answers in time.
    pub async fn lookup(&self, job: &SessionLookupJob) -> Option<RankKey> {
        let key = self.key_of(&job.partition, &job.session_id);
        let mut conn = self.connection();
        let started = Instant::now();
        let found: Result<Option<String>, CallError> = self
            .call(
                "session_lookup",
                redis::cmd("GET").arg(&key).query_async(&mut conn),
            )
            .await;
        self.metrics
            .lookup_seconds
            .observe(started.elapsed().as_secs_f64());
        let event = |name: &str| self.metrics.sessions.with_label_values(&[name]).inc();
        match found {
            Ok(Some(text)) => match decode_rank(&text) {
                Some(rank) => {
                    event("remote_hit");
                    Some(rank)
                }
                None => {
                    event("remote_miss");
                    None
                }
            },
            Ok(None) => {
                event("remote_miss");
                None
            }
            Err(CallError::Timeout) => {
                self.metrics
                    .local_fallbacks
                    .with_label_values(&["timeout"])
                    .inc();
                None
            }
            Err(CallError::Failed) => {
                self.metrics
                    .local_fallbacks
                    .with_label_values(&["error"])
                    .inc();
                None
            }
        }
    }

    /// Queues the write a pick calls for: a new binding is claimed, a reused one refreshed.
    /// `before` is the session's local binding before the pick. Never blocks: a full queue drops
    /// the write (the session's next request writes again).
    pub fn after_pick(&self, selection: &Selection, session_id: &str, before: Option<RankKey>) {
        let (reused, release) = match selection.session {
            Some(SessionOutcome::Created) => (false, false),
            Some(SessionOutcome::Reused) => (true, false),
            Some(SessionOutcome::Released) => (false, true),
            _ => return,
        };
        let ours = selection.primary.key;
        let write = SessionWrite {
            partition: selection.partition.clone(),
            session_id: session_id.to_string(),
            expected: before.filter(|b| *b != ours),
            ours,
            reused,
            release,
        };
        if self.writes.try_send(write).is_err() {
            self.metrics.sessions.with_label_values(&["dropped"]).inc();
        }
    }

    /// One compare-and-set; returns `(status, binding)` ([`CLAIM_SCRIPT`]).
    pub(super) async fn claim(
        &self,
        key: &str,
        expected: Option<&str>,
        ours: &str,
    ) -> Result<(i64, String), CallError> {
        let ttl_ms = u64::try_from(self.config.session_ttl.as_millis()).unwrap_or(u64::MAX);
        let mut conn = self.connection();
        let mut invocation = CLAIM.key(key);
        invocation
            .arg(expected.unwrap_or_default())
            .arg(ours)
            .arg(ttl_ms);
        self.call("session_write", invocation.invoke_async(&mut conn))
            .await
    }

    pub(super) async fn write(&self, core: &SelectionCore, write: SessionWrite) {
        let key = self.key_of(&write.partition, &write.session_id);
        if write.release {
            let mut conn = self.connection();
            let deleted: Result<i64, CallError> = self
                .call(
                    "session_write",
                    redis::cmd("DEL").arg(&key).query_async(&mut conn),
                )
                .await;
            if deleted.is_ok() {
                self.metrics.sessions.with_label_values(&["released"]).inc();
            }
            return;
        }
        let ours = encode_rank(write.ours);
        let expected = write.expected.map(encode_rank);
        let event = |name: &str| self.metrics.sessions.with_label_values(&[name]).inc();
        match self.claim(&key, expected.as_deref(), &ours).await {
            Ok((0, _)) if write.reused => event("reconciled"),
            Ok((0 | 2, _)) => event("claimed"),
            Ok((3, theirs)) => {
                let installed = decode_rank(&theirs).map(|rank| {
                    core.install_session_binding(&write.partition, &write.session_id, rank)
                });
                match installed {
                    Some(Installed::Yes) => event("adopted"),
                    // Their binding is valid; this replica just has no room to follow it. It
                    // stays for the replicas that can (the next request here looks it up again).
                    Some(Installed::TableFull) => event("not_adopted_full"),
                    // Not a rank this replica knows (it left the catalog, or not a binding):
                    // ours replaces it, if it is still there.
                    Some(Installed::UnknownRank) | None => {
                        if matches!(self.claim(&key, Some(&theirs), &ours).await, Ok((2, _))) {
                            event("claimed");
                        }
                    }
                }
            }
            Ok(_) | Err(_) => {}
        }
    }
}

/// The selection core reaches the shared state only through [`SharedHooks`].
impl SharedHooks for SharedState {
    fn is_up(&self) -> bool {
        SharedState::is_up(self)
    }

    fn lookup_skipped_down(&self) {
        self.metrics
            .local_fallbacks
            .with_label_values(&["down"])
            .inc();
    }

    fn lookup<'a>(
        &'a self,
        job: &'a SessionLookupJob,
    ) -> futures::future::BoxFuture<'a, Option<RankKey>> {
        Box::pin(SharedState::lookup(self, job))
    }

    fn after_pick(&self, selection: &Selection, session_id: &str, before: Option<RankKey>) {
        SharedState::after_pick(self, selection, session_id, before);
    }
}

/// Drains the write queue. While Redis is down, writes are dropped (counted): every request of a
/// session queues one again, and the first that runs after the outage reconciles the key.
pub(super) async fn run_writer(
    shared: Arc<SharedState>,
    core: Arc<SelectionCore>,
    mut queue: mpsc::Receiver<SessionWrite>,
) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    loop {
        if queue.recv_many(&mut batch, WRITE_BATCH).await == 0 {
            return;
        }
        if !shared.is_up() {
            shared
                .metrics
                .sessions
                .with_label_values(&["dropped"])
                .inc_by(batch.len() as u64);
            batch.clear();
            continue;
        }
        let writes = batch.drain(..).map(|w| shared.write(&core, w));
        futures::future::join_all(writes).await;
    }
}

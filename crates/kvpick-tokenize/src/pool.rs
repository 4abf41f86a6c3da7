//! The tokenizer pool (ARCHITECTURE.md §8): one OS thread per core taking CPU-bound tokenization
//! jobs from one bounded queue, so tokenization never runs on the async reactor and never
//! competes with tokio's blocking pool.
//!
//! A request waits for its tokens: a job is never abandoned because it waited some fixed time,
//! since on a busy host (engines sharing the cores) a queue wait of tens of ms is normal and a
//! request routed without its tokens is a cache miss costing far more prefill than the wait.
//! Two bounds keep a flood from holding requests without limit:
//! - **work:** the bytes of request bodies outstanding (queued or running, `JobLimits::max_bytes`)
//!   and the number of queued jobs (`capacity`). A job that would go over either is refused at
//!   once, so the wait behind the queue is at most that much tokenization work;
//! - **progress:** a queued job is abandoned only when no worker has started or finished any job
//!   for `JobLimits::stall` since it was queued: the pool is stuck, not busy (a busy pool keeps
//!   starting and finishing jobs, however slowly its threads get the CPU).
//!
//! A job a worker has started always runs to its answer. This module owns the threads, the
//! queue and those rules only. It knows nothing about models, bodies or metrics: a job is a
//! closure with a size, its outcome a value; the outstanding bytes are reported to an observer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};

/// Queued jobs per worker thread: with ~1 ms jobs, a full queue means the pool is far behind,
/// not a short burst.
pub const QUEUE_PER_THREAD: usize = 64;

/// Why a job gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The queue held its bound of jobs or of outstanding bytes: refused without waiting.
    #[error("tokenizer queue full")]
    QueueFull,
    /// No worker started or finished any job for the stall timeout while this one was queued.
    #[error("no tokenizer thread made progress within the stall timeout")]
    Stalled,
    /// The job panicked (the worker survives it).
    #[error("tokenizer job panicked: {0}")]
    Panicked(String),
    /// The pool is shutting down.
    #[error("tokenizer pool stopped")]
    Stopped,
}

/// One job's size and the bounds it is admitted and waited under.
#[derive(Debug, Clone, Copy)]
pub struct JobLimits {
    /// The job's size (the request body's bytes).
    pub bytes: usize,
    /// Outstanding bytes (queued or running) the pool may hold with this job; over it the job
    /// is refused. A job alone is always admitted.
    pub max_bytes: usize,
    /// How long the pool may make no progress before this job, still queued, is abandoned.
    pub stall: Duration,
}

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const ABANDONED: u8 = 2;

type Work = Box<dyn FnOnce() + Send>;

/// Called with the outstanding bytes after every change (a metrics gauge).
pub type Observer = Arc<dyn Fn(usize) + Send + Sync>;

struct Job {
    /// QUEUED until a worker claims it (STARTED) or its caller gives up on it (ABANDONED).
    state: Arc<AtomicU8>,
    /// Runs the closure, gives back its bytes, records progress and answers.
    work: Work,
}

/// What the workers and the callers share.
struct Shared {
    /// Bytes of jobs queued or running.
    outstanding: AtomicUsize,
    /// When a worker last started or finished a job: nanoseconds since `epoch`.
    progress: AtomicU64,
    epoch: Instant,
    observer: parking_lot::RwLock<Option<Observer>>,
}

impl Shared {
    fn progressed(&self) {
        let nanos = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.progress.fetch_max(nanos, Ordering::AcqRel);
    }

    fn last_progress(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.progress.load(Ordering::Acquire))
    }

    /// Takes `bytes` if the total stays within `max` (or nothing else is outstanding).
    fn reserve(&self, bytes: usize, max: usize) -> bool {
        let mut current = self.outstanding.load(Ordering::Acquire);
        loop {
            let next = current.saturating_add(bytes);
            if current > 0 && next > max {
                return false;
            }
            match self.outstanding.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.observe(next);
                    return true;
                }
                Err(now) => current = now,
            }
        }
    }

    fn release(&self, bytes: usize) {
        let before = self.outstanding.fetch_sub(bytes, Ordering::AcqRel);
        self.observe(before.saturating_sub(bytes));
    }

    fn observe(&self, bytes: usize) {
        if let Some(observer) = self.observer.read().as_ref() {
            observer(bytes);
        }
    }
}

/// Worker threads and their bounded queue; dropping the pool stops the threads once the queue
/// drains.
pub struct TokenizerPool {
    queue: Sender<Job>,
    threads: usize,
    capacity: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TokenizerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerPool")
            .field("threads", &self.threads)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl TokenizerPool {
    /// `threads` workers (at least one) over a queue of `capacity` jobs (at least one).
    pub fn new(threads: usize, capacity: usize) -> std::io::Result<Self> {
        let (threads, capacity) = (threads.max(1), capacity.max(1));
        let (queue, jobs) = crossbeam_channel::bounded::<Job>(capacity);
        let shared = Arc::new(Shared {
            outstanding: AtomicUsize::new(0),
            progress: AtomicU64::new(0),
            epoch: Instant::now(),
            observer: parking_lot::RwLock::new(None),
        });
        for n in 0..threads {
            let jobs = jobs.clone();
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("kvpick-tokenize-{n}"))
                .spawn(move || {
                    for job in jobs {
                        if job
                            .state
                            .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                        {
                            shared.progressed();
                            (job.work)();
                        }
                    }
                })?;
        }
        Ok(TokenizerPool {
            queue,
            threads,
            capacity,
            shared,
        })
    }

    /// One worker per core, [`QUEUE_PER_THREAD`] queued jobs per worker.
    pub fn per_core() -> std::io::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self::new(cores, cores * QUEUE_PER_THREAD)
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of jobs queued or running.
    pub fn outstanding_bytes(&self) -> usize {
        self.shared.outstanding.load(Ordering::Acquire)
    }

    /// Reports the outstanding bytes to `observer` after every change (and now).
    pub fn set_observer(&self, observer: Observer) {
        observer(self.outstanding_bytes());
        *self.shared.observer.write() = Some(observer);
    }

    /// Runs `work` on a worker: its answer, or why there is none. Refused at once over the
    /// bounds; once queued, waits until a worker has run it, unless the pool makes no progress
    /// for `limits.stall` first.
    pub async fn run<T, F>(&self, limits: JobLimits, work: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        if !self.shared.reserve(limits.bytes, limits.max_bytes) {
            return Err(PoolError::QueueFull);
        }
        let (answer, answered) = tokio::sync::oneshot::channel();
        let state = Arc::new(AtomicU8::new(QUEUED));
        let shared = Arc::clone(&self.shared);
        let bytes = limits.bytes;
        let job = Job {
            state: Arc::clone(&state),
            work: Box::new(move || {
                let outcome = catch_unwind(AssertUnwindSafe(work)).map_err(panic_message);
                // Done before answering: whoever the answer wakes sees the bytes given back.
                shared.release(bytes);
                shared.progressed();
                // The caller may have gone (its stream closed): nobody to answer.
                let _ = answer.send(outcome);
            }),
        };
        let queued_at = Instant::now();
        match self.queue.try_send(job) {
            Ok(()) => {}
            Err(e) => {
                self.shared.release(limits.bytes);
                return Err(match e {
                    TrySendError::Full(_) => PoolError::QueueFull,
                    TrySendError::Disconnected(_) => PoolError::Stopped,
                });
            }
        }
        // A caller that goes away (its stream closed) abandons a job still queued.
        let claim = AbandonOnDrop {
            state,
            bytes: limits.bytes,
            shared: Arc::clone(&self.shared),
        };
        let mut answered = answered;
        loop {
            let idle = self.shared.last_progress().max(queued_at).elapsed();
            if idle >= limits.stall {
                break;
            }
            tokio::select! {
                biased;
                outcome = &mut answered => return flatten(outcome),
                _ = tokio::time::sleep(limits.stall - idle) => {}
            }
        }
        if claim.abandon() {
            return Err(PoolError::Stalled);
        }
        // A worker took it meanwhile: its answer is on the way.
        flatten(answered.await)
    }
}

/// Abandons its job if no worker has started it (at a stall or when dropped), giving back its
/// bytes.
struct AbandonOnDrop {
    state: Arc<AtomicU8>,
    bytes: usize,
    shared: Arc<Shared>,
}

impl AbandonOnDrop {
    /// Whether the job was still queued (and is now abandoned).
    fn abandon(&self) -> bool {
        let abandoned = self
            .state
            .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if abandoned {
            self.shared.release(self.bytes);
        }
        abandoned
    }
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.abandon();
    }
}

fn flatten<T>(
    outcome: Result<Result<T, PoolError>, tokio::sync::oneshot::error::RecvError>,
) -> Result<T, PoolError> {
    outcome.unwrap_or(Err(PoolError::Stopped))
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> PoolError {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    PoolError::Panicked(text)
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;

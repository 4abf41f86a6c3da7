//! The tokenizer pool (ARCHITECTURE.md §8): one OS thread per core taking CPU-bound tokenization
//! jobs from one bounded queue, so tokenization never runs on the async reactor and never
//! competes with tokio's blocking pool. A job carries a queue-wait deadline: a job no worker has
//! started by then is abandoned (its caller routes on load alone and no CPU is spent on it); a
//! job a worker has started always runs to its answer. A full queue refuses a job at once.
//!
//! This module owns the threads, the queue and the deadline rule only. It knows nothing about
//! models, bodies or metrics: a job is a closure and its outcome a value.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Sender, TrySendError};

/// Queued jobs per worker thread: with ~1 ms jobs, more than any deadline of tens of ms lets
/// start, so a full queue means the pool is far behind, not a short burst.
pub const QUEUE_PER_THREAD: usize = 64;

/// Why a job gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The queue held its capacity of jobs: refused without waiting.
    #[error("tokenizer queue full")]
    QueueFull,
    /// No worker started the job before its deadline.
    #[error("no tokenizer thread free within the deadline")]
    QueueTimeout,
    /// The job panicked (the worker survives it).
    #[error("tokenizer job panicked: {0}")]
    Panicked(String),
    /// The pool is shutting down.
    #[error("tokenizer pool stopped")]
    Stopped,
}

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const ABANDONED: u8 = 2;

type Work = Box<dyn FnOnce() + Send>;

struct Job {
    /// QUEUED until a worker claims it (STARTED) or its caller gives up on it (ABANDONED).
    state: Arc<AtomicU8>,
    work: Work,
}

/// Worker threads and their bounded queue; dropping the pool stops the threads once the queue
/// drains.
pub struct TokenizerPool {
    queue: Sender<Job>,
    threads: usize,
    capacity: usize,
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
        for n in 0..threads {
            let jobs = jobs.clone();
            std::thread::Builder::new()
                .name(format!("kvpick-tokenize-{n}"))
                .spawn(move || {
                    for job in jobs {
                        if job
                            .state
                            .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                        {
                            (job.work)();
                        }
                    }
                })?;
        }
        Ok(TokenizerPool {
            queue,
            threads,
            capacity,
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

    /// Runs `work` on a worker: its answer, or why there is none. Waits at most `deadline` for a
    /// worker to start it; once started, until it finishes.
    pub async fn run<T, F>(&self, deadline: Duration, work: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let state = Arc::new(AtomicU8::new(QUEUED));
        let job = Job {
            state: Arc::clone(&state),
            work: Box::new(move || {
                let outcome = catch_unwind(AssertUnwindSafe(work)).map_err(panic_message);
                // The caller may have gone (its stream closed): nobody to answer.
                let _ = answer.send(outcome);
            }),
        };
        match self.queue.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(PoolError::QueueFull),
            Err(TrySendError::Disconnected(_)) => return Err(PoolError::Stopped),
        }
        // A caller that goes away (its stream closed) abandons a job still queued.
        let claim = AbandonOnDrop(state);
        let mut answered = answered;
        tokio::select! {
            outcome = &mut answered => return flatten(outcome),
            _ = tokio::time::sleep(deadline) => {}
        }
        if claim.abandon() {
            return Err(PoolError::QueueTimeout);
        }
        // A worker took it before the deadline: its answer is on the way.
        flatten(answered.await)
    }
}

/// Abandons its job if no worker has started it, at the deadline or when dropped.
struct AbandonOnDrop(Arc<AtomicU8>);

impl AbandonOnDrop {
    /// Whether the job was still queued (and is now abandoned).
    fn abandon(&self) -> bool {
        self.0
            .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
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

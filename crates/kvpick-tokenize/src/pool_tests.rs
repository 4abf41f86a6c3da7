use super::*;

use std::sync::mpsc;

/// Generous bounds: neither the work bound nor a stall decides these jobs.
fn open(bytes: usize) -> JobLimits {
    JobLimits {
        bytes,
        max_bytes: usize::MAX,
        stall: Duration::from_secs(3600),
    }
}

/// Holds a worker with a job until its sender is dropped (or sent to); returns once the job runs.
async fn hold(
    pool: &Arc<TokenizerPool>,
    bytes: usize,
) -> (mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
    let (release, wait) = mpsc::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let pool2 = Arc::clone(pool);
    let running = tokio::spawn(async move {
        let outcome = pool2
            .run(open(bytes), move || {
                let _ = started_tx.send(());
                let _ = wait.recv();
            })
            .await;
        assert_eq!(outcome, Ok(()));
    });
    started.await.unwrap();
    (release, running)
}

/// A refusal is at once: a minute is a hang (the bound was not applied), not a slow host.
async fn at_once<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("refused at once, not queued")
}

/// Queues a job (it stays queued while every worker is held) and returns once it is in the
/// channel.
async fn queue<T: Send + 'static>(
    pool: &Arc<TokenizerPool>,
    limits: JobLimits,
    work: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<Result<T, PoolError>> {
    let before = pool.queue.len();
    let pool2 = Arc::clone(pool);
    let job = tokio::spawn(async move { pool2.run(limits, work).await });
    while pool.queue.len() == before {
        tokio::task::yield_now().await;
    }
    job
}

#[tokio::test]
async fn runs_jobs_on_its_own_named_threads() {
    let pool = TokenizerPool::new(2, 4).unwrap();
    let name = pool
        .run(open(1), || {
            std::thread::current().name().unwrap_or("").to_string()
        })
        .await
        .unwrap();
    assert!(name.starts_with("kvpick-tokenize-"), "{name}");
    assert_eq!((pool.threads(), pool.capacity()), (2, 4));
    assert_eq!(
        pool.outstanding_bytes(),
        0,
        "the job's bytes are given back"
    );
}

// Real time throughout: the workers are OS threads, and a paused clock would jump while they
// work. A stall that must happen is short and the worker is held meanwhile; one that must not
// is long compared with the steps that make progress.

/// The only worker is stuck: the queued job is abandoned once the pool has made no progress
/// for the stall timeout, never runs, and gives its bytes back; with the worker free again the
/// next job runs.
#[tokio::test]
async fn a_queued_job_behind_a_stuck_pool_is_abandoned_at_the_stall_timeout() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let (release, running) = hold(&pool, 10).await;
    let ran = Arc::new(AtomicU8::new(0));
    let flag = Arc::clone(&ran);
    let limits = JobLimits {
        bytes: 5,
        max_bytes: usize::MAX,
        stall: Duration::from_millis(20),
    };
    let outcome = pool
        .run(limits, move || flag.store(1, Ordering::SeqCst))
        .await;
    assert_eq!(outcome, Err(PoolError::Stalled));
    assert_eq!(
        pool.outstanding_bytes(),
        10,
        "only the running job's bytes remain"
    );
    drop(release);
    running.await.unwrap();
    assert_eq!(pool.run(open(1), || 7).await, Ok(7));
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the abandoned job ran");
    assert_eq!(pool.outstanding_bytes(), 0);
}

/// The 50 ms rule this replaced would have dropped this job: it waits longer than its stall
/// timeout in all, but the pool keeps finishing and starting jobs meanwhile, so it is busy, not
/// stuck, and the job runs.
#[tokio::test]
async fn a_queued_job_waits_past_the_stall_timeout_while_the_pool_progresses() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let stall = Duration::from_millis(600);
    let step = Duration::from_millis(400);
    let (release_a, running_a) = hold(&pool, 1).await;
    let (release_b, wait_b) = mpsc::channel::<()>();
    let b = queue(&pool, open(1), move || {
        let _ = wait_b.recv();
    })
    .await;
    let queued = Instant::now();
    let limits = JobLimits {
        bytes: 1,
        max_bytes: usize::MAX,
        stall,
    };
    let target = queue(&pool, limits, || 42).await;
    tokio::time::sleep(step).await;
    drop(release_a); // A finishes, B starts: progress.
    running_a.await.unwrap();
    tokio::time::sleep(step).await;
    drop(release_b); // B finishes, the target starts.
    assert_eq!(b.await.unwrap(), Ok(()));
    assert_eq!(target.await.unwrap(), Ok(42));
    assert!(
        queued.elapsed() > stall,
        "the job waited longer than the stall timeout"
    );
}

/// A job a worker has started is waited for, however long it runs.
#[tokio::test]
async fn a_started_job_is_answered_after_the_stall_timeout() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let (go, wait) = mpsc::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let job = {
        let pool = Arc::clone(&pool);
        tokio::spawn(async move {
            let limits = JobLimits {
                bytes: 1,
                max_bytes: usize::MAX,
                stall: Duration::from_millis(10),
            };
            pool.run(limits, move || {
                let _ = started_tx.send(());
                let _ = wait.recv();
                42
            })
            .await
        })
    };
    started.await.unwrap();
    // The stall timeout passes while the job runs (the answer is 42 either way: this only
    // makes the late answer the case under test).
    tokio::time::sleep(Duration::from_millis(30)).await;
    go.send(()).unwrap();
    assert_eq!(job.await.unwrap(), Ok(42));
}

/// The job bound: `capacity` jobs wait, the next one is refused at once.
#[tokio::test]
async fn a_full_queue_refuses_the_job_just_over_its_capacity() {
    let pool = Arc::new(TokenizerPool::new(1, 2).unwrap());
    let (release, running) = hold(&pool, 1).await;
    let mut queued = Vec::new();
    for i in 0..2 {
        queued.push(queue(&pool, open(1), move || i).await);
    }
    assert_eq!(
        at_once(pool.run(open(1), || 9)).await,
        Err(PoolError::QueueFull)
    );
    assert_eq!(
        pool.outstanding_bytes(),
        3,
        "the refused job's bytes are not kept"
    );
    drop(release);
    running.await.unwrap();
    for (i, q) in queued.into_iter().enumerate() {
        assert_eq!(q.await.unwrap(), Ok(i));
    }
}

/// The work bound: with 100 bytes outstanding and a bound of 150, a 50-byte job is admitted
/// (exactly at the bound) and a 1-byte job then is refused at once; a job alone is admitted
/// whatever its size. The observer follows every change back to 0.
#[tokio::test]
async fn a_job_just_over_the_outstanding_bytes_bound_is_refused_at_once() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    pool.set_observer(Arc::new(move |b| log.lock().push(b)));
    let bound = |bytes| JobLimits {
        bytes,
        max_bytes: 150,
        stall: Duration::from_secs(3600),
    };
    let (release, running) = hold(&pool, 100).await;
    let fits = queue(&pool, bound(50), || "fits").await;
    assert_eq!(pool.outstanding_bytes(), 150);
    assert_eq!(
        at_once(pool.run(bound(1), || "over")).await,
        Err(PoolError::QueueFull)
    );
    assert_eq!(pool.outstanding_bytes(), 150);
    drop(release);
    running.await.unwrap();
    assert_eq!(fits.await.unwrap(), Ok("fits"));
    assert_eq!(pool.run(bound(1_000), || "alone").await, Ok("alone"));
    assert_eq!(pool.outstanding_bytes(), 0);
    let seen = seen.lock().clone();
    assert_eq!(seen.first(), Some(&0));
    assert_eq!(seen.last(), Some(&0));
    assert!(seen.contains(&150) && seen.contains(&1_000), "{seen:?}");
}

/// A caller that goes away while its job is queued abandons it and gives its bytes back.
#[tokio::test]
async fn a_caller_gone_while_queued_gives_its_bytes_back() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let (release, running) = hold(&pool, 1).await;
    let job = queue(&pool, open(64), || ()).await;
    assert_eq!(pool.outstanding_bytes(), 65);
    job.abort();
    assert!(job.await.unwrap_err().is_cancelled());
    assert_eq!(pool.outstanding_bytes(), 1);
    drop(release);
    running.await.unwrap();
}

#[tokio::test]
async fn a_panicking_job_is_an_error_and_the_worker_survives() {
    let pool = TokenizerPool::new(1, 2).unwrap();
    let outcome: Result<(), _> = pool.run(open(1), || panic!("bad input")).await;
    assert_eq!(outcome, Err(PoolError::Panicked("bad input".into())));
    assert_eq!(pool.run(open(1), || 1).await, Ok(1));
    assert_eq!(pool.outstanding_bytes(), 0);
}

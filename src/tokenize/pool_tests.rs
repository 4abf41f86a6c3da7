use super::*;

use std::sync::mpsc;

/// Occupies every worker of `pool` until the returned sender is dropped; returns once all of
/// them are running (readiness signals, no sleeps).
async fn occupy(pool: &Arc<TokenizerPool>) -> (mpsc::Sender<()>, Vec<tokio::task::JoinHandle<()>>) {
    let (release, hold) = mpsc::channel::<()>();
    let hold = Arc::new(parking_lot::Mutex::new(hold));
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut running = Vec::new();
    for _ in 0..pool.threads() {
        let (pool, hold, started_tx) = (Arc::clone(pool), Arc::clone(&hold), started_tx.clone());
        running.push(tokio::spawn(async move {
            let outcome = pool
                .run(Duration::from_secs(3600), move || {
                    let _ = started_tx.send(());
                    // Each blocker waits for the release (the sender dropped).
                    let _ = hold.lock().recv();
                })
                .await;
            assert_eq!(outcome, Ok(()));
        }));
    }
    for _ in 0..pool.threads() {
        started.recv().await.unwrap();
    }
    (release, running)
}

#[tokio::test]
async fn runs_jobs_on_its_own_named_threads() {
    let pool = TokenizerPool::new(2, 4).unwrap();
    let name = pool
        .run(Duration::from_secs(5), || {
            std::thread::current().name().unwrap_or("").to_string()
        })
        .await
        .unwrap();
    assert!(name.starts_with("kvpick-tokenize-"), "{name}");
    assert_eq!((pool.threads(), pool.capacity()), (2, 4));
}

// Real time throughout: the workers are OS threads, and a paused clock would jump past every
// deadline whenever the runtime waits for them. A deadline that must pass is short and the
// workers are held busy meanwhile; one that must not pass is an hour.

/// The only worker is busy: the job is abandoned at its deadline and never runs; the next job,
/// with the worker free again, runs.
#[tokio::test]
async fn a_job_not_started_by_its_deadline_is_abandoned_and_never_runs() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let (release, running) = occupy(&pool).await;
    let ran = Arc::new(AtomicU8::new(0));
    let flag = Arc::clone(&ran);
    let outcome = pool
        .run(Duration::from_millis(5), move || {
            flag.store(1, Ordering::SeqCst)
        })
        .await;
    assert_eq!(outcome, Err(PoolError::QueueTimeout));
    drop(release);
    for r in running {
        r.await.unwrap();
    }
    assert_eq!(pool.run(Duration::from_secs(3600), || 7).await, Ok(7));
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the abandoned job ran");
}

/// A job a worker started before the deadline is waited for, however long it runs.
#[tokio::test]
async fn a_started_job_is_answered_after_the_deadline() {
    let pool = Arc::new(TokenizerPool::new(1, 8).unwrap());
    let (go, wait) = mpsc::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let job = {
        let pool = Arc::clone(&pool);
        tokio::spawn(async move {
            pool.run(Duration::from_millis(10), move || {
                let _ = started_tx.send(());
                let _ = wait.recv();
                42
            })
            .await
        })
    };
    started.await.unwrap();
    // The deadline passes while the job runs (the answer is 42 either way: this only makes the
    // late answer the case under test).
    tokio::time::sleep(Duration::from_millis(30)).await;
    go.send(()).unwrap();
    assert_eq!(job.await.unwrap(), Ok(42));
}

/// The queue bound: `capacity` jobs wait, the next one is refused at once.
#[tokio::test]
async fn a_full_queue_refuses_the_job_just_over_its_capacity() {
    let pool = Arc::new(TokenizerPool::new(1, 2).unwrap());
    let (release, running) = occupy(&pool).await;
    let mut queued = Vec::new();
    for i in 0..2 {
        let pool = Arc::clone(&pool);
        queued.push(tokio::spawn(async move {
            pool.run(Duration::from_secs(3600), move || i).await
        }));
    }
    // The two queued jobs are in the channel once their tasks ran to the await.
    while pool.queue.len() < 2 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        pool.run(Duration::from_secs(3600), || 9).await,
        Err(PoolError::QueueFull)
    );
    drop(release);
    for r in running {
        r.await.unwrap();
    }
    for (i, q) in queued.into_iter().enumerate() {
        assert_eq!(q.await.unwrap(), Ok(i));
    }
}

#[tokio::test]
async fn a_panicking_job_is_an_error_and_the_worker_survives() {
    let pool = TokenizerPool::new(1, 2).unwrap();
    let outcome: Result<(), _> = pool
        .run(Duration::from_secs(5), || panic!("bad input"))
        .await;
    assert_eq!(outcome, Err(PoolError::Panicked("bad input".into())));
    assert_eq!(pool.run(Duration::from_secs(5), || 1).await, Ok(1));
}

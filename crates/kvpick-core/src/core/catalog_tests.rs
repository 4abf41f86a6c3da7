use super::*;
use crate::catalog::RankLayout;

/// Before `modify_source`, an upsert read the source list, dropped the lock and wrote the
/// list back, so two concurrent upserts of different workers could lose one. Eight threads
/// upsert distinct workers into one source at once, many rounds: every worker must survive.
#[test]
fn concurrent_upserts_of_one_source_lose_nothing() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 50;
    let core = Core::new(CoreConfig::default());
    let barrier = std::sync::Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (core, barrier) = (&core, &barrier);
            scope.spawn(move || {
                for round in 0..ROUNDS {
                    if round % 10 == 0 {
                        barrier.wait();
                    }
                    let name = format!("w{t}-{round}");
                    let spec = WorkerSpec::for_test(&name, "m", RankLayout::PerPort(vec![1]));
                    core.upsert_source_worker("api", spec, Instant::now())
                        .unwrap();
                }
            });
        }
    });
    assert_eq!(core.catalog.lock().source("api").len(), THREADS * ROUNDS);
    assert_eq!(core.records().len(), THREADS * ROUNDS);
    // Deletes race the same way.
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let core = &core;
            scope.spawn(move || {
                for round in 0..ROUNDS {
                    let (found, _, _) = core
                        .delete_source_worker("api", &format!("w{t}-{round}"), Instant::now())
                        .unwrap();
                    assert!(found);
                }
            });
        }
    });
    assert!(core.records().is_empty());
}

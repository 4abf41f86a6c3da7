//! Flow control's delivery under concurrency: many tasks admitting, waiting, cancelling and
//! freeing at once on a multi-threaded runtime.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvpick_core::{CoreConfig, FlowConfig, PromptInput, SelectionRequest};

use super::*;
use crate::observability::metrics::Metrics;
use crate::sources::catalog::{RankLayout, WorkerSpec};

/// Two ranks taking one request each: nearly every admission queues, and every free releases
/// one waiter from another task, so releases race the registration of waiters.
fn narrow_core() -> Arc<SelectionCore> {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(5),
            flow: FlowConfig {
                queue_timeout: Duration::from_secs(600),
                saturation: crate::selection::ONE_SLOT,
                ..FlowConfig::default()
            },
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(vec![WorkerSpec::for_test(
        "a",
        "m",
        RankLayout::PerPort(vec![8000, 8001]),
    )])
    .unwrap();
    core
}

fn request(id: String) -> SelectionRequest {
    SelectionRequest {
        request_id: id,
        model: Some("m".into()),
        prompt: PromptInput::Tokens(vec![1; 64]),
        ..SelectionRequest::default()
    }
}

#[derive(Default)]
struct Tally {
    booked_now: AtomicU64,
    released: AtomicU64,
    cancelled: AtomicU64,
    errors: AtomicU64,
}

/// Every waiter gets exactly one outcome and it is a booking (the queue timeout is far away, so
/// any error — "shutting down", "lost its waiter" — is a delivery bug); every booking is freed
/// exactly once; afterwards no booking, load, queued request or mailbox is left.
#[test]
fn concurrent_admit_wait_cancel_and_free_leave_nothing_behind() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let core = narrow_core();
    let tally = Arc::new(Tally::default());
    const TASKS: u64 = 8;
    const ROUNDS: u64 = 300;
    runtime.block_on(async {
        let mut tasks = Vec::new();
        for task in 0..TASKS {
            let core = Arc::clone(&core);
            let tally = Arc::clone(&tally);
            tasks.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let id = format!("t{task}-{round}");
                    let reservation = match core.admit(&request(id)) {
                        Ok(Admitted::Now(r)) => {
                            tally.booked_now.fetch_add(1, Ordering::Relaxed);
                            *r
                        }
                        Ok(Admitted::Queued(waiter)) if round % 5 == 0 => {
                            // The client goes away while queued (or just as it is released).
                            tokio::task::yield_now().await;
                            drop(waiter);
                            tally.cancelled.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Ok(Admitted::Queued(waiter)) => match waiter.wait().await {
                            Ok(r) => {
                                tally.released.fetch_add(1, Ordering::Relaxed);
                                r
                            }
                            Err(_) => {
                                tally.errors.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                        },
                        Err(_) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    };
                    tokio::task::yield_now().await;
                    if round % 2 == 0 {
                        reservation.free();
                    } else {
                        drop(reservation);
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let done = tally.booked_now.load(Ordering::Relaxed)
        + tally.released.load(Ordering::Relaxed)
        + tally.cancelled.load(Ordering::Relaxed);
    assert_eq!(
        tally.errors.load(Ordering::Relaxed),
        0,
        "a waiter got an error"
    );
    assert_eq!(
        done,
        TASKS * ROUNDS,
        "every admission has exactly one outcome"
    );
    assert!(
        tally.released.load(Ordering::Relaxed) > 0,
        "the test must exercise the queue"
    );
    assert_eq!(core.live_bookings(), 0, "a booking was left behind");
    assert_eq!(core.waiting_requests(), 0);
    assert_eq!(core.mailboxes.len(), 0, "a mailbox was left behind");
    for worker in core.list_workers(None) {
        for load in worker.loads {
            assert_eq!(
                load,
                kvpick_core::RankLoad::default(),
                "load left on a rank"
            );
        }
    }
}

/// A release delivered before the waiter registers is kept, then taken by the registration;
/// a waiter registered first receives it. Either order gives the outcome to exactly one side.
#[test]
fn delivery_and_registration_in_either_order_meet_once() {
    let boxes = Mailboxes::default();
    boxes.deliver(1, Err(SelectError::Unavailable("x".into())));
    assert!(matches!(boxes.register(1), Registered::Ready(o) if o.is_err()));
    assert_eq!(boxes.len(), 0);
    let Registered::Waiting(mut rx) = boxes.register(2) else {
        panic!("nothing was delivered for ticket 2");
    };
    boxes.deliver(2, Err(SelectError::Unavailable("y".into())));
    assert!(matches!(rx.try_recv(), Ok(Err(_))));
    assert_eq!(boxes.len(), 0);
}

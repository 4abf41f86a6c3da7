//! Locks that spin for a few microseconds before they sleep: a partition's state mutex and its
//! KV read-write lock. Owns only how a contended lock is waited for; what the locks guard, and
//! their order (state before KV), stay with the partition.
//!
//! Why: a partition's critical sections last microseconds, but a thread that parks (futex) is
//! woken by a syscall and an inter-processor interrupt, which on a VM costs tens of
//! microseconds. parking_lot spins only a handful of iterations before it parks, so two threads
//! picking on one partition spent most of their time waking each other: 2 threads made 0.4x
//! the picks of one, using 1.03 cores (docs/benchmarks.md, concurrency). Spinning up to
//! [`SPIN_LIMIT`] first keeps a waiter on its core while the holder finishes; past it, the
//! waiter parks as before, so a descheduled holder costs a bounded spin, not a core. The
//! waiter's thread is blocked either way (these are synchronous locks): spinning spends the
//! wait on its core instead of in the scheduler.
//!
//! The spin re-tries only once the lock looks free (test and test-and-set), so waiters read the
//! lock word rather than write it while they wait.

use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Longest a contended acquisition spins before it parks. A partition's longest common hold
/// is one walk or one insert of a capped prompt into a big, cache-cold index (~40 µs on the
/// 2-core machine); this covers it and a short queue behind it. Measured (concurrency bench,
/// distinct prompts, 2 pick threads against 1): 10 µs 0.59x, 40 µs 0.66–0.78x, 100 µs 0.95x.
pub(crate) const SPIN_LIMIT: Duration = Duration::from_micros(100);

/// Spin-loop hints between two looks at the clock (the clock costs ~20 ns; a hint 10–40 ns).
const SPINS_PER_CHECK: u32 = 64;

/// A guard from `try_acquire` at once; else from it again whenever `busy` turns false, for up
/// to [`SPIN_LIMIT`]; else from `block` (parking until the lock is free).
fn acquire<G>(
    mut try_acquire: impl FnMut() -> Option<G>,
    busy: impl Fn() -> bool,
    block: impl FnOnce() -> G,
) -> G {
    if let Some(guard) = try_acquire() {
        return guard;
    }
    let started = Instant::now();
    loop {
        for _ in 0..SPINS_PER_CHECK {
            std::hint::spin_loop();
            if !busy() {
                if let Some(guard) = try_acquire() {
                    return guard;
                }
            }
        }
        if started.elapsed() >= SPIN_LIMIT {
            return block();
        }
    }
}

/// A [`Mutex`] whose contended `lock` spins up to [`SPIN_LIMIT`] before parking.
#[derive(Debug, Default)]
pub(crate) struct SpinMutex<T>(Mutex<T>);

impl<T> SpinMutex<T> {
    pub(crate) fn new(value: T) -> Self {
        SpinMutex(Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        acquire(
            || self.0.try_lock(),
            || self.0.is_locked(),
            || self.0.lock(),
        )
    }
}

/// A [`RwLock`] whose contended `read` and `write` spin up to [`SPIN_LIMIT`] before parking.
#[derive(Debug, Default)]
pub(crate) struct SpinRwLock<T>(RwLock<T>);

impl<T> SpinRwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        SpinRwLock(RwLock::new(value))
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
        acquire(
            || self.0.try_read(),
            || self.0.is_locked_exclusive(),
            || self.0.read(),
        )
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
        acquire(
            || self.0.try_write(),
            || self.0.is_locked(),
            || self.0.write(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Barrier};

    /// Holds `lock` for `hold` after `waiter` has started, checking that the waiter never gets
    /// in meanwhile, then releases it; returns what the waiter read.
    fn hold_while_a_waiter_waits(hold: Duration) -> u64 {
        let lock = Arc::new(SpinMutex::new(0u64));
        let started = Arc::new(Barrier::new(2));
        let inside = Arc::new(AtomicBool::new(false));
        let mut held = lock.lock();
        let waiter = {
            let (lock, started, inside) =
                (Arc::clone(&lock), Arc::clone(&started), Arc::clone(&inside));
            std::thread::spawn(move || {
                started.wait();
                let mut guard = lock.lock();
                inside.store(true, Ordering::SeqCst);
                *guard += 1;
                *guard
            })
        };
        started.wait();
        let until = Instant::now() + hold;
        while Instant::now() < until {
            assert!(
                !inside.load(Ordering::SeqCst),
                "the waiter ran past a held lock"
            );
            std::hint::spin_loop();
        }
        *held = 41;
        drop(held);
        waiter.join().unwrap()
    }

    #[test]
    fn a_waiter_inside_the_spin_gets_the_mutex_once_the_holder_lets_go() {
        // Released well within the spin: the waiter is spinning, not parked.
        assert_eq!(hold_while_a_waiter_waits(SPIN_LIMIT / 4), 42);
    }

    #[test]
    fn a_waiter_held_off_past_the_spin_limit_still_gets_the_mutex() {
        // Held far past the spin: the waiter has fallen back to parking and must be woken.
        assert_eq!(hold_while_a_waiter_waits(SPIN_LIMIT * 50), 42);
    }

    #[test]
    fn a_reader_held_off_past_the_spin_limit_by_a_writer_still_gets_the_lock() {
        let lock = Arc::new(SpinRwLock::new(0u64));
        let started = Arc::new(Barrier::new(2));
        let done = Arc::new(AtomicBool::new(false));
        let mut held = lock.write();
        let waiter = {
            let (lock, started, done) =
                (Arc::clone(&lock), Arc::clone(&started), Arc::clone(&done));
            std::thread::spawn(move || {
                started.wait();
                let value = *lock.read();
                done.store(true, Ordering::SeqCst);
                value
            })
        };
        started.wait();
        let until = Instant::now() + SPIN_LIMIT * 50;
        while Instant::now() < until {
            assert!(
                !done.load(Ordering::SeqCst),
                "the reader ran past a held write lock"
            );
            std::hint::spin_loop();
        }
        *held = 7;
        drop(held);
        assert_eq!(waiter.join().unwrap(), 7);
    }

    #[test]
    fn counts_from_many_threads_all_land() {
        let lock = Arc::new(SpinRwLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        *lock.write() += 1;
                        let _ = *lock.read();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.read(), 40_000);
    }
}

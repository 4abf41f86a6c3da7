//! The process clock: tokio's, so a paused test or replay clock reaches every part that reads
//! the time for the selection core (the core itself, the pool gauges at a scrape, engine
//! readings). A leaf: it imports nothing of this crate, so `metrics` and `selection` both read
//! it without importing each other.

/// Now on the process clock (tokio's, as a `std` instant).
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

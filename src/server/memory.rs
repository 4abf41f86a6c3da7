//! How the kernel may back kvpick's heap: transparent huge pages (THP) are off for the process
//! unless `--huge-pages`, set once at start before the KV indexes allocate. Owns only that process
//! flag; it must not allocate or size anything itself.
//!
//! Why off: with THP, each first touch of fresh heap memory makes the kernel zero a whole 2 MiB
//! page inside whatever allocation touched it. On the development VM (a Firecracker guest whose
//! memory the host backs lazily) that costs tens of milliseconds a page; in the scale benchmark
//! (1,000 pods x 8 ranks, 2,000 picks/s) a backlog that grew the heap then fed on itself, and 7
//! of 22 runs collapsed or fell behind (a fifth of kvpick's CPU zeroing pages). With THP off, 6
//! of 6 ran clean with an event-lag p99 of 4.3-4.9 ms. The price: 6-15% more CPU per 32 KB
//! request through Envoy, where huge pages spare TLB misses (docs/benchmarks.md, "Huge pages
//! off"). `--huge-pages` is for hosts where first touches are cheap (bare metal) and that CPU
//! matters more.

/// Turns transparent huge pages off for this process unless `allow` (Linux
/// `prctl(PR_SET_THP_DISABLE)`, which also overrides the allocator's own `MADV_HUGEPAGE`).
/// Returns whether they are now off; a kernel that refuses leaves them as they were, with a
/// warning (never fatal: it changes cost, not behaviour).
pub(crate) fn apply_huge_pages(allow: bool) -> bool {
    #[cfg(target_os = "linux")]
    {
        if !allow {
            if let Err(err) = rustix::thread::disable_transparent_huge_pages(true) {
                tracing::warn!(%err, "could not turn transparent huge pages off (prctl)");
            }
        }
        rustix::thread::transparent_huge_pages_are_disabled().unwrap_or(false)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = allow;
        false
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_go_off_unless_allowed() {
        // Allowing them leaves the process's flag as it was (a parent may have set it: inherited).
        let before = rustix::thread::transparent_huge_pages_are_disabled().unwrap_or(false);
        assert_eq!(apply_huge_pages(true), before);
        assert!(apply_huge_pages(false));
        assert_eq!(
            rustix::thread::transparent_huge_pages_are_disabled().ok(),
            Some(true)
        );
    }
}

//! How the kernel may back kvpick's heap: `--no-huge-pages` turns transparent huge pages (THP)
//! off for the process at start, before the KV indexes allocate. Owns only that process flag; it
//! must not allocate or size anything itself.
//!
//! The KV index's tables already live in the system allocator's 4 KiB pages
//! (`kvpick_core::index`'s shards), which is what keeps a growing table from zeroing 2 MiB per
//! first touch under the partition's lock. On a node whose THP mode is `always`, the kernel may
//! give even those huge pages; on a VM that backs guest memory lazily (Firecracker), that stalled
//! single inserts for 60–170 ms here. This flag is the lever for that case. It is not the default
//! because the rest of the heap gains from huge pages: 6–15% less CPU per 32 KB request with them
//! (docs/benchmarks.md, "Index tables off huge pages").

/// Turns transparent huge pages off for this process when `off` (Linux
/// `prctl(PR_SET_THP_DISABLE)`, which also overrides the allocator's own `MADV_HUGEPAGE`).
/// Returns whether they are now off; a kernel that refuses leaves them as they were, with a
/// warning (never fatal: it changes cost, not behaviour).
pub(crate) fn apply_huge_pages_off(off: bool) -> bool {
    #[cfg(target_os = "linux")]
    {
        if off {
            if let Err(err) = rustix::thread::disable_transparent_huge_pages(true) {
                tracing::warn!(%err, "could not turn transparent huge pages off (prctl)");
            }
        }
        rustix::thread::transparent_huge_pages_are_disabled().unwrap_or(false)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = off;
        false
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_go_off_when_asked() {
        // Not asking leaves the process's flag as it was (on for a test process).
        assert!(!apply_huge_pages_off(false));
        assert!(apply_huge_pages_off(true));
        assert_eq!(
            rustix::thread::transparent_huge_pages_are_disabled().ok(),
            Some(true)
        );
    }
}

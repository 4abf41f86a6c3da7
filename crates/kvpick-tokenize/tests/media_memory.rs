//! An image's bytes are hashed while its base64 text is decoded, a few KiB at a time, and never
//! kept (src/media.rs): the memory identifying an image takes does not grow with it.
//! Measured with a counting allocator (peak live bytes above the start), on a 48 KiB and a 12 MiB
//! image, through the data-URL and the body paths.

#![allow(clippy::unwrap_used, clippy::expect_used)]
// a test harness: a panic is a failure report
// The counting allocator below (as in benches/index.rs) is why this harness allows unsafe code.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use kvpick_tokenize::json::Json;
use kvpick_tokenize::media::{data_url_identifier, items};
use kvpick_tokenize::Endpoint;

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(by: isize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Tests in this harness run one at a time: the counters are process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

/// Peak live bytes `f` added above what was live when it started.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed) - start)
}

/// Base64 text of `len` pseudo-random bytes (no padding issues: a multiple of 3).
fn base64_of(len: usize) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x: u32 = 7;
    let mut out = String::with_capacity(len / 3 * 4);
    for _ in 0..len / 3 * 4 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        out.push(A[(x >> 16) as usize % 64] as char);
    }
    out
}

/// Well under the smallest image: what hashing may hold (the decode chunk, the hasher, the hex).
const BOUND: isize = 16 * 1024;

#[test]
fn identifying_a_data_url_image_takes_the_same_memory_at_48_kib_and_12_mib() {
    let _serial = SERIAL.lock().unwrap();
    for len in [48 * 1024, 12 * 1024 * 1024] {
        let url = format!("data:image/png;base64,{}", base64_of(len));
        let (id, peak) = peak_during(|| data_url_identifier(&url, "model").unwrap());
        assert_eq!(id.len(), 64);
        assert!(
            peak < BOUND,
            "{len}-byte image: {peak} bytes held while hashing"
        );
    }
}

#[test]
fn identifying_a_bodys_images_holds_none_of_their_bytes() {
    let _serial = SERIAL.lock().unwrap();
    for len in [48 * 1024, 12 * 1024 * 1024] {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"hi"}},
            {{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}}]}}]}}"#,
            base64_of(len)
        );
        // The parsed body (bounded by --tokenize-max-body-bytes) is the caller's; identifying
        // its images adds only the identifiers.
        let json: Json = serde_json::from_str(&body).unwrap();
        let (found, peak) = peak_during(|| items(Endpoint::Generate, &json, "model"));
        assert!(found.len() == 1 && found[0].exact);
        assert!(
            peak < BOUND,
            "{len}-byte image: {peak} bytes held while identifying"
        );
    }
}

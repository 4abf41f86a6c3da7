//! `kvpick replay|sim|workload|report-html` hand over to `kvpick-lab` beside the binary: with the
//! lab there, its process replaces kvpick's (arguments, `--help` and exit status are the lab's);
//! without it, exit 2 and the exact commands that build and run it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::path::{Path, PathBuf};
use std::process::Command;

/// `kvpick` alone in a fresh directory (a hard link to the built binary, so `current_exe` is here).
fn lonely_kvpick() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lab-handover-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let kvpick = dir.join("kvpick");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_kvpick"), &kvpick).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_kvpick"), &kvpick).unwrap();
    }
    (dir, kvpick)
}

#[test]
fn without_the_lab_the_error_names_the_commands() {
    let (dir, kvpick) = lonely_kvpick();
    let out = Command::new(&kvpick)
        .args(["replay", "--trace", "a b.jsonl", "--workers", "8"])
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cargo build --release -p kvpick-lab"), "{err}");
    assert!(
        err.contains("target/release/kvpick-lab replay --trace 'a b.jsonl' --workers 8"),
        "{err}"
    );
}

/// `kvpick` with a stand-in lab beside it: a link to a system tool (linked, not a script written
/// here, so no other test's child can hold it open for writing when it is executed).
fn kvpick_with_lab(tool: &str) -> (PathBuf, PathBuf) {
    let (dir, kvpick) = lonely_kvpick();
    std::os::unix::fs::symlink(tool, dir.join("kvpick-lab")).unwrap();
    (dir, kvpick)
}

#[test]
fn with_the_lab_beside_it_the_lab_runs_with_every_argument() {
    let (dir, kvpick) = kvpick_with_lab("/bin/echo");
    let workload = Command::new(&kvpick)
        .args(["workload", "--family", "chat", "--help"])
        .output()
        .unwrap();
    let sim = Command::new(&kvpick)
        .args(["sim", "--workers", "2", "--", "-x"])
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(workload.status.success());
    assert_eq!(
        String::from_utf8_lossy(&workload.stdout),
        "workload --family chat --help\n"
    );
    assert_eq!(
        String::from_utf8_lossy(&sim.stdout),
        "sim --workers 2 -- -x\n"
    );
}

#[test]
fn the_exit_status_is_the_labs() {
    // `false` exits 1; kvpick's own errors exit 2.
    let (dir, kvpick) = kvpick_with_lab("/bin/false");
    let out = Command::new(&kvpick).args(["replay"]).output().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

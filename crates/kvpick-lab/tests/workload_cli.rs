//! `kvpick-lab workload` and `kvpick-lab replay --offered-load` through the real binary: the subcommand
//! writes a trace and its statistics, the same seed writes the same bytes, the replay loads the
//! trace at the asked load, and bad input is a clear error (exit 2), not a panic.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::path::Path;
use std::process::Command;

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("kvpick-workload-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn lab(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvpick-lab"))
        .args(args)
        .output()
        .expect("run kvpick-lab")
}

fn workload(dir: &Path, name: &str, seed: &str) -> (Vec<u8>, serde_json::Value, String) {
    let out = dir.join(format!("{name}.jsonl"));
    let stats = dir.join(format!("{name}.stats.json"));
    let run = lab(&[
        "workload",
        "--family",
        "chat",
        "--seed",
        seed,
        "--requests",
        "120",
        "--out",
        out.to_str().unwrap(),
        "--stats",
        stats.to_str().unwrap(),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stats: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    (
        std::fs::read(&out).unwrap(),
        stats,
        String::from_utf8(run.stdout).unwrap(),
    )
}

#[test]
fn workload_writes_a_deterministic_trace_that_replays_at_the_asked_load() {
    let dir = TempDir::new();
    let (a, stats, printed) = workload(dir.path(), "a", "5");
    let (b, _, _) = workload(dir.path(), "b", "5");
    let (c, _, _) = workload(dir.path(), "c", "6");
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(stats["requests"], 120);
    assert_eq!(stats["family"], "chat");
    assert!(printed.starts_with("chat: 120 requests"), "{printed}");
    assert!(printed.contains("reuse gap"), "{printed}");

    let report = dir.path().join("report.json");
    let run = lab(&[
        "replay",
        "--trace",
        dir.path().join("a.jsonl").to_str().unwrap(),
        "--workers",
        "4",
        "--policy",
        "kvpick,round-robin",
        "--offered-load",
        "0.9",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert!((report["offered_load"].as_f64().unwrap() - 0.9).abs() < 1e-9);
    for p in report["policies"].as_array().unwrap() {
        assert_eq!(p["completed"], 120, "{}", p["policy"]);
    }
}

#[test]
fn bad_workload_arguments_are_clear_errors() {
    let dir = TempDir::new();
    let out = dir.path().join("t.jsonl");
    let zero = lab(&[
        "workload",
        "--family",
        "agentic",
        "--requests",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(zero.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&zero.stderr).contains("--requests must be in"));
    let family = lab(&[
        "workload",
        "--family",
        "nope",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(family.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&family.stderr).contains("small-families"));
    let rate = lab(&[
        "workload",
        "--family",
        "chat",
        "--rate",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(rate.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&rate.stderr).contains("--rate must be > 0"));
}

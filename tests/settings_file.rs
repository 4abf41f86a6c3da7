//! Runs the real `kvpick serve --settings FILE`: the file fills flags below the command line and
//! the environment, a live edit changes decisions, an edit that is not live is reported as
//! needing a restart, and an invalid edit keeps the last good settings (seen in the metrics).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use kvpick::proto::SelectRequest;
use tonic_health::pb::health_check_response::ServingStatus;

mod common;

fn metrics_text(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

fn metric(port: u16, name: &str) -> f64 {
    metrics_text(port)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} not exported"))
}

/// Polls the reload counter for `result` until it is `want` (bounded: 10 s).
async fn wait_reloads(port: u16, result: &str, want: f64) {
    let name = format!("kvpick_settings_reloads_total{{result=\"{result}\"}}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(port, &name) != want {
        assert!(Instant::now() < deadline, "{name} never became {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn select(id: &str) -> SelectRequest {
    SelectRequest {
        request_id: id.into(),
        model: "m".into(),
        token_ids: id.bytes().map(u32::from).cycle().take(64).collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn settings_file_reloads_live_and_keeps_the_last_good_version() {
    let dir = common::temp_dir("kvpick-settings");
    let catalog = dir.join("catalog.yaml");
    std::fs::write(
        &catalog,
        "workers: [{name: a, model: m, address: 127.0.0.1, port: 8000}]\n",
    )
    .unwrap();
    let settings = dir.join("settings.yaml");
    // `config` is overridden by KVPICK_CONFIG and `catalog-poll-ms` by the flag: were the file
    // to win, start-up would fail (no such catalog) or the reloads below would time out.
    std::fs::write(
        &settings,
        "config: /nonexistent/catalog.yaml\ncatalog-poll-ms: 600000\nselection-api: true\n\
         active-prefill-tokens-threshold: 1000\n",
    )
    .unwrap();
    let serve = common::start_with(dir, |c| {
        c.args(["--secure-serving=false", "--catalog-poll-ms", "50"])
            .arg("--settings")
            .arg(&settings)
            .env("KVPICK_CONFIG", &catalog);
    });
    common::wait_readiness(serve.health, ServingStatus::Serving).await;
    assert!(
        metric(
            serve.metrics,
            "kvpick_settings_last_reload_success_timestamp_seconds"
        ) > 0.0
    );
    let mut api = common::api(serve.grpc).await;
    // 1000 prefill tokens allowed on the one rank: two 64-token bookings fit.
    api.select_and_reserve(select("r0")).await.unwrap();
    api.select_and_reserve(select("r1")).await.unwrap();
    let cost = |api: &mut common::Api| {
        let mut api = api.clone();
        async move { api.select(select("probe")).await.unwrap().into_inner().cost }
    };
    let before = cost(&mut api).await;

    // Live: the rank is now over its threshold.
    let live = "selection-api: true\nactive-prefill-tokens-threshold: 100\n";
    std::fs::write(&settings, live).unwrap();
    wait_reloads(serve.metrics, "ok", 1.0).await;
    let refused = api.select_and_reserve(select("r2")).await.unwrap_err();
    assert_ne!(refused.code(), tonic::Code::Ok);

    // Invalid (clap refuses a negative count): the last good threshold stays.
    std::fs::write(&settings, "active-prefill-tokens-threshold: -5\n").unwrap();
    wait_reloads(serve.metrics, "invalid", 1.0).await;
    api.select_and_reserve(select("r3")).await.unwrap_err();

    // Not live: reported as needing a restart; the live part still applies.
    std::fs::write(
        &settings,
        "selection-api: true\nactive-prefill-tokens-threshold: 100000\nindex-max-blocks: 64\n\
         prefill-load-scale: 4\n",
    )
    .unwrap();
    wait_reloads(serve.metrics, "restart_needed", 1.0).await;
    // A live weight: the same decision over the same bookings now weighs prefill load 4x.
    let after = cost(&mut api).await;
    assert!(after > before * 1.5, "cost {before} -> {after}");
    api.select_and_reserve(select("r4")).await.unwrap();
    assert_eq!(
        metric(
            serve.metrics,
            "kvpick_settings_reloads_total{result=\"ok\"}"
        ),
        1.0
    );
}

#[test]
fn a_bad_settings_file_fails_start_up_naming_the_key_and_line() {
    let dir = common::temp_dir("kvpick-settings");
    let path = dir.join("settings.yaml");
    for (text, expected) in [
        (
            "stall-weight: 1\nqueue-timeout: 3601\n",
            "line 2: `queue-timeout`",
        ),
        (
            "stall-weight: 1\ncolour: red\n",
            "line 2: `colour`: unknown setting",
        ),
    ] {
        std::fs::write(&path, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kvpick"))
            .args(["serve", "--grpc-port", "0", "--grpc-health-port", "0"])
            .args(["--metrics-port", "0", "--settings"])
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{stderr}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

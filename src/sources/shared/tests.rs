//! The shared state against a real `redis-server` (Debian's package; `e2e/setup.sh` installs it),
//! started per test on a unix socket in a temp dir, so no port is guessed.

use super::*;
use crate::observability::metrics::Metrics;
use crate::selection::{
    CoreConfig, Holder, PartitionKey, PromptInput, RankKey, SelectionRequest, SessionOutcome,
};
use crate::sources::catalog::{RankLayout, WorkerSpec};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// A `redis-server` child on a unix socket; killed on drop.
struct RedisServer {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
}

impl RedisServer {
    fn start() -> RedisServer {
        let dir = std::env::temp_dir().join(format!("kvpick-redis-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no"])
            .arg("--unixsocket")
            .arg(&socket)
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("redis-server is needed for these tests (apt-get install redis-server; e2e/setup.sh does): {e}")
            });
        RedisServer { child, dir, socket }
    }

    fn url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Waits until the server answers PING (its readiness signal).
    async fn ready(&self) {
        let client = redis::Client::open(self.url()).unwrap();
        for _ in 0..500 {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let pong: redis::RedisResult<String> =
                    redis::cmd("PING").query_async(&mut conn).await;
                if pong.is_ok() {
                    return;
                }
            }
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "redis-server on {} did not answer PING",
            self.socket.display()
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(url: &str, timeout_ms: u64) -> SharedConfig {
    SharedConfig::new(
        url,
        None,
        None,
        "t",
        timeout_ms,
        10,
        Duration::from_secs(300),
    )
    .unwrap()
}

/// One replica: a selection core over workers a and b, with its own shared-state handle.
async fn replica(url: &str) -> (Arc<SelectionCore>, Arc<SharedState>) {
    replica_with(url, CoreConfig::default()).await
}

async fn replica_with(
    url: &str,
    core_config: CoreConfig,
) -> (Arc<SelectionCore>, Arc<SharedState>) {
    let metrics = Metrics::new();
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(3),
            allow_pins: true,
            ..core_config
        },
        metrics.clone(),
    );
    core.apply_snapshot(vec![
        WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1])),
        WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![2])),
    ])
    .unwrap();
    let shared = SharedState::new(config(url, 500), &metrics.registry).unwrap();
    core.attach_shared(Arc::clone(&shared));
    (core, shared)
}

fn partition() -> PartitionKey {
    PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    }
}

fn request(id: &str, session: &str) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(vec![9; 64]),
        session_id: Some(session.into()),
        holder: Holder::Api,
        ..Default::default()
    }
}

/// Runs the replica's next queued write (the writer task is not running in these tests).
async fn run_queued_write(shared: &SharedState, core: &SelectionCore) {
    let write = shared
        .writes_rx
        .lock()
        .await
        .as_mut()
        .unwrap()
        .recv()
        .await
        .unwrap();
    shared.write(core, write).await;
}

fn rank(core: &SelectionCore, name: &str) -> RankKey {
    let w = core
        .list_workers(None)
        .into_iter()
        .find(|w| w.record.spec.name == name)
        .unwrap();
    RankKey {
        worker_id: w.record.id,
        dp_rank: 0,
    }
}

#[test]
fn ranks_round_trip_and_garbage_is_no_binding() {
    let r = RankKey {
        worker_id: 1 << 52,
        dp_rank: 7,
    };
    assert_eq!(sessions::decode_rank(&sessions::encode_rank(r)), Some(r));
    for bad in ["", "1", "x:1", "1:y", "1:2:3"] {
        assert_eq!(sessions::decode_rank(bad), None, "{bad:?}");
    }
    let key = sessions::session_key("p", &partition(), "s");
    assert!(
        key.starts_with("p:session:") && key.ends_with(":s"),
        "{key}"
    );
}

#[test]
fn bad_flags_are_clear_errors_that_never_echo_the_password() {
    let err = SharedConfig::new(
        "http://:secret@host",
        None,
        None,
        "p",
        20,
        50,
        Duration::from_secs(1),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--shared-state") && !err.contains("secret"),
        "{err}"
    );
    let err = SharedConfig::new(
        "redis://h:1",
        None,
        None,
        "p",
        0,
        50,
        Duration::from_secs(1),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("--shared-state-timeout-ms"), "{err}");
    let missing = PathBuf::from("/nonexistent/password");
    let err = SharedConfig::new(
        "redis://h:1",
        Some(&missing),
        None,
        "p",
        20,
        50,
        Duration::from_secs(1),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("--shared-state-password-file"), "{err}");
    let c = config("redis://user:hunter2@db.example:6380/2", 20);
    assert_eq!(c.redacted_url(), "redis://db.example:6380/2");
}

/// Two replicas bind the same new session to different ranks: the first write wins, the
/// second replica installs the winner; a replica that restarts (empty local table) finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_binding_wins_and_survives_a_restart() {
    let redis = RedisServer::start();
    redis.ready().await;
    let (core_a, shared_a) = replica(&redis.url()).await;
    let (core_b, shared_b) = replica(&redis.url()).await;
    let (a, b) = (rank(&core_a, "a"), rank(&core_a, "b"));
    let key = sessions::session_key("t", &partition(), "s1");
    let ours = |r| sessions::encode_rank(r);
    assert_eq!(
        shared_a.claim(&key, None, &ours(a)).await,
        Ok((0, ours(a))),
        "absent: written"
    );
    assert_eq!(
        shared_b.claim(&key, None, &ours(b)).await,
        Ok((3, ours(a))),
        "another replica's binding wins"
    );
    assert_eq!(
        shared_a.claim(&key, None, &ours(a)).await,
        Ok((1, ours(a))),
        "a refresh"
    );
    assert_eq!(
        shared_b.claim(&key, Some(&ours(a)), &ours(b)).await,
        Ok((2, ours(b))),
        "replacing the binding it saw"
    );

    // Through the selection path: B picks for a session A bound; it installs A's binding.
    let job = core_b.session_lookup(Some("m"), "", Some("s2"));
    assert!(job.is_some(), "no local binding: a lookup is due");
    let reservation = core_a.select_and_reserve(&request("r1", "s2")).unwrap();
    let bound = reservation.selection().primary.key;
    assert_eq!(
        reservation.selection().session,
        Some(SessionOutcome::Created)
    );
    let session_key = sessions::session_key("t", &partition(), "s2");
    // The writer is not running in this test: run A's queued write by hand.
    run_queued_write(&shared_a, &core_a).await;
    let mut conn = shared_a.connection();
    let stored: Option<String> = redis::cmd("GET")
        .arg(&session_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, Some(ours(bound)));
    for i in 0..3 {
        let job = core_b.session_lookup(Some("m"), "", Some("s2"));
        if let Some(job) = job {
            assert_eq!(i, 0, "looked up once, then served locally");
            core_b.prefetch_session(job).await;
        }
        let r = core_b
            .select_and_reserve(&request(&format!("b{i}"), "s2"))
            .unwrap();
        assert_eq!(r.selection().primary.key, bound, "replica B follows A");
        assert_eq!(r.selection().session, Some(SessionOutcome::Reused));
    }
    // A restarted replica starts with an empty table and finds the binding in Redis.
    let (core_c, _shared_c) = replica(&redis.url()).await;
    let job = core_c.session_lookup(Some("m"), "", Some("s2")).unwrap();
    core_c.prefetch_session(job).await;
    let r = core_c.select_and_reserve(&request("c0", "s2")).unwrap();
    assert_eq!(r.selection().primary.key, bound);
    assert_eq!(
        shared_b
            .metrics
            .sessions
            .with_label_values(&["remote_hit"])
            .get(),
        1
    );
}

/// A replica whose session table is full (every session has a request in flight) cannot follow
/// another replica's binding: that binding is valid and stays in Redis, never overwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_local_table_never_overwrites_a_remote_binding() {
    let redis = RedisServer::start();
    redis.ready().await;
    let (core_a, shared_a) = replica(&redis.url()).await;
    let mut config = CoreConfig::default();
    config.sessions.max_entries = 1;
    let (core_b, shared_b) = replica_with(&redis.url(), config).await;
    let (a, b) = (rank(&core_a, "a"), rank(&core_a, "b"));
    // B's only slot is leased by a session with a request in flight.
    let held = core_b.select_and_reserve(&request("held", "sx")).unwrap();
    assert_eq!(held.selection().session, Some(SessionOutcome::Created));
    // A bound s9 to rank a; B's pick for s9 (made before it saw A's) chose b.
    let key = sessions::session_key("t", &partition(), "s9");
    let ours = |r| sessions::encode_rank(r);
    assert_eq!(shared_a.claim(&key, None, &ours(a)).await, Ok((0, ours(a))));
    let mut selection = held.selection().clone();
    selection.primary.key = b;
    shared_b.after_pick(&selection, "s9", None);
    let mut queue = shared_b.writes_rx.lock().await;
    let queue = queue.as_mut().unwrap();
    for _ in 0..2 {
        // The held request's own write first, then s9's.
        let write = queue.recv().await.unwrap();
        shared_b.write(&core_b, write).await;
    }
    let mut conn = shared_a.connection();
    let stored: Option<String> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, Some(ours(a)), "A's valid binding survives");
    let events = &shared_b.metrics.sessions;
    assert_eq!(events.with_label_values(&["not_adopted_full"]).get(), 1);
    assert_eq!(events.with_label_values(&["adopted"]).get(), 0);
    drop(held);
}

/// A's bookings become B's remote load through one exchange each; once A stops publishing, its
/// entry expires and B routes on its own load again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_of_one_replica_are_load_for_the_other_until_it_dies() {
    let redis = RedisServer::start();
    redis.ready().await;
    let (core_a, shared_a) = replica(&redis.url()).await;
    let (core_b, shared_b) = replica(&redis.url()).await;
    let b_rank = rank(&core_a, "b");
    let mut held = Vec::new();
    for i in 0..6 {
        let mut r = request(&format!("h{i}"), "x");
        r.session_id = None;
        r.pin = Some(crate::selection::Pin {
            worker_id: b_rank.worker_id,
            dp_rank: None,
        });
        held.push(core_a.select_and_reserve(&r).unwrap());
    }
    let local_a = core_a.inner().local_loads();
    assert_eq!(local_a.len(), 1);
    // A's entry is written (and its TTL starts) inside this exchange, so its expiry is at least
    // `ttl` after this instant however long the steps below take on a loaded machine.
    let published = std::time::Instant::now();
    assert_eq!(
        load::exchange(&shared_a, &core_a).await.unwrap().len(),
        0,
        "alone so far"
    );
    let seen_by_b = load::exchange(&shared_b, &core_b).await.unwrap();
    assert_eq!(seen_by_b.get(&b_rank).map(|l| l.active_requests), Some(6));
    assert_eq!(shared_b.metrics.replicas.get(), 2);
    core_b.set_remote_loads(&seen_by_b);
    for i in 0..8u32 {
        let mut r = request(&format!("n{i}"), "x");
        r.session_id = None;
        r.prompt = PromptInput::Tokens(vec![100 + i; 64]);
        let pick = core_b.select_and_reserve(&r).unwrap();
        assert_ne!(
            pick.selection().primary.key,
            b_rank,
            "B avoids what A filled"
        );
    }
    drop(held);
    // A is gone without a word: its entry expires after the TTL (1 s here).
    let ttl = load_ttl(shared_a.config.interval);
    loop {
        let seen = load::exchange(&shared_b, &core_b).await.unwrap();
        if seen.is_empty() {
            break;
        }
        assert!(
            published.elapsed() < ttl * 10,
            "A's load did not expire: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Measured from before A published (not from here, which a loaded machine may reach late
    // in the TTL): the entry cannot expire sooner than its TTL; half of it is asserted, since
    // Redis expires keys on its own clock.
    assert!(
        published.elapsed() >= ttl / 2,
        "expired by TTL, not at once"
    );
    assert_eq!(shared_b.metrics.replicas.get(), 1);
}

/// Redis absent: every call fails within the timeout, the outage is counted once, the pick
/// goes on; when Redis appears the state is up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_picks_go_on_and_the_outage_is_counted_once() {
    let redis = RedisServer::start();
    let url = redis.url();
    // Not ready yet / nothing listening: point at a socket that does not exist.
    let missing = format!("unix://{}/absent.sock", redis.dir.display());
    let (core, shared) = replica(&missing).await;
    let started = std::time::Instant::now();
    for i in 0..5 {
        if let Some(job) = core.session_lookup(Some("m"), "", Some("s")) {
            core.prefetch_session(job).await;
        }
        let r = core
            .select_and_reserve(&request(&format!("r{i}"), "s"))
            .unwrap();
        let want = if i == 0 {
            SessionOutcome::Created
        } else {
            SessionOutcome::Reused
        };
        assert_eq!(
            r.selection().session,
            Some(want),
            "local affinity still works"
        );
    }
    assert!(
        load::exchange(&shared, &core).await.is_err(),
        "no Redis: the exchange fails"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!shared.is_up());
    assert_eq!(shared.metrics.up.get(), 0);
    assert_eq!(
        shared.metrics.outages.get(),
        1,
        "one outage, however many failures"
    );
    assert!(shared.metrics.errors.with_label_values(&["load"]).get() >= 1);
    redis.ready().await;
    let (core_ok, shared_ok) = replica(&url).await;
    load::exchange(&shared_ok, &core_ok).await.unwrap();
    assert!(shared_ok.is_up());
}

/// `rediss://` with `--shared-state-ca-file`: a TLS-only redis-server with a self-signed
/// certificate for 127.0.0.1; the exchange works with the CA given and fails without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_file() {
    let dir = std::env::temp_dir().join(format!("kvpick-redis-tls-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let (cert_pem, key_pem) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
    std::fs::write(&key_pem, cert.signing_key.serialize_pem()).unwrap();
    // redis-server cannot bind port 0 and report it: take a free port (TLS needs TCP).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
        .arg("--tls-cert-file")
        .arg(&cert_pem)
        .arg("--tls-key-file")
        .arg(&key_pem)
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server (apt-get install redis-server; e2e/setup.sh does)");
    let url = format!("rediss://127.0.0.1:{port}");
    let with_ca = SharedConfig::new(
        &url,
        None,
        Some(&cert_pem),
        "tls",
        500,
        10,
        Duration::from_secs(300),
    )
    .unwrap();
    let metrics = Metrics::new();
    let core = SelectionCore::new(CoreConfig::default(), metrics.clone());
    let shared = SharedState::new(with_ca, &metrics.registry).unwrap();
    let mut connected = false;
    for _ in 0..200 {
        if load::exchange(&shared, &core).await.is_ok() {
            connected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let without_ca = SharedState::new(config(&url, 500), &Metrics::new().registry).unwrap();
    let refused = load::exchange(&without_ca, &core).await.is_err();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(connected, "no TLS exchange with the CA file");
    assert!(refused, "an unknown CA must not verify");
}

/// A session's final request on one replica deletes the shared binding: a replica that looks
/// the session up afterwards finds none, and the releasing replica's own table has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_request_releases_the_shared_binding() {
    let redis = RedisServer::start();
    redis.ready().await;
    let (core_a, shared_a) = replica(&redis.url()).await;
    let (core_b, shared_b) = replica(&redis.url()).await;
    let r = core_a.select_and_reserve(&request("a0", "s")).unwrap();
    let bound = r.selection().primary.key;
    run_queued_write(&shared_a, &core_a).await;
    // B follows A's binding for the final request, then releases it everywhere.
    let job = core_b.session_lookup(Some("m"), "", Some("s")).unwrap();
    core_b.prefetch_session(job).await;
    let last = SelectionRequest {
        session_final: true,
        ..request("b-final", "s")
    };
    let r = core_b.select_and_reserve(&last).unwrap();
    assert_eq!(r.selection().primary.key, bound, "routed on the binding");
    assert_eq!(r.selection().session, Some(SessionOutcome::Released));
    run_queued_write(&shared_b, &core_b).await;
    let mut conn = shared_b.connection();
    let stored: Option<String> = redis::cmd("GET")
        .arg(sessions::session_key("t", &partition(), "s"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, None, "the key is gone");
    assert_eq!(
        shared_b
            .metrics
            .sessions
            .with_label_values(&["released"])
            .get(),
        1
    );
    assert!(
        core_b.session_lookup(Some("m"), "", Some("s")).is_some(),
        "no local binding left"
    );
    let (core_c, _shared_c) = replica(&redis.url()).await;
    let job = core_c.session_lookup(Some("m"), "", Some("s")).unwrap();
    core_c.prefetch_session(job).await;
    assert!(
        core_c.session_lookup(Some("m"), "", Some("s")).is_some(),
        "nothing found to install"
    );
}

/// A child session's first request on a replica that knows neither it nor its parent: the
/// parent's binding (made by another replica) is looked up with the child's, so the child's
/// first pick can prefer the parent's rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_childs_lookup_brings_its_parents_binding_from_another_replica() {
    let redis = RedisServer::start();
    redis.ready().await;
    let (core_a, shared_a) = replica(&redis.url()).await;
    let (core_b, _shared_b) = replica(&redis.url()).await;
    let r = core_a.select_and_reserve(&request("a0", "p")).unwrap();
    let home = r.selection().primary.key;
    run_queued_write(&shared_a, &core_a).await;
    let job = core_b
        .session_tree_lookup(Some("m"), "", Some("c"), Some("p"))
        .unwrap();
    assert_eq!(job.parent_session_id.as_deref(), Some("p"));
    core_b.prefetch_session(job).await;
    let child = SelectionRequest {
        parent_session_id: Some("p".into()),
        ..request("b-child", "c")
    };
    let r = core_b.select_and_reserve(&child).unwrap();
    assert_eq!(r.selection().primary.key, home);
    let followed = core_b
        .metrics()
        .selection
        .session_events
        .with_label_values(&["parent_followed"])
        .get();
    assert_eq!(followed, 1);
    // Once the parent is bound here, a sibling's lookup asks only for its own session.
    let job = core_b
        .session_tree_lookup(Some("m"), "", Some("c2"), Some("p"))
        .unwrap();
    assert_eq!(job.parent_session_id, None);
}

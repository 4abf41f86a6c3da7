use super::*;
use crate::catalog::RankLayout;
use crate::request::PromptInput;
use crate::session::SessionOutcome;
use std::time::Duration;

/// Two one-rank workers `a` and `b` serving model `m` (shared with `api_tests`).
pub(super) fn core_with(config: CoreConfig) -> Core {
    let core = Core::new(config);
    let specs = vec![
        WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1])),
        WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![2])),
    ];
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    core
}

fn request(id: &str, holder: Holder) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(vec![7; 64]),
        holder,
        on_duplicate: if holder == Holder::Api {
            DuplicateId::Reject
        } else {
            DuplicateId::Suffix
        },
        ..Default::default()
    }
}

fn inflight(core: &Core) -> u64 {
    core.list_workers(None)
        .iter()
        .flat_map(|w| &w.loads)
        .map(|l| l.active_requests)
        .sum()
}

fn key_of(core: &Core, name: &str) -> RankKey {
    let record = core
        .records()
        .into_iter()
        .find(|r| r.spec.name == name)
        .unwrap();
    RankKey {
        worker_id: record.id,
        dp_rank: 0,
    }
}

/// Another replica's load steers picks here; this process reports only its own bookings.
#[test]
fn remote_load_steers_picks_and_local_loads_report_only_own_bookings() {
    let core = core_with(CoreConfig::default());
    let now = Instant::now();
    let (a, b) = (key_of(&core, "a"), key_of(&core, "b"));
    let busy = RankLoad {
        active_prefill_tokens: 0,
        active_decode_blocks: 400,
        active_requests: 12,
    };
    core.set_remote_loads(&HashMap::from([(a, busy)]));
    for i in 0..8 {
        let (s, _) = core
            .select_and_reserve(&request(&format!("r{i}"), Holder::Api), now)
            .unwrap();
        assert_eq!(s.primary.key, b, "pick {i} avoids the remotely loaded rank");
        core.free(&s.booking_id, Claim::Any, now);
    }
    let (s, _) = core
        .select_and_reserve(&request("held", Holder::Api), now)
        .unwrap();
    let local = core.local_loads();
    assert_eq!(local.len(), 1, "{local:?}");
    assert_eq!((local[0].0, local[0].1.active_requests), (b, 1));
    core.free(&s.booking_id, Claim::Any, now);
    core.set_remote_loads(&HashMap::new());
    assert!(core.local_loads().is_empty());
    let picks: std::collections::HashSet<RankKey> = (0..32)
        .map(|i| {
            let mut r = request(&format!("q{i}"), Holder::Api);
            r.prompt = PromptInput::Tokens(vec![1000 + i; 64]);
            let (s, _) = core.select(&r, now).unwrap();
            s.primary.key
        })
        .collect();
    assert_eq!(picks.len(), 2, "the remote load is gone: ties again");
}

/// A binding installed from elsewhere is followed like one made here, and reported by
/// `session_binding`; an unknown rank is refused.
#[test]
fn an_installed_session_binding_is_followed() {
    let core = core_with(CoreConfig::default());
    let now = Instant::now();
    let (a, b) = (key_of(&core, "a"), key_of(&core, "b"));
    let (key, bound, _) = core.session_binding(Some("m"), "", "s1", now).unwrap();
    assert_eq!(bound, None);
    let stranger = RankKey {
        worker_id: 999,
        dp_rank: 0,
    };
    assert_eq!(
        core.install_session_binding(&key, "s1", stranger, now).0,
        crate::session::Installed::UnknownRank
    );
    for target in [a, b] {
        assert!(core
            .install_session_binding(&key, "s1", target, now)
            .0
            .is_yes());
        for i in 0..4 {
            let mut r = request(&format!("{target:?}{i}"), Holder::Api);
            r.session_id = Some("s1".into());
            let (s, _) = core.select_and_reserve(&r, now).unwrap();
            assert_eq!(s.primary.key, target);
            assert_eq!(s.session, Some(SessionOutcome::Reused));
        }
        assert_eq!(
            core.session_binding(Some("m"), "", "s1", now).unwrap().1,
            Some(target)
        );
    }
    assert!(core.session_binding(Some("other"), "", "s1", now).is_none());
}

/// An API booking expires and its id is reused by a new booking: the first holder's late
/// free (its own generation) must not free the second.
#[test]
fn a_stale_free_never_frees_a_newer_booking_of_the_same_id() {
    let core = core_with(CoreConfig::default());
    let t0 = Instant::now();
    let (first, _) = core
        .select_and_reserve(&request("r", Holder::Api), t0)
        .unwrap();
    let (reaped, _) = core.reap_expired(t0 + Duration::from_secs(301));
    assert_eq!(reaped, 1);
    let (second, _) = core
        .select_and_reserve(&request("r", Holder::Api), t0)
        .unwrap();
    assert_eq!(second.booking_id, "r", "the id is free again");
    assert_ne!(first.generation, second.generation);
    let (freed, _) = core.free("r", Claim::Generation(first.generation), t0);
    assert!(
        !freed,
        "the first holder's free names a booking that is gone"
    );
    assert_eq!(inflight(&core), 1, "the second booking still counts");
    let (freed, _) = core.free("r", Claim::Generation(second.generation), t0);
    assert!(freed);
    assert_eq!((inflight(&core), core.live_bookings()), (0, 0));
}

/// A worker leaves with a booking, the id is booked again on another worker, then the catalog
/// pass that dropped the first forgets it: the registry must keep the new booking.
#[test]
fn dropping_a_worker_forgets_only_its_own_generation() {
    let core = core_with(CoreConfig::default());
    let now = Instant::now();
    let (first, _) = core
        .select_and_reserve(&request("r", Holder::Stream), now)
        .unwrap();
    let gone = first.primary.worker_name.clone();
    let keep = if gone == "a" { "b" } else { "a" };
    core.delete_source_worker("catalog", &gone, now).unwrap();
    assert_eq!(core.live_bookings(), 0);
    let (second, _) = core
        .select_and_reserve(&request("r", Holder::Stream), now)
        .unwrap();
    assert_eq!(second.primary.worker_name, keep);
    // A late free of the first booking (its stream ends now) is a no-op.
    assert!(!core.free("r", Claim::Generation(first.generation), now).0);
    assert_eq!(inflight(&core), 1);
    assert!(core.free("r", Claim::Generation(second.generation), now).0);
}

#[test]
fn the_api_frees_only_api_bookings_and_holds_a_bounded_number() {
    let core = core_with(CoreConfig {
        max_api_bookings: 2,
        ..CoreConfig::default()
    });
    let now = Instant::now();
    let (stream, _) = core
        .select_and_reserve(&request("s", Holder::Stream), now)
        .unwrap();
    assert!(
        !core.free("s", Claim::HeldBy(Holder::Api), now).0,
        "not the API's"
    );
    assert!(
        !core
            .mark_prefill_complete("s", Claim::HeldBy(Holder::Api), now)
            .0
    );
    assert_eq!(inflight(&core), 1);
    core.select_and_reserve(&request("x", Holder::Api), now)
        .unwrap();
    core.select_and_reserve(&request("y", Holder::Api), now)
        .unwrap();
    let err = core
        .select_and_reserve(&request("z", Holder::Api), now)
        .unwrap_err();
    assert_eq!(err.label(), "overloaded", "{err}");
    assert!(core.free("y", Claim::HeldBy(Holder::Api), now).0);
    // A refused duplicate does not use up the bound: "z" still fits after it.
    assert_eq!(
        core.select_and_reserve(&request("x", Holder::Api), now)
            .unwrap_err()
            .label(),
        "conflict"
    );
    core.select_and_reserve(&request("z", Holder::Api), now)
        .unwrap();
    assert!(core.free("s", Claim::Generation(stream.generation), now).0);
}

#[test]
fn only_api_bookings_expire() {
    let core = core_with(CoreConfig::default());
    let t0 = Instant::now();
    core.select_and_reserve(&request("s", Holder::Stream), t0)
        .unwrap();
    core.select_and_reserve(&request("a", Holder::Api), t0)
        .unwrap();
    let (reaped, _) = core.reap_expired(t0 + Duration::from_secs(3_600));
    assert_eq!(reaped, 1);
    assert_eq!(core.live_bookings(), 1);
    assert_eq!(inflight(&core), 1);
}

/// Repeated live ids are suffixed in O(1) tries: `#2`, then the generation.
#[test]
fn repeated_ids_get_distinct_suffixes() {
    let core = core_with(CoreConfig::default());
    let now = Instant::now();
    let ids: Vec<String> = (0..50)
        .map(|_| {
            core.select_and_reserve(&request("dup", Holder::Stream), now)
                .unwrap()
                .0
                .booking_id
        })
        .collect();
    assert_eq!(ids[0], "dup");
    assert_eq!(ids[1], "dup#2");
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 50);
    assert_eq!(core.live_bookings(), 50);
}

//! Routing: the echo after the headers response, header-only requests, the `--shared-state` session
//! lookup, flow control's queue.

use super::super::tests::*;
use super::super::*;
use crate::observability::metrics::Metrics;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpTrailers, ProcessingRequest};
use processing_response::Response as R;

#[test]
fn large_body_is_echoed_in_bounded_chunks() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let mut big = br#"{"model":"m","prompt":""#.to_vec();
    big.extend(std::iter::repeat_n(b'x', 200_000));
    big.extend_from_slice(br#""}"#);
    m.handle(post_headers()).unwrap();
    let step = m.handle(body(&big, true)).unwrap();
    let chunks: Vec<(&[u8], bool)> = step.responses[1..].iter().map(streamed).collect();
    assert_eq!(chunks.len(), big.len().div_ceil(MAX_BODY_CHUNK));
    assert!(chunks
        .iter()
        .all(|(c, _)| c.len() <= MAX_BODY_CHUNK && !c.is_empty()));
    assert!(chunks[..chunks.len() - 1].iter().all(|(_, eos)| !eos));
    assert!(chunks.last().unwrap().1);
    let joined: Vec<u8> = chunks.iter().flat_map(|(c, _)| c.to_vec()).collect();
    assert_eq!(joined, big);
}

#[test]
fn header_only_request_is_routed_at_once() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let step = m
        .handle(headers(
            &[(":method", "GET"), (":path", "/v1/models")],
            true,
        ))
        .unwrap();
    assert_eq!(step.responses.len(), 1);
    let mutation = header_mutation(&step.responses[0]);
    assert!(set_value(mutation, DESTINATION_HEADER).is_some());
    assert!(
        set_value(mutation, "x-request-id").is_some(),
        "minted request id"
    );
    assert_eq!(core.live_bookings(), 1);
    drop(m);
    assert_eq!(core.live_bookings(), 0, "dropped stream frees its booking");
}

/// `--shared-state`: a session this replica has no binding for waits for one lookup before its
/// pick (body and trailers are answered after routing); with Redis unreachable the lookup fails,
/// the request routes on local state, and the next one does not even try while Redis is down.
#[tokio::test]
async fn a_session_unknown_here_is_looked_up_before_its_pick_and_redis_down_never_fails_it() {
    let (core, _) = setup(default_pool(), ExtProcSettings::default());
    let config = crate::sources::shared::SharedConfig::new(
        "unix:///nonexistent/kvpick-test-redis.sock",
        None,
        None,
        "t",
        50,
        50,
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    let metrics = Metrics::new();
    let shared = crate::sources::shared::SharedState::new(config, &metrics.registry).unwrap();
    core.attach_shared(Arc::clone(&shared));
    let settings = Arc::new(ExtProcSettings::default());
    let session_headers = || {
        headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("x-session-id", "s-1"),
            ],
            false,
        )
    };
    let trailers = || ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };

    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(session_headers()).unwrap();
    assert!(m.handle(body(CHAT, false)).unwrap().responses.is_empty());
    let step = m.handle(trailers()).unwrap();
    assert!(
        step.responses.is_empty(),
        "nothing is answered before the pick"
    );
    let job = step
        .session_lookup
        .expect("no local binding: a lookup first");
    core.prefetch_session(job).await;
    assert!(!shared.is_up(), "the failed lookup opened an outage");
    let step = m.resume_after_lookup();
    assert_eq!(
        step.responses.len(),
        3,
        "headers, the body echo, then the trailers"
    );
    assert!(matches!(
        step.responses[0].response,
        Some(R::RequestHeaders(_))
    ));
    assert!(matches!(
        step.responses[2].response,
        Some(R::RequestTrailers(_))
    ));

    // The binding made on local state serves the next request; another session routes at
    // once too: no lookup is tried while Redis is down.
    for sid in ["s-1", "s-2"] {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        let mut h = session_headers();
        if let Some(processing_request::Request::RequestHeaders(hh)) = &mut h.request {
            for header in hh.headers.iter_mut().flat_map(|m| m.headers.iter_mut()) {
                if header.key == "x-session-id" {
                    header.raw_value = sid.as_bytes().to_vec();
                }
            }
        }
        m.handle(h).unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        assert!(step.session_lookup.is_none(), "{sid}: no lookup");
        assert_eq!(step.responses.len(), 2, "{sid}: routed at once");
    }
    assert_eq!(
        shared
            .metrics()
            .local_fallbacks
            .with_label_values(&["down"])
            .get(),
        1,
        "s-2 was routed on local state because Redis is down"
    );
}

/// Flow control through the state machine: one rank that takes one request at a time.
mod queue {
    use super::*;

    use std::time::Duration;

    /// Client priorities are clamped to the policy's bands: these tests queue in 9, 0 and -1.
    fn machine(core: &Arc<SelectionCore>) -> StreamMachine {
        let settings = rewrite_settings("objectives:\n  - {name: high, priority: 9}\n");
        StreamMachine::new(Arc::clone(core), Arc::new(settings))
    }

    fn request(id: &str, priority: &str) -> ProcessingRequest {
        headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("x-request-id", id),
                ("x-dynamo-request-priority", priority),
            ],
            false,
        )
    }

    /// Sends a request through; returns the step after its body.
    fn send(m: &mut StreamMachine, id: &str, priority: &str) -> Step {
        assert!(m
            .handle(request(id, priority))
            .unwrap()
            .responses
            .is_empty());
        m.handle(body(CHAT, true)).unwrap()
    }

    fn status(step: &Step) -> Option<u32> {
        step.responses
            .iter()
            .find_map(|r| match r.response.as_ref()? {
                R::ImmediateResponse(i) => Some(i.status.as_ref()?.code as u32),
                _ => None,
            })
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_stream_is_routed_when_capacity_frees_and_its_body_follows() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut first = machine(&core);
        let step = send(&mut first, "r1", "0");
        assert!(step.queue.is_none());
        assert_eq!(step.responses.len(), 2, "headers + body");
        let mut second = machine(&core);
        let mut step = send(&mut second, "r2", "0");
        assert!(step.responses.is_empty(), "nothing answered while queued");
        let waiter = step.queue.take().expect("queued");
        assert_eq!(core.waiting_requests(), 1);
        drop(first); // the first stream ends: its booking frees and releases the second
        let outcome = waiter.wait().await;
        let step = second.resume_after_queue(outcome);
        let m = header_mutation(&step.responses[0]);
        assert_eq!(
            set_value(m, DESTINATION_HEADER).as_deref(),
            Some("127.0.0.1:8000")
        );
        assert!(
            matches!(step.responses[1].response, Some(R::RequestBody(_))),
            "the held body is echoed after the headers"
        );
        assert_eq!(second.booking_id(), Some("r2"));
        assert_eq!(core.live_bookings(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn higher_priority_streams_are_released_first() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        let mut low = machine(&core);
        let low_waiter = send(&mut low, "low", "-1").queue.unwrap();
        let mut high = machine(&core);
        let high_waiter = send(&mut high, "high", "9").queue.unwrap();
        drop(running);
        let outcome = high_waiter.wait().await;
        assert_eq!(outcome.as_ref().unwrap().booking_id(), "high");
        let high_step = high.resume_after_queue(outcome);
        assert_eq!(status(&high_step), None);
        assert_eq!(core.waiting_requests(), 1, "the sheddable one still waits");
        drop(high);
        let outcome = low_waiter.wait().await;
        assert_eq!(outcome.unwrap().booking_id(), "low");
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_timeout_answers_503_and_429_for_sheddable() {
        let core = one_at_a_time(Duration::from_secs(2));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        for (priority, expected) in [("0", 503), ("-1", 429)] {
            let mut m = machine(&core);
            let waiter = send(&mut m, "w", priority).queue.unwrap();
            let started = tokio::time::Instant::now();
            let outcome = waiter.wait().await;
            assert_eq!(started.elapsed(), Duration::from_secs(2));
            let step = m.resume_after_queue(outcome);
            assert_eq!(status(&step), Some(expected));
            assert!(step.finished);
        }
        assert_eq!(core.waiting_requests(), 0);
        let text = core.metrics().render();
        assert!(
            text.contains(r#"kvpick_queue_rejected_total{priority="0",reason="timeout"} 1"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_gone_while_queued_leaves_the_queue_and_books_nothing() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        let mut gone = machine(&core);
        let waiter = send(&mut gone, "gone", "0").queue.unwrap();
        assert_eq!(core.waiting_requests(), 1);
        drop(waiter);
        drop(gone);
        assert_eq!(core.waiting_requests(), 0);
        drop(running);
        assert_eq!(
            core.live_bookings(),
            0,
            "nothing was released to the gone client"
        );
        let text = core.metrics().render();
        assert!(text.contains(r#"reason="cancelled"} 1"#), "{text}");
        assert!(
            text.contains(r#"kvpick_queue_depth{priority="0"} 0"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_after_its_release_frees_the_booking() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        let mut late = machine(&core);
        let waiter = send(&mut late, "late", "0").queue.unwrap();
        drop(running); // released: booked for "late"...
        assert_eq!(core.live_bookings(), 1);
        drop(waiter); // ...whose client went away before it read the outcome
        assert_eq!(core.live_bookings(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn bad_flow_headers_are_400() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut m = machine(&core);
        let h = headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("x-llm-d-slo-ttft-ms", "soon"),
            ],
            false,
        );
        m.handle(h).unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        assert_eq!(status(&step), Some(400));
    }
}

#[path = "route_scores_tests.rs"]
mod scores;

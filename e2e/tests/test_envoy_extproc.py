"""End-to-end: client -> real Envoy 1.40 -> ext_proc -> kvpick -> Envoy routes to the picked upstream.

All waiting is on conditions with deadlines (port files, admin endpoints, metrics, gates)."""

from __future__ import annotations

import hashlib
import json
import math
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from harness import Gate, chat_body, wait_until, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}
EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("readiness", "inference-extension", EXTPROC_SERVICE)


def post_chat(client, base, body=None, headers=None, path=CHAT):
    raw = json.dumps(body if body is not None else chat_body()).encode()
    return client.post(base + path, content=raw, headers={**JSON_CT, **(headers or {})})


def assert_kvpick_error(resp, status):
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text!r}"
    assert resp.text.startswith("kvpick: "), f"error body not from kvpick: {resp.text!r}"


def metric_or_zero(kv, name, **labels):
    return kv.metric(name, **labels) or 0.0


def assert_routed(resp, ports):
    """200 from a real upstream whose received routing headers agree with where it landed."""
    assert resp.status_code == 200, f"{resp.status_code}: {resp.text[:300]!r}"
    j = resp.json()
    assert j["port"] in ports, f"served by unexpected port {j['port']} (allowed {ports})"
    h = j["headers"]
    dest = f"127.0.0.1:{j['port']}"
    assert h.get("x-gateway-destination-endpoint") == dest, h
    # header vs envoy.lb dynamic metadata (route adds x-seen-metadata from DYNAMIC_METADATA)
    assert h.get("x-seen-metadata") == dest, h
    assert h.get("x-dynamo-worker-instance-id", "").isdigit(), h
    assert h.get("x-dynamo-dp-rank", "").isdigit(), h
    return j


# ------------------------------------------------------------------------------------------------
# routing basics (shared stack: worker w0 with rank 0 = upstream a, rank 1 = upstream b)


def test_chat_completion_lands_on_picked_rank(stack, upstreams, client):
    a, b = upstreams
    ports = {a.port, b.port}
    worker_ids = set()
    for _ in range(8):
        j = assert_routed(post_chat(client, stack.url()), ports)
        h = j["headers"]
        assert h["x-dynamo-dp-rank"] == ("0" if j["port"] == a.port else "1"), h
        assert "x-data-parallel-rank" not in h, "rank-per-port worker must not get X-data-parallel-rank"
        assert j["path"] == CHAT and j["method"] == "POST"
        worker_ids.add(h["x-dynamo-worker-instance-id"])
    assert len(worker_ids) == 1, f"both ranks belong to one worker, got ids {worker_ids}"


def test_one_mib_body_arrives_byte_identical(stack, upstreams, client):
    ports = {u.port for u in upstreams}
    body = json.dumps({
        "model": "m1",
        "messages": [{"role": "user", "content": "lorem ipsum dolor sit amet " * 40_000}],
        "temperature": 0.25,
        "x-unknown-field": {"kept": [1, 2, 3]},
    }, indent=1).encode()
    assert len(body) >= 1 << 20
    resp = client.post(stack.url() + CHAT, content=body, headers=JSON_CT)
    j = assert_routed(resp, ports)
    assert j["len"] == len(body)
    assert j["sha256"] == hashlib.sha256(body).hexdigest()


def test_sse_streams_through_before_upstream_finishes(stack, upstreams, client):
    ports = {u.port for u in upstreams}
    gate = Gate()
    events = []
    with client.stream("POST", stack.url() + CHAT, content=json.dumps(chat_body(stream=True)),
                       headers={**JSON_CT, **gate.headers()}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(l for l in lines if l.startswith("data:"))
        # The client holds the first event while the upstream is still blocked on the gate. The
        # upstream sets first_sent just after writing the event, so the client may read it first:
        # wait for the flag rather than assert it at once (the race a loaded run found).
        assert gate.first_sent.wait(10), "the upstream never finished sending event 1"
        assert not gate.final_sent.is_set(), "upstream finished before the client saw event 1"
        ev0 = json.loads(first[len("data:"):])
        assert ev0["seq"] == 0 and ev0["port"] in ports
        assert ev0["headers"]["x-gateway-destination-endpoint"] == f"127.0.0.1:{ev0['port']}"
        gate.release.set()
        events = [l[len("data:"):].strip() for l in lines if l.startswith("data:")]
    assert gate.released_in_time is True
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["seq"] for c in chunks] == [1, 2]
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    # response end of stream releases the booking
    wait_until(lambda: stack.kvpick.metric("kvpick_inflight_total") == 0, 15,
               desc="kvpick_inflight_total == 0 after the stream ended")


def test_get_without_body_is_routed(stack, upstreams, client):
    resp = client.get(stack.url() + "/v1/models")
    j = assert_routed(resp, {u.port for u in upstreams})
    assert j["method"] == "GET" and j["path"] == "/v1/models" and j["len"] == 0


# ------------------------------------------------------------------------------------------------
# errors


def test_malformed_json_is_400(stack, upstreams, client):
    before_up = sum(u.count() for u in upstreams)
    before = metric_or_zero(stack.kvpick, "kvpick_requests_total", status="400")
    resp = client.post(stack.url() + CHAT, content=b'{"model": "m1", "messages": [',
                       headers=JSON_CT)
    assert_kvpick_error(resp, 400)
    assert sum(u.count() for u in upstreams) == before_up, "a rejected request reached an upstream"
    wait_until(lambda: metric_or_zero(stack.kvpick, "kvpick_requests_total", status="400")
               >= before + 1, 10, desc='kvpick_requests_total{status="400"} incremented')


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "no model"}]},
    {"model": 7, "messages": [{"role": "user", "content": "model not a string"}]},
], ids=["missing", "not-a-string"])
def test_missing_model_is_400(stack, upstreams, client, body):
    before_up = sum(u.count() for u in upstreams)
    assert_kvpick_error(post_chat(client, stack.url(), body), 400)
    assert sum(u.count() for u in upstreams) == before_up


def test_body_over_max_body_bytes_is_413(make_stack, make_upstream, client):
    up = make_upstream()
    s = make_stack([worker("w0", ports=[up.port])], max_body_bytes=4096, name="maxbody")
    small = chat_body(content="x" * 1000)
    assert_routed(post_chat(client, s.url(), small), {up.port})
    big = chat_body(content="y" * 16_384)
    resp = post_chat(client, s.url(), big)
    assert_kvpick_error(resp, 413)
    assert up.count() == 1, "the oversized request must not reach the upstream"
    wait_until(lambda: metric_or_zero(s.kvpick, "kvpick_requests_total", status="413") >= 1, 10,
               desc='kvpick_requests_total{status="413"}')


def test_unknown_model_is_503(stack, upstreams, client):
    assert_kvpick_error(post_chat(client, stack.url(), chat_body(model="no-such-model")), 503)


# ------------------------------------------------------------------------------------------------
# catalog, health, reload


def ready_services(kv, want: str) -> bool:
    """Every readiness service reports ``want``. kvpick sets them one after the other, so a
    test waits for all of them rather than asserting the rest right after the first."""
    return all(kv.health(svc) == want for svc in READY_SERVICES)


def test_health_serving_with_workers(stack):
    kv = stack.kvpick
    wait_until(lambda: kv.health("liveness") == "SERVING", 20, desc="liveness SERVING")
    # The catalog is applied and the statuses published by tasks of their own: wait for the
    # state, never assert one they may not have reached yet.
    wait_until(lambda: ready_services(kv, "SERVING"), 20,
               desc="every readiness service SERVING with a worker in the catalog")


def test_empty_catalog_503_not_ready_then_ready_after_reload(make_stack, make_upstream, client):
    s = make_stack([], name="empty")
    kv = s.kvpick
    wait_until(lambda: kv.health("liveness") == "SERVING", 20, desc="liveness SERVING")
    wait_until(lambda: ready_services(kv, "NOT_SERVING"), 20,
               desc="every readiness service NOT_SERVING with an empty catalog")
    assert_kvpick_error(post_chat(client, s.url()), 503)
    wait_until(lambda: metric_or_zero(kv, "kvpick_requests_total", status="503") >= 1, 10,
               desc='kvpick_requests_total{status="503"}')

    up = make_upstream()
    kv.write_catalog([worker("w0", ports=[up.port])])
    wait_until(lambda: ready_services(kv, "SERVING"), 20,
               desc="every readiness service SERVING after the catalog gained a worker")
    assert_routed(post_chat(client, s.url()), {up.port})


def test_catalog_rewrite_removes_worker(make_stack, make_upstream, client):
    a, b = make_upstream("a"), make_upstream("b")
    s = make_stack([worker("w0", ports=[a.port]), worker("w1", ports=[b.port])], name="reload")
    seen = set()

    def both_used():
        seen.add(assert_routed(post_chat(client, s.url()), {a.port, b.port})["port"])
        return seen == {a.port, b.port}

    wait_until(both_used, 30, interval=0, desc="both workers receive requests")

    s.kvpick.write_catalog([worker("w0", ports=[a.port])])
    streak = [0]

    def only_a():
        port = assert_routed(post_chat(client, s.url()), {a.port, b.port})["port"]
        streak[0] = streak[0] + 1 if port == a.port else 0
        return streak[0] >= 20

    wait_until(only_a, 30, interval=0, desc="20 consecutive requests avoid the removed worker")
    b_count = b.count()
    for _ in range(20):
        assert_routed(post_chat(client, s.url()), {a.port})
    assert b.count() == b_count


# ------------------------------------------------------------------------------------------------
# subset hint and header hygiene


def test_subset_hint_restricts_pick(stack, upstreams, client):
    a, b = upstreams
    for _ in range(20):
        assert_routed(post_chat(client, stack.url("hint_b")), {b.port})
    for _ in range(20):
        assert_routed(post_chat(client, stack.url("hint_csv")), {a.port})
    for _ in range(5):
        assert_routed(post_chat(client, stack.url("hint_ip")), {a.port, b.port})


def test_subset_hint_matching_nothing_is_503(stack, upstreams, client):
    before_up = sum(u.count() for u in upstreams)
    assert_kvpick_error(post_chat(client, stack.url("hint_none")), 503)
    assert sum(u.count() for u in upstreams) == before_up


def test_client_supplied_routing_headers_are_replaced(stack, upstreams, client):
    ports = {u.port for u in upstreams}
    spoof = {
        "x-gateway-destination-endpoint": "127.0.0.1:1",
        "x-gateway-destination-endpoint-served": "127.0.0.1:2",
        "x-gateway-destination-endpoint-fallback": "127.0.0.1:3",
        "x-gateway-inference-fairness-id": "tenant-x",
        # a target model (read as llm-d-router reads it: docs/headers.md), never forwarded
        "x-gateway-model-name-rewrite": "m1",
    }
    for _ in range(5):
        h = assert_routed(post_chat(client, stack.url(), headers=spoof), ports)["headers"]
        for name in spoof:
            if name != "x-gateway-destination-endpoint":
                assert name not in h, f"client-supplied {name} reached the upstream"


def test_llm_d_s_fairness_header_counts_under_its_tenant(stack, upstreams, client):
    """Issue 46: three requests naming their tenant in llm-d-router's current header, through
    Envoy, are counted under that tenant (docs/headers.md)."""
    ports = {u.port for u in upstreams}
    kv = stack.kvpick
    before = metric_or_zero(kv, "llm_d_epp_request_total", fairness_id="tenant-zz7")
    for _ in range(3):
        assert_routed(post_chat(client, stack.url(),
                                headers={"x-llm-d-inference-fairness-id": "tenant-zz7"}), ports)
    wait_until(lambda: metric_or_zero(kv, "llm_d_epp_request_total",
                                      fairness_id="tenant-zz7") == before + 3, 15,
               desc="three requests counted under fairness_id=tenant-zz7")


# ------------------------------------------------------------------------------------------------
# endpoint scores (--emit-endpoint-scores): envoy.lb x-gateway-destination-endpoint-scores


def scores_envoy_config():
    """The reference config with the scores metadata copied into a request header the upstream
    echoes (as x-seen-metadata shows the destination)."""
    cfg = harness.load_envoy_template()
    for listener in cfg["static_resources"]["listeners"]:
        for vh in harness._hcm(listener)["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                route.setdefault("request_headers_to_add", []).append({
                    "header": {"key": "x-seen-scores", "value":
                               "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-scores)%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
    return cfg


def test_endpoint_scores_reach_envoy(make_stack, make_upstream, client):
    ups = [make_upstream(f"s{i}") for i in range(3)]
    ports = {u.port for u in ups}
    s = make_stack([worker(f"w{i}", ports=[u.port]) for i, u in enumerate(ups)], name="scores",
                   envoy_config=scores_envoy_config(),
                   extra_args=["--emit-endpoint-scores", "--endpoint-scores-limit", "2"])
    for _ in range(5):
        j = assert_routed(post_chat(client, s.url()), ports)
        dest = j["headers"]["x-gateway-destination-endpoint"]
        scores = json.loads(j["headers"]["x-seen-scores"])
        # Three candidates, a limit of 2: the destination and the best other one.
        assert len(scores) == 2, scores
        assert dest in scores, (scores, dest)
        assert set(scores) <= {f"127.0.0.1:{p}" for p in ports}, scores
        assert all(0 < v <= 1 for v in scores.values()), scores
    # The documented access-log format shows the same struct (Envoy flushes its log on a timer).
    log = s.envoy.access_log
    wait_until(lambda: log.exists() and "scores={" in log.read_text(), 30,
               desc="the access log prints envoy.lb:x-gateway-destination-endpoint-scores")


def test_endpoint_scores_are_off_by_default(make_stack, make_upstream, client):
    ups = [make_upstream(f"o{i}") for i in range(2)]
    s = make_stack([worker(f"w{i}", ports=[u.port]) for i, u in enumerate(ups)],
                   name="noscores", envoy_config=scores_envoy_config())
    for _ in range(3):
        h = assert_routed(post_chat(client, s.url()), {u.port for u in ups})["headers"]
        assert h.get("x-seen-scores", "") in ("", "-"), h


# ------------------------------------------------------------------------------------------------
# data-parallel ranks multiplexed behind one port


def test_multiplexed_dp_ranks(make_stack, make_upstream, client):
    up = make_upstream("dp")
    s = make_stack([worker("w1", port=up.port, dp_size=2)], name="dp")
    ranks = []
    ids = set()
    for _ in range(40):
        h = assert_routed(post_chat(client, s.url()), {up.port})["headers"]
        rank = h.get("x-data-parallel-rank")
        assert rank in {"0", "1"}, h
        assert h["x-dynamo-dp-rank"] == rank, h
        ranks.append(rank)
        ids.add(h["x-dynamo-worker-instance-id"])
    assert set(ranks) == {"0", "1"}, f"only rank(s) {set(ranks)} used in 40 requests"
    assert len(ids) == 1


# ------------------------------------------------------------------------------------------------
# bookings


def test_client_disconnect_mid_stream_frees_booking(stack, upstreams, client):
    kv = stack.kvpick
    wait_until(lambda: kv.metric("kvpick_inflight_total") == 0, 15, desc="no booking to start with")
    gate = Gate()
    with client.stream("POST", stack.url() + CHAT, content=json.dumps(chat_body(stream=True)),
                       headers={**JSON_CT, **gate.headers(forever=True)}) as resp:
        assert resp.status_code == 200
        # keep a reference to the line iterator: dropping it would close the response early
        lines = resp.iter_lines()
        first = next(l for l in lines if l.startswith("data:"))
        port = json.loads(first[len("data:"):])["port"]
        rank = "0" if port == upstreams[0].port else "1"
        wait_until(lambda: kv.metric("kvpick_inflight_total") == 1, 15,
                   desc="kvpick_inflight_total == 1 while streaming")
        assert kv.metric("kvpick_inflight_requests", worker="w0", rank=rank) == 1
        # leave mid-stream: close the response and the client's connection
    client.close()
    assert gate.disconnected.wait(20), "upstream never noticed the client went away"
    wait_until(lambda: kv.metric("kvpick_inflight_total") == 0, 20,
               desc="kvpick_inflight_total back to 0 after the client disconnected")
    assert kv.metric("kvpick_inflight_requests", worker="w0", rank=rank) == 0


# ------------------------------------------------------------------------------------------------
# transport


@pytest.mark.parametrize("secure", [True, False], ids=["tls", "h2c"])
def test_transport_modes_route(make_stack, make_upstream, client, secure):
    up = make_upstream()
    s = make_stack([worker("w0", ports=[up.port])], secure=secure,
                   name="tls" if secure else "h2c")
    for _ in range(3):
        assert_routed(post_chat(client, s.url()), {up.port})
    if secure:
        assert harness.tls_alpn(s.kvpick.grpc_port) == "h2", "ext_proc port must negotiate ALPN h2"
    else:
        with pytest.raises((ssl.SSLError, OSError)):
            harness.tls_alpn(s.kvpick.grpc_port)
        # the same health services are on the ext_proc port (for Envoy's cluster health check)
        grpc_port = s.kvpick.grpc_port
        wait_until(lambda: s.kvpick.health("readiness", port=grpc_port) == "SERVING"
                   and s.kvpick.health("liveness", port=grpc_port) == "SERVING", 20,
                   desc="readiness and liveness SERVING on the ext_proc port")


# Istio's gateway names the EPP's cluster `outbound|PORT||SERVICE` and sends that name as the TLS
# SNI and as the gRPC `:authority` (Envoy's envoy_grpc authority defaults to the cluster name).
ISTIO_CLUSTER_NAME = "outbound|9002||kvpick.default.svc.cluster.local"


def istio_style_envoy_config(*, sni: str | None, authority: str | None):
    cfg = harness.load_envoy_template()
    kv = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvpick")
    tls_ctx = kv["transport_socket"]["typed_config"]
    tls_ctx.pop("sni", None)
    if sni is not None:
        tls_ctx["sni"] = sni
    if authority is not None:
        main = next(l for l in cfg["static_resources"]["listeners"]
                    if l["name"] == harness.MAIN_LISTENER)
        ext_proc = next(f for f in harness._hcm(main)["http_filters"]
                        if f["name"] == "envoy.filters.http.ext_proc")
        ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["authority"] = authority
    return cfg


@pytest.mark.parametrize(
    "secure,sni,authority",
    [
        (True, None, None),
        (True, ISTIO_CLUSTER_NAME, None),
        (True, None, ISTIO_CLUSTER_NAME),
        (True, ISTIO_CLUSTER_NAME, ISTIO_CLUSTER_NAME),
        (False, None, ISTIO_CLUSTER_NAME),
    ],
    ids=["tls-plain", "tls-istio-sni", "tls-istio-authority", "tls-istio-both",
         "h2c-istio-authority"],
)
def test_istio_style_sni_and_authority_route(make_stack, make_upstream, client, secure, sni,
                                             authority):
    up = make_upstream()
    s = make_stack([worker("w0", ports=[up.port])], secure=secure, name="istio",
                   envoy_config=istio_style_envoy_config(sni=sni, authority=authority))
    for _ in range(3):
        assert_routed(post_chat(client, s.url()), {up.port})
    assert_routed(post_chat(client, s.url(), headers={"x-session-id": "istio-1"}), {up.port})


# ------------------------------------------------------------------------------------------------
# volume + pick latency


def test_thousand_requests_and_pick_latency(stack, upstreams, client):
    kv = stack.kvpick
    ports = {u.port for u in upstreams}
    before = kv.metrics()
    ok_before = harness.metric_sum(before, "kvpick_requests_total", status="200") or 0
    epp_before = harness.metric_sum(before, "llm_d_epp_request_total") or 0
    _, _, sched_before = harness.histogram(before, "llm_d_epp_scheduler_e2e_duration_seconds")
    b_before, _, c_before = harness.histogram(before, "kvpick_pick_latency_seconds")

    n, workers = 1000, 4
    lock = threading.Lock()
    failures: list[str] = []

    def run(share: int) -> int:
        import httpx
        done = 0
        with httpx.Client(trust_env=False, timeout=60) as c:
            for _ in range(share):
                try:
                    assert_routed(post_chat(c, stack.url()), ports)
                    done += 1
                except Exception as exc:  # noqa: BLE001 - collected and asserted below
                    with lock:
                        failures.append(repr(exc)[:300])
        return done

    with ThreadPoolExecutor(workers) as pool:
        done = sum(pool.map(run, [n // workers] * workers))
    assert not failures, f"{len(failures)} of {n} failed, first: {failures[:3]}"
    assert done == n

    after = kv.metrics()
    ok_after = harness.metric_sum(after, "kvpick_requests_total", status="200") or 0
    b_after, s_after, c_after = harness.histogram(after, "kvpick_pick_latency_seconds")
    assert ok_after - ok_before == n
    # The EPP contract's series move with kvpick's (docs/observability.md, "Metric families").
    assert (harness.metric_sum(after, "llm_d_epp_request_total") or 0) - epp_before == n
    _, _, sched_after = harness.histogram(after, "llm_d_epp_scheduler_e2e_duration_seconds")
    assert sched_after - sched_before == c_after - c_before
    assert c_after - c_before >= n
    before_map = dict(b_before)
    delta = [(le, cnt - before_map.get(le, 0.0)) for le, cnt in b_after]
    p50 = harness.histogram_quantile(0.50, delta)
    p99 = harness.histogram_quantile(0.99, delta)
    assert not math.isnan(p50) and not math.isnan(p99)
    result = {
        "requests": n, "concurrency": workers, "picks_observed": c_after - c_before,
        "p50_seconds": p50, "p99_seconds": p99,
        "buckets": [[("+Inf" if math.isinf(le) else le), cnt] for le, cnt in delta],
        "kvpick_binary": str(harness.kvpick_binary()),
    }
    harness.WORK_ROOT.mkdir(parents=True, exist_ok=True)
    (harness.WORK_ROOT / "last-pick-latency.json").write_text(json.dumps(result, indent=2))
    print(f"\nkvpick pick latency over {n} requests through Envoy: "
          f"p50 ~ {p50 * 1e6:.1f} us, p99 ~ {p99 * 1e6:.1f} us "
          f"(histogram estimate; {harness.WORK_ROOT / 'last-pick-latency.json'})")
    wait_until(lambda: kv.metric("kvpick_inflight_total") == 0, 15,
               desc="no bookings left after the run")

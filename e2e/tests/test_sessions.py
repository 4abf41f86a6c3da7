"""End-to-end session affinity: client -> real Envoy -> ext_proc -> kvpick -> fake upstream ranks.

Every request's landing rank is read from what the upstream echoes (its own port plus the routing
headers it received). All waiting is on conditions with deadlines: metrics, the catalog reload
counter, gates, and (for the TTL) the passing of wall time re-checked in a bounded loop."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

import harness
from harness import Gate, wait_until, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}
SID = "x-dynamo-session-id"
EVENTS = "kvpick_session_events_total"
INVALIDATED = "kvpick_session_invalidated_total"
BINDINGS = "kvpick_session_bindings"


# ------------------------------------------------------------------------------------------------
# helpers


@dataclass(frozen=True)
class Landing:
    """The rank a request was served by, as the upstream saw it."""

    port: int
    worker_id: str
    dp_rank: str

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def landing(resp: httpx.Response, sent: bytes | None = None) -> Landing:
    """Asserts a 200 from a fake upstream whose routing headers agree with where it landed."""
    assert resp.status_code == 200, f"{resp.status_code}: {resp.text[:300]!r}"
    j = resp.json()
    h = j["headers"]
    dest = f"127.0.0.1:{j['port']}"
    assert h.get("x-gateway-destination-endpoint") == dest, h
    assert h.get("x-seen-metadata") == dest, h
    assert h.get("x-dynamo-worker-instance-id", "").isdigit(), h
    assert h.get("x-dynamo-dp-rank", "").isdigit(), h
    if sent is not None:
        assert j["len"] == len(sent) and j["sha256"] == hashlib.sha256(sent).hexdigest(), \
            "the body the upstream received differs from the one sent"
    return Landing(j["port"], h["x-dynamo-worker-instance-id"], h["x-dynamo-dp-rank"])


def post(client: httpx.Client, base: str, body: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> tuple[httpx.Response, bytes]:
    raw = json.dumps(body if body is not None else harness.chat_body()).encode()
    resp = client.post(base + CHAT, content=raw, headers={**JSON_CT, **(headers or {})})
    return resp, raw


def new_sid(tag: str = "s") -> str:
    return f"{tag}-{uuid.uuid4().hex}"


def m(kv: harness.Kvpick, name: str, **labels: str) -> float:
    return kv.metric(name, **labels) or 0.0


@dataclass
class SessionCounters:
    created: float
    reused: float
    table_full: float
    expired: float
    invalidated: float
    gone: float
    bindings: float

    @classmethod
    def read(cls, kv: harness.Kvpick) -> "SessionCounters":
        s = kv.metrics()

        def v(name: str, **labels: str) -> float:
            return harness.metric_sum(s, name, **labels) or 0.0

        return cls(
            created=v(EVENTS, event="created"),
            reused=v(EVENTS, event="reused"),
            table_full=v(EVENTS, event="table_full"),
            expired=v(EVENTS, event="expired"),
            invalidated=v(INVALIDATED),
            gone=v(INVALIDATED, reason="gone"),
            bindings=v(BINDINGS),
        )

    def minus(self, other: "SessionCounters") -> dict[str, float]:
        return {k: getattr(self, k) - getattr(other, k) for k in self.__dataclass_fields__}


@dataclass
class Conversation:
    """One chat session whose prompt grows by a user and an assistant message per turn."""

    sid: str
    header: str = SID
    model: str = "m1"
    messages: list[dict[str, str]] = field(default_factory=list)
    landings: list[Landing] = field(default_factory=list)
    echoes: list[str | None] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def turn(self, client: httpx.Client, base: str,
             extra_headers: dict[str, str] | None = None) -> Landing:
        if not self.messages:
            self.messages.append({"role": "system", "content": f"You are helping {self.sid}."})
        n = len(self.landings)
        self.messages.append({"role": "user",
                              "content": f"turn {n} of {self.sid}: {uuid.uuid4().hex} " * 4})
        body = {"model": self.model, "messages": self.messages}
        resp, raw = post(client, base, body, {self.header: self.sid, **(extra_headers or {})})
        where = landing(resp, raw)
        self.landings.append(where)
        self.echoes.append(resp.headers.get(SID))
        self.sizes.append(len(raw))
        self.messages.append({"role": "assistant",
                              "content": f"answer {n} from rank {where.endpoint} " * 4})
        return where


@pytest.fixture(scope="module")
def ranks4():
    """Four fake ranks: worker w0 = ports [0, 1], worker w1 = ports [2, 3]."""
    ups = [harness.Upstream(f"r{i}").start() for i in range(4)]
    yield ups
    for u in ups:
        u.stop()


def two_workers(ups: list[harness.Upstream]) -> list[dict[str, Any]]:
    return [worker("w0", ports=[ups[0].port, ups[1].port]),
            worker("w1", ports=[ups[2].port, ups[3].port])]


@pytest.fixture(scope="module")
def sstack(kvpick_bin, ranks4):
    """A module-wide kvpick + Envoy with default session settings over the four ranks."""
    s = harness.Stack(two_workers(ranks4), name="sessions")
    s.start()
    yield s
    s.stop()


@pytest.fixture
def client():
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(60.0)) as c:
        yield c


# ------------------------------------------------------------------------------------------------
# 1. many multi-turn sessions stay on their first rank


def test_200_sessions_5_turns_stick_to_first_rank(sstack, ranks4):
    kv = sstack.kvpick
    n_sessions, turns, concurrency = 200, 5, 8
    before = SessionCounters.read(kv)
    convs = [Conversation(new_sid("conv")) for _ in range(n_sessions)]
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()
    failures: list[str] = []

    def run(conv: Conversation) -> None:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(trust_env=False, timeout=60)
            with lock:
                clients.append(c)
        try:
            for _ in range(turns):
                conv.turn(c, sstack.url())
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            with lock:
                failures.append(f"{conv.sid} turn {len(conv.landings)}: {exc!r}"[:400])

    started = time.monotonic()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(run, convs))
    finally:
        for c in clients:
            c.close()
    elapsed = time.monotonic() - started

    followups = sum(max(0, len(c.landings) - 1) for c in convs)
    on_first = sum(sum(1 for l in c.landings[1:] if l == c.landings[0]) for c in convs if c.landings)
    fully_sticky = sum(1 for c in convs
                       if len(c.landings) == turns and len(set(c.landings)) == 1)
    spread = Counter(c.landings[0].endpoint for c in convs if c.landings)
    stickiness = on_first / followups if followups else float("nan")
    result = {
        "sessions": n_sessions, "turns_per_session": turns, "concurrency": concurrency,
        "requests_ok": sum(len(c.landings) for c in convs), "failures": len(failures),
        "followup_turns": followups, "followup_turns_on_first_rank": on_first,
        "stickiness": stickiness, "sessions_fully_sticky": fully_sticky,
        "first_rank_spread": dict(sorted(spread.items())), "seconds": round(elapsed, 3),
        "kvpick_binary": str(harness.kvpick_binary()),
    }
    harness.WORK_ROOT.mkdir(parents=True, exist_ok=True)
    out = harness.WORK_ROOT / "last-session-stickiness.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\nsession stickiness: {on_first}/{followups} follow-up turns on the first turn's rank "
          f"= {stickiness:.2%}; {fully_sticky}/{n_sessions} sessions fully sticky; first ranks "
          f"{dict(spread)}; {elapsed:.1f}s ({out})")

    assert not failures, f"{len(failures)} session(s) failed, first: {failures[:3]}"
    assert fully_sticky == n_sessions and stickiness == 1.0, \
        [(c.sid, [l.endpoint for l in c.landings]) for c in convs if len(set(c.landings)) > 1][:5]
    assert len(spread) > 1, f"all sessions landed on one rank: {spread}"
    for c in convs:
        assert c.echoes == [c.sid] * turns, (c.sid, c.echoes)
        assert all(a < b for a, b in zip(c.sizes, c.sizes[1:])), "the conversation must grow"
    ids = {l.endpoint: (l.worker_id, l.dp_rank) for c in convs for l in c.landings}
    assert len(set(ids.values())) == len(ids), f"two endpoints reported one rank: {ids}"
    d = SessionCounters.read(kv).minus(before)
    assert d["created"] == n_sessions, d
    assert d["reused"] == n_sessions * (turns - 1), d
    assert d["table_full"] == 0 and d["expired"] == 0 and d["invalidated"] == 0, d
    assert d["bindings"] == n_sessions, d


# ------------------------------------------------------------------------------------------------
# 2. concurrent first requests of one session converge on one binding


def test_50_concurrent_first_requests_of_one_session_share_a_rank(sstack):
    kv = sstack.kvpick
    n = 50
    sid = new_sid("burst")
    before = SessionCounters.read(kv)
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def one(i: int) -> None:
        with httpx.Client(trust_env=False, timeout=60) as c:
            raw = json.dumps(harness.chat_body()).encode()
            try:
                barrier.wait(timeout=30)
                resp = c.post(sstack.url() + CHAT, content=raw, headers={**JSON_CT, SID: sid})
                results[i] = (landing(resp, raw), resp.headers.get(SID))
            except Exception as exc:  # noqa: BLE001 - asserted below
                results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [r for r in results if not isinstance(r, tuple)]
    assert not errors, f"{len(errors)} of {n} failed, first: {errors[:3]}"
    ranks = Counter(r[0].endpoint for r in results)
    assert len(ranks) == 1, f"one session's concurrent first requests split over {ranks}"
    assert all(r[1] == sid for r in results), Counter(r[1] for r in results)
    d = SessionCounters.read(kv).minus(before)
    assert d["created"] == 1 and d["reused"] == n - 1, d
    assert d["bindings"] == 1, d


# ------------------------------------------------------------------------------------------------
# 3. fallback session headers and their precedence


@pytest.mark.parametrize("header", ["x-session-id", "x-claude-code-session-id", "session-id", "thread-id"])
def test_fallback_session_header_alone_is_sticky(sstack, client, header):
    kv = sstack.kvpick
    before = SessionCounters.read(kv)
    convs = [Conversation(new_sid("fb"), header=header) for _ in range(6)]
    for _ in range(4):
        for conv in convs:
            conv.turn(client, sstack.url())
    for conv in convs:
        assert len(set(conv.landings)) == 1, (header, [l.endpoint for l in conv.landings])
        assert conv.echoes == [conv.sid] * 4, (header, conv.echoes)
    d = SessionCounters.read(kv).minus(before)
    assert d["created"] == len(convs) and d["reused"] == 3 * len(convs), d


def test_dynamo_session_header_wins_over_x_session_id(sstack, client):
    kv = sstack.kvpick
    url = sstack.url()
    d_id = new_sid("dyn")
    d_rank = landing(post(client, url, headers={SID: d_id})[0])

    def bind_elsewhere():
        s_id = new_sid("xs")
        s_rank = landing(post(client, url, headers={"x-session-id": s_id})[0])
        return (s_id, s_rank) if s_rank != d_rank else None

    s_id, s_rank = wait_until(bind_elsewhere, 20, interval=0,
                              desc="an x-session-id session bound to another rank")
    before = SessionCounters.read(kv)
    orders = [{SID: d_id, "x-session-id": s_id}, {"x-session-id": s_id, SID: d_id}]
    for _ in range(3):
        for hdrs in orders:
            resp, raw = post(client, url, headers=hdrs)
            assert landing(resp, raw) == d_rank, \
                f"with both headers the request left {SID}'s rank {d_rank} for {resp.json()['port']}"
            assert resp.headers.get(SID) == d_id, resp.headers
    d = SessionCounters.read(kv).minus(before)
    assert d["created"] == 0 and d["reused"] == 6 and d["invalidated"] == 0, d
    # the x-session-id binding is untouched by the combined requests
    resp, raw = post(client, url, headers={"x-session-id": s_id})
    assert landing(resp, raw) == s_rank and resp.headers.get(SID) == s_id


# ------------------------------------------------------------------------------------------------
# 3b. session trees: a child's first pick joins its parent's rank; a final request releases


def fresh_body(tag: str) -> dict[str, Any]:
    """A prompt no other request shares: only the session headers can place it."""
    return {"model": "m1",
            "messages": [{"role": "user", "content": f"{tag} {uuid.uuid4().hex} " * 8}]}


def test_children_join_their_parents_rank_and_a_final_request_releases_the_binding(sstack, client):
    kv = sstack.kvpick
    url = sstack.url()
    followed = lambda: m(kv, EVENTS, event="parent_followed")  # noqa: E731
    before, followed_before = SessionCounters.read(kv), followed()
    parents = []
    for i in range(8):
        sid = new_sid("cc")
        resp, raw = post(client, url, fresh_body(f"parent {i}"),
                         {"x-claude-code-session-id": sid})
        parents.append((sid, landing(resp, raw)))
    # A Claude Code subagent (agent id) and an OpenCode child (parent session header), each
    # with a prompt unlike its parent's, land on the parent's rank.
    for i, (sid, home) in enumerate(parents):
        agent = {"x-claude-code-session-id": sid, "x-claude-code-agent-id": f"agent-{i}"}
        resp, raw = post(client, url, fresh_body(f"subagent {i}"), agent)
        assert landing(resp, raw) == home, (sid, resp.json()["port"], home)
        assert resp.headers.get(SID) == f"{sid}/agent-{i}", resp.headers
    for i, (sid, home) in enumerate(parents[:4]):
        child = {"x-dynamo-session-id": new_sid("oc-child"), "x-dynamo-parent-session-id": sid}
        resp, raw = post(client, url, fresh_body(f"child {i}"), child)
        assert landing(resp, raw) == home
    assert followed() - followed_before == 12
    d = SessionCounters.read(kv).minus(before)
    assert d["created"] == 8 + 12 and d["bindings"] == 8 + 12, d
    # Each parent's final request is routed on its binding, which is then released.
    released_before = m(kv, EVENTS, event="released")
    final_before = m(kv, INVALIDATED, reason="final")
    for sid, home in parents:
        hdrs = {"x-claude-code-session-id": sid, "x-dynamo-session-final": "true"}
        resp, raw = post(client, url, fresh_body("bye"), hdrs)
        assert landing(resp, raw) == home
    assert m(kv, EVENTS, event="released") - released_before == 8
    assert m(kv, INVALIDATED, reason="final") - final_before == 8
    d = SessionCounters.read(kv).minus(before)
    assert d["bindings"] == 12, d
    # The next request with a released id binds anew (created, not reused).
    created = SessionCounters.read(kv).created
    resp, raw = post(client, url, fresh_body("again"), {"x-claude-code-session-id": parents[0][0]})
    landing(resp, raw)
    assert SessionCounters.read(kv).created - created == 1


# ------------------------------------------------------------------------------------------------
# 4. a bound worker leaves the catalog


def test_removed_worker_moves_its_sessions_exactly_once(make_stack, make_upstream, client):
    ups = [make_upstream(f"g{i}") for i in range(4)]
    s = make_stack(two_workers(ups), name="gone", extra_args=["--catalog-poll-ms", "100"])
    kv, url = s.kvpick, s.url()
    w1_ports = {ups[2].port, ups[3].port}
    w0_ports = {ups[0].port, ups[1].port}
    convs: list[Conversation] = []

    def enough_on_each_worker():
        conv = Conversation(new_sid("mv"))
        conv.turn(client, url)
        convs.append(conv)
        on_w1 = sum(1 for c in convs if c.landings[0].port in w1_ports)
        return len(convs) >= 12 and on_w1 >= 3 and len(convs) - on_w1 >= 3

    wait_until(enough_on_each_worker, 30, interval=0, desc="sessions bound on both workers")
    moving = [c for c in convs if c.landings[0].port in w1_ports]
    staying = [c for c in convs if c.landings[0].port in w0_ports]
    before = SessionCounters.read(kv)
    applied = m(kv, "kvpick_catalog_reloads_total", result="applied")

    s.kvpick.write_catalog([worker("w0", ports=[ups[0].port, ups[1].port])])
    wait_until(lambda: m(kv, "kvpick_catalog_reloads_total", result="applied") > applied
               and m(kv, "kvpick_catalog_workers") == 1
               and m(kv, "kvpick_catalog_workers", lifecycle="Schedulable") == 1,
               20, desc="catalog without w1 applied")
    w1_count = ups[2].count() + ups[3].count()

    for conv in convs:
        conv.turn(client, url)
    d = SessionCounters.read(kv).minus(before)
    assert d["gone"] == len(moving), f"{len(moving)} sessions were on w1; deltas {d}"
    assert d["invalidated"] == d["gone"], d
    assert d["created"] == len(moving) and d["reused"] == len(staying), d
    for c in moving:
        assert c.landings[1].port in w0_ports, (c.sid, c.landings)
    for c in staying:
        assert c.landings[1] == c.landings[0], f"{c.sid} on the surviving worker moved: {c.landings}"

    for _ in range(3):
        for conv in convs:
            conv.turn(client, url)
    for conv in convs:
        assert len(set(conv.landings[1:])) == 1, \
            f"{conv.sid} did not stick to its new rank: {[l.endpoint for l in conv.landings]}"
        assert conv.echoes == [conv.sid] * 5, conv.echoes
    d = SessionCounters.read(kv).minus(before)
    assert d["gone"] == len(moving) and d["created"] == len(moving), \
        f"sessions moved more than once: {d}"
    assert d["reused"] == len(staying) + 3 * len(convs), d
    assert d["bindings"] == 0 and m(kv, BINDINGS) == len(convs), d
    assert ups[2].count() + ups[3].count() == w1_count, "a request reached the removed worker"


# ------------------------------------------------------------------------------------------------
# 5. a full session table still routes, without affinity


def test_full_session_table_evicts_idle_bindings_and_refuses_only_when_all_are_leased(
        make_stack, make_upstream, client):
    ups = [make_upstream(f"f{i}") for i in range(4)]
    s = make_stack(two_workers(ups), name="full", extra_args=["--session-max-entries", "5"])
    kv, url = s.kvpick, s.url()

    # 20 sessions of 2 turns each, one after the other: every one binds (the binding idle longest
    # makes room) and keeps its rank for its second turn; the table never grows past 5.
    convs = [Conversation(new_sid("full")) for _ in range(20)]
    for conv in convs:
        conv.turn(client, url)
        conv.turn(client, url)
        assert conv.echoes == [conv.sid, conv.sid], conv
        assert conv.landings[0] == conv.landings[1], conv
        assert m(kv, BINDINGS) <= 5
    assert m(kv, EVENTS, event="created") == 20 and m(kv, EVENTS, event="reused") == 20
    assert m(kv, INVALIDATED, reason="evicted") == 15
    assert m(kv, EVENTS, event="table_full") == 0

    # Five sessions with a request in flight fill the table with leased bindings: a new session is
    # routed without affinity (no echo), and counted.
    gates = [Gate() for _ in range(5)]
    done = []

    def hold(gate: Gate, sid: str) -> None:
        with httpx.Client(trust_env=False, timeout=60) as sc:
            body = json.dumps(harness.chat_body(stream=True)).encode()
            with sc.stream("POST", url + CHAT, content=body,
                           headers={**JSON_CT, SID: sid, **gate.headers()}) as resp:
                assert resp.status_code == 200
                for _ in resp.iter_lines():
                    pass
        done.append(sid)

    threads = [threading.Thread(target=hold, args=(g, new_sid("lease")), daemon=True)
               for g in gates]
    for t in threads:
        t.start()
    for g in gates:
        assert g.first_sent.wait(20), "a leased stream never started"
    resp, raw = post(client, url, headers={SID: new_sid("late")})
    landing(resp, raw)
    assert resp.headers.get(SID) is None, "a table full of leased sessions cannot bind"
    assert m(kv, EVENTS, event="table_full") == 1
    for g in gates:
        g.release.set()
    for t in threads:
        t.join(30)
    assert len(done) == 5
    assert m(kv, BINDINGS) == 5


# ------------------------------------------------------------------------------------------------
# 6. idle TTL


def wall_time_passed(since: float, seconds: float, desc: str) -> None:
    """Waits (bounded) until ``seconds`` of wall time have passed since ``since`` (monotonic)."""
    wait_until(lambda: time.monotonic() - since >= seconds, seconds + 5, desc=desc)


def test_session_ttl_expires_idle_bindings(make_stack, make_upstream, client):
    ups = [make_upstream(f"t{i}") for i in range(4)]
    s = make_stack(two_workers(ups), name="ttl", extra_args=["--session-ttl", "1"])
    kv, url = s.kvpick, s.url()

    def consistent(c: SessionCounters) -> bool:
        return c.bindings == c.created - c.expired - c.invalidated

    a, b, lease = Conversation(new_sid("ttl-a")), Conversation(new_sid("ttl-b")), new_sid("ttl-c")
    a.turn(client, url)
    a_idle = time.monotonic()
    b.turn(client, url)
    c0 = SessionCounters.read(kv)
    assert c0.created == 2 and consistent(c0), c0

    # A binding with an in-flight request does not idle: hold one of C's streams past the TTL.
    gate = Gate()
    with httpx.Client(trust_env=False, timeout=60) as sc:
        body = json.dumps(harness.chat_body(stream=True)).encode()
        with sc.stream("POST", url + CHAT, content=body,
                       headers={**JSON_CT, SID: lease, **gate.headers()}) as resp:
            assert resp.status_code == 200 and resp.headers.get(SID) == lease
            lines = resp.iter_lines()
            first = json.loads(next(l for l in lines if l.startswith("data:"))[len("data:"):])
            leased_at = time.monotonic()
            wall_time_passed(leased_at, 1.6, "the TTL passing while C's stream is open")
            before = SessionCounters.read(kv)
            r2, raw = post(client, url, headers={SID: lease})
            assert landing(r2, raw).port == first["port"], "a leased binding was dropped"
            d = SessionCounters.read(kv).minus(before)
            assert d["created"] == 0 and d["reused"] == 1, f"leased binding expired: {d}"
            gate.release.set()
            assert [l for l in lines if l.startswith("data:")][-1] == "data: [DONE]"

    # A's binding has idled past the TTL: its next request expires it and binds afresh.
    assert time.monotonic() - a_idle > 1.5
    before = SessionCounters.read(kv)
    a.turn(client, url)
    after = SessionCounters.read(kv)
    d = after.minus(before)
    assert after.expired - c0.expired >= 1, f"no expiry counted for an idle binding: {after}"
    assert d["created"] == 1 and d["reused"] == 0, f"A's expired binding was reused: {d}"
    assert a.echoes[-1] == a.sid and consistent(after), after

    # With no more traffic every binding idles out; the reaper (10 s period) empties the table.
    wait_until(lambda: m(kv, BINDINGS) == 0, 25, interval=0.2,
               desc="kvpick_session_bindings back to 0 after every session idled past the TTL")
    end = SessionCounters.read(kv)
    assert end.expired == end.created and end.invalidated == 0 and consistent(end), end
    # a reaped session starts over with a new binding (no second expiry for it)
    b.turn(client, url)
    d = SessionCounters.read(kv).minus(end)
    assert d["created"] == 1 and d["expired"] == 0 and d["bindings"] == 1, d


# ------------------------------------------------------------------------------------------------
# 7. session id length limit


@pytest.mark.parametrize("header", [SID, "x-session-id"])
def test_session_id_over_256_bytes_is_400(sstack, ranks4, client, header):
    kv = sstack.kvpick
    before_up = sum(u.count() for u in ranks4)
    bad400 = m(kv, "kvpick_requests_total", status="400")
    resp, _ = post(client, sstack.url(), headers={header: "L" * 257})
    assert resp.status_code == 400, f"{resp.status_code}: {resp.text[:200]!r}"
    assert resp.text.startswith("kvpick: 400:"), resp.text
    assert sum(u.count() for u in ranks4) == before_up, "the rejected request reached an upstream"
    wait_until(lambda: m(kv, "kvpick_requests_total", status="400") >= bad400 + 1, 10,
               desc='kvpick_requests_total{status="400"} incremented')

    sid = "E" * 240 + uuid.uuid4().hex[:16]
    assert len(sid.encode()) == 256
    first = None
    for _ in range(3):
        resp, raw = post(client, sstack.url(), headers={header: sid})
        where = landing(resp, raw)
        first = first or where
        assert where == first
        assert resp.headers.get(SID) == sid


# ------------------------------------------------------------------------------------------------
# 8. flag validation


@pytest.mark.parametrize("flag,value", [
    ("--session-ttl", "0"),
    ("--session-ttl", "31536001"),
    ("--session-max-entries", "0"),
])
def test_out_of_range_session_flags_refuse_to_start(kvpick_bin, flag, value):
    wd = harness.new_workdir("badflag")
    catalog = wd / "catalog.yaml"
    catalog.write_text(harness.catalog_yaml([worker("w0", ports=[1])]))
    argv = [str(kvpick_bin), "serve", "--config", str(catalog), "--bind", "127.0.0.1",
            "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
            "--port-file", str(wd / "ports.json"), flag, value]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"kvpick kept running with {flag} {value}: {exc.stdout!r} {exc.stderr!r}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"kvpick exited 0 with {flag} {value}: {out[-500:]}"
    assert flag in out, f"the error does not name {flag}: {out[-500:]}"


def test_in_range_session_flags_start(kvpick_bin):
    """Control for the test above: the same command line with in-range values serves."""
    kv = harness.Kvpick([worker("w0", ports=[1])], secure=False,
                        extra_args=["--session-ttl", "31536000", "--session-max-entries", "1"])
    try:
        kv.start()
        assert m(kv, BINDINGS) == 0
    finally:
        kv.stop()

"""Active-active replicas sharing state on a real Redis (``--shared-state``): two kvpick
replicas behind one Envoy whose ext_proc cluster balances streams round-robin over both.

1. Sessions stay on their worker whichever replica picks, and across a replica's SIGKILL and
   restart (its local table is empty; the bindings come from Redis).
2. Load one replica placed steers the other (and every replica subscribes to every engine's
   KV events).
3. Redis hung, then killed and restarted, under load: no request fails, the outage is counted
   and logged once, readiness stays, and the bindings are written again once Redis is back.
"""

from __future__ import annotations

import json
import threading
import uuid

import httpx

import harness
from harness import Gate, RedisServer, Replicas, wait_until, worker
from kv_events.publisher import KvEventPublisher

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}
SID = "x-session-id"


def shared_args(redis: RedisServer, *extra: str) -> list[str]:
    # A fresh prefix per test: tests sharing the Redis never see each other's keys.
    return ["--shared-state", redis.url, "--shared-state-prefix", f"t{uuid.uuid4().hex[:8]}",
            *extra]


def turn(client: httpx.Client, url: str, sid: str | None = None, **headers: str) -> int:
    """One request; the upstream port that served it."""
    h = {**JSON_CT, **headers}
    if sid:
        h[SID] = sid
    r = client.post(url + CHAT, headers=h, content=json.dumps(harness.chat_body()))
    assert r.status_code == 200, r.text
    return r.json()["port"]


def picks(kv: harness.Kvpick) -> float:
    return kv.metric("kvpick_requests_total", status="200") or 0


def test_sessions_stick_across_replicas_and_a_replica_restart(make_upstream, client):
    ups = [make_upstream(f"s{i}") for i in range(3)]
    redis = RedisServer().start()
    try:
        workers = [worker(f"w{i}", ports=[u.port]) for i, u in enumerate(ups)]
        with Replicas(workers, 2, name="sticky", extra_args=shared_args(redis)) as rep:
            url = rep.url()
            # An odd count: round-robin over two replicas then alternates each session's turns.
            sessions = [f"sess-{uuid.uuid4().hex[:8]}" for _ in range(11)]
            served: dict[str, set[int]] = {s: set() for s in sessions}
            for _ in range(3):
                for s in sessions:
                    served[s].add(turn(client, url, s))
            moved = {s: p for s, p in served.items() if len(p) != 1}
            assert not moved, f"sessions changed worker across replicas: {moved}"
            assert all(picks(k) > 0 for k in rep.kvpicks), "Envoy used both replicas"
            hits = sum(k.metric("kvpick_shared_state_sessions_total", event="remote_hit") or 0
                       for k in rep.kvpicks)
            assert hits >= len(sessions) // 2, "turns on the other replica followed Redis's binding"
            assert len({p for ports in served.values() for p in ports}) > 1, "spread by load"

            # A replica crashes and comes back empty: its sessions come from Redis.
            crashed = rep.kvpicks[1]
            crashed.kill()
            crashed.restart()
            rep.wait_healthy()
            for _ in range(2):
                for s in sessions:
                    served[s].add(turn(client, url, s))
            moved = {s: p for s, p in served.items() if len(p) != 1}
            assert not moved, f"sessions changed worker after the restart: {moved}"
            assert (crashed.metric("kvpick_shared_state_sessions_total", event="remote_hit")
                    or 0) >= 1, "the restarted replica looked its sessions up"
    finally:
        redis.stop()


def test_load_placed_by_one_replica_steers_the_other(make_upstream, client):
    ups = [make_upstream(f"l{i}") for i in range(2)]
    redis = RedisServer().start()
    gates = [Gate() for _ in range(6)]
    threads: list[threading.Thread] = []
    try:
        with KvEventPublisher("tcp://127.0.0.1", "tcp://127.0.0.1") as pub:
            workers = [
                worker("full", ports=[ups[0].port]),
                {**worker("free", ports=[ups[1].port]), "block_size": 16,
                 "kv_events": pub.endpoint, "kv_replay": pub.replay_endpoint},
            ]
            with Replicas(workers, 2, name="load",
                          extra_args=shared_args(redis, "--allow-pins")) as rep:
                a, b = rep.kvpicks
                # Every replica subscribes to every engine: one event reaches both.
                pub.store([41], token_ids=list(range(16)), block_size=16)
                for k in rep.kvpicks:
                    wait_until(lambda k=k: (k.metric("kvpick_kv_events_total", result="applied")
                                            or 0) >= 1, 20, desc=f"{k.process.label} applied")

                # Replica A fills worker "full" with six long (held) requests.
                # The worker id of "full", as kvpick tells the upstream it picked.
                for _ in range(40):
                    if turn(client, rep.via(0)) == ups[0].port:
                        break
                full_id = ups[0].received()[-1].headers["x-dynamo-worker-instance-id"]

                def hold(gate: Gate) -> None:
                    with httpx.Client(trust_env=False, timeout=60) as c:
                        body = json.dumps(harness.chat_body(stream=True))
                        with c.stream("POST", rep.via(0) + CHAT, content=body,
                                      headers={**JSON_CT, **gate.headers(),
                                               "x-dynamo-worker-instance-id": full_id}) as resp:
                            assert resp.status_code == 200
                            for _ in resp.iter_lines():
                                pass

                threads = [threading.Thread(target=hold, args=(g,), daemon=True) for g in gates]
                for t in threads:
                    t.start()
                for g in gates:
                    assert g.first_sent.wait(20), "a held request never started"
                assert all(r.port == ups[0].port for r in ups[0].received()[-6:])
                wait_until(lambda: (b.metric("kvpick_shared_state_remote_requests") or 0) >= 6,
                           5, desc="replica B counts A's six bookings")

                # Replica B places new requests: none on the worker A filled.
                placed = [turn(client, rep.via(1)) for _ in range(12)]
                assert placed == [ups[1].port] * 12, placed
                # A counts B from its own next load exchange, which may come after B's picks.
                wait_until(lambda: (a.metric("kvpick_shared_state_replicas") or 0) == 2, 5,
                           desc="replica A sees two live replicas")
                for g in gates:
                    g.release.set()
                for t in threads:
                    t.join(30)
                # final_sent is set just after the upstream's last write: wait for it.
                assert all(g.final_sent.wait(10) for g in gates), "held requests completed"
    finally:
        for g in gates:
            g.release.set()
        for t in threads:
            t.join(30)
        redis.stop()


def test_redis_hung_then_killed_and_restarted_under_load_fails_no_request(make_upstream):
    ups = [make_upstream(f"r{i}") for i in range(2)]
    redis = RedisServer().start()
    try:
        workers = [worker(f"w{i}", ports=[u.port]) for i, u in enumerate(ups)]
        prefix_args = shared_args(redis)
        prefix = prefix_args[prefix_args.index("--shared-state-prefix") + 1]
        with Replicas(workers, 2, name="outage", extra_args=prefix_args) as rep:
            url = rep.url()
            statuses: list[int] = []
            stop = threading.Event()
            sessions = [f"o-{uuid.uuid4().hex[:8]}" for _ in range(8)]

            def load() -> None:
                with httpx.Client(trust_env=False, timeout=30) as c:
                    i = 0
                    while not stop.is_set() and i < 5000:
                        h = {**JSON_CT, SID: sessions[i % len(sessions)]}
                        try:
                            r = c.post(url + CHAT, headers=h,
                                       content=json.dumps(harness.chat_body()))
                            statuses.append(r.status_code)
                        except httpx.HTTPError:
                            statuses.append(-1)
                        i += 1

            def more(n: int) -> None:
                target = len(statuses) + n
                wait_until(lambda: len(statuses) >= target, 60, desc=f"{n} more requests")

            def up_everywhere(value: int) -> bool:
                return all(k.metric("kvpick_shared_state_up") == value for k in rep.kvpicks)

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            more(20)
            assert redis.keys(f"{prefix}:session:*"), "bindings are in Redis"

            redis.pause()                       # hung: every call times out
            wait_until(lambda: up_everywhere(0), 10, desc="both replicas see Redis down")
            more(30)
            assert all(k.health("envoy.service.ext_proc.v3.ExternalProcessor") == "SERVING"
                       for k in rep.kvpicks), "readiness does not depend on Redis"
            redis.resume()
            wait_until(lambda: up_everywhere(1), 10, desc="Redis answers again")
            more(10)

            redis.kill()                        # gone, then back empty
            wait_until(lambda: up_everywhere(0), 10, desc="both replicas see Redis gone")
            more(30)
            redis.start()
            wait_until(lambda: up_everywhere(1), 10, desc="Redis is back")
            wait_until(lambda: len(redis.keys(f"{prefix}:session:*")) == len(sessions), 20,
                       desc="every live session is written again")
            wait_until(lambda: len(redis.keys(f"{prefix}:load:*")) == 2, 5,
                       desc="both replicas publish their load again")
            more(10)
            stop.set()
            loader.join(30)

            failed = [s for s in statuses if s != 200]
            assert not failed, f"{len(failed)} of {len(statuses)} requests failed: {failed[:10]}"
            for k in rep.kvpicks:
                # Two outages (hung, killed); a call racing Redis's return may open one more.
                outages = k.metric("kvpick_shared_state_outages_total") or 0
                assert outages >= 2
                assert (k.metric("kvpick_shared_state_local_fallbacks_total") or 0) + (
                    k.metric("kvpick_shared_state_sessions_total", event="dropped") or 0) >= 1
                logged = k.log().count("shared state unreachable")
                assert logged == outages, f"{k.process.label} logged {logged} of {outages} outages"
            reconciled = sum(k.metric("kvpick_shared_state_sessions_total", event="reconciled")
                             or 0 for k in rep.kvpicks)
            assert reconciled >= 1, "bindings lost with Redis were written back"
    finally:
        redis.stop()

"""Replica figures of issue 17: two or three kvpick replicas behind one Envoy (ext_proc streams
balanced round-robin over them), three fake workers, with and without ``--shared-state`` on a
real redis-server. Prints a Markdown table and writes target/bench-replicas.json.

- sticky: 20 sessions x 4 turns through the balanced listener (in a new random order each turn,
  so which replica a turn meets is not fixed by the round-robin's parity); sessions whose 4 turns
  all landed on one worker.
- load: replica 0 fills one worker with 12 long (held) requests; then 12 new requests through the
  other replicas; how many of them went to the filled worker.
- restart: 20 sessions x 2 turns, then replica 1 is SIGKILLed and restarted, then 2 more turns;
  sessions whose every turn landed on one worker.
- latency: the pick latency (kvpick_pick_latency_seconds: body end to routing answer, p50/p99
  estimated from the histogram) and the client round trip through Envoy (p50/p99), for 400
  sequential requests through replica 0: sessions it has bound already (local), and a new session
  every request (each pick waits for one Redis lookup: the worst case).

Run: ``cargo build --bin kvpick && .venv/bin/python e2e/bench_replicas.py`` (debug build; pass
``KVPICK_BIN=target/release/kvpick`` for release numbers).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx

import harness
from harness import Gate, RedisServer, Replicas, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}
SID = "x-session-id"
REPO = Path(__file__).resolve().parent.parent


def turn(client: httpx.Client, url: str, sid: str | None = None, **headers: str) -> int:
    h = {**JSON_CT, **headers}
    if sid:
        h[SID] = sid
    r = client.post(url + CHAT, headers=h, content=json.dumps(harness.chat_body()))
    r.raise_for_status()
    return r.json()["port"]


def sticky(rep: Replicas, client: httpx.Client) -> int:
    sessions = [f"st-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    served: dict[str, set[int]] = {s: set() for s in sessions}
    for _ in range(4):
        for s in shuffled(sessions):
            served[s].add(turn(client, rep.url(), s))
    return sum(len(p) == 1 for p in served.values())


def shuffled(sessions: list[str]) -> list[str]:
    # A new order every turn: which replica a turn meets is then as it is under real traffic, not
    # fixed by the round-robin's parity.
    order = list(sessions)
    random.shuffle(order)
    return order


def load(rep: Replicas, ups: list[harness.Upstream], client: httpx.Client, shared: bool) -> int:
    full = ups[0]
    for _ in range(60):
        if turn(client, rep.via(0)) == full.port:
            break
    full_id = full.received()[-1].headers["x-dynamo-worker-instance-id"]
    gates = [Gate() for _ in range(12)]

    def hold(gate: Gate) -> None:
        with httpx.Client(trust_env=False, timeout=120) as c:
            body = json.dumps(harness.chat_body(stream=True))
            with c.stream("POST", rep.via(0) + CHAT, content=body,
                          headers={**JSON_CT, **gate.headers(),
                                   "x-dynamo-worker-instance-id": full_id}) as resp:
                for _ in resp.iter_lines():
                    pass

    threads = [threading.Thread(target=hold, args=(g,), daemon=True) for g in gates]
    for t in threads:
        t.start()
    for g in gates:
        g.first_sent.wait(30)
    others = rep.kvpicks[1:]
    if shared:
        harness.wait_until(lambda: all((k.metric("kvpick_shared_state_remote_requests") or 0)
                                       >= 12 for k in others), 10, desc="remote load seen")
    placed = [turn(client, rep.via(1 + i % len(others))) for i in range(12)]
    for g in gates:
        g.release.set()
    for t in threads:
        t.join(60)
    return sum(p == full.port for p in placed)


def restart(rep: Replicas, client: httpx.Client) -> int:
    sessions = [f"rs-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    served: dict[str, set[int]] = {s: set() for s in sessions}
    for _ in range(2):
        for s in shuffled(sessions):
            served[s].add(turn(client, rep.url(), s))
    rep.kvpicks[1].kill()
    rep.kvpicks[1].restart()
    rep.wait_healthy()
    for _ in range(2):
        for s in shuffled(sessions):
            served[s].add(turn(client, rep.url(), s))
    return sum(len(p) == 1 for p in served.values())


def quantiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return (statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))])


def latency(rep: Replicas, client: httpx.Client, new_sessions: bool, n: int = 400) -> dict:
    kv = rep.kvpicks[0]
    sid = f"lat-{uuid.uuid4().hex[:8]}"
    turn(client, rep.via(0), sid)
    rtts = []
    samples = kv.metrics()
    before = harness.histogram(samples, "kvpick_pick_latency_seconds")[0]
    lookups_before = harness.histogram(samples, "kvpick_shared_state_lookup_seconds")[0]
    for i in range(n):
        s = f"lat-{uuid.uuid4().hex[:12]}" if new_sessions else sid
        t0 = time.perf_counter()
        turn(client, rep.via(0), s)
        rtts.append(time.perf_counter() - t0)
    samples = kv.metrics()
    after = harness.histogram(samples, "kvpick_pick_latency_seconds")[0]
    delta = [(le, c - dict(before).get(le, 0.0)) for le, c in after]
    lookups = [(le, c - dict(lookups_before).get(le, 0.0))
               for le, c in harness.histogram(samples, "kvpick_shared_state_lookup_seconds")[0]]
    p50, p99 = quantiles(rtts)
    return {
        "lookups": lookups[-1][1] if lookups else 0,
        "lookup_p50_ms": 1e3 * harness.histogram_quantile(0.5, lookups) if lookups else None,
        "lookup_p99_ms": 1e3 * harness.histogram_quantile(0.99, lookups) if lookups else None,
        "pick_p50_ms": 1e3 * harness.histogram_quantile(0.5, delta),
        "pick_p99_ms": 1e3 * harness.histogram_quantile(0.99, delta),
        "rtt_p50_ms": 1e3 * p50,
        "rtt_p99_ms": 1e3 * p99,
    }


def run(n: int, shared: bool) -> dict:
    ups = [harness.Upstream(f"w{i}").start() for i in range(3)]
    redis = RedisServer().start() if shared else None
    extra = ["--allow-pins"]
    if redis is not None:
        extra += ["--shared-state", redis.url]
    out: dict = {"replicas": n, "shared_state": shared}
    try:
        workers = [worker(f"w{i}", ports=[u.port]) for i, u in enumerate(ups)]
        with Replicas(workers, n, name=f"bench-{n}-{shared}", extra_args=extra) as rep, \
                httpx.Client(trust_env=False, timeout=60) as client:
            out["sticky_of_20"] = sticky(rep, client)
            out["to_filled_worker_of_12"] = load(rep, ups, client, shared)
            out["latency_local"] = latency(rep, client, new_sessions=False)
            out["latency_new_session"] = latency(rep, client, new_sessions=True)
            out["kept_after_restart_of_20"] = restart(rep, client)
    finally:
        if redis is not None:
            redis.stop()
        for u in ups:
            u.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    args = ap.parse_args()
    results = [run(n, shared) for n in args.replicas for shared in (False, True)]
    (REPO / "target").mkdir(exist_ok=True)
    (REPO / "target" / "bench-replicas.json").write_text(json.dumps(results, indent=2))
    print("| replicas | shared state | sticky (of 20, 4 turns) | new requests to the filled worker "
          "(of 12) | kept after a replica restart (of 20) | pick p50/p99 ms, local | pick p50/p99 "
          "ms, new session | Redis lookup p50/p99 ms | round trip p50/p99 ms, local | round trip "
          "p50/p99 ms, new session |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lo, new = r["latency_local"], r["latency_new_session"]
        print(f"| {r['replicas']} | {'redis' if r['shared_state'] else 'none'} "
              f"| {r['sticky_of_20']} | {r['to_filled_worker_of_12']} "
              f"| {r['kept_after_restart_of_20']} "
              f"| {lo['pick_p50_ms']:.3f} / {lo['pick_p99_ms']:.3f} "
              f"| {new['pick_p50_ms']:.3f} / {new['pick_p99_ms']:.3f} "
              + (f"| {new['lookup_p50_ms']:.3f} / {new['lookup_p99_ms']:.3f} " if new["lookups"]
                 else "| - ") +
              f"| {lo['rtt_p50_ms']:.2f} / {lo['rtt_p99_ms']:.2f} "
              f"| {new['rtt_p50_ms']:.2f} / {new['rtt_p99_ms']:.2f} |")
    harness.stop_all()
    harness.remove_workdirs()


if __name__ == "__main__":
    main()

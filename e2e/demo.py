"""kvpick demo: upstream model-server ranks + kvpick + a real Envoy, traffic through it, a result table.

Until the simulator lands (`kvpick sim`), the ranks are the e2e suite's fake upstreams: they answer
immediately and can hold SSE streams open. The demo shows (1) 300 chat requests with unrelated
prompts spread over the ranks, (2) 40 agent-style requests sharing a long system prompt following the
rank that already holds it, (3) 12 concurrent held streams spread by load, and (4) kvpick's own pick
latency from its metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import urllib.request

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import harness  # noqa: E402


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 30.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    return urllib.request.urlopen(req, timeout=timeout)


def main() -> int:
    ups = [harness.Upstream(f"rank{i}").start() for i in range(3)]
    workers = [harness.worker("vllm-0", ports=[ups[0].port, ups[1].port]),
               harness.worker("vllm-1", ports=[ups[2].port])]
    stack = harness.Stack(workers, name="demo").start()
    url = stack.url() + "/v1/chat/completions"
    try:
        # 1. Plain traffic, 4 at a time.
        def one(i: int) -> int:
            with post(url, harness.chat_body(content=f"request {i}")) as r:
                return json.loads(r.read())["port"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            served = list(pool.map(one, range(300)))

        # 2. Requests sharing a long system prompt follow the rank that served it first.
        system = "You are a coding agent. " + "Follow the repository conventions carefully. " * 60
        def shared(i: int) -> int:
            body = {"model": "m1", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": f"task {i}"}]}
            with post(url, body) as r:
                return json.loads(r.read())["port"]
        prefix_served = [shared(i) for i in range(40)]

        # 3. Twelve streams held open at once: their KV blocks make busy ranks costlier.
        gates = [harness.Gate() for _ in range(12)]
        responses = []
        for g in gates:
            r = post(url, harness.chat_body(stream=True), headers=g.headers())
            r.readline()  # first SSE event has arrived: the stream is live
            responses.append(r)
        held = {}
        for u in ups:
            held[u.port] = stack.kvpick.metric("kvpick_inflight_requests",
                                               worker="vllm-0" if u is not ups[2] else "vllm-1",
                                               rank="0" if u is not ups[1] else "1") or 0
        for g in gates:
            g.release.set()
        for r in responses:
            r.read()
            r.close()

        samples = stack.kvpick.metrics()
        buckets, total, count = harness.histogram(samples, "kvpick_pick_latency_seconds")
        p50 = harness.histogram_quantile(0.5, buckets) * 1e6
        p99 = harness.histogram_quantile(0.99, buckets) * 1e6

        print()
        print("kvpick demo: client -> Envoy 1.40 -> ext_proc kvpick -> picked rank")
        print()
        print("| rank (worker/dp) | endpoint | of 300 unrelated requests | of 40 shared-prefix requests | of 12 concurrent streams |")
        print("|---|---|---|---|---|")
        names = ["vllm-0/0", "vllm-0/1", "vllm-1/0"]
        for name, u in zip(names, ups):
            print(f"| {name} | {u.endpoint} | {served.count(u.port)} | {prefix_served.count(u.port)} "
                  f"| {int(held[u.port])} |")
        print()
        print(f"kvpick pick latency over {int(count)} picks: p50 ~{p50:.0f} us, p99 ~{p99:.0f} us "
              "(from kvpick_pick_latency_seconds)")
        print("policy: KV-aware cost (cached prefix vs. queued prefill vs. active KV blocks); without "
              "engine KV events kvpick remembers its own routing decisions (approximate mode)")
        return 0
    finally:
        stack.stop()
        for u in ups:
            u.stop()


if __name__ == "__main__":
    sys.exit(main())

"""Self-test of the KV-event publisher used by the interop tests (e2e/kv_events/publisher.py):
real ZeroMQ sockets on 127.0.0.1, a SUB for the live stream and a DEALER for replay, exactly as a
router talks to vLLM. No sleeps: every wait is a poll with a deadline."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

E2E_DIR = Path(__file__).resolve().parent.parent
if str(E2E_DIR) not in sys.path:
    sys.path.insert(0, str(E2E_DIR))

from kv_events import wire  # noqa: E402
from kv_events.publisher import END_SEQ, KvEventPublisher  # noqa: E402

TIMEOUT = 10.0


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def recv(sock: zmq.Socket, timeout: float = TIMEOUT) -> list[bytes]:
    if not sock.poll(int(timeout * 1000)):
        raise AssertionError(f"nothing received within {timeout}s")
    return sock.recv_multipart()


def subscribe(ctx: zmq.Context, pub: KvEventPublisher) -> tuple[zmq.Socket, int]:
    """SUB connected to ``pub`` that is known to receive (ZeroMQ's slow joiner: messages
    published before the subscription reaches the PUB are dropped). Publishes AllBlocksCleared
    probes until one arrives; returns the socket and the seq of the probe that arrived."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        pub.clear()
        if sub.poll(100):
            frames = sub.recv_multipart()
            # Nothing else is in flight: the next probe is only sent after a 100 ms silence.
            return sub, int.from_bytes(frames[1], "big")
    raise AssertionError("subscriber never received a probe")


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """DEALER replay request from ``start``; all reply messages up to and including the end
    marker, as the DEALER sees them (``[b"", seq, payload]``)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)  # a DEALER queues until connected: no slow-joiner issue
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        frames = recv(dealer)
        out.append(frames)
        if frames[-2] == END_SEQ:
            dealer.close()
            return out


@pytest.mark.parametrize("layout", wire.LAYOUTS)
def test_live_stream_frames_and_payload(ctx, layout):
    with KvEventPublisher("tcp://127.0.0.1", topic="kv", layout=layout, data_parallel_rank=1) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        sub, probe = subscribe(ctx, pub)
        seq = pub.store([0x11, -5], token_ids=list(range(32)), block_size=16)
        assert seq == probe + 1
        topic, seq_b, payload = recv(sub)
        assert topic == b"kv"
        assert int.from_bytes(seq_b, "big") == seq
        # The payload is what the engine's own struct types decode.
        ns = wire.structs(layout)
        batch = msgspec.msgpack.decode(payload, type=ns.EventBatch)
        ev = batch.events[0]
        if isinstance(ev, list):  # sglang-v2's EventBatch types events as list[Any]
            union = ns.BlockStored | ns.BlockRemoved | ns.AllBlocksCleared
            ev = msgspec.msgpack.decode(msgspec.msgpack.encode(ev), type=union)
        assert isinstance(ev, ns.BlockStored)
        assert ev.block_hashes == [0x11, -5]
        assert ev.token_ids == list(range(32))
        assert ev.block_size == 16
        if ns.rank_field:
            assert getattr(batch, ns.rank_field) == 1
        sub.close()


def test_replay_recovers_a_dropped_range(ctx):
    with KvEventPublisher("tcp://127.0.0.1", replay_endpoint="tcp://127.0.0.1") as pub:
        sub, probe = subscribe(ctx, pub)
        live = pub.store([1], token_ids=list(range(16)))
        dropped = [pub.store([h], token_ids=list(range(16)), send=False) for h in (2, 3, 4)]
        after = pub.remove([1])
        got = [int.from_bytes(recv(sub)[1], "big") for _ in range(2)]
        assert got == [live, after]  # the gap: dropped seqs never arrived live
        assert not sub.poll(50)

        buffered = dict(pub.buffered())
        msgs = replay(ctx, pub.replay_endpoint, dropped[0])
        *body, end = msgs
        assert end == [b"", END_SEQ, b""]
        seqs = [int.from_bytes(m[1], "big") for m in body]
        assert seqs == dropped + [after]
        for m in body:
            assert m[0] == b""
            assert m[2] == buffered[int.from_bytes(m[1], "big")]
        # Replay from 0 returns everything still buffered, probes included.
        everything = replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(m[1], "big") for m in everything[:-1]] == list(range(after + 1))
        assert pub.replays_served == 2
        sub.close()
    assert probe >= 0


def test_replay_past_the_end_and_bad_requests(ctx):
    with KvEventPublisher("tcp://127.0.0.1", replay_endpoint="tcp://127.0.0.1",
                          buffer_steps=3) as pub:
        for h in range(5):
            pub.store([h], send=False)
        # Only the last 3 are kept (a too-old start gets what is left: the gap stays visible).
        assert [int.from_bytes(m[1], "big") for m in replay(ctx, pub.replay_endpoint, 0)[:-1]] \
            == [2, 3, 4]
        assert replay(ctx, pub.replay_endpoint, 99) == [[b"", END_SEQ, b""]]
        # A malformed request (wrong frame count) is ignored; the socket keeps serving.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"x", b"y"])
        assert not dealer.poll(200)
        dealer.close()
        assert replay(ctx, pub.replay_endpoint, 4)[0][1] == (4).to_bytes(8, "big")


def test_trtllm_replay_variant_carries_the_topic(ctx):
    with KvEventPublisher("tcp://127.0.0.1", replay_endpoint="tcp://127.0.0.1", topic=b"t",
                          replay_with_topic=True) as pub:
        pub.clear(send=False)
        msgs = replay(ctx, pub.replay_endpoint, 0)
        assert msgs[0][:3] == [b"", b"t", (0).to_bytes(8, "big")]
        assert msgs[-1] == [b"", b"", END_SEQ, b""]


def test_restart_resets_seq_and_buffer_on_the_same_ports(ctx):
    with KvEventPublisher("tcp://127.0.0.1", replay_endpoint="tcp://127.0.0.1",
                          first_seq=1) as pub:
        sub, probe = subscribe(ctx, pub)
        assert probe >= 1
        pub.store([9], token_ids=list(range(16)))
        recv(sub)
        endpoints = (pub.endpoint, pub.replay_endpoint)
        pub.restart()
        assert (pub.endpoint, pub.replay_endpoint) == endpoints
        assert pub.next_seq == 0 and pub.buffered() == []
        # The same SUB reconnects by itself; probes (from seq 0) flow again.
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert time.monotonic() < deadline, "no message after restart"
            pub.clear()
            if sub.poll(100):
                first = int.from_bytes(sub.recv_multipart()[1], "big")
                break
        assert first < pub.next_seq
        seqs = [int.from_bytes(m[1], "big") for m in replay(ctx, pub.replay_endpoint, 0)[:-1]]
        assert seqs == list(range(pub.next_seq))
        sub.close()


def test_json_lines_cli(ctx):
    env = dict(os.environ, PYTHONPATH=str(E2E_DIR))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kv_events.publisher", "--replay-endpoint", "tcp://127.0.0.1",
         "--layout", "vllm-map", "--rank", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
    )
    pending = b""

    def readline() -> dict:
        nonlocal pending
        deadline = time.monotonic() + TIMEOUT
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            assert left > 0, "publisher CLI did not answer"
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                assert chunk, "publisher CLI exited"
                pending += chunk
        line, pending = pending.split(b"\n", 1)
        return json.loads(line)

    def call(req: dict) -> dict:
        proc.stdin.write((json.dumps(req) + "\n").encode())
        return readline()

    try:
        ready = readline()
        assert ready["ready"] and ready["replay_endpoint"].startswith("tcp://127.0.0.1:")
        ev = {"type": "BlockStored", "block_hashes": [{"bin": "00" * 24 + "0102030405060708"}],
              "parent_block_hash": None, "token_ids": list(range(16)), "block_size": 16}
        assert call({"op": "publish", "events": [ev], "ts": 1.5, "send": False}) == \
            {"ok": True, "seq": 0}
        assert call({"op": "raw", "payload_hex": "c0", "send": False})["seq"] == 1
        assert call({"op": "publish", "events": [{"type": "Nope"}]})["ok"] is False
        status = call({"op": "status"})
        assert (status["next_seq"], status["buffered"]) == (2, 2)
        msgs = replay(ctx, ready["replay_endpoint"], 0)
        batch = msgspec.msgpack.decode(msgs[0][2])
        assert batch["ts"] == 1.5 and batch["data_parallel_rank"] == 2
        assert batch["events"][0]["block_hashes"] == [bytes(24) + bytes(range(1, 9))]
        assert msgs[1][2] == b"\xc0"
        assert call({"op": "restart"})["ok"]
        assert call({"op": "status"})["next_seq"] == 0
        assert call({"op": "close"}) == {"ok": True}
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

#!/usr/bin/env python3
"""A real ZeroMQ KV-event publisher that behaves like vLLM's / SGLang's ``ZmqEventPublisher``.

Wire behaviour (matches ``vllm/distributed/kv_events.py``):

* PUB socket, one multipart message per batch: ``[topic, seq (8 bytes big-endian), payload]``;
  ``seq`` counts from 0 per publisher process (``first_seq`` lets a test mimic simulators that
  start at 1) and starts over on :meth:`KvEventPublisher.restart`.
* Optional ROUTER replay socket. A DEALER sends ``[b"", start_seq (8 bytes BE)]``; the ROUTER sees
  ``[identity, b"", start_seq]`` and answers, for every buffered batch with ``seq >= start_seq``,
  ``[identity, b"", seq, payload]`` (the DEALER receives ``[b"", seq, payload]``), then the end
  marker ``[identity, b"", (-1 as i64 BE = 0xFFFFFFFFFFFFFFFF), b""]``. Requests that are not 3
  frames are ignored, as vLLM does. ``replay_with_topic=True`` switches to TensorRT-LLM's variant,
  which inserts the topic frame: ``[identity, b"", topic, seq, payload]`` and
  ``[identity, b"", b"", END, b""]``.
* The replay buffer keeps the last ``buffer_steps`` batches (vLLM default 10 000), including
  batches that were *not* sent on PUB (``send=False``), which is how a test simulates a dropped
  range that a subscriber must recover by replay.

Payloads are built by ``wire.py`` from the engines' own msgspec structs (``layout`` picks vLLM's
array / mixed / map layout or SGLang's).

Python API (pytest)::

    with KvEventPublisher("tcp://127.0.0.1", replay_endpoint="tcp://127.0.0.1") as pub:
        pub.endpoint, pub.replay_endpoint          # actual tcp://127.0.0.1:PORT addresses
        seq = pub.store([0x11, 0x22], token_ids=list(range(32)), block_size=16)
        pub.remove([0x11])
        pub.clear()
        pub.publish([{"type": "BlockStored", ...}], send=False)   # "dropped": replay only
        pub.restart()                               # engine restart: seq back to 0, same ports

An endpoint without a port (``tcp://127.0.0.1``) binds a random free port.

CLI with a JSON-lines control interface (one request per stdin line, one reply per stdout line)::

    python e2e/kv_events/publisher.py --endpoint tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 [--layout vllm-array] [--topic T] [--rank 0]

    <- {"ready": true, "endpoint": "...", "replay_endpoint": "..."}
    -> {"op": "publish", "events": [{"type": "BlockStored", "block_hashes": [1], ...}],
        "ts": 1.5, "rank": 0, "layout": "sglang", "send": true}
    <- {"ok": true, "seq": 0}
    -> {"op": "raw", "payload_hex": "93...", "send": false}      (arbitrary payload bytes)
    -> {"op": "restart", "first_seq": 0}
    -> {"op": "status"}   <- {"ok": true, "next_seq": 2, "buffered": 2, ...}
    -> {"op": "close"}    (or EOF)

Hashes in JSON are ints or ``{"bin": "<hex>"}`` for vLLM's bytes hashes.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import zmq

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kv_events import wire  # noqa: E402
else:
    from . import wire

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HAS_PORT = re.compile(r"^tcp://[^/]+?(:\d+|:\*)$")

_DEFAULT_RANK = object()


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; a tcp endpoint without a port gets a random free one. Returns the bound address."""
    if endpoint.startswith("tcp://") and not _HAS_PORT.match(endpoint):
        sock.bind_to_random_port(endpoint)
    else:
        sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KvEventPublisher:
    """PUB + ROUTER-replay publisher (see the module docstring). Thread-safe."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1",
        replay_endpoint: Optional[str] = None,
        *,
        topic: str | bytes = b"",
        layout: str = "vllm-array",
        data_parallel_rank: Optional[int] = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        first_seq: int = 0,
        replay_with_topic: bool = False,
        replay_hwm: int = 0,
        ctx: Optional[zmq.Context] = None,
    ) -> None:
        wire.structs(layout)  # validate early
        self.layout = layout
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self.data_parallel_rank = data_parallel_rank
        self.replay_with_topic = replay_with_topic
        self._hwm = hwm
        # vLLM leaves the ROUTER at ZeroMQ's default SNDHWM (1000), so a replay longer than that to
        # a slow reader can silently lose messages; 0 (unlimited) keeps tests deterministic.
        self._replay_hwm = replay_hwm
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._lock = threading.Lock()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._next_seq = first_seq
        self._closed = False
        self._pub: Optional[zmq.Socket] = None
        self._router: Optional[zmq.Socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.replays_served = 0
        self.endpoint = self._open_pub(endpoint)
        self.replay_endpoint = self._open_router(replay_endpoint) if replay_endpoint else None

    # -- sockets ---------------------------------------------------------------------------------

    def _open_pub(self, endpoint: str) -> str:
        pub = self._ctx.socket(zmq.PUB)
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(self._hwm)
            bound = _bind(pub, endpoint)
        except BaseException:
            pub.close(linger=0)
            raise
        self._pub = pub
        return bound

    def _open_router(self, endpoint: str) -> str:
        router = self._ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, self._replay_hwm)
            bound = _bind(router, endpoint)
        except BaseException:
            router.close(linger=0)
            raise
        self._router = router
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve_replay, args=(router, self._stop), daemon=True, name="kv-replay"
        )
        self._thread.start()
        return bound

    def _serve_replay(self, router: zmq.Socket, stop: threading.Event) -> None:
        # The ROUTER belongs to this thread alone (ZeroMQ sockets are not thread-safe).
        try:
            while not stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue  # vLLM: "Invalid replay request", ignored
                client_id, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    batch = [(s, p) for s, p in self._buffer if s >= start_seq]
                for seq, payload in batch:
                    seq_b = seq.to_bytes(8, "big")
                    if self.replay_with_topic:
                        router.send_multipart([client_id, b"", self.topic, seq_b, payload])
                    else:
                        router.send_multipart([client_id, b"", seq_b, payload])
                if self.replay_with_topic:
                    router.send_multipart([client_id, b"", b"", END_SEQ, b""])
                else:
                    router.send_multipart([client_id, b"", END_SEQ, b""])
                self.replays_served += 1
        finally:
            router.close(linger=0)

    def _stop_replay(self) -> None:
        # Never called with self._lock held: the replay thread takes it to copy the buffer.
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self._router = None

    def _close_pub(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None

    # -- publishing ------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq

    def buffered(self) -> list[tuple[int, bytes]]:
        """A copy of the replay buffer: ``(seq, payload)`` oldest first."""
        with self._lock:
            return list(self._buffer)

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish raw payload bytes as the next seq; ``send=False`` only buffers it (a drop)."""
        with self._lock:
            if self._closed or self._pub is None:
                raise RuntimeError("publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            if send:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            return seq

    def publish(
        self,
        events: Iterable[Any],
        *,
        ts: Optional[float] = None,
        rank: Any = _DEFAULT_RANK,
        layout: Optional[str] = None,
        send: bool = True,
    ) -> int:
        """Encode ``events`` (neutral dicts or ``wire`` structs) as one batch and publish it."""
        payload = wire.encode_batch(
            layout or self.layout,
            list(events),
            time.time() if ts is None else ts,
            self.data_parallel_rank if rank is _DEFAULT_RANK else rank,
        )
        return self.publish_payload(payload, send=send)

    def store(
        self,
        block_hashes: list,
        *,
        token_ids: Optional[list[int]] = None,
        block_size: int = 16,
        parent_block_hash: Any = None,
        medium: Optional[str] = "GPU",
        lora_name: Optional[str] = None,
        send: bool = True,
        **extra: Any,
    ) -> int:
        """One ``BlockStored`` batch."""
        ev = {
            "type": "BlockStored",
            "block_hashes": list(block_hashes),
            "parent_block_hash": parent_block_hash,
            "token_ids": list(token_ids or []),
            "block_size": block_size,
            "medium": medium,
            "lora_name": lora_name,
            **extra,
        }
        return self.publish([ev], send=send)

    def remove(self, block_hashes: list, *, medium: Optional[str] = "GPU", send: bool = True) -> int:
        """One ``BlockRemoved`` batch."""
        ev = {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}
        return self.publish([ev], send=send)

    def clear(self, *, send: bool = True) -> int:
        """One ``AllBlocksCleared`` batch."""
        return self.publish([{"type": "AllBlocksCleared"}], send=send)

    # -- lifecycle -------------------------------------------------------------------------------

    def restart(self, *, first_seq: int = 0, rebind: bool = True, timeout: float = 10.0) -> None:
        """Simulate an engine restart: empty replay buffer, seq from ``first_seq`` again.

        With ``rebind`` the sockets are closed and bound again on the same addresses, so
        subscribers see a disconnect and ZeroMQ's automatic reconnect, as with a real restart.
        Publishing from another thread while this runs fails with RuntimeError.
        """
        with self._lock:
            self._buffer.clear()
            self._next_seq = first_seq
            if not rebind:
                return
            self._close_pub()
        self._stop_replay()
        deadline = time.monotonic() + timeout
        with self._lock:
            self.endpoint = self._retry_bind(lambda: self._open_pub(self.endpoint), deadline)
        if self.replay_endpoint:
            ep = self.replay_endpoint
            self.replay_endpoint = self._retry_bind(lambda: self._open_router(ep), deadline)

    @staticmethod
    def _retry_bind(open_fn, deadline: float) -> str:
        while True:
            try:
                return open_fn()
            except zmq.ZMQError as e:
                # libzmq closes the old listener asynchronously: EADDRINUSE for a moment.
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                threading.Event().wait(0.02)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_pub()
        self._stop_replay()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> "KvEventPublisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- JSON-lines CLI --------------------------------------------------------------------------------


def _handle(pub: KvEventPublisher, req: dict) -> dict:
    op = req.get("op")
    if op == "publish":
        kwargs: dict[str, Any] = {"send": bool(req.get("send", True))}
        if "ts" in req:
            kwargs["ts"] = float(req["ts"])
        if "rank" in req:
            kwargs["rank"] = req["rank"]
        if "layout" in req:
            kwargs["layout"] = req["layout"]
        return {"ok": True, "seq": pub.publish(req.get("events", []), **kwargs)}
    if op == "raw":
        payload = bytes.fromhex(req["payload_hex"])
        return {"ok": True, "seq": pub.publish_payload(payload, send=bool(req.get("send", True)))}
    if op == "restart":
        pub.restart(first_seq=int(req.get("first_seq", 0)), rebind=bool(req.get("rebind", True)))
        return {"ok": True, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
    if op == "status":
        buf = pub.buffered()
        return {
            "ok": True,
            "next_seq": pub.next_seq,
            "buffered": len(buf),
            "oldest_seq": buf[0][0] if buf else None,
            "replays_served": pub.replays_served,
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
        }
    raise ValueError(f"unknown op {op!r}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="KV-event ZeroMQ publisher (JSON-lines control)")
    ap.add_argument("--endpoint", default="tcp://127.0.0.1", help="PUB bind address")
    ap.add_argument("--replay-endpoint", default=None, help="ROUTER replay bind address")
    ap.add_argument("--layout", default="vllm-array", choices=wire.LAYOUTS)
    ap.add_argument("--topic", default="")
    ap.add_argument("--rank", type=int, default=0, help="data_parallel_rank put in batches")
    ap.add_argument("--first-seq", type=int, default=0)
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--replay-with-topic", action="store_true", help="TensorRT-LLM replay frames")
    args = ap.parse_args(argv)

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    with KvEventPublisher(
        args.endpoint,
        args.replay_endpoint,
        topic=args.topic,
        layout=args.layout,
        data_parallel_rank=args.rank,
        first_seq=args.first_seq,
        buffer_steps=args.buffer_steps,
        replay_with_topic=args.replay_with_topic,
    ) as pub:
        reply({"ready": True, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint})
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                req = json.loads(line)
                if req.get("op") == "close":
                    reply({"ok": True})
                    break
                reply(_handle(pub, req))
            except Exception as e:  # one bad request never stops the publisher
                reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writes the committed seed inputs of the h2_front fuzz target (fuzz/seeds/h2_front/seed-*).

    .venv/bin/python fuzz/h2_front_seeds.py fuzz/seeds/h2_front

Each raw input is `[read size < 128][client frames after the preface]`: requests (Istio authorities,
a shared HPACK table, padding + priority + CONTINUATION, trailers, never-indexed fields), control
and DATA frames, and each attack of e2e/hostile_h2.py in a size that fits -max_len; three
structured inputs (first byte >= 128) are ops for the target's HPACK encoder.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
import hostile_h2 as h  # noqa: E402
import hpack  # noqa: E402

out = sys.argv[1]
F = h.frame
def req(enc, authority="kvpick:9002", extra=(), huffman=True):
    hs = [(":method","POST"),(":scheme","http"),(":path","/envoy.service.ext_proc.v3.ExternalProcessor/Process"),(":authority",authority),("content-type","application/grpc"),("te","trailers"),*extra]
    return enc.encode(hs, huffman=huffman)
seeds = {}
e = hpack.Encoder()
seeds["simple"] = bytes([0]) + F(1, 5, 1, req(e))
e = hpack.Encoder()
seeds["istio"] = bytes([7]) + F(1, 5, 1, req(e, "outbound|9002||kvpick.default.svc.cluster.local"))
e = hpack.Encoder()
seeds["shared_table"] = bytes([3]) + F(1, 5, 1, req(e, "outbound|9002||a.b.svc")) + F(1, 5, 3, req(e, "outbound|9002||a.b.svc")) + F(1,5,5, req(e, "x:1", extra=[("x-session-id","abc")]))
e = hpack.Encoder()
b = req(e, "outbound|1||h", huffman=False)
p = bytes([3]) + b"\x00\x00\x00\x00\x10" + b[:10] + b"\x00\x00\x00"
seeds["padded_priority_continuation"] = bytes([1]) + F(1, 0x8|0x20|1, 1, p) + F(9, 0, 1, b[10:20]) + F(9, 4, 1, b[20:])
e = hpack.Encoder()
seeds["data_and_control"] = bytes([16]) + F(4,0,0,b"\x00\x04\x00\x10\x00\x00") + F(1, 4, 1, req(e)) + F(0,0,1,b"\x00\x00\x00\x00\x05hello") + F(8,0,0,b"\x00\x00\x10\x00") + F(6,0,0,b"12345678") + F(0,1,1,b"") + F(3,0,1,b"\x00\x00\x00\x08")
seeds["bomb_8k"] = bytes([0]) + h.block_frames(h.bomb_block(8*1024, 4000))
seeds["bomb_20k_small_frames"] = bytes([100]) + h.block_frames(h.bomb_block(20*1024, 1000), frame_bytes=4096)
seeds["continuation_flood"] = bytes([0]) + F(1, 1, 1, h.request_block()) + F(9,0,1,b"")*12 + F(9,4,1,b"")
seeds["size_update_start"] = bytes([0]) + F(1, 5, 1, h.hpack_int(4096,5,0x20) + h.hpack_int(0,5,0x20) + h.request_block())
seeds["size_update_above"] = bytes([0]) + F(1, 5, 1, h.hpack_int(4097,5,0x20) + h.request_block())
e = hpack.Encoder()
seeds["near_limit"] = bytes([0]) + h.block_frames(req(e, extra=[("x-big", "v"*15800)], huffman=False))
seeds["oversized_frame"] = bytes([0]) + F(1, 4, 1, h.request_block()) + F(0, 0, 1, b"", length=16385)
e = hpack.Encoder()
seeds["trailers"] = bytes([5]) + F(1, 4, 1, req(e)) + F(0,0,1,b"\x00\x00\x00\x00\x00") + F(1, 5, 1, e.encode([("x-trailer","t")]))
e = hpack.Encoder()
seeds["never_indexed"] = bytes([0]) + F(1, 5, 1, req(e) + b"\x10" + h.hpack_string(b"authorization") + h.hpack_string(b"secret") + b"\x1f\x10" + h.hpack_string(b"v"))
e = hpack.Encoder()
seeds["dynamic_refs"] = bytes([2]) + F(1,5,1, req(e, extra=[("x-a","1"),("x-b","2")])) + F(1,5,3, bytes([0x80|62, 0x80|63, 0x80|64]) + req(e))
seeds["push_promise"] = bytes([0]) + F(5, 4, 1, b"\x00\x00\x00\x02" + h.request_block())
seeds["interrupted"] = bytes([0]) + F(1, 0, 1, h.request_block()[:5]) + F(0,0,1,b"x")
seeds["huffman_authority"] = bytes([9]) + F(1, 5, 1, hpack.Encoder().encode([(":method","GET"),(":scheme","https"),(":path","/"),(":authority","outbound|80|v1|reviews.default.svc.cluster.local")], huffman=True))
# Structured mode (first byte >= 0x80): ops the target turns into HPACK with an encoder.
seeds["ops_request"] = bytes([0x80, 0, 1, 4, 3, 0x04, 0, 2, 9, 4, 0x06, 0, 6, 3, 5, 0x1f, 5, 0x01, 0])
seeds["ops_istio_split"] = bytes([0x83, 0, 0x80, 10, 2, 0x06, 1, 6, 20, 7, 0x10, 5, 0x29, 0])
seeds["ops_refs_size_update"] = bytes([0x87, 4, 0x10, 0x00, 0, 6, 20, 1, 0x04, 3, 62, 3, 62,
                                       5, 0x40, 1, 6, 10, 1, 4, 0, 0, 5, 1, 0])
os.makedirs(out, exist_ok=True)
for name, data in seeds.items():
    open(os.path.join(out, "seed-" + name), "wb").write(data)
print(len(seeds), "seeds", max(len(d) for d in seeds.values()))

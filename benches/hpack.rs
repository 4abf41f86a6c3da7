//! The HTTP/2 front layer's HPACK decoding (src/transport/h2_authority/hpack.rs) on the block that made
//! it a CPU flood: 2.4 KB of one-byte Huffman-coded literals, decoded the way kvpick decodes
//! (`decode_block`, Huffman via `h2_authority::huffman`) and the way `loona_hpack` alone does
//! (its own Huffman decoder, the behaviour before). Also a typical Envoy ext_proc HEADERS block.
//! Run: `cargo bench --bench hpack`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench harness: a panic is a failure report

use criterion::{criterion_group, criterion_main, Criterion};
use kvpick::transport::h2_authority::hpack::decode_block;
use kvpick::transport::h2_authority::limits::FrontLimits;

fn decoder() -> loona_hpack::Decoder<'static> {
    let mut d = loona_hpack::Decoder::new();
    d.set_max_allowed_table_size(4096);
    d
}

/// 480 literals without indexing, name and value each the one-byte Huffman string "0".
fn huffman_flood() -> Vec<u8> {
    (0..480)
        .flat_map(|_| [0x00, 0x81, 0x07, 0x81, 0x07])
        .collect()
}

/// What Envoy sends on an ext_proc stream's first HEADERS (raw literals, names indexed).
fn envoy_headers() -> Vec<u8> {
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme https
    for (index, value) in [
        (
            4u8,
            &b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"[..],
        ),
        (1, b"kvpick.default.svc:9002"),
        (31, b"application/grpc"),
    ] {
        block.push(0x40 | index); // literal with incremental indexing, indexed name
        block.push(value.len() as u8);
        block.extend_from_slice(value);
    }
    block.extend([
        0x00, 2, b't', b'e', 8, b't', b'r', b'a', b'i', b'l', b'e', b'r', b's',
    ]);
    block
}

fn bench(c: &mut Criterion) {
    let limits = FrontLimits::default();
    let flood = huffman_flood();
    let envoy = envoy_headers();
    assert_eq!(
        decode_block(&mut decoder(), &flood, &limits).unwrap().len(),
        480
    );
    assert_eq!(
        decode_block(&mut decoder(), &envoy, &limits).unwrap().len(),
        6
    );
    c.bench_function("hpack/huffman_flood_2.4KB/kvpick", |b| {
        b.iter(|| decode_block(&mut decoder(), &flood, &limits).unwrap())
    });
    c.bench_function("hpack/huffman_flood_2.4KB/loona_hpack_alone", |b| {
        b.iter(|| decoder().decode(&flood).unwrap())
    });
    c.bench_function("hpack/envoy_headers/kvpick", |b| {
        b.iter(|| decode_block(&mut decoder(), &envoy, &limits).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The streaming scanner against serde's whole-body parse: the same answer for every body, split
//! anywhere; every reason it leaves a body to serde; and realistic bodies settled by the scanner
//! itself (else the fast path would go unused without a test noticing).

use rand::{Rng, SeedableRng};

use super::*;
use crate::body::{parse_request_body_for, Prompt};

const ENDPOINTS: [Endpoint; 4] = [
    Endpoint::Generate,
    Endpoint::Embeddings,
    Endpoint::Messages,
    Endpoint::SglangGenerate,
];

fn scan(endpoint: Endpoint, chunks: &[&[u8]]) -> Scanned {
    let mut scanner = BodyScanner::new(endpoint, Some("application/json"));
    for chunk in chunks {
        scanner.feed(chunk);
    }
    scanner.finish(chunks)
}

/// The scanner (whole, split in two at every byte, and byte by byte) answers as serde does.
fn assert_same(endpoint: Endpoint, body: &[u8]) {
    let want = parse_request_body_for(endpoint, Some("application/json"), body);
    let check = |chunks: &[&[u8]], how: &str| {
        let got = parse_chunks(endpoint, Some("application/json"), chunks);
        assert_eq!(
            got,
            want,
            "{endpoint:?} {how}: {:?}",
            String::from_utf8_lossy(body)
        );
    };
    check(&[body], "whole");
    for at in 0..=body.len() {
        check(&[&body[..at], &body[at..]], &format!("split at {at}"));
    }
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    check(&bytes, "byte by byte");
}

/// Bodies of every API kvpick reads, as clients send them.
fn realistic() -> Vec<(Endpoint, Vec<u8>)> {
    let g = Endpoint::Generate;
    let mut bodies: Vec<(Endpoint, &[u8])> = vec![
        (g, br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"cache_salt":"s"}"#),
        (g, br#"{"model":"m1","prompt":[1,2,3,4294967295],"max_tokens":8}"#),
        (g, br#" { "model" : "m" , "prompt" : [ 0 , 10 ,20 ] , "stream" : false } "#),
        (g, br#"{"model":"m","prompt":"tell me \"why\" \u00e9\n"}"#),
        (g, br#"{"model":"m","prompt":["a","b"],"temperature":0.5e-3}"#),
        (g, br#"{"model":"m","prompt":[]}"#),
        (g, br#"{"model":"m","prompt":[ [1,2],[3]]}"#),
        (Endpoint::Embeddings, br#"{"model":"m","input":[[9],[10]]}"#),
        (g, br#"{"model":"m","prompt":null,"messages":[{"role":"user","content":"x"}]}"#),
        (g, br#"{"model":"m","instructions":"be brief","input":[{"role":"user","content":"q"}],"tools":[{"type":"function","name":"f"}]}"#),
        (g, br#"{"model":"m","messages":[],"tools":[],"cache_salt":null,"stream":null}"#),
        (g, br#"{"model":"m","n":-0,"x":[true,false,null,{"a":{"b":[1.5E+2]}}],"messages":[{"content":"\ud83d\ude00"}]}"#),
        (g, "{\"model\":\"模型\",\"messages\":[{\"content\":\"日本語 ✓\"}]}".as_bytes()),
        (g, br#"{"messages":[]}"#),
        (g, br#"{"model":5}"#),
        (g, br#"{"model":""}"#),
        (g, br#"{"model":["m"]}"#),
        (g, br#"{"model":"m","stream":1,"cache_salt":7}"#),
        (Endpoint::Messages, br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"q"}],"system":"S","tools":[]}"#),
        (Endpoint::Messages, br#"{"model":"m","system":[{"type":"text","text":"long shared"}],"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}"#),
        (Endpoint::Embeddings, br#"{"model":"m","input":[7,8]}"#),
        (Endpoint::Embeddings, br#"{"model":"m","input":"some text"}"#),
        (Endpoint::Embeddings, br#"{"model":"m","input":["a","b"]}"#),
        (Endpoint::SglangGenerate, br#"{"input_ids":[1,2,3],"text":"ignored","rid":"r","stream":true,"sampling_params":{"max_new_tokens":4}}"#),
        (Endpoint::SglangGenerate, br#"{"text":"hello","input_ids":null}"#),
        (Endpoint::SglangGenerate, br#"{"model":"m","text":["a","b"]}"#),
        (Endpoint::SglangGenerate, br#"{"rid":"r"}"#),
    ];
    let mut owned: Vec<(Endpoint, Vec<u8>)> =
        bodies.drain(..).map(|(e, b)| (e, b.to_vec())).collect();
    // The benchmark's shapes (e2e/bench_overhead.py): a long id prompt, a long chat.
    let ids: Vec<String> = (0..3000)
        .map(|i| (1000 + (i * 7919) % 120_000).to_string())
        .collect();
    owned.push((
        g,
        format!(r#"{{"model":"m1","prompt":[7,{}]}}"#, ids.join(",")).into_bytes(),
    ));
    let words: Vec<String> = (0..3000)
        .map(|i| format!("word{}", (i * 7919) % 5000))
        .collect();
    owned.push((
        g,
        format!(
            r#"{{"model": "m1", "messages": [{{"role": "system", "content": "You are a helpful assistant."}}, {{"role": "user", "content": "7 {}"}}]}}"#,
            words.join(" ")
        )
        .into_bytes(),
    ));
    owned
}

#[test]
fn realistic_bodies_are_settled_by_the_scanner_as_serde_settles_them() {
    for (endpoint, body) in realistic() {
        let want = parse_request_body_for(endpoint, Some("application/json"), &body);
        assert_eq!(
            scan(endpoint, &[&body]),
            Scanned::Parsed(want),
            "{endpoint:?}: {}",
            String::from_utf8_lossy(&body)
        );
        if body.len() < 2000 {
            assert_same(endpoint, &body);
        }
    }
}

#[test]
fn long_bodies_split_anywhere_read_the_same() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (endpoint, body) in realistic().into_iter().filter(|(_, b)| b.len() >= 2000) {
        let want = parse_request_body_for(endpoint, Some("application/json"), &body);
        for _ in 0..200 {
            let mut cuts: Vec<usize> = (0..rng.random_range(1..12))
                .map(|_| rng.random_range(0..=body.len()))
                .collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for cut in cuts {
                chunks.push(&body[from..cut]);
                from = cut;
            }
            chunks.push(&body[from..]);
            assert_eq!(scan(endpoint, &chunks), Scanned::Parsed(want.clone()));
        }
    }
}

#[test]
fn bodies_in_the_fuzz_corpus_read_the_same() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/seeds/request_body");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        let [flags, _, body @ ..] = data.as_slice() else {
            continue;
        };
        assert_same(ENDPOINTS[usize::from((flags >> 2) & 3)], body);
        seen += 1;
    }
    assert!(seen >= 50, "the corpus is there ({seen} seeds)");
}

/// A random JSON-ish body: mostly valid envelopes with every field shape, then bent (a byte
/// replaced, inserted, removed, or the body cut short).
fn random_body(rng: &mut impl Rng) -> Vec<u8> {
    fn value(rng: &mut impl Rng, depth: u32, out: &mut String) {
        let pick = if depth > 3 {
            rng.random_range(0..6)
        } else {
            rng.random_range(0..9)
        };
        match pick {
            0 => out.push_str(["true", "false", "null"][rng.random_range(0..3)]),
            1 => out.push_str(&rng.random_range(0..5_000_000_000u64).to_string()),
            2 => out.push_str(
                ["-1", "0", "1.5", "2e9", "-0.0E-3", "1e400", "00", "1."][rng.random_range(0..8)],
            ),
            3 | 4 => {
                let s = [
                    "m", "", "a\\\"b", "\\u00e9", "\\ud800", "x\\ny", "é", "\\u0041",
                ][rng.random_range(0..8)];
                out.push('"');
                out.push_str(s);
                out.push('"');
            }
            5 => {
                out.push('[');
                for i in 0..rng.random_range(0..12) {
                    if i > 0 {
                        out.push_str([",", ",", ", ", " ,\n"][rng.random_range(0..4)]);
                    }
                    let id = match rng.random_range(0..10) {
                        0 => rng.random_range(10_000_000..5_000_000_000u64).to_string(),
                        1 => ["0", "01", "4294967295", "4294967296", "-1"][rng.random_range(0..5)]
                            .into(),
                        _ => rng.random_range(0..200_000u32).to_string(),
                    };
                    out.push_str(&id);
                }
                out.push(']');
            }
            6 => {
                out.push('[');
                for i in 0..rng.random_range(0..4) {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    value(rng, depth + 1, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                for i in 0..rng.random_range(0..4) {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("\"k{}\":", rng.random_range(0..3)));
                    value(rng, depth + 1, out);
                }
                out.push('}');
            }
        }
    }
    const KEYS: [&str; 14] = [
        "model",
        "stream",
        "cache_salt",
        "prompt",
        "messages",
        "tools",
        "instructions",
        "input",
        "system",
        "text",
        "input_ids",
        "max_tokens",
        "mod\\u0065l",
        "rid",
    ];
    let mut out = String::from(if rng.random_bool(0.1) { " {" } else { "{" });
    for i in 0..rng.random_range(0..6) {
        if i > 0 {
            out.push_str(if rng.random_bool(0.2) { " , " } else { "," });
        }
        out.push_str(&format!("\"{}\":", KEYS[rng.random_range(0..KEYS.len())]));
        value(rng, 0, &mut out);
    }
    out.push('}');
    let mut body = out.into_bytes();
    let noise = b"{}[],:\"\\ 0-1e.tnx\xff\xc3\x01";
    match rng.random_range(0..8) {
        0 if !body.is_empty() => {
            let at = rng.random_range(0..body.len());
            body[at] = noise[rng.random_range(0..noise.len())];
        }
        1 => {
            let at = rng.random_range(0..=body.len());
            body.insert(at, noise[rng.random_range(0..noise.len())]);
        }
        2 if !body.is_empty() => {
            body.remove(rng.random_range(0..body.len()));
        }
        3 => body.truncate(rng.random_range(0..=body.len())),
        _ => {}
    }
    body
}

#[test]
fn random_bodies_read_the_same() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(27);
    let mut settled = 0;
    for round in 0..4000 {
        let body = random_body(&mut rng);
        let endpoint = ENDPOINTS[round % 4];
        if round % 8 == 0 {
            assert_same(endpoint, &body);
        } else {
            let want = parse_request_body_for(endpoint, Some("application/json"), &body);
            let at = rng.random_range(0..=body.len());
            let got = parse_chunks(
                endpoint,
                Some("application/json"),
                &[&body[..at], &body[at..]],
            );
            assert_eq!(
                got,
                want,
                "{endpoint:?}: {:?}",
                String::from_utf8_lossy(&body)
            );
        }
        if let Scanned::Parsed(_) = scan(endpoint, &[&body]) {
            settled += 1;
        }
    }
    // The generator reaches both sides: bodies the scanner settles and bodies it leaves to serde.
    assert!((400..3600).contains(&settled), "settled {settled} of 4000");
}

/// Each reason the scanner leaves a body to serde, on a body that shows it; serde's answer
/// (through [`parse_chunks`]) is then the answer.
#[test]
fn every_undecided_reason_falls_back_to_serde() {
    let g = Endpoint::Generate;
    let cases: [(Endpoint, &[u8], Undecided); 16] = [
        (g, b"[1,2]", Undecided::NotAnObject),
        (g, b"\x0c{\"model\":\"m\"}", Undecided::NotAnObject),
        (g, b"{\"model\":\"m\",}", Undecided::Syntax { at: 13 }),
        (g, b"{\"model\":\"m\"} x", Undecided::Syntax { at: 14 }),
        (
            g,
            b"{\"model\":\"m\",\"x\":01}",
            Undecided::Syntax { at: 18 },
        ),
        (g, b"{\"model\":\"a\x01\"}", Undecided::Syntax { at: 11 }),
        (g, b"{\"model\":\"\\q\"}", Undecided::Syntax { at: 11 }),
        (g, b"{\"model\":\"\xff\"}", Undecided::InvalidUtf8),
        (
            g,
            b"{\"x\":\"\xff\",\"model\":\"m\"}",
            Undecided::InvalidUtf8,
        ),
        (g, b"{\"mod\\u0065l\":\"m\"}", Undecided::EscapedKey),
        (
            g,
            b"{\"model\":\"m\",\"model\":\"n\"}",
            Undecided::DuplicateField,
        ),
        (
            g,
            b"{\"model\":\"m\",\"prompt\":null,\"prompt\":[1]}",
            Undecided::DuplicateField,
        ),
        (
            g,
            b"{\"model\":\"m\",\"prompt\":[1,[2],[3]]}",
            Undecided::NotFlatIds,
        ),
        (
            Endpoint::Embeddings,
            b"{\"model\":\"m\",\"input\":[1.0]}",
            Undecided::NotFlatIds,
        ),
        (
            g,
            b"{\"model\":\"m\",\"prompt\":[1,2",
            Undecided::Incomplete,
        ),
        (g, b"{\"model\":1e400}", Undecided::Value),
    ];
    for (endpoint, body, why) in cases {
        assert_eq!(
            scan(endpoint, &[body]),
            Scanned::Undecided(why),
            "{:?}",
            String::from_utf8_lossy(body)
        );
        assert_same(endpoint, body);
    }
    // Deeper than the scanner goes (serde then refuses or accepts it by its own limit).
    for depth in [MAX_DEPTH - 1, MAX_DEPTH, 127, 200] {
        let body = format!(
            "{{\"model\":\"m\",\"x\":{}{}}}",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let got = scan(g, &[body.as_bytes()]);
        if depth < MAX_DEPTH {
            assert!(
                matches!(got, Scanned::Parsed(Ok(Some(_)))),
                "{depth}: {got:?}"
            );
        } else {
            assert_eq!(got, Scanned::Undecided(Undecided::TooDeep), "{depth}");
        }
        assert_same(g, body.as_bytes());
    }
    // A lone surrogate in `stream`: serde refuses the body; alone, so does the value parse.
    assert_eq!(
        scan(g, &[b"{\"model\":\"m\",\"stream\":\"\\ud800\"}"]),
        Scanned::Undecided(Undecided::Value)
    );
    // ...but in `cache_salt` serde reads the body and drops the salt, as the scanner does.
    assert_same(g, b"{\"model\":\"m\",\"cache_salt\":\"\\ud800\"}");
}

#[test]
fn empty_and_non_json_bodies_are_not_read() {
    assert_eq!(scan(Endpoint::Generate, &[]), Scanned::Parsed(Ok(None)));
    assert_eq!(
        scan(Endpoint::Generate, &[b"", b""]),
        Scanned::Parsed(Ok(None))
    );
    let mut multipart =
        BodyScanner::new(Endpoint::Generate, Some("multipart/form-data; boundary=x"));
    multipart.feed(b"--x not json");
    assert_eq!(
        multipart.finish(&[b"--x not json"]),
        Scanned::Parsed(Ok(None))
    );
    let mut no_type = BodyScanner::new(Endpoint::Generate, None);
    let body = br#"{"model":"m","prompt":[5]}"#;
    no_type.feed(body);
    let Scanned::Parsed(Ok(Some(parsed))) = no_type.finish(&[body]) else {
        panic!("a body without a content type is read as JSON")
    };
    assert_eq!(parsed.prompt, Prompt::TokenIds(vec![5]));
}

#[test]
fn ids_are_read_as_they_arrive_and_fields_not_read_are_not_kept() {
    let mut scanner = BodyScanner::new(Endpoint::Generate, None);
    let chunks: [&[u8]; 3] = [
        br#"{"model":"m","prompt":[12"#,
        br#"34,5"#,
        br#"6],"system":"not read by chat"}"#,
    ];
    scanner.feed(chunks[0]);
    scanner.feed(chunks[1]);
    assert_eq!(scanner.ids, vec![1234]);
    scanner.feed(chunks[2]);
    assert!(scanner.kept[Slot::System as usize].is_none());
    let Scanned::Parsed(Ok(Some(parsed))) = scanner.finish(&chunks) else {
        panic!()
    };
    assert_eq!(parsed.prompt, Prompt::TokenIds(vec![1234, 56]));
    // An id over u32::MAX is not an id: serde reads the prompt as text.
    assert_same(
        Endpoint::Generate,
        br#"{"model":"m","prompt":[4294967296]}"#,
    );
}

#[test]
fn the_id_list_takes_room_for_a_chunk_as_it_arrives_and_no_more_than_its_bytes() {
    // Eight-byte ids (`1234567,`): grown by doubling alone the list would hold 2,048 after a
    // 16 KiB chunk; reserved by the chunk it holds room for 4,096 and no more than the bytes.
    let ids: Vec<u32> = (0..8_192).map(|k| 1_000_000 + k).collect();
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let body = format!(r#"{{"model":"m","prompt":[{}]}}"#, list.join(","));
    let head = br#"{"model":"m","prompt":["#.len();
    let mut scanner = BodyScanner::new(Endpoint::Generate, None);
    scanner.feed(&body.as_bytes()[..head]);
    let chunks: Vec<&[u8]> = body.as_bytes()[head..].chunks(16_384).collect();
    scanner.feed(chunks[0]);
    let room = scanner.ids.capacity();
    assert!(room >= chunks[0].len() / 4, "{room}");
    assert!(room * 4 <= chunks[0].len(), "{room}");
    for chunk in &chunks[1..] {
        scanner.feed(chunk);
    }
    let Scanned::Parsed(Ok(Some(parsed))) = scanner.finish(&[body.as_bytes()]) else {
        panic!()
    };
    assert_eq!(parsed.prompt, Prompt::TokenIds(ids));
}

#[test]
fn fields_are_copied_out_of_the_body_in_any_chunking() {
    let body: &[u8] =
        br#"{"model":"m","tools":[{"name":"t"}],"messages":[{"role":"user","content":"hello there"}]}"#;
    let want = parse_request_body_for(Endpoint::Generate, None, body);
    for fed_at in 0..body.len() {
        let mut scanner = BodyScanner::new(Endpoint::Generate, None);
        scanner.feed(&body[..fed_at]);
        scanner.feed(&body[fed_at..]);
        // The stream keeps the chunks coalesced differently from how they came.
        let kept_at = (fed_at * 7) % body.len();
        let kept: [&[u8]; 3] = [&body[..kept_at], b"", &body[kept_at..]];
        assert_eq!(
            scanner.finish(&kept),
            Scanned::Parsed(want.clone()),
            "{fed_at}/{kept_at}"
        );
    }
    // Handed fewer bytes than it read, it answers from what it has, without a panic.
    let mut scanner = BodyScanner::new(Endpoint::Generate, None);
    scanner.feed(body);
    let _ = scanner.finish(&[&body[..10]]);
}

#[test]
fn short_ids_read_eight_bytes_at_a_time() {
    for id in [0u32, 7, 10, 99, 100, 12345, 999_999, 1_000_000, 9_999_999] {
        for tail in [&b","[..], b"]", b" ", b"x", b"\",", b"5"] {
            let text = format!("{id}{}-padding", String::from_utf8_lossy(tail));
            let digits = id.to_string().len() + usize::from(tail == b"5");
            let want = (digits < 8).then(|| (text[..digits].parse::<u32>().unwrap(), digits));
            assert_eq!(short_id(text.as_bytes()), want, "{text}");
        }
    }
    assert_eq!(short_id(b"12345678,"), None, "eight digits go byte by byte");
    assert_eq!(
        short_id(b"123,"),
        None,
        "fewer than eight bytes go byte by byte"
    );
}

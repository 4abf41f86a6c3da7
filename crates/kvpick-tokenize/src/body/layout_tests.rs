//! The scanner's layout against serde's for the same body: the same fields, spans and items.

use super::*;
use crate::body::scan::BodyScanner;

fn scanned(endpoint: Endpoint, chunks: &[&[u8]]) -> Option<BodyLayout> {
    let mut scanner = BodyScanner::new(endpoint, Some("application/json"));
    for chunk in chunks {
        scanner.feed(chunk);
    }
    scanner.finish_layout(chunks).1
}

#[test]
fn the_scanner_records_what_serde_reads() {
    let bodies = [
        r#"{"model":"m","messages":[{"role":"user","content":"a"}, {"role":"assistant","content":"b"} ],"tools":[],"stream":true}"#,
        r#" { "input" : [ {"role":"user","content":[{"type":"input_text","text":"x"}]} , "y" , 3 ] , "instructions":"i", "model":"m" } "#,
        r#"{"model":"m","input":"text","prompt":[1,2,3],"chat_template_kwargs":{"enable_thinking":false},"a_rather_long_key_name":null}"#,
        r#"{"messages":[],"x":1,"x":2}"#,
        r#"{"model":"m","messages":[[1,[2]],{"k":{"messages":[1]}}]}"#,
        r#"{}"#,
    ];
    for body in bodies {
        let serde = BodyLayout::from_serde(Endpoint::Generate, body.as_bytes()).unwrap();
        for cut in 0..body.len() {
            let (a, b) = body.as_bytes().split_at(cut);
            let layout = scanned(Endpoint::Generate, &[a, b]);
            assert_eq!(layout.as_ref(), Some(&serde), "{body} cut at {cut}");
        }
    }
}

#[test]
fn only_chat_bodies_record_conversation_items() {
    let body = br#"{"model":"m","messages":[{"role":"user","content":"q"}],"input":[1]}"#;
    for endpoint in [
        Endpoint::Messages,
        Endpoint::Embeddings,
        Endpoint::SglangGenerate,
    ] {
        let layout = scanned(endpoint, &[body]).unwrap();
        assert!(
            layout.fields.iter().all(|f| f.items.is_none()),
            "{endpoint:?}"
        );
        assert_eq!(layout.fields.len(), 3);
    }
    let layout = scanned(Endpoint::Generate, &[body]).unwrap();
    let messages = layout.unique("messages").unwrap();
    assert_eq!(messages.items.as_ref().map(Vec::len), Some(1));
    let item = messages.items.as_ref().unwrap()[0];
    assert_eq!(
        decode(body, item).unwrap(),
        serde_json::from_str::<Json>(r#"{"role":"user","content":"q"}"#).unwrap()
    );
}

#[test]
fn bodies_the_scanner_leaves_get_no_layout_from_it() {
    // An escaped key, a syntax error, a body cut short: serde's layout (or error) instead.
    let escaped = br#"{"mod\u0065l":"m","messages":[{"role":"user","content":"q"}]}"#;
    assert_eq!(scanned(Endpoint::Generate, &[escaped]), None);
    let serde = BodyLayout::of(Endpoint::Generate, escaped).unwrap();
    assert_eq!(serde.fields[0].key, "model");
    assert_eq!(
        serde
            .unique("messages")
            .unwrap()
            .items
            .as_ref()
            .unwrap()
            .len(),
        1
    );
    assert!(BodyLayout::of(Endpoint::Generate, br#"{"model":"m","#).is_err());
    assert_eq!(scanned(Endpoint::Generate, &[br#"{"model":"m""#]), None);
    // JSON that is not an object has no fields; a body past serde's depth is its error.
    assert_eq!(
        BodyLayout::of(Endpoint::Generate, b"[1]"),
        Ok(BodyLayout::default())
    );
    let deep = format!(r#"{{"x":{}{}}}"#, "[".repeat(127), "]".repeat(127));
    assert!(BodyLayout::of(Endpoint::Generate, deep.as_bytes()).is_err());
    let fits = format!(r#"{{"x":{}{}}}"#, "[".repeat(126), "]".repeat(126));
    assert!(BodyLayout::of(Endpoint::Generate, fits.as_bytes()).is_ok());
    // A body a routing check refuses (no model) still has its layout.
    assert!(scanned(Endpoint::Generate, &[br#"{"messages":[]}"#]).is_some());
}

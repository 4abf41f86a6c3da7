//! A stream that ends before its first response byte takes back what its pick predicted.

use super::*;
use crate::selection::{PromptInput, SelectionRequest};
use crate::tokenize::body::Prompt;

/// A chat request whose prompt spans several blocks (64 bytes of text per 16-token block).
const LONG_CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"Summarise the attached design document in three short paragraphs, then list every open question it leaves for the reviewers, one per line, most important first."}]}"#;

fn cached(core: &SelectionCore) -> u32 {
    let prompt =
        match crate::tokenize::body::parse_request_body(Some("application/json"), LONG_CHAT) {
            Ok(Some(p)) => p.prompt,
            other => panic!("{other:?}"),
        };
    let request = SelectionRequest {
        request_id: "look".into(),
        model: Some("m".into()),
        prompt: match prompt {
            Prompt::Text(t) => PromptInput::Text(t),
            other => panic!("{other:?}"),
        },
        ..Default::default()
    };
    let (_, ranks) = core.overlap_scores(&request).unwrap();
    ranks.iter().map(|(_, d)| d.gpu).max().unwrap_or(0)
}

/// 200 headers, then Envoy ends the stream before any body byte (the client went away while
/// the engine prefilled): the prediction goes, nothing counts against the rank.
#[test]
fn a_stream_gone_after_the_headers_but_before_the_first_byte_takes_back_its_prediction() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    m.handle(body(LONG_CHAT, true)).unwrap();
    let predicted = cached(&core);
    assert!(predicted > 0, "the pick predicted its prompt");
    m.handle(response_status("200")).unwrap();
    drop(m);
    assert_eq!(cached(&core), 0);
    assert_eq!(core.live_bookings(), 0);
    // Once its first byte came, the engine computed the prompt: the prediction stays.
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::new(ExtProcSettings::default()));
    m.handle(post_headers()).unwrap();
    m.handle(body(LONG_CHAT, true)).unwrap();
    m.handle(response_status("200")).unwrap();
    m.handle(response_body(b"data: {}\n\n", false)).unwrap();
    drop(m);
    assert_eq!(cached(&core), predicted);
    let responses = |class: &str| {
        let m = &core.metrics().outlier.responses;
        ["0", "1"]
            .iter()
            .map(|rank| m.with_label_values(&["a", rank, class]).get())
            .sum::<u64>()
    };
    assert_eq!(responses("2xx"), 2);
    assert_eq!(
        responses("reset"),
        0,
        "a reset after an answer is not counted again"
    );
}

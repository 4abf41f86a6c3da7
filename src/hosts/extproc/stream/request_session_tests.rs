//! Session trees through the stream (docs/sessions.md): the agents' headers reach the core as
//! session, parent and final, in the documented precedence.

use super::*;
use crate::sources::catalog::WorkerSpec;

fn pool() -> Vec<WorkerSpec> {
    vec![
        worker("a", "m", RankLayout::PerPort(vec![8000])),
        worker("b", "m", RankLayout::PerPort(vec![9000])),
    ]
}

/// A request routed (headers and body), its stream left open: its booking is load.
fn open(core: &Arc<SelectionCore>, pairs: &[(&str, &str)]) -> (StreamMachine, String) {
    let mut all = vec![(":method", "POST"), ("content-type", "application/json")];
    all.extend_from_slice(pairs);
    let mut m = StreamMachine::new(Arc::clone(core), Arc::new(ExtProcSettings::default()));
    m.handle(headers(&all, false)).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).unwrap();
    (m, dest)
}

fn events(core: &SelectionCore, event: &str) -> u64 {
    core.metrics()
        .selection
        .session_events
        .with_label_values(&[event])
        .get()
}

#[test]
fn a_claude_code_subagent_joins_its_session_and_the_final_request_releases_it() {
    let (core, _) = setup(pool(), ExtProcSettings::default());
    let (_parent, home) = open(&core, &[("x-claude-code-session-id", "S")]);
    // An unrelated new session goes to the idle rank...
    let (_other, away) = open(&core, &[("x-session-id", "lone")]);
    assert_ne!(away, home);
    let (_lone_child, dest) = open(
        &core,
        &[("x-session-id", "kid"), ("x-parent-session-id", "nobody")],
    );
    assert_eq!(events(&core, "parent_followed"), 0, "{dest}");
    // ...a subagent of S goes where S is, as the child session `S/a1`.
    let (mut child, dest) = open(
        &core,
        &[
            ("x-claude-code-session-id", "S"),
            ("x-claude-code-agent-id", "a1"),
        ],
    );
    assert_eq!(dest, home);
    assert_eq!(events(&core, "parent_followed"), 1);
    let echoed = child.handle(response_headers("application/json")).unwrap();
    let R::ResponseHeaders(h) = echoed.responses[0].response.as_ref().unwrap() else {
        panic!("not response headers")
    };
    let mutation = h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap();
    assert_eq!(
        set_value(mutation, "x-dynamo-session-id").as_deref(),
        Some("S/a1")
    );
    // The final request of S (Dynamo's header, whatever named the session) is routed on S's
    // binding and releases it.
    let live = core.metrics().selection.sessions_live.get();
    let (_last, dest) = open(
        &core,
        &[
            ("x-claude-code-session-id", "S"),
            ("x-dynamo-session-final", "true"),
        ],
    );
    assert_eq!(dest, home);
    assert_eq!(events(&core, "released"), 1);
    assert_eq!(core.metrics().selection.sessions_live.get(), live - 1);
    assert_eq!(
        core.metrics()
            .selection
            .session_invalidated
            .with_label_values(&["final"])
            .get(),
        1
    );
}

/// `x-dynamo-session-id` outranks every agent's own header; its parent header pairs with it.
#[test]
fn dynamo_headers_outrank_the_agents_own() {
    let (core, _) = setup(pool(), ExtProcSettings::default());
    let (_parent, home) = open(&core, &[("x-dynamo-session-id", "root")]);
    let (_child, dest) = open(
        &core,
        &[
            ("x-session-id", "opencode"),
            ("x-parent-session-id", "elsewhere"),
            ("x-dynamo-session-id", "child"),
            ("x-dynamo-parent-session-id", "root"),
        ],
    );
    assert_eq!(dest, home);
    assert_eq!(events(&core, "parent_followed"), 1);
}

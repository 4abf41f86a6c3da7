//! The refusals: client errors and an empty catalog answered at once, nothing booked.

use super::super::tests::*;
use super::super::*;

#[test]
fn client_errors_are_immediate_responses() {
    let cases: [(&[u8], u16, &str); 3] = [
        (b"{not json", 400, "malformed JSON"),
        (br#"{"messages":[]}"#, 400, "missing `model`"),
        (
            br#"{"model":"unknown"}"#,
            503,
            "no ready worker serves model unknown",
        ),
    ];
    for (payload, status, text) in cases {
        let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
        m.handle(post_headers()).unwrap();
        let (code, msg) = immediate_status(&m.handle(body(payload, true)).unwrap());
        assert_eq!(code, status);
        assert!(msg.starts_with(&format!("kvpick: {status}: ")), "{msg}");
        assert!(msg.contains(text), "{msg}");
        assert_eq!(core.live_bookings(), 0);
        // Anything after an immediate response is ignored.
        assert!(m.handle(body(b"", true)).unwrap().responses.is_empty());
    }
}

#[test]
fn empty_catalog_is_503() {
    let (_core, mut m) = setup(vec![], ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    let (code, msg) = immediate_status(&m.handle(body(CHAT, true)).unwrap());
    assert_eq!(code, 503);
    assert!(msg.contains("no ready worker"), "{msg}");
}

//! The ledger as a value: gRPC prefixes read across DATA frames split anywhere (padding
//! skipped), each charge released when its message or stream ends, DATA bytes released by h2's
//! connection WINDOW_UPDATEs, and every limit with input at it and one byte over it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

const MAX_MESSAGE: usize = 1 << 20;

fn ledger(account: usize, connection: usize) -> (Ledger, Arc<MemoryAccount>) {
    let account = MemoryAccount::unmetered(account);
    let config = LedgerConfig {
        account: Arc::clone(&account),
        connection_bytes: connection,
        max_message_bytes: MAX_MESSAGE,
    };
    (Ledger::new(config), account)
}

fn prefix(len: u32) -> Vec<u8> {
    let mut p = vec![0];
    p.extend(len.to_be_bytes());
    p
}

/// One client DATA frame of `payload` on `stream`, fed in pieces of `step` bytes.
fn data(l: &mut Ledger, stream: u32, flags: u8, payload: &[u8], step: usize) -> Verdict {
    let verdict = l
        .client_frame(TYPE_DATA, flags, stream, payload.len())
        .unwrap();
    if verdict == Verdict::Pass {
        for piece in payload.chunks(step.max(1)) {
            l.client_payload(piece).unwrap();
        }
    }
    verdict
}

/// h2 credits `n` bytes back on the connection.
fn credit(l: &mut Ledger, n: u32) {
    l.server_bytes(&window_update_frame(0, n));
}

#[test]
fn a_message_is_charged_its_declared_length_until_its_last_byte_whatever_the_framing() {
    for step in [1, 3, 5, 7, 1000] {
        let (mut l, account) = ledger(1 << 30, 1 << 30);
        l.client_headers(1, 0);
        let mut message = prefix(100);
        message.extend([9; 100]);
        message.extend(prefix(10));
        // The first message and the second's prefix, then the second's body in another frame.
        assert_eq!(data(&mut l, 1, 0, &message, step), Verdict::Pass);
        assert_eq!(account.used_by(Kind::PartialMessage), 10, "step {step}");
        assert_eq!(account.used_by(Kind::Http2Buffered), message.len());
        data(&mut l, 1, 0, &[1; 9], step);
        assert_eq!(account.used_by(Kind::PartialMessage), 10);
        data(&mut l, 1, 0, &[1; 1], step);
        assert_eq!(account.used_by(Kind::PartialMessage), 0);
        credit(&mut l, message.len() as u32 + 10);
        assert_eq!(account.used(), 0);
    }
}

#[test]
fn padding_is_skipped_and_end_stream_releases_the_unfinished_message() {
    let (mut l, account) = ledger(1 << 30, 1 << 30);
    l.client_headers(3, 0);
    // PADDED: pad length 4, a prefix claiming 1000 bytes, 4 bytes of padding that look like data.
    let mut payload = vec![4];
    payload.extend(prefix(1000));
    payload.extend([0xff; 4]);
    data(&mut l, 3, FLAG_PADDED, &payload, 2);
    assert_eq!(account.used_by(Kind::PartialMessage), 1000);
    data(&mut l, 3, FLAG_END_STREAM, &[], 1);
    assert_eq!(
        account.used_by(Kind::PartialMessage),
        0,
        "the client ended it"
    );

    // A server end (trailers, or its RST_STREAM) releases it too.
    l.client_headers(5, 0);
    data(&mut l, 5, 0, &prefix(1000), 5);
    assert_eq!(account.used_by(Kind::PartialMessage), 1000);
    l.server_bytes(&rst_stream_frame(5, 0));
    assert_eq!(account.used_by(Kind::PartialMessage), 0);
    // And the connection's end releases what is left.
    l.client_headers(7, 0);
    data(&mut l, 7, 0, &prefix(1000), 5);
    drop(l);
    assert_eq!(account.used(), 0);
}

#[test]
fn a_message_over_the_message_limit_is_not_charged_tonic_refuses_it() {
    let (mut l, account) = ledger(1 << 30, 1 << 30);
    l.client_headers(1, 0);
    data(&mut l, 1, 0, &prefix(MAX_MESSAGE as u32), 5);
    assert_eq!(
        account.used_by(Kind::PartialMessage),
        MAX_MESSAGE,
        "at the limit"
    );
    l.client_headers(3, 0);
    data(&mut l, 3, 0, &prefix(MAX_MESSAGE as u32 + 1), 5);
    assert_eq!(
        account.used_by(Kind::PartialMessage),
        MAX_MESSAGE,
        "over it: nothing more"
    );
}

/// Expects `stream` reset by the ledger: RST_STREAM(ENHANCE_YOUR_CALM) for the client and a
/// RST_STREAM(CANCEL) for h2.
fn assert_reset(l: &mut Ledger, stream: u32) {
    let to_client = std::mem::take(l.to_client());
    let rst = rst_stream_frame(stream, code::ENHANCE_YOUR_CALM);
    assert!(
        to_client.windows(13).any(|w| w == rst),
        "RST_STREAM for the client"
    );
    let inbound = l.take_inbound_resets();
    assert_eq!(inbound, vec![(stream, rst_stream_frame(stream, CANCEL))]);
}

#[test]
fn the_account_limit_at_it_passes_one_byte_over_resets_the_stream() {
    // 5 bytes of prefix in h2 plus the declared message: exactly the account at 95.
    let (mut l, account) = ledger(100, 1 << 30);
    l.client_headers(1, 0);
    data(&mut l, 1, 0, &prefix(95), 5);
    assert_eq!(account.used(), 100);
    assert!(!l.has_frames_for_client());
    credit(&mut l, 5);
    // One byte over: 5 + 96 > 100 - 0.
    l.client_headers(3, 0);
    let (mut l2, account2) = ledger(100, 1 << 30);
    l2.client_headers(1, 0);
    data(&mut l2, 1, 0, &prefix(96), 5);
    assert_eq!(account2.used_by(Kind::PartialMessage), 0, "nothing charged");
    assert_reset(&mut l2, 1);
    // Its later frames are dropped (their bytes credited to the client), until it ends.
    assert_eq!(data(&mut l2, 1, 0, &[0; 50], 50), Verdict::Drop);
    let credit_back = window_update_frame(0, 50);
    assert_eq!(std::mem::take(l2.to_client()), credit_back.to_vec());
    assert_eq!(
        l2.client_headers(1, FLAG_END_STREAM),
        Verdict::Drop,
        "its trailers too"
    );
    assert_eq!(l2.reset_streams(), 0, "ended by the client: forgotten");
    drop(l);
    assert_eq!(account.used(), 0);
}

#[test]
fn the_connection_share_at_it_passes_one_byte_over_resets_the_stream() {
    let (mut l, account) = ledger(1 << 30, 1000);
    l.client_headers(1, 0);
    data(&mut l, 1, 0, &prefix(495), 5);
    l.client_headers(3, 0);
    data(&mut l, 3, 0, &prefix(495), 5);
    assert_eq!(l.held(), 1000, "at the share");
    assert!(!l.has_frames_for_client());
    l.client_headers(5, 0);
    // The DATA frame itself (1 byte) is over the share: dropped, the stream reset.
    assert_eq!(data(&mut l, 5, 0, &[0], 1), Verdict::Drop);
    assert_reset(&mut l, 5);
    assert_eq!(account.used(), 1000);
}

#[test]
fn a_connection_keeping_too_many_reset_streams_is_closed() {
    let (mut l, _account) = ledger(1 << 30, 10);
    let mut id = 1;
    for _ in 0..MAX_RESET_STREAMS {
        l.client_headers(id, 0);
        assert_eq!(data(&mut l, id, 0, &prefix(100), 5), Verdict::Pass);
        id += 2;
        credit(&mut l, 5);
    }
    assert_eq!(l.reset_streams(), MAX_RESET_STREAMS, "at the bound");
    l.client_headers(id, 0);
    l.client_frame(TYPE_DATA, 0, id, 5).unwrap();
    assert_eq!(
        l.client_payload(&prefix(100)),
        Err(TooManyResets),
        "one more"
    );
}

#[test]
fn an_inactive_ledger_passes_everything_and_charges_nothing() {
    let mut l = Ledger::default();
    assert_eq!(l.client_headers(1, 0), Verdict::Pass);
    assert_eq!(l.client_frame(TYPE_DATA, 0, 1, 5).unwrap(), Verdict::Pass);
    l.client_payload(&prefix(u32::MAX)).unwrap();
    assert_eq!(l.held(), 0);
    assert!(!l.has_frames_for_client());
}

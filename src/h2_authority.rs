//! A thin layer between an accepted connection and the HTTP/2 server (h2, under hyper/tonic)
//! that makes `:authority` values h2 refuses acceptable, and changes nothing else.
//!
//! Istio's gateway calls the EPP with `:authority` = its cluster name,
//! `outbound|9002||epp.ns.svc.cluster.local`. h2 0.4 parses `:authority` as an
//! `http::uri::Authority`, which refuses `|`, and resets the stream as malformed before tonic
//! sees it (hyperium/h2 issue 619, still open). kvpick never reads the authority, so this layer
//! reads the client's frames, decodes each header block (HEADERS + CONTINUATION) with HPACK,
//! replaces an `:authority` that `http` would refuse (Istio's `outbound|PORT|SUBSET|HOST` becomes
//! `HOST:PORT`; anything else is dropped, which h2 accepts), and re-encodes the block for h2.
//! Every other frame passes through byte for byte. Because HPACK keeps per-connection state, every
//! header block of the connection goes through one decoder (the client's table) and one encoder
//! (h2's table), whether or not it changed.
//!
//! It owns only the client-to-server byte stream; writes go straight to the connection. It never
//! looks at what a request means.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface (RFC 9113 §3.4) that precedes the first frame.
const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Frames written towards h2 stay within the default SETTINGS_MAX_FRAME_SIZE, which every
/// HTTP/2 server accepts whatever it advertised.
const MAX_EMITTED_FRAME: usize = 16_384;
/// Largest header block (all its fragments) this layer buffers; beyond it the connection fails
/// (h2's own header-list limit is far lower).
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// h2's SETTINGS_HEADER_TABLE_SIZE (the HTTP/2 default; hyper does not change it): the most the
/// client's encoder may use, and the size of the table this layer's encoder fills towards h2.
const HEADER_TABLE_SIZE: usize = 4_096;

/// Replaces an `:authority` value that `http::uri::Authority` refuses. `None` = drop the header.
/// Istio's cluster names (`direction|port|subset|host`) become `host:port`.
pub fn acceptable_authority(value: &[u8]) -> Option<Vec<u8>> {
    if http::uri::Authority::try_from(value).is_ok() {
        return Some(value.to_vec());
    }
    let text = std::str::from_utf8(value).ok()?;
    let mut parts = text.split('|');
    let (_direction, port, _subset, host) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || port.parse::<u16>().is_err() {
        return None;
    }
    let rewritten = format!("{host}:{port}");
    http::uri::Authority::try_from(rewritten.as_str())
        .ok()
        .map(|_| rewritten.into_bytes())
}

/// The first frame of a header block being collected, and its fragments so far.
struct PendingBlock {
    stream_id: u32,
    /// END_STREAM and PRIORITY of the HEADERS frame (END_HEADERS is set on what is emitted).
    flags: u8,
    /// The 5 priority bytes when PRIORITY is set.
    priority: Option<[u8; 5]>,
    fragments: Vec<u8>,
}

/// An `AsyncRead + AsyncWrite` connection whose inbound HTTP/2 header blocks have an acceptable
/// `:authority` (see the module doc).
pub struct AuthorityFix<S> {
    inner: S,
    /// Bytes read from the connection and not yet processed.
    raw: BytesMut,
    /// Processed bytes ready for h2.
    out: BytesMut,
    preface_left: usize,
    /// Payload bytes of the current non-header frame still to pass through untouched.
    passthrough_left: usize,
    pending: Option<PendingBlock>,
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
    rewrites: u64,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        let mut encoder = loona_hpack::Encoder::new();
        encoder.set_max_table_size(HEADER_TABLE_SIZE);
        AuthorityFix {
            inner,
            raw: BytesMut::with_capacity(16 * 1024),
            out: BytesMut::new(),
            preface_left: PREFACE_LEN,
            passthrough_left: 0,
            pending: None,
            decoder,
            encoder,
            rewrites: 0,
            eof: false,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Moves what can be processed from `raw` to `out`.
    fn process(&mut self) -> io::Result<()> {
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.raw.len());
            self.out.extend_from_slice(&self.raw.split_to(n));
            self.preface_left -= n;
            if self.preface_left > 0 {
                return Ok(());
            }
        }
        loop {
            if self.passthrough_left > 0 {
                let n = self.passthrough_left.min(self.raw.len());
                self.out.extend_from_slice(&self.raw.split_to(n));
                self.passthrough_left -= n;
                if self.passthrough_left > 0 {
                    return Ok(());
                }
            }
            if self.raw.len() < FRAME_HEADER_LEN {
                return Ok(());
            }
            let len = u32::from_be_bytes([0, self.raw[0], self.raw[1], self.raw[2]]) as usize;
            let kind = self.raw[3];
            let flags = self.raw[4];
            let stream_id =
                u32::from_be_bytes([self.raw[5], self.raw[6], self.raw[7], self.raw[8]])
                    & 0x7fff_ffff;
            let is_header_frame = kind == TYPE_HEADERS || kind == TYPE_CONTINUATION;
            if !is_header_frame {
                if self.pending.is_some() {
                    return Err(protocol_error(
                        "a header block was interrupted by another frame",
                    ));
                }
                self.out
                    .extend_from_slice(&self.raw.split_to(FRAME_HEADER_LEN));
                self.passthrough_left = len;
                continue;
            }
            if len > MAX_HEADER_BLOCK {
                return Err(protocol_error("header frame too large"));
            }
            if self.raw.len() < FRAME_HEADER_LEN + len {
                return Ok(());
            }
            self.raw.advance(FRAME_HEADER_LEN);
            let payload = self.raw.split_to(len);
            if kind == TYPE_HEADERS {
                self.start_block(stream_id, flags, &payload)?;
            } else {
                self.continue_block(stream_id, &payload)?;
            }
            if flags & FLAG_END_HEADERS != 0 {
                self.finish_block()?;
            }
        }
    }

    fn start_block(&mut self, stream_id: u32, flags: u8, payload: &[u8]) -> io::Result<()> {
        if self.pending.is_some() {
            return Err(protocol_error("HEADERS inside another header block"));
        }
        let mut body = payload;
        if flags & FLAG_PADDED != 0 {
            let (&pad, rest) = body
                .split_first()
                .ok_or_else(|| protocol_error("padded HEADERS without a pad length"))?;
            let keep = rest
                .len()
                .checked_sub(pad as usize)
                .ok_or_else(|| protocol_error("HEADERS padding longer than the frame"))?;
            body = &rest[..keep];
        }
        let priority = if flags & FLAG_PRIORITY != 0 {
            if body.len() < 5 {
                return Err(protocol_error("HEADERS priority truncated"));
            }
            let mut p = [0u8; 5];
            p.copy_from_slice(&body[..5]);
            body = &body[5..];
            Some(p)
        } else {
            None
        };
        self.pending = Some(PendingBlock {
            stream_id,
            flags: flags & (FLAG_END_STREAM | FLAG_PRIORITY),
            priority,
            fragments: body.to_vec(),
        });
        Ok(())
    }

    fn continue_block(&mut self, stream_id: u32, payload: &[u8]) -> io::Result<()> {
        let block = self
            .pending
            .as_mut()
            .filter(|b| b.stream_id == stream_id)
            .ok_or_else(|| protocol_error("CONTINUATION without its HEADERS"))?;
        if block.fragments.len() + payload.len() > MAX_HEADER_BLOCK {
            return Err(protocol_error("header block too large"));
        }
        block.fragments.extend_from_slice(payload);
        Ok(())
    }

    /// Decodes the collected block, fixes `:authority`, re-encodes it and emits HEADERS (+
    /// CONTINUATION frames when it does not fit one frame).
    fn finish_block(&mut self) -> io::Result<()> {
        let Some(block) = self.pending.take() else {
            return Ok(());
        };
        let decoded = self
            .decoder
            .decode(&block.fragments)
            .map_err(|e| protocol_error(&format!("HPACK: {e:?}")))?;
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(decoded.len());
        for (name, value) in decoded {
            if name == b":authority" {
                match acceptable_authority(&value) {
                    Some(fixed) if fixed == value => headers.push((name, value)),
                    Some(fixed) => {
                        self.note_rewrite(&value);
                        headers.push((name, fixed));
                    }
                    None => self.note_rewrite(&value),
                }
            } else {
                headers.push((name, value));
            }
        }
        let encoded = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        self.emit_block(&block, &encoded);
        Ok(())
    }

    fn note_rewrite(&mut self, value: &[u8]) {
        if self.rewrites == 0 {
            tracing::debug!(
                authority = %String::from_utf8_lossy(value),
                "rewriting an :authority h2 would refuse (Istio cluster name?)"
            );
        }
        self.rewrites += 1;
    }

    fn emit_block(&mut self, block: &PendingBlock, encoded: &[u8]) {
        let priority: &[u8] = match &block.priority {
            Some(p) => p,
            None => &[],
        };
        let first_room = MAX_EMITTED_FRAME - priority.len();
        let (first, mut rest) = encoded.split_at(encoded.len().min(first_room));
        let end_headers = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        self.put_frame_header(
            priority.len() + first.len(),
            TYPE_HEADERS,
            block.flags | end_headers,
            block.stream_id,
        );
        self.out.extend_from_slice(priority);
        self.out.extend_from_slice(first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_EMITTED_FRAME));
            let end_headers = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
            self.put_frame_header(chunk.len(), TYPE_CONTINUATION, end_headers, block.stream_id);
            self.out.extend_from_slice(chunk);
            rest = tail;
        }
    }

    fn put_frame_header(&mut self, len: usize, kind: u8, flags: u8, stream_id: u32) {
        let len = len as u32;
        self.out.put_slice(&len.to_be_bytes()[1..]);
        self.out.put_u8(kind);
        self.out.put_u8(flags);
        self.out.put_u32(stream_id);
    }
}

fn protocol_error(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 protocol error: {what}"),
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !this.out.is_empty() {
                let n = this.out.len().min(buf.remaining());
                buf.put_slice(&this.out.split_to(n));
                return Poll::Ready(Ok(()));
            }
            // Inside a DATA (or other non-header) frame with nothing buffered: read its payload
            // straight into the caller's buffer, sparing a copy of request bodies.
            if this.passthrough_left > 0 && this.raw.is_empty() && this.preface_left == 0 {
                let limit = this.passthrough_left.min(buf.remaining());
                let mut direct = ReadBuf::new(buf.initialize_unfilled_to(limit));
                std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut direct))?;
                let n = direct.filled().len();
                buf.advance(n);
                this.passthrough_left -= n;
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // Whatever partial frame is left goes to h2 as is; it reports the truncation.
                let n = this.raw.len().min(buf.remaining());
                buf.put_slice(&this.raw.split_to(n));
                return Poll::Ready(Ok(()));
            }
            this.process()?;
            if !this.out.is_empty() {
                continue;
            }
            this.raw.reserve(16 * 1024);
            let n = std::task::ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.inner),
                cx,
                &mut this.raw
            ))?;
            if n == 0 {
                this.eof = true;
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use tokio::io::AsyncWriteExt;

    const ISTIO: &[u8] = b"outbound|9002||kvpick.default.svc.cluster.local";

    #[test]
    fn istio_cluster_names_become_host_port_and_valid_values_stay() {
        assert_eq!(
            acceptable_authority(ISTIO).unwrap(),
            b"kvpick.default.svc.cluster.local:9002"
        );
        assert_eq!(
            acceptable_authority(b"kvpick.default:9002").unwrap(),
            b"kvpick.default:9002"
        );
        // Not Istio's shape: dropped.
        assert_eq!(acceptable_authority(b"a|b"), None);
        assert_eq!(acceptable_authority(b"outbound|notaport||host"), None);
        assert_eq!(acceptable_authority(b"outbound|9002||bad host"), None);
        assert_eq!(acceptable_authority(b"outbound|1|2|host|extra"), None);
    }

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        out.extend([kind, flags]);
        out.extend(stream_id.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn request_headers(authority: &[u8], extra: &[(&[u8], &[u8])]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut h: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (
                b":path".to_vec(),
                b"/envoy.service.ext_proc.v3.ExternalProcessor/Process".to_vec(),
            ),
            (b":authority".to_vec(), authority.to_vec()),
        ];
        h.extend(extra.iter().map(|(n, v)| (n.to_vec(), v.to_vec())));
        h
    }

    /// Sends `client_bytes` (after the preface and an empty SETTINGS) through the fix to a real h2
    /// server and returns the authority and `x-test` header of each request it accepts.
    async fn served(client_bytes: Vec<u8>, requests: usize) -> Vec<(Option<String>, String)> {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        wire.extend(frame(0x4, 0, 0, &[]));
        wire.extend(client_bytes);
        client.write_all(&wire).await.unwrap();
        let mut conn = h2::server::handshake(AuthorityFix::new(server))
            .await
            .unwrap();
        let mut seen = Vec::new();
        for _ in 0..requests {
            let (request, _respond) = conn.accept().await.unwrap().unwrap();
            let authority = request.uri().authority().map(|a| a.to_string());
            let marker = request.headers()["x-test"].to_str().unwrap().to_string();
            seen.push((authority, marker));
        }
        seen
    }

    fn encode(encoder: &mut loona_hpack::Encoder<'_>, headers: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
    }

    #[tokio::test]
    async fn istio_authority_reaches_h2_rewritten_across_a_shared_hpack_table() {
        let mut enc = loona_hpack::Encoder::new();
        let mut bytes = Vec::new();
        // The first block puts the invalid authority and x-test in the client's dynamic table;
        // the second refers to them by index, so the fix must track the client's table.
        for (stream, marker) in [(1u32, b"one".as_slice()), (3, b"one")] {
            let block = encode(&mut enc, &request_headers(ISTIO, &[(b"x-test", marker)]));
            bytes.extend(frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS | FLAG_END_STREAM,
                stream,
                &block,
            ));
        }
        let seen = served(bytes, 2).await;
        let want = Some("kvpick.default.svc.cluster.local:9002".to_string());
        assert_eq!(
            seen,
            vec![(want.clone(), "one".into()), (want, "one".into())]
        );
    }

    #[tokio::test]
    async fn padded_priority_and_continuation_blocks_are_reassembled() {
        let mut enc = loona_hpack::Encoder::new();
        let block = encode(&mut enc, &request_headers(ISTIO, &[(b"x-test", b"split")]));
        let (a, b) = block.split_at(block.len() / 2);
        // HEADERS with 3 bytes of padding and a priority, then the rest in a CONTINUATION.
        let mut payload = vec![3u8];
        payload.extend([0, 0, 0, 0, 16]);
        payload.extend_from_slice(a);
        payload.extend([0, 0, 0]);
        let mut bytes = frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
            1,
            &payload,
        );
        bytes.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, b));
        // A valid authority on the next stream is kept as is.
        let block = encode(
            &mut enc,
            &request_headers(b"kvpick:9002", &[(b"x-test", b"plain")]),
        );
        bytes.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            3,
            &block,
        ));
        let seen = served(bytes, 2).await;
        assert_eq!(
            seen,
            vec![
                (
                    Some("kvpick.default.svc.cluster.local:9002".into()),
                    "split".into()
                ),
                (Some("kvpick:9002".into()), "plain".into()),
            ]
        );
    }

    #[tokio::test]
    async fn an_unfixable_authority_is_dropped_and_a_big_block_is_split_into_frames() {
        let mut enc = loona_hpack::Encoder::new();
        let big = vec![b'v'; 40_000];
        let block = encode(
            &mut enc,
            &request_headers(b"not|istio", &[(b"x-test", b"big"), (b"x-big", &big)]),
        );
        let bytes = frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, &block);
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        wire.extend(frame(0x4, 0, 0, &[]));
        wire.extend(bytes);
        client.write_all(&wire).await.unwrap();
        let mut conn = h2::server::Builder::new()
            .max_header_list_size(1 << 20)
            .handshake::<_, bytes::Bytes>(AuthorityFix::new(server))
            .await
            .unwrap();
        let (request, _respond) = conn.accept().await.unwrap().unwrap();
        assert_eq!(request.uri().authority(), None);
        assert_eq!(request.headers()["x-big"].len(), big.len());
    }

    #[tokio::test]
    async fn a_header_block_interrupted_by_another_frame_fails_the_connection() {
        let mut fix = AuthorityFix::new(tokio::io::empty());
        fix.raw
            .extend_from_slice(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        fix.raw.extend(frame(TYPE_HEADERS, 0, 1, &[0x82]));
        fix.raw.extend(frame(0x0, 0, 1, b"data"));
        let err = fix.process().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}

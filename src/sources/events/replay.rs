//! The client of an engine's replay socket (vLLM's `replay_endpoint`: a ROUTER that answers a
//! start sequence with every buffered message from it on, then an end marker of sequence -1).
//! A DEALER per replay, closed after it; each message goes to the caller's visitor, which may
//! stop the replay early.
//!
//! Owns the socket and the reply framing only; what a replayed message means is
//! [`super::ingest`]'s.

use std::time::Duration;

use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use super::decode::{decode_seq, REPLAY_END_SEQ};

/// How long a replay may go without a reply before it is abandoned as incomplete; also the
/// bound of its connect.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the visitor wants after a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    Continue,
    Stop,
}

/// How a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The end marker came.
    Complete,
    /// The visitor stopped it.
    Stopped,
}

/// Asks `endpoint` for every message from `from` on and hands each `(seq, payload)` to `visit`.
pub async fn replay(
    endpoint: &str,
    from: u64,
    mut visit: impl FnMut(u64, &[u8]) -> Visit,
) -> Result<Ended, String> {
    let mut options = SocketOptions::default();
    options.connect_timeout(REPLY_TIMEOUT);
    let mut dealer = DealerSocket::with_options(options);
    tokio::time::timeout(REPLY_TIMEOUT, dealer.connect(endpoint))
        .await
        .map_err(|_| "replay connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let mut request = ZmqMessage::from(Vec::<u8>::new());
    request.push_back(from.to_be_bytes().to_vec().into());
    dealer.send(request).await.map_err(|e| e.to_string())?;
    loop {
        let reply = tokio::time::timeout(REPLY_TIMEOUT, dealer.recv())
            .await
            .map_err(|_| "replay timed out".to_string())?
            .map_err(|e| e.to_string())?;
        let mut frames: Vec<&[u8]> = reply.iter().map(|f| f.as_ref()).collect();
        // Replies are [b"", (topic,) seq, payload]; drop the delimiter and any topic.
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        if frames.len() > 2 {
            frames.drain(..frames.len() - 2);
        }
        let [seq_frame, payload] = frames[..] else {
            return Err(format!("replay reply with {} frames", frames.len()));
        };
        let seq = decode_seq(seq_frame).map_err(|e| e.to_string())?;
        if seq == REPLAY_END_SEQ {
            return Ok(Ended::Complete);
        }
        if visit(seq, payload) == Visit::Stop {
            return Ok(Ended::Stopped);
        }
    }
}

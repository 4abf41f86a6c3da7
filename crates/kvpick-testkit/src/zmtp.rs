//! A ZeroMQ PUB endpoint speaking ZMTP 3.0 (NULL mechanism) itself, for fleets of thousands of
//! simulated ranks: `zeromq` 0.7's `PubSocket` preallocates a 100,000-message fan-out queue per
//! socket (about 4 MB: 400 sockets held 1.6 GB), so 8,000 of them do not fit a test machine. The
//! subscriber side stays the real thing: kvpick's `zeromq::SubSocket` connects to these.
//!
//! What it implements: the 64-byte greeting, the READY command with `Socket-Type: PUB`, the
//! peer's greeting and READY read and checked, multipart messages framed as ZMTP frames (MORE and
//! LONG flags). What it does not: topic filtering (every subscriber gets every message; kvpick
//! subscribes to all topics), other mechanisms, ZMTP 2. Like a PUB socket it never blocks a
//! sender: a subscriber whose queue is full loses the message.
//!
//! Owns sockets and framing only.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Messages queued per subscriber before new ones are dropped (ZeroMQ's default SNDHWM).
pub const QUEUE_PER_SUBSCRIBER: usize = 1_000;
/// Longest READY command read from a peer (its properties are small).
const MAX_COMMAND: usize = 4_096;

/// The greeting: signature, version 3.0, mechanism NULL, not a server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command announcing a socket of `kind` (`PUB`, `ROUTER`).
fn ready(kind: &str) -> Vec<u8> {
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(kind.len() as u32).to_be_bytes());
    body.extend_from_slice(kind.as_bytes());
    let mut out = vec![0x04, body.len() as u8];
    out.extend_from_slice(&body);
    out
}

/// One message's frames as ZMTP frames, ready to write.
pub fn encode(frames: &[&[u8]]) -> Bytes {
    let mut out = BytesMut::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { 0x01 } else { 0x00 };
        if frame.len() > 255 {
            out.put_u8(more | 0x02);
            out.put_u64(frame.len() as u64);
        } else {
            out.put_u8(more);
            out.put_u8(frame.len() as u8);
        }
        out.put_slice(frame);
    }
    out.freeze()
}

/// The greeting and READY exchange with a connecting peer, as a socket of `kind`.
pub async fn handshake(stream: &mut TcpStream, kind: &str) -> anyhow::Result<()> {
    stream.write_all(&greeting()).await?;
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).await?;
    if theirs[0] != 0xff || theirs[9] != 0x7f || theirs[10] < 3 || &theirs[12..16] != b"NULL" {
        bail!("not a ZMTP 3 NULL greeting");
    }
    stream.write_all(&ready(kind)).await?;
    let flags = stream.read_u8().await?;
    if flags & 0x04 == 0 {
        bail!("expected the peer's READY command, got flags {flags:#x}");
    }
    let len = if flags & 0x02 != 0 {
        stream.read_u64().await? as usize
    } else {
        usize::from(stream.read_u8().await?)
    };
    if len > MAX_COMMAND {
        bail!("a {len}-byte command");
    }
    let mut command = vec![0u8; len];
    stream.read_exact(&mut command).await?;
    if command.get(..6) != Some(&b"\x05READY"[..]) {
        bail!("expected READY");
    }
    Ok(())
}

/// Reads one multipart message (its frames) from a peer; `None` at the end of the stream.
/// Commands between messages are skipped.
pub async fn read_message(stream: &mut (impl AsyncReadExt + Unpin)) -> Option<Vec<Vec<u8>>> {
    let mut frames = Vec::new();
    loop {
        let flags = stream.read_u8().await.ok()?;
        let len = if flags & 0x02 != 0 {
            usize::try_from(stream.read_u64().await.ok()?).ok()?
        } else {
            usize::from(stream.read_u8().await.ok()?)
        };
        if len > MAX_FRAME {
            return None;
        }
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await.ok()?;
        if flags & 0x04 != 0 {
            continue;
        }
        frames.push(body);
        if flags & 0x01 == 0 {
            return Some(frames);
        }
    }
}

/// Largest frame [`read_message`] accepts (requests to the fakes are small).
const MAX_FRAME: usize = 1 << 20;

/// One bound PUB endpoint and its connected subscribers.
pub struct Publisher {
    addr: SocketAddr,
    subscribers: Subscribers,
    /// Subscribers that completed the handshake, ever (a readiness signal for tests).
    handshakes: tokio::sync::watch::Receiver<u64>,
    dropped: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Publisher {
    /// Binds `addr` and accepts subscribers until dropped.
    pub async fn bind(addr: SocketAddr) -> anyhow::Result<Publisher> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding a KV-event publisher on {addr}"))?;
        let addr = listener.local_addr()?;
        let subscribers: Subscribers = Arc::default();
        let (count, handshakes) = tokio::sync::watch::channel(0);
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&subscribers), count));
        Ok(Publisher {
            addr,
            subscribers,
            handshakes,
            dropped: Arc::default(),
            accept,
        })
    }

    /// The address it listens on (the port a bind to port 0 got).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and disconnects every subscriber; returns once the port is free again.
    pub async fn close(mut self) {
        self.subscribers.lock().clear();
        self.accept.abort();
        let accept = std::mem::replace(&mut self.accept, tokio::spawn(async {}));
        let _ = accept.await;
    }

    /// Queues `message` (see [`encode`]) for every subscriber; returns how many took it.
    pub fn send(&self, message: Bytes) -> usize {
        let mut subscribers = self.subscribers.lock();
        subscribers.retain(|s| !s.is_closed());
        let mut taken = 0;
        for s in subscribers.iter() {
            match s.try_send(message.clone()) {
                Ok(()) => taken += 1,
                Err(_) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        taken
    }

    /// Closes every subscriber's connection and keeps listening (a network blip: they may
    /// connect again).
    pub fn disconnect_all(&self) {
        self.subscribers.lock().clear();
    }

    /// Connected subscribers.
    pub fn subscribers(&self) -> usize {
        let mut subscribers = self.subscribers.lock();
        subscribers.retain(|s| !s.is_closed());
        subscribers.len()
    }

    /// Resolves once `n` subscribers have completed the handshake since the bind.
    pub async fn handshaken(&self, n: u64) {
        let mut handshakes = self.handshakes.clone();
        let _ = handshakes.wait_for(|done| *done >= n).await;
    }

    /// Messages lost to full subscriber queues.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.accept.abort();
        self.subscribers.lock().clear();
    }
}

type Subscribers = Arc<Mutex<Vec<mpsc::Sender<Bytes>>>>;

async fn accept_loop(
    listener: TcpListener,
    subscribers: Subscribers,
    handshakes: tokio::sync::watch::Sender<u64>,
) {
    let handshakes = Arc::new(handshakes);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (subscribers, handshakes) = (Arc::clone(&subscribers), Arc::clone(&handshakes));
        tokio::spawn(async move {
            let _ = serve_subscriber(stream, subscribers, &handshakes).await;
        });
    }
}

/// Handshakes, then writes queued messages until the subscriber goes away; what it sends us
/// (its subscriptions) is read and ignored so its writes never block.
async fn serve_subscriber(
    mut stream: TcpStream,
    subscribers: Subscribers,
    handshakes: &tokio::sync::watch::Sender<u64>,
) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    handshake(&mut stream, "PUB").await?;
    let (tx, mut rx) = mpsc::channel::<Bytes>(QUEUE_PER_SUBSCRIBER);
    subscribers.lock().push(tx);
    handshakes.send_modify(|n| *n += 1);
    let (mut read, mut write) = stream.into_split();
    let drain = tokio::spawn(async move {
        let mut sink = [0u8; 512];
        while matches!(read.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    while let Some(message) = rx.recv().await {
        if write.write_all(&message).await.is_err() || drain.is_finished() {
            break;
        }
    }
    drain.abort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeromq::{Socket, SocketRecv, SubSocket};

    #[test]
    fn frames_carry_more_and_long_flags() {
        let long = vec![7u8; 300];
        let encoded = encode(&[b"", b"ab", &long]);
        assert_eq!(&encoded[..5], &[0x01, 0, 0x01, 2, b'a']);
        assert_eq!(encoded[6], 0x02, "the last frame, long");
        assert_eq!(&encoded[7..15], &300u64.to_be_bytes());
        assert_eq!(encoded.len(), 2 + 4 + 9 + 300);
    }

    /// The real `zeromq` SUB socket (kvpick's) receives what this publisher sends.
    #[tokio::test]
    async fn a_zeromq_sub_socket_receives_the_frames() {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = probe.local_addr().unwrap();
        drop(probe);
        let publisher = Publisher::bind(addr).await.unwrap();
        let mut sub = SubSocket::new();
        sub.connect(&format!("tcp://{addr}")).await.unwrap();
        sub.subscribe("").await.unwrap();
        publisher.handshaken(1).await;
        let payload = vec![9u8; 1_000];
        assert_eq!(
            publisher.send(encode(&[b"", &5u64.to_be_bytes(), &payload])),
            1
        );
        let received = sub.recv().await.unwrap();
        let frames: Vec<Vec<u8>> = received.iter().map(|f| f.to_vec()).collect();
        assert_eq!(frames, vec![vec![], 5u64.to_be_bytes().to_vec(), payload]);
        assert_eq!(publisher.subscribers(), 1);
    }
}

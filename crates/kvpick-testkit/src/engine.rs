//! A vLLM-like engine's three ports on 127.0.0.1, for tests of kvpick's KV-event ingestion and
//! engine watching: the KV-event PUB endpoint ([`crate::zmtp::Publisher`]), the replay endpoint
//! (vLLM's ROUTER: a start sequence in, every buffered message from it on out, then the end
//! marker, sequence -1), and the HTTP port (it accepts connections and closes them: all a connect
//! probe sees). Messages are vLLM's (`[topic, seq, payload]`, the msgpack `KVEventBatch` of
//! `kvpick_sim::sim::wire`, `ts` = the send's wall clock), numbered from the run's first
//! sequence, and buffered for replay like vLLM's publisher does.
//!
//! [`FakeEngine::stop`] closes all three ports (a killed engine: subscribers see the connection
//! end, connects are refused); [`FakeEngine::start_at`] binds the same ports again as a new run.
//!
//! Owns sockets and its buffer only; it knows nothing of kvpick.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bytes::Bytes;
use kvpick_core::event::KvEvent;
use kvpick_sim::sim::wire::{encode_batch, Encoding};
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::zmtp::{encode, handshake, read_message, Publisher};

/// The ports of one engine (0 in a request: any free port).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EnginePorts {
    pub events: u16,
    pub replay: u16,
    pub http: u16,
}

impl EnginePorts {
    pub fn events_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.events)
    }

    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay)
    }
}

type Buffer = Arc<Mutex<Vec<(u64, Bytes)>>>;

/// One run of a fake engine.
pub struct FakeEngine {
    pub ports: EnginePorts,
    publisher: Publisher,
    buffer: Buffer,
    next_seq: u64,
    tasks: Vec<JoinHandle<()>>,
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

impl FakeEngine {
    /// A new engine on free ports, numbering its messages from `first_seq`.
    pub async fn start(first_seq: u64) -> anyhow::Result<FakeEngine> {
        FakeEngine::start_at(EnginePorts::default(), first_seq).await
    }

    /// A new engine run on `ports` (those of a stopped run: a restart), numbering from
    /// `first_seq`, with an empty replay buffer.
    pub async fn start_at(ports: EnginePorts, first_seq: u64) -> anyhow::Result<FakeEngine> {
        let publisher = Publisher::bind(local(ports.events)).await?;
        let replay = TcpListener::bind(local(ports.replay))
            .await
            .with_context(|| format!("binding the replay port {}", ports.replay))?;
        let http = TcpListener::bind(local(ports.http))
            .await
            .with_context(|| format!("binding the HTTP port {}", ports.http))?;
        let ports = EnginePorts {
            events: publisher.local_addr().port(),
            replay: replay.local_addr()?.port(),
            http: http.local_addr()?.port(),
        };
        let buffer: Buffer = Arc::default();
        let tasks = vec![
            tokio::spawn(serve_replays(replay, Arc::clone(&buffer))),
            tokio::spawn(async move {
                // Accepted and closed at once: a connect probe needs no more.
                while let Ok((stream, _)) = http.accept().await {
                    drop(stream);
                }
            }),
        ];
        Ok(FakeEngine {
            ports,
            publisher,
            buffer,
            next_seq: first_seq,
            tasks,
        })
    }

    /// Publishes one batch of `events` stamped now; `live: false` only buffers it for replay (a
    /// message the subscriber lost). Returns its sequence number.
    pub fn publish(&mut self, events: &[KvEvent], live: bool) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.publish_at(events, live, now)
    }

    /// [`FakeEngine::publish`] with the batch stamped `ts` (seconds since the Unix epoch).
    pub fn publish_at(&mut self, events: &[KvEvent], live: bool, ts: f64) -> u64 {
        let payload = Bytes::from(encode_batch(ts, events, Some(0), Encoding::Array));
        self.publish_payload(payload, live)
    }

    /// Publishes a payload as given (e.g. one recorded from a real engine), numbered and buffered
    /// like [`FakeEngine::publish`]'s.
    pub fn publish_payload(&mut self, payload: Bytes, live: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer.lock().push((seq, payload.clone()));
        if live {
            self.publisher
                .send(encode(&[b"kv@0", &seq.to_be_bytes(), &payload]));
        }
        seq
    }

    /// Resolves once `n` subscribers have connected to this run since it started.
    pub async fn subscribed(&self, n: u64) {
        self.publisher.handshaken(n).await;
    }

    /// Closes the subscribers' connections; the engine keeps running and publishing (a network
    /// blip, not a restart).
    pub fn drop_subscribers(&self) {
        self.publisher.disconnect_all();
    }

    /// Connected subscribers now.
    pub fn subscribers(&self) -> usize {
        self.publisher.subscribers()
    }

    /// Closes every port (subscribers see their connection end; connects are refused) and
    /// returns them once they are free, for a restart.
    pub async fn stop(self) -> EnginePorts {
        for task in &self.tasks {
            task.abort();
        }
        for task in self.tasks {
            let _ = task.await;
        }
        self.publisher.close().await;
        self.ports
    }
}

/// Serves replay requests on `listener` (one connection per DEALER), until aborted.
async fn serve_replays(listener: TcpListener, buffer: Buffer) {
    let mut peers = tokio::task::JoinSet::new();
    while let Ok((stream, _)) = listener.accept().await {
        peers.spawn(serve_replay_peer(stream, Arc::clone(&buffer)));
    }
}

/// vLLM's replay: `[b"", start]` in, `[b"", seq, payload]` per buffered message from `start` on,
/// then `[b"", -1, b""]`.
async fn serve_replay_peer(mut stream: TcpStream, buffer: Buffer) -> anyhow::Result<()> {
    handshake(&mut stream, "ROUTER").await?;
    while let Some(frames) = read_message(&mut stream).await {
        let start = frames
            .last()
            .and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok())
            .map_or(0, u64::from_be_bytes);
        let replies: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in replies {
            stream
                .write_all(&encode(&[b"", &seq.to_be_bytes(), &payload]))
                .await?;
        }
        stream
            .write_all(&encode(&[b"", &(-1i64).to_be_bytes(), b""]))
            .await?;
    }
    Ok(())
}

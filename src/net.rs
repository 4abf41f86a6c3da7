//! Listener plumbing shared by the gRPC ports: an accept loop that sets TCP_NODELAY, optionally
//! terminates TLS (OpenSSL, handshakes off the accept path), puts the `:authority` fix
//! (`h2_authority`) in front of h2, and stops accepting at shutdown so a
//! draining process refuses new connections instead of leaving them hanging.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_openssl::SslStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::h2_authority::AuthorityFix;
use crate::tls::TlsServer;

/// The byte stream under HTTP/2: plain (h2c) or TLS.
pub enum Transport {
    Plain(TcpStream),
    Tls(Box<SslStream<TcpStream>>),
}

/// An accepted connection, as h2 sees it: the transport behind the `:authority` fix
/// (`h2_authority`), plus the addresses tonic reports.
pub struct Conn {
    io: AuthorityFix<Transport>,
    info: TcpConnectInfo,
}

impl Conn {
    fn new(transport: Transport, info: TcpConnectInfo) -> Self {
        Conn {
            io: AuthorityFix::new(transport),
            info,
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Plain(s) => s.is_write_vectored(),
            Transport::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// One TLS handshake on an accepted TCP connection.
async fn tls_handshake(tls: &TlsServer, stream: TcpStream) -> anyhow::Result<SslStream<TcpStream>> {
    let mut stream = SslStream::new(tls.ssl()?, stream)?;
    Pin::new(&mut stream).accept().await?;
    Ok(stream)
}

/// Accepts on `listener` until `shutdown` turns true, yielding ready connections.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<TlsServer>>,
    mut shutdown: watch::Receiver<bool>,
) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(128);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tx.closed() => return,
            };
            let (stream, peer) = match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let info = stream.connect_info();
            match &tls {
                None => {
                    if tx
                        .send(Ok(Conn::new(Transport::Plain(stream), info)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Some(tls) => {
                    let tls = Arc::clone(tls);
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let handshake = tls_handshake(&tls, stream);
                        match tokio::time::timeout(Duration::from_secs(10), handshake).await {
                            Ok(Ok(tls)) => {
                                let conn = Conn::new(Transport::Tls(Box::new(tls)), info);
                                let _ = tx.send(Ok(conn)).await;
                            }
                            Ok(Err(err)) => {
                                tracing::debug!(%peer, err = format!("{err:#}"), "TLS handshake failed")
                            }
                            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

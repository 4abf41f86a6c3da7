//! `--kv-index-remote https://...`: the connection to an indexer that serves its gRPC port over
//! TLS (kvpick's default), made with OpenSSL (as the ext_proc port is served) and ALPN h2. The
//! server certificate is verified against the system's roots, or `--kv-index-remote-ca-file`;
//! a URL ending in `#insecure` skips the check (kvpick's generated self-signed certificate).
//!
//! It owns the connector only: what is asked over the connection is `kv_remote`'s.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use anyhow::Context as _;
use hyper_util::rt::TokioIo;
use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use tokio::net::TcpStream;
use tokio_openssl::SslStream;
use tonic::codegen::Service;
use tonic::transport::Uri;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Opens TLS connections to the indexer (a `tower` service of URIs, as tonic's channel wants).
#[derive(Clone)]
pub struct TlsConnect {
    connector: SslConnector,
    insecure: bool,
}

impl TlsConnect {
    /// Verifies the server against `ca_file` (else the system's roots), or not at all.
    pub fn new(ca_file: Option<&Path>, insecure: bool) -> anyhow::Result<Self> {
        let mut builder = SslConnector::builder(SslMethod::tls_client())?;
        builder.set_alpn_protos(b"\x02h2")?;
        if let Some(ca) = ca_file {
            builder.set_ca_file(ca).with_context(|| {
                format!(
                    "--kv-index-remote-ca-file {}: not a PEM CA file",
                    ca.display()
                )
            })?;
        }
        if insecure {
            builder.set_verify(SslVerifyMode::NONE);
        }
        Ok(TlsConnect {
            connector: builder.build(),
            insecure,
        })
    }
}

async fn connect(
    connector: SslConnector,
    insecure: bool,
    uri: Uri,
) -> Result<TokioIo<SslStream<TcpStream>>, BoxError> {
    let host = uri
        .host()
        .ok_or("the URL names no host")?
        .trim_matches(['[', ']'])
        .to_string();
    let port = uri.port_u16().unwrap_or(443);
    let tcp = TcpStream::connect((host.as_str(), port)).await?;
    tcp.set_nodelay(true)?;
    let mut config = connector.configure()?;
    if insecure {
        config.set_verify_hostname(false);
    }
    let mut stream = SslStream::new(config.into_ssl(&host)?, tcp)?;
    Pin::new(&mut stream).connect().await?;
    if stream.ssl().selected_alpn_protocol() != Some(b"h2") {
        return Err("the indexer did not negotiate HTTP/2 (ALPN h2)".into());
    }
    Ok(TokioIo::new(stream))
}

impl Service<Uri> for TlsConnect {
    type Response = TokioIo<SslStream<TcpStream>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(connect(self.connector.clone(), self.insecure, uri))
    }
}

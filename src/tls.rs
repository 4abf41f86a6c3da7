//! TLS for the ext_proc port: a generated self-signed certificate by default, or `tls.crt` /
//! `tls.key` from `--cert-path`, re-read when they change (cert-manager rotations need no restart).
//! Owns only certificate material and the OpenSSL acceptor; it never sees requests.
//!
//! Why OpenSSL and not rustls: Istio's gateway sends the SNI `outbound|9002||epp.ns.svc.cluster.local`
//! (its cluster name). That is not a DNS name, and rustls 0.23 answers it with a fatal
//! `illegal_parameter` alert while parsing the ClientHello, before any hook of ours runs (the
//! switch to accept it exists only in the unreleased 0.24). The ClientHello cannot be rewritten in
//! flight either: both ends hash it into the handshake transcript. OpenSSL, like Envoy's
//! BoringSSL and Go's crypto/tls, accepts any SNI without a NUL byte, and kvpick never uses the
//! SNI (one certificate for every name).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use arc_swap::ArcSwap;
use openssl::pkey::PKey;
use openssl::ssl::{select_next_proto, AlpnError, Ssl, SslAcceptor, SslMethod, SslVersion};
use openssl::x509::X509;

/// The server side of TLS on one port; `ssl()` starts a handshake with the current certificate.
pub struct TlsServer {
    current: ArcSwap<SslAcceptor>,
}

impl TlsServer {
    /// A new OpenSSL session for one accepted connection, with the certificate in force now.
    pub fn ssl(&self) -> anyhow::Result<Ssl> {
        Ssl::new(self.current.load().context()).context("cannot create a TLS session")
    }
}

/// ALPN wire form of the only protocol kvpick speaks on TLS: HTTP/2.
const ALPN_H2: &[u8] = b"\x02h2";

/// An acceptor for the PEM certificate chain (leaf first) and private key: TLS 1.2 and 1.3 with
/// Mozilla's intermediate cipher list, ALPN h2.
fn acceptor(chain_pem: &[u8], key_pem: &[u8]) -> anyhow::Result<SslAcceptor> {
    let chain = X509::stack_from_pem(chain_pem).context("invalid PEM certificate")?;
    let mut chain = chain.into_iter();
    let leaf = chain.next().context("no certificate in the PEM data")?;
    let key = PKey::private_key_from_pem(key_pem).context("invalid PEM private key")?;
    let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
        .context("OpenSSL acceptor")?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .context("TLS protocol versions")?;
    builder.set_certificate(&leaf).context("certificate")?;
    for intermediate in chain {
        builder
            .add_extra_chain_cert(intermediate)
            .context("certificate chain")?;
    }
    builder.set_private_key(&key).context("private key")?;
    // Without read-ahead OpenSSL reads each record's 5-byte header and then its body, two
    // `recvfrom` per record (~5 extra syscalls per 32 KB ext_proc request); with it, one read
    // takes whatever has arrived. tokio-openssl tries `SSL_read` before waiting on the socket,
    // so records buffered ahead are never stranded.
    builder.set_read_ahead(true);
    builder
        .check_private_key()
        .context("certificate and key do not form a usable pair")?;
    // A client offering ALPN without h2 is refused (as a TLS alert), like rustls did; a client
    // offering no ALPN at all still gets h2 (gRPC needs nothing else).
    builder.set_alpn_select_callback(|_, offered| {
        select_next_proto(ALPN_H2, offered).ok_or(AlpnError::ALERT_FATAL)
    });
    Ok(builder.build())
}

fn self_signed() -> anyhow::Result<SslAcceptor> {
    let cert =
        rcgen::generate_simple_self_signed(vec!["kvpick".to_string(), "localhost".to_string()])
            .context("generating the self-signed certificate")?;
    acceptor(
        cert.cert.pem().as_bytes(),
        cert.signing_key.serialize_pem().as_bytes(),
    )
}

fn load_dir(dir: &Path) -> anyhow::Result<SslAcceptor> {
    let crt = dir.join("tls.crt");
    let key = dir.join("tls.key");
    let chain = std::fs::read(&crt).with_context(|| format!("cannot read {}", crt.display()))?;
    let key_pem = std::fs::read(&key).with_context(|| format!("cannot read {}", key.display()))?;
    acceptor(&chain, &key_pem).with_context(|| format!("in {} / {}", crt.display(), key.display()))
}

fn mtimes(dir: &Path) -> Option<(SystemTime, SystemTime)> {
    let m = |name: &str| {
        std::fs::metadata(dir.join(name))
            .and_then(|m| m.modified())
            .ok()
    };
    Some((m("tls.crt")?, m("tls.key")?))
}

/// Builds the server TLS state (ALPN h2). With a cert dir, spawns a task that reloads the pair
/// when either file changes; a bad pair is logged and the previous one kept.
pub fn server(cert_path: Option<PathBuf>) -> anyhow::Result<Arc<TlsServer>> {
    let initial = match &cert_path {
        Some(dir) => load_dir(dir)?,
        None => self_signed()?,
    };
    let server = Arc::new(TlsServer {
        current: ArcSwap::from_pointee(initial),
    });
    if let Some(dir) = cert_path {
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            let mut seen = mtimes(&dir);
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                let now = mtimes(&dir);
                if now.is_none() || now == seen {
                    continue;
                }
                seen = now;
                match load_dir(&dir) {
                    Ok(acceptor) => {
                        server.current.store(Arc::new(acceptor));
                        tracing::info!(dir = %dir.display(), "TLS certificate reloaded");
                    }
                    Err(err) => tracing::error!(
                        error = format!("{err:#}"),
                        "TLS certificate reload failed, keeping the previous one"
                    ),
                }
            }
        });
    }
    Ok(server)
}

//! TLS for the ext_proc port: a generated self-signed certificate by default, or `tls.crt` /
//! `tls.key` from `--cert-path`, re-read when they change (cert-manager rotations need no restart);
//! optionally client authentication (`--client-ca-path`, `--client-allowed-sans`): a client
//! certificate chaining to the CA bundle and naming an allowed URI or DNS SAN, and why a
//! handshake was refused. Owns only certificate material and the OpenSSL acceptor; it never sees
//! requests.
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
use openssl::ssl::{
    select_next_proto, AlpnError, Ssl, SslAcceptor, SslAcceptorBuilder, SslMethod, SslRef,
    SslVerifyMode, SslVersion,
};
use openssl::x509::store::X509StoreBuilder;
use openssl::x509::{X509StoreContextRef, X509VerifyResult, X509};

/// Client authentication on the port: who may complete a handshake.
#[derive(Debug, Clone)]
pub struct ClientAuth {
    /// PEM bundle of the CA certificates a client certificate must chain to.
    pub ca_path: PathBuf,
    /// URI or DNS SANs of which the client certificate must name one; empty: any.
    pub allowed_sans: Arc<[String]>,
}

/// Why a handshake was refused by client authentication (the metric's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The client presented no certificate.
    NoCertificate,
    /// Its certificate does not chain to the CA bundle (or is expired, malformed, ...).
    Untrusted,
    /// It chains to the CA but names none of the allowed SANs.
    SanNotAllowed,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NoCertificate => "no_certificate",
            Refusal::Untrusted => "untrusted",
            Refusal::SanNotAllowed => "san_not_allowed",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "client certificate refused: {}", self.as_str())
    }
}

impl std::error::Error for Refusal {}

/// The server side of TLS on one port; `ssl()` starts a handshake with the current certificate.
pub struct TlsServer {
    current: ArcSwap<SslAcceptor>,
    client: Option<ClientAuth>,
}

impl TlsServer {
    /// A new OpenSSL session for one accepted connection, with the certificate in force now.
    pub fn ssl(&self) -> anyhow::Result<Ssl> {
        Ssl::new(self.current.load().context()).context("cannot create a TLS session")
    }

    /// Why client authentication refused the failed handshake of `ssl`; `None` when it did
    /// not (no client authentication, or the handshake failed for another reason).
    pub fn refusal(&self, ssl: &SslRef) -> Option<Refusal> {
        self.client.as_ref()?;
        let result = ssl.verify_result();
        if result == X509VerifyResult::APPLICATION_VERIFICATION {
            Some(Refusal::SanNotAllowed)
        } else if result != X509VerifyResult::OK {
            Some(Refusal::Untrusted)
        } else if ssl.peer_certificate().is_none() {
            Some(Refusal::NoCertificate)
        } else {
            None
        }
    }
}

/// Whether the leaf certificate names one of `allowed` as a URI or DNS SAN.
fn san_allowed(ctx: &X509StoreContextRef, allowed: &[String]) -> bool {
    let Some(names) = ctx.current_cert().and_then(|c| c.subject_alt_names()) else {
        return false;
    };
    names.iter().any(|name| {
        name.uri()
            .or_else(|| name.dnsname())
            .is_some_and(|n| allowed.iter().any(|a| a == n))
    })
}

/// Asks every client for a certificate chaining to `client`'s CA bundle (read now) and, when
/// SANs are listed, naming one of them; a handshake without one fails.
fn require_client_cert(
    builder: &mut SslAcceptorBuilder,
    client: &ClientAuth,
) -> anyhow::Result<()> {
    let pem = std::fs::read(&client.ca_path)
        .with_context(|| format!("cannot read {}", client.ca_path.display()))?;
    let cas = X509::stack_from_pem(&pem)
        .with_context(|| format!("invalid PEM in {}", client.ca_path.display()))?;
    if cas.is_empty() {
        anyhow::bail!("no certificate in {}", client.ca_path.display());
    }
    let mut store = X509StoreBuilder::new().context("X509 store")?;
    let mut names = openssl::stack::Stack::new().context("CA name list")?;
    for ca in cas {
        names
            .push(ca.subject_name().to_owned().context("CA name")?)
            .context("CA name list")?;
        store.add_cert(ca).context("CA certificate")?;
    }
    builder
        .set_verify_cert_store(store.build())
        .context("client CA store")?;
    builder.set_client_ca_list(names);
    let allowed = Arc::clone(&client.allowed_sans);
    builder.set_verify_callback(
        SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
        move |chained, ctx| {
            if !chained || ctx.error_depth() != 0 || allowed.is_empty() {
                return chained;
            }
            let ok = san_allowed(ctx, &allowed);
            if !ok {
                // Read back by `TlsServer::refusal` to name the reason.
                ctx.set_error(X509VerifyResult::APPLICATION_VERIFICATION);
            }
            ok
        },
    );
    Ok(())
}

/// ALPN wire form of the only protocol kvpick speaks on TLS: HTTP/2.
const ALPN_H2: &[u8] = b"\x02h2";

/// An acceptor for the PEM certificate chain (leaf first) and private key: TLS 1.2 and 1.3 with
/// Mozilla's intermediate cipher list, ALPN h2.
fn acceptor(
    chain_pem: &[u8],
    key_pem: &[u8],
    client: Option<&ClientAuth>,
) -> anyhow::Result<SslAcceptor> {
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
    if let Some(client) = client {
        require_client_cert(&mut builder, client)?;
    }
    Ok(builder.build())
}

fn self_signed(client: Option<&ClientAuth>) -> anyhow::Result<SslAcceptor> {
    let cert =
        rcgen::generate_simple_self_signed(vec!["kvpick".to_string(), "localhost".to_string()])
            .context("generating the self-signed certificate")?;
    acceptor(
        cert.cert.pem().as_bytes(),
        cert.signing_key.serialize_pem().as_bytes(),
        client,
    )
}

fn load_dir(dir: &Path, client: Option<&ClientAuth>) -> anyhow::Result<SslAcceptor> {
    let crt = dir.join("tls.crt");
    let key = dir.join("tls.key");
    let chain = std::fs::read(&crt).with_context(|| format!("cannot read {}", crt.display()))?;
    let key_pem = std::fs::read(&key).with_context(|| format!("cannot read {}", key.display()))?;
    acceptor(&chain, &key_pem, client)
        .with_context(|| format!("in {} / {}", crt.display(), key.display()))
}

/// The modification times of the files an acceptor is built from (the CA bundle's too).
fn mtimes(dir: &Path, client: Option<&ClientAuth>) -> Option<Vec<SystemTime>> {
    let m = |path: PathBuf| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut times = vec![m(dir.join("tls.crt"))?, m(dir.join("tls.key"))?];
    if let Some(client) = client {
        times.push(m(client.ca_path.clone())?);
    }
    Some(times)
}

/// Builds the server TLS state (ALPN h2) without client authentication ([`server_with`]).
pub fn server(cert_path: Option<PathBuf>) -> anyhow::Result<Arc<TlsServer>> {
    server_with(cert_path, None)
}

/// Builds the server TLS state (ALPN h2), with client authentication when `client` is set.
/// With a cert dir, spawns a task that reloads the pair (and the client CA bundle) when a file
/// changes; a bad version is logged and the previous one kept.
pub fn server_with(
    cert_path: Option<PathBuf>,
    client: Option<ClientAuth>,
) -> anyhow::Result<Arc<TlsServer>> {
    let initial = match &cert_path {
        Some(dir) => load_dir(dir, client.as_ref())?,
        None => self_signed(client.as_ref())?,
    };
    let server = Arc::new(TlsServer {
        current: ArcSwap::from_pointee(initial),
        client,
    });
    if let Some(dir) = cert_path {
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            let client = server.client.clone();
            let mtimes = |dir: &Path| mtimes(dir, client.as_ref());
            let mut seen = mtimes(&dir);
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                let now = mtimes(&dir);
                if now.is_none() || now == seen {
                    continue;
                }
                seen = now;
                match load_dir(&dir, client.as_ref()) {
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

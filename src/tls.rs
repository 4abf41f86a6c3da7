//! TLS for the ext_proc port: a generated self-signed certificate by default, or `tls.crt` /
//! `tls.key` from `--cert-path`, re-read when they change (cert-manager rotations need no restart).
//! Owns only certificate material and the rustls config; it never sees requests.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use arc_swap::ArcSwap;
use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

#[derive(Debug)]
struct ReloadingResolver {
    current: ArcSwap<CertifiedKey>,
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> anyhow::Result<CertifiedKey> {
    let provider = default_provider();
    CertifiedKey::from_der(chain, key, &provider)
        .context("certificate and key do not form a usable pair")
}

fn self_signed() -> anyhow::Result<CertifiedKey> {
    let cert =
        rcgen::generate_simple_self_signed(vec!["kvpick".to_string(), "localhost".to_string()])
            .context("generating the self-signed certificate")?;
    let key = PrivateKeyDer::try_from(cert.signing_key.serialize_der())
        .map_err(|e| anyhow::anyhow!("self-signed key: {e}"))?;
    certified_key(vec![cert.cert.der().clone()], key)
}

fn load_dir(dir: &Path) -> anyhow::Result<CertifiedKey> {
    let crt = dir.join("tls.crt");
    let key = dir.join("tls.key");
    let chain = CertificateDer::pem_file_iter(&crt)
        .with_context(|| format!("cannot read {}", crt.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("invalid PEM in {}", crt.display()))?;
    if chain.is_empty() {
        anyhow::bail!("no certificate in {}", crt.display());
    }
    let key = PrivateKeyDer::from_pem_file(&key)
        .with_context(|| format!("cannot read a private key from {}", key.display()))?;
    certified_key(chain, key)
}

fn mtimes(dir: &Path) -> Option<(SystemTime, SystemTime)> {
    let m = |name: &str| {
        std::fs::metadata(dir.join(name))
            .and_then(|m| m.modified())
            .ok()
    };
    Some((m("tls.crt")?, m("tls.key")?))
}

/// Builds the server TLS config (ALPN h2). With a cert dir, spawns a task that reloads the pair
/// when either file changes; a bad pair is logged and the previous one kept.
pub fn server_config(cert_path: Option<PathBuf>) -> anyhow::Result<Arc<ServerConfig>> {
    let initial = match &cert_path {
        Some(dir) => load_dir(dir)?,
        None => self_signed()?,
    };
    let resolver = Arc::new(ReloadingResolver {
        current: ArcSwap::from_pointee(initial),
    });
    if let Some(dir) = cert_path {
        let resolver = Arc::clone(&resolver);
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
                    Ok(key) => {
                        resolver.current.store(Arc::new(key));
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
    let mut config = ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

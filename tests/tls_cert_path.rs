//! `--cert-path DIR`: kvpick serves the given `tls.crt`/`tls.key` on the ext_proc port with ALPN h2,
//! and picks up a replaced pair without a restart.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};

mod common;

fn write_pair(dir: &Path, name: &str) -> CertificateDer<'static> {
    let cert = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    // Write the key first and the certificate last (kvpick reloads when both are readable).
    std::fs::write(dir.join("tls.key"), cert.signing_key.serialize_pem()).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.cert.pem()).unwrap();
    cert.cert.der().clone()
}

/// Handshakes with `expected` as the only trusted root; returns the negotiated ALPN protocol.
async fn handshake(
    port: u16,
    name: &str,
    expected: &CertificateDer<'static>,
) -> Result<Vec<u8>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(expected.clone()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = connector
        .connect(ServerName::try_from(name.to_string()).unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    Ok(tls.get_ref().1.alpn_protocol().unwrap_or_default().to_vec())
}

#[tokio::test]
async fn serves_and_reloads_the_certificate_in_cert_path() {
    let dir = common::temp_dir("kvpick-tls");
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    let first = write_pair(&certs, "first.kvpick.test");
    std::fs::write(dir.join("catalog.yaml"), "workers: []\n").unwrap();
    let config = dir.join("catalog.yaml");
    let serve = common::start_with(dir, |c| {
        c.arg("--cert-path").arg(&certs).arg("--config").arg(config);
    });
    let port = serve.grpc;

    assert_eq!(
        handshake(port, "first.kvpick.test", &first).await.unwrap(),
        b"h2"
    );

    // Rotate: a new pair for another name. kvpick checks the files every few seconds.
    let second = write_pair(&certs, "second.kvpick.test");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match handshake(port, "second.kvpick.test", &second).await {
            Ok(alpn) => {
                assert_eq!(alpn, b"h2");
                break;
            }
            Err(err) => {
                assert!(
                    Instant::now() < deadline,
                    "rotated certificate never served: {err}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    // The old certificate is no longer presented.
    assert!(handshake(port, "first.kvpick.test", &first).await.is_err());
}

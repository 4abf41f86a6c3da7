//! Client authentication on the ext_proc port (`--client-ca-path`, `--client-allowed-sans`) on
//! the real binary: certificates made here with OpenSSL (a CA, another CA, client certificates
//! with SPIFFE URI SANs); a handshake without a certificate, with one from the other CA or with
//! a SAN not allowed is refused and counted with its reason, the allowed one is served HTTP/2.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::io::{Read, Write};
use std::pin::Pin;
use std::time::{Duration, Instant};

use openssl::asn1::Asn1Time;
use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use openssl::x509::extension::{
    BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName,
};
use openssl::x509::{X509NameBuilder, X509};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;

const GATEWAY: &str = "spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy-default";
const OTHER: &str = "spiffe://cluster.local/ns/default/sa/curl";

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap()
}

fn name(cn: &str) -> openssl::x509::X509Name {
    let mut n = X509NameBuilder::new().unwrap();
    n.append_entry_by_text("CN", cn).unwrap();
    n.build()
}

/// A certificate for `cn` signed by `issuer` (self-signed when `None`): a CA, or a client
/// certificate naming `uri` as its SAN.
fn certificate(
    cn: &str,
    key: &PKey<Private>,
    issuer: Option<(&X509, &PKey<Private>)>,
    uri: Option<&str>,
) -> X509 {
    let mut b = X509::builder().unwrap();
    b.set_version(2).unwrap();
    let serial = BigNum::from_u32(rand_serial())
        .unwrap()
        .to_asn1_integer()
        .unwrap();
    b.set_serial_number(&serial).unwrap();
    b.set_subject_name(&name(cn)).unwrap();
    let issuer_name =
        issuer.map_or_else(|| name(cn), |(c, _)| c.subject_name().to_owned().unwrap());
    b.set_issuer_name(&issuer_name).unwrap();
    b.set_pubkey(key).unwrap();
    b.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    b.set_not_after(&Asn1Time::days_from_now(1).unwrap())
        .unwrap();
    if issuer.is_none() {
        b.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
        b.append_extension(KeyUsage::new().key_cert_sign().crl_sign().build().unwrap())
            .unwrap();
    } else {
        b.append_extension(
            KeyUsage::new()
                .critical()
                .digital_signature()
                .build()
                .unwrap(),
        )
        .unwrap();
        b.append_extension(ExtendedKeyUsage::new().client_auth().build().unwrap())
            .unwrap();
    }
    if let Some(uri) = uri {
        let san = SubjectAlternativeName::new()
            .uri(uri)
            .build(&b.x509v3_context(issuer.map(|(c, _)| &**c), None))
            .unwrap();
        b.append_extension(san).unwrap();
    }
    let signer = issuer.map_or(key, |(_, k)| k);
    b.sign(signer, MessageDigest::sha256()).unwrap();
    b.build()
}

fn rand_serial() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Whether kvpick serves HTTP/2 to a client presenting `client` (certificate and key), or
/// none: after the handshake the client sends the connection preface and waits for the
/// server's SETTINGS frame. A refused client sees the handshake fail or the connection close
/// (TLS 1.3 verifies the client's certificate after the client's handshake completes).
async fn served(port: u16, client: Option<(&X509, &PKey<Private>)>) -> bool {
    let mut connector = SslConnector::builder(SslMethod::tls_client()).unwrap();
    // kvpick's certificate here is its generated self-signed one: not what is tested.
    connector.set_verify(SslVerifyMode::NONE);
    connector.set_alpn_protos(b"\x02h2").unwrap();
    if let Some((cert, key)) = client {
        connector.set_certificate(cert).unwrap();
        connector.set_private_key(key).unwrap();
    }
    let ssl = connector
        .build()
        .configure()
        .unwrap()
        .verify_hostname(false)
        .into_ssl("kvpick")
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut tls = tokio_openssl::SslStream::new(ssl, tcp).unwrap();
    if Pin::new(&mut tls).connect().await.is_err() {
        return false;
    }
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // an empty SETTINGS frame
    if tls.write_all(&preface).await.is_err() {
        return false;
    }
    let mut header = [0u8; 9];
    let read = tokio::time::timeout(Duration::from_secs(10), tls.read_exact(&mut header))
        .await
        .expect("kvpick neither served nor closed the connection");
    read.is_ok() && header[3] == 4
}

fn metric(port: u16, name: &str) -> f64 {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Polls kvpick's metric until it equals `want` (bounded: 10 s).
async fn wait_metric(port: u16, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(port, name) != want {
        assert!(Instant::now() < deadline, "{name} never became {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn refused(reason: &str) -> String {
    format!("kvpick_tls_client_auth_refused_total{{reason=\"{reason}\"}}")
}

#[tokio::test]
async fn only_a_certificate_from_the_ca_naming_an_allowed_san_is_served() {
    let dir = common::temp_dir("kvpick-mtls");
    let (ca_key, other_ca_key) = (key(), key());
    let ca = certificate("kvpick test CA", &ca_key, None, None);
    let other_ca = certificate("another CA", &other_ca_key, None, None);
    std::fs::write(dir.join("ca.pem"), ca.to_pem().unwrap()).unwrap();
    let client_key = key();
    let gateway = certificate("gateway", &client_key, Some((&ca, &ca_key)), Some(GATEWAY));
    let stranger = certificate("curl", &client_key, Some((&ca, &ca_key)), Some(OTHER));
    let forged = certificate(
        "gateway",
        &client_key,
        Some((&other_ca, &other_ca_key)),
        Some(GATEWAY),
    );
    std::fs::write(dir.join("catalog.yaml"), "workers: []\n").unwrap();
    let (config, ca_path) = (dir.join("catalog.yaml"), dir.join("ca.pem"));
    let serve = common::start_with(dir, |c| {
        c.arg("--config")
            .arg(config)
            .arg("--client-ca-path")
            .arg(ca_path)
            .arg("--client-allowed-sans")
            .arg(format!("{GATEWAY},spiffe://cluster.local/ns/x/sa/y"));
    });
    let port = serve.grpc;

    assert!(!served(port, None).await, "no certificate");
    wait_metric(serve.metrics, &refused("no_certificate"), 1.0).await;
    assert!(
        !served(port, Some((&forged, &client_key))).await,
        "wrong CA"
    );
    wait_metric(serve.metrics, &refused("untrusted"), 1.0).await;
    assert!(
        !served(port, Some((&stranger, &client_key))).await,
        "right CA, SAN not allowed"
    );
    wait_metric(serve.metrics, &refused("san_not_allowed"), 1.0).await;
    assert!(
        served(port, Some((&gateway, &client_key))).await,
        "the gateway"
    );
    // Nothing else was refused.
    assert_eq!(metric(serve.metrics, &refused("no_certificate")), 1.0);
    assert_eq!(metric(serve.metrics, &refused("untrusted")), 1.0);
    assert_eq!(metric(serve.metrics, &refused("san_not_allowed")), 1.0);
}

#[tokio::test]
async fn without_allowed_sans_any_certificate_from_the_ca_is_served() {
    let dir = common::temp_dir("kvpick-mtls-any");
    let ca_key = key();
    let ca = certificate("kvpick test CA", &ca_key, None, None);
    std::fs::write(dir.join("ca.pem"), ca.to_pem().unwrap()).unwrap();
    let client_key = key();
    let stranger = certificate("curl", &client_key, Some((&ca, &ca_key)), Some(OTHER));
    let no_san = certificate("plain", &client_key, Some((&ca, &ca_key)), None);
    std::fs::write(dir.join("catalog.yaml"), "workers: []\n").unwrap();
    let (config, ca_path) = (dir.join("catalog.yaml"), dir.join("ca.pem"));
    let serve = common::start_with(dir, |c| {
        c.arg("--config")
            .arg(config)
            .arg("--client-ca-path")
            .arg(ca_path);
    });
    assert!(served(serve.grpc, Some((&stranger, &client_key))).await);
    assert!(served(serve.grpc, Some((&no_san, &client_key))).await);
    assert!(!served(serve.grpc, None).await);
    wait_metric(serve.metrics, &refused("no_certificate"), 1.0).await;
}

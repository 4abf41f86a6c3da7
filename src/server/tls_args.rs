//! `serve`'s TLS flags for the ext_proc port: TLS on or off, the server certificate, and the
//! optional client authentication (mTLS: the CA bundle client certificates must chain to and the
//! identities allowed). Owns the flags and their checks only; `crate::transport::tls` does the TLS.

use std::path::PathBuf;

use clap::Args;

/// TLS on the ext_proc port.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// Serve the ext_proc port over TLS (self-signed unless --cert-path). `--secure-serving=false` serves h2c.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub secure_serving: bool,

    /// Directory holding `tls.crt` and `tls.key` for the ext_proc port; reloaded when they change.
    #[arg(long, value_name = "DIR")]
    pub cert_path: Option<PathBuf>,

    /// Client authentication (mTLS) on the ext_proc port: a PEM bundle of CA certificates; a
    /// client must present a certificate chaining to one of them or its handshake is refused
    /// (`kvpick_tls_client_auth_refused_total{reason}`). With --cert-path it is re-read when it
    /// or the certificate changes. Unset: any client may connect (only the gateway should reach the port:
    /// docs/security.md#who-may-hold-capacity). Needs --secure-serving.
    #[arg(long, value_name = "FILE")]
    pub client_ca_path: Option<PathBuf>,

    /// With --client-ca-path: the client identities allowed, comma-separated URI or DNS SANs
    /// (e.g. the gateway's SPIFFE id `spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy-default`);
    /// a certificate from the CA naming none of them is refused. Empty: any certificate from
    /// the CA.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub client_allowed_sans: Vec<String>,
}

impl TlsArgs {
    /// The client authentication asked for, checked against the other TLS flags.
    pub fn client_auth(&self) -> anyhow::Result<Option<crate::transport::tls::ClientAuth>> {
        let allowed: Vec<String> = self
            .client_allowed_sans
            .iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let Some(ca) = &self.client_ca_path else {
            if !allowed.is_empty() {
                anyhow::bail!("--client-allowed-sans needs --client-ca-path");
            }
            return Ok(None);
        };
        if !self.secure_serving {
            anyhow::bail!("--client-ca-path needs --secure-serving (client certificates are TLS)");
        }
        Ok(Some(crate::transport::tls::ClientAuth {
            ca_path: ca.clone(),
            allowed_sans: allowed.into(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(secure: bool, ca: Option<&str>, sans: &[&str]) -> TlsArgs {
        TlsArgs {
            secure_serving: secure,
            cert_path: None,
            client_ca_path: ca.map(PathBuf::from),
            client_allowed_sans: sans.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn client_auth_needs_tls_and_sans_need_a_ca() {
        assert!(args(true, None, &[]).client_auth().unwrap().is_none());
        assert!(args(true, None, &["spiffe://a"]).client_auth().is_err());
        assert!(args(false, Some("ca.pem"), &[]).client_auth().is_err());
        let auth = args(true, Some("ca.pem"), &[" spiffe://a ", "", "b.example"])
            .client_auth()
            .unwrap()
            .unwrap();
        assert_eq!(&*auth.allowed_sans, ["spiffe://a", "b.example"]);
    }
}

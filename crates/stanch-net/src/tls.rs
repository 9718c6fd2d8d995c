//! TLS: the one cryptography provider, certificates from PEM files, the acceptor.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// The cryptography of every TLS connection stanch accepts or makes: *ring*'s, for TLS
/// 1.3 and 1.2 with X25519, P-256 and P-384 key exchange. rustls deprecates *ring*'s
/// provider because it has no post-quantum key exchange (X25519MLKEM768); aws-lc-rs's
/// has, and costs every build a C library with its own build system. A route table is
/// not secret for long and a token can be rotated, so *ring* stays, in this one place
/// (docs/operations.md, "TLS").
#[expect(
    deprecated,
    reason = "ring's provider, chosen over aws-lc-rs's: no post-quantum key exchange"
)]
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Why certificates or a key could not be loaded, or a TLS configuration made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("{}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file holds no certificate.
    #[error("{}: no PEM certificate in it", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A certificate could not be trusted as a root (a private CA's).
    #[error("{}: not a CA certificate rustls can use", path.display())]
    BadRoot {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls::Error,
    },
    /// The certificate and the key do not fit, or rustls refused the configuration.
    #[error("certificate and key do not fit")]
    Config(#[source] rustls::Error),
}

/// The certificates of a PEM file; an error names the file, and a file without any
/// certificate is one.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        path: path.to_owned(),
        source,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<_, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// Loads a PEM certificate chain and private key into a TLS acceptor that offers
/// HTTP/1.1 by ALPN, and `h2` before it when `http2` (the listener's
/// [`ConnLimits::http2`](crate::ConnLimits::http2)).
pub fn tls_acceptor(cert: &Path, key: &Path, http2: bool) -> Result<TlsAcceptor, TlsError> {
    let certs = certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Pem {
        path: key.to_owned(),
        source,
    })?;
    let mut config = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TlsError::Config)?;
    config.alpn_protocols = if http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(TlsAcceptor::from(Arc::new(config)))
}

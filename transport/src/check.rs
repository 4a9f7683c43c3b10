//! Start-up checks of the TLS files both binaries load, reporting every problem at once
//! (`--check-config`, and before a run): each file exists and is readable, PEM parses,
//! the CA file holds CA certificates (`basicConstraints CA:true`), a certificate is valid
//! now, its key matches it, and — for a node — its DNS SAN is the configured node name.
//!
//! Each problem is `(field, message)`, the field being the configuration field that named
//! the file.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use x509_parser::prelude::{FromDer, X509Certificate};

/// One problem: the configuration field and what is wrong.
pub type Problem = (&'static str, String);

fn read(field: &'static str, path: &Path, out: &mut Vec<Problem>) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(b) => Some(b),
        Err(e) => {
            out.push((field, format!("{}: {e}", path.display())));
            None
        }
    }
}

fn pem_certs(field: &'static str, path: &Path, bytes: &[u8], out: &mut Vec<Problem>) -> Vec<CertificateDer<'static>> {
    match CertificateDer::pem_slice_iter(bytes).collect::<Result<Vec<_>, _>>() {
        Ok(c) if c.is_empty() => {
            out.push((field, format!("{}: no PEM certificate in the file", path.display())));
            Vec::new()
        }
        Ok(c) => c,
        Err(e) => {
            out.push((field, format!("{}: not PEM certificates: {e}", path.display())));
            Vec::new()
        }
    }
}

/// Problems of one certificate's time validity (checked against the system clock).
fn validity(field: &'static str, path: &Path, cert: &X509Certificate<'_>, out: &mut Vec<Problem>) {
    let v = cert.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now < v.not_before {
        out.push((field, format!("{}: not valid before {}", path.display(), v.not_before)));
    } else if now > v.not_after {
        out.push((field, format!("{}: expired {}", path.display(), v.not_after)));
    }
}

/// Checks a CA file: readable, PEM, every certificate a CA and valid now.
#[must_use]
pub fn ca(field: &'static str, path: &Path) -> Vec<Problem> {
    let mut out = Vec::new();
    let Some(bytes) = read(field, path, &mut out) else { return out };
    for der in pem_certs(field, path, &bytes, &mut out) {
        match X509Certificate::from_der(der.as_ref()) {
            Ok((_, c)) => {
                if !c.is_ca() {
                    out.push((
                        field,
                        format!(
                            "{}: {} is not a CA certificate (no basicConstraints CA:true)",
                            path.display(),
                            c.subject()
                        ),
                    ));
                }
                validity(field, path, &c, &mut out);
            }
            Err(e) => out.push((field, format!("{}: certificate does not parse: {e}", path.display()))),
        }
    }
    out
}

/// Checks a certificate and its key: both readable and PEM, the certificate valid now,
/// the key its key, and (with `node_name`) its first DNS SAN that name.
#[must_use]
pub fn identity(
    cert_field: &'static str,
    cert: &Path,
    key_field: &'static str,
    key: &Path,
    node_name: Option<&str>,
) -> Vec<Problem> {
    let mut out = Vec::new();
    let certs = read(cert_field, cert, &mut out).map(|b| pem_certs(cert_field, cert, &b, &mut out));
    let leaf = certs.as_ref().and_then(|c| c.first()).cloned();
    if let Some(leaf) = &leaf {
        match X509Certificate::from_der(leaf.as_ref()) {
            Ok((_, c)) => validity(cert_field, cert, &c, &mut out),
            Err(e) => out.push((cert_field, format!("{}: certificate does not parse: {e}", cert.display()))),
        }
        if let Some(want) = node_name {
            match crate::name_of(leaf) {
                Ok(san) if san == want => {}
                Ok(san) => out.push((
                    cert_field,
                    format!(
                        "{}: its DNS SAN is {san:?}, not the node name {want:?} (the aggregator knows a node by its certificate)",
                        cert.display()
                    ),
                )),
                Err(e) => out.push((cert_field, format!("{}: {e}", cert.display()))),
            }
        }
    }
    let Some(key_bytes) = read(key_field, key, &mut out) else { return out };
    let signing = match PrivateKeyDer::from_pem_slice(&key_bytes) {
        Ok(k) => match rustls::crypto::ring::sign::any_supported_type(&k) {
            Ok(s) => s,
            Err(e) => {
                out.push((key_field, format!("{}: unusable private key: {e}", key.display())));
                return out;
            }
        },
        Err(e) => {
            out.push((key_field, format!("{}: not a PEM private key: {e}", key.display())));
            return out;
        }
    };
    if let Some(certs) = certs.filter(|c| !c.is_empty()) {
        let certified = rustls::sign::CertifiedKey::new(certs, signing);
        if let Err(e) = certified.keys_match() {
            out.push((key_field, format!("{}: does not match {} ({e})", key.display(), cert.display())));
        }
    }
    out
}

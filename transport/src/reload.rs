//! Certificate hot reload: both binaries look at their TLS files (CA, certificate, key)
//! every `tls_reload_interval_ms` and, when one changed, build the TLS configuration
//! anew from all three and put it in force for **new** connections; connections already
//! up keep the keys they were made with. No restart, no dropped connection.
//!
//! A file's version is its device, inode, size and modification time (a Kubernetes
//! Secret volume — cert-manager's rotations — swaps a symlink to a new directory, which
//! changes the inode). A set that does not load (a key that does not match its new
//! certificate because only one file was written so far, a truncated PEM) leaves the
//! configuration in force as it was; it is retried at every interval while it fails and
//! logged once per distinct problem. `ringwatch_tls_reloads_total{result}` counts both
//! outcomes and `ringwatch_tls_certificate_expiry_timestamp_seconds` says when the
//! certificate in force expires.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::TransportError;
use crate::metrics::{Families, Spec};

/// How often the files are looked at unless configured (`tls_reload_interval_ms`).
pub const DEFAULT_INTERVAL_MS: u64 = 10_000;

/// What identifies one version of a file.
type Stamp = (u64, u64, u64, i64, i64);

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
}

/// What the reloads did, for `/metrics` and `/healthz`.
#[derive(Debug, Default)]
pub struct ReloadCounters {
    /// Reloads that put a new configuration in force.
    pub applied: AtomicU64,
    /// Attempts whose files did not load (the old configuration stayed).
    pub failed: AtomicU64,
    /// The files changed and the last attempt failed: what is in force is older than
    /// what is on disk.
    pub failing: AtomicBool,
    /// `notAfter` of the leaf certificate in force, seconds since the epoch (0: unknown).
    pub expires_at: AtomicI64,
    /// The last attempt's problem, while failing.
    pub problem: Mutex<Option<String>>,
}

impl ReloadCounters {
    /// The last problem, while failing.
    #[must_use]
    pub fn problem(&self) -> Option<String> {
        if !self.failing.load(Relaxed) {
            return None;
        }
        self.problem.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// `notAfter` of the first certificate in a PEM file, seconds since the epoch.
#[must_use]
pub fn expiry_of(cert: &Path) -> Option<i64> {
    let der = CertificateDer::pem_file_iter(cert).ok()?.next()?.ok()?;
    let (_, c) = X509Certificate::from_der(der.as_ref()).ok()?;
    Some(c.validity().not_after.timestamp())
}

/// The watch over one party's TLS files.
#[derive(Debug)]
pub struct TlsWatch {
    files: Vec<PathBuf>,
    /// The certificate (the leaf's expiry is read from it).
    cert: PathBuf,
    seen: Vec<Option<Stamp>>,
    pub counters: Arc<ReloadCounters>,
}

impl TlsWatch {
    /// Watches `ca`, `cert` and `key` (and any `extra` file the configuration is built
    /// from), taking their versions now as the ones in force.
    #[must_use]
    pub fn new(ca: &Path, cert: &Path, key: &Path, extra: &[&Path]) -> Self {
        let mut files = vec![ca.to_path_buf(), cert.to_path_buf(), key.to_path_buf()];
        files.extend(extra.iter().map(|p| p.to_path_buf()));
        let seen = files.iter().map(|f| stamp(f)).collect();
        let counters = Arc::new(ReloadCounters::default());
        counters.expires_at.store(expiry_of(cert).unwrap_or(0), Relaxed);
        Self { files, cert: cert.to_path_buf(), seen, counters }
    }

    /// Looks at the files; when one changed since the last look (or the last attempt
    /// failed), runs `build` and returns what it built. A failure is counted and logged
    /// (once per distinct problem) and leaves the caller's configuration as it is.
    pub fn poll<T>(&mut self, what: &'static str, build: impl FnOnce() -> Result<T, TransportError>) -> Option<T> {
        let now: Vec<Option<Stamp>> = self.files.iter().map(|f| stamp(f)).collect();
        let changed = now != self.seen;
        if !changed && !self.counters.failing.load(Relaxed) {
            return None;
        }
        self.seen = now;
        let mut problem = self.counters.problem.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match build() {
            Ok(t) => {
                self.counters.applied.fetch_add(1, Relaxed);
                self.counters.failing.store(false, Relaxed);
                *problem = None;
                let expires = expiry_of(&self.cert).unwrap_or(0);
                self.counters.expires_at.store(expires, Relaxed);
                tracing::info!(what, cert = %self.cert.display(), expires_at = expires, "TLS files reloaded: new connections use them");
                Some(t)
            }
            Err(e) => {
                let e = e.to_string();
                // A retry of the same broken set is not counted again, nor logged.
                if changed || problem.as_deref() != Some(e.as_str()) {
                    self.counters.failed.fetch_add(1, Relaxed);
                    tracing::warn!(what, problem = %e, "TLS files changed but do not load: the configuration in force stays");
                }
                self.counters.failing.store(true, Relaxed);
                *problem = Some(e);
                None
            }
        }
    }
}

/// The reload's metrics, served by both binaries (`listener`: `quic`, or `http` for the
/// aggregator's API).
pub const SPECS: [Spec; 3] = [
    Spec::counter(
        "ringwatch_tls_reloads_total",
        "1",
        &["listener", "result"],
        "Certificate reloads after a file changed: applied (used for new connections) or failed (the old set stays).",
    ),
    Spec::gauge(
        "ringwatch_tls_reload_failing",
        "1",
        &["listener"],
        "1 while the TLS files on disk do not load (the configuration in force is older than the files).",
    ),
    Spec::gauge(
        "ringwatch_tls_certificate_expiry_timestamp_seconds",
        "seconds",
        &["listener"],
        "When the certificate in force expires (notAfter), seconds since the epoch.",
    ),
];

/// Fills the reload's metrics for one listener.
pub fn fill(f: &mut Families, listener: &str, c: &ReloadCounters) {
    f.count("ringwatch_tls_reloads_total", &[listener, "applied"], c.applied.load(Relaxed));
    f.count("ringwatch_tls_reloads_total", &[listener, "failed"], c.failed.load(Relaxed));
    f.level("ringwatch_tls_reload_failing", &[listener], u64::from(c.failing.load(Relaxed)));
    #[allow(clippy::cast_precision_loss, reason = "seconds since the epoch fit a double exactly")]
    f.gauge("ringwatch_tls_certificate_expiry_timestamp_seconds", &[listener], c.expires_at.load(Relaxed) as f64);
}

/// A TLS server configuration that can be replaced while a listener uses it (the HTTP
/// API's): each accepted connection takes the one in force.
pub type SharedServerTls = Arc<RwLock<Arc<rustls::ServerConfig>>>;

/// The configuration in force.
#[must_use]
pub fn current(tls: &SharedServerTls) -> Arc<rustls::ServerConfig> {
    Arc::clone(&tls.read().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// Puts `config` in force.
pub fn replace(tls: &SharedServerTls, config: Arc<rustls::ServerConfig>) {
    *tls.write().unwrap_or_else(std::sync::PoisonError::into_inner) = config;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, text: &str) {
        std::fs::write(p, text).expect("write");
    }

    #[test]
    fn a_change_is_built_once_and_a_failing_set_is_retried_until_it_loads() {
        let dir = std::env::temp_dir().join(format!("rw-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (ca, cert, key) = (dir.join("ca"), dir.join("cert"), dir.join("key"));
        for p in [&ca, &cert, &key] {
            write(p, "v1");
        }
        let mut w = TlsWatch::new(&ca, &cert, &key, &[]);
        // Nothing changed: nothing is built.
        assert_eq!(w.poll("t", || Ok::<_, TransportError>(1)), None);
        // A changed key (atomic rename, as a Secret volume does: a new inode).
        write(&dir.join("key.new"), "v2 longer");
        std::fs::rename(dir.join("key.new"), &key).expect("rename");
        let broken = || Err::<u32, _>(TransportError::NoCertificate { path: "cert".into() });
        assert_eq!(w.poll("t", broken), None);
        assert_eq!(w.counters.failed.load(Relaxed), 1);
        assert!(w.counters.failing.load(Relaxed));
        assert!(w.counters.problem().is_some_and(|p| p.contains("no certificate")));
        // The same broken set again: retried, neither counted nor logged again.
        assert_eq!(w.poll("t", broken), None);
        assert_eq!(w.counters.failed.load(Relaxed), 1);
        // Now it loads (the other file arrived): in force, failing cleared.
        assert_eq!(w.poll("t", || Ok::<_, TransportError>(2)), Some(2));
        assert_eq!(w.counters.applied.load(Relaxed), 1);
        assert!(!w.counters.failing.load(Relaxed));
        assert_eq!(w.counters.problem(), None);
        // And then nothing until the next change.
        assert_eq!(w.poll("t", || Ok::<_, TransportError>(3)), None);
        // A file that disappears is a change too (and its set fails to load).
        std::fs::remove_file(&ca).expect("rm");
        assert_eq!(w.poll("t", broken), None);
        assert_eq!(w.counters.failed.load(Relaxed), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! The API's optional bearer token (`api_token_file`): a request without
//! `Authorization: Bearer <token>` is answered `401` (JSON error body,
//! `WWW-Authenticate: Bearer`); `/healthz` and `/readyz` are exempt (probes carry no
//! token), and so are the live page's files (`/` and `/ui/…`: no data;
//! the page sends the token with its API requests).
//!
//! The file is re-read when it changes (its inode, size or modification time; and at
//! least once a second, for a rewrite the file system's timestamps cannot tell apart), so
//! a token rotates without a restart — a Kubernetes Secret volume swaps its files
//! atomically, which this follows. A file that turns unreadable or empty keeps the last
//! good token in force (logged), rather than locking every client out or letting every
//! client in. The comparison takes the same time wherever the tokens differ.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::state::Shared;

/// Paths answered without a token.
pub const EXEMPT: &[&str] = &["/healthz", "/readyz"];

/// The longest token file read.
const MAX_TOKEN_BYTES: u64 = 4096;

/// A token file re-read this long after the last read even if it looks unchanged.
const REREAD_AFTER: Duration = Duration::from_secs(1);

/// The token in `path`: its text, surrounding white space trimmed.
///
/// # Errors
/// Unreadable, larger than 4 KiB, not UTF-8, or empty.
pub fn read_token(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.len() > MAX_TOKEN_BYTES {
        return Err(format!("{}: {} bytes; a token file holds at most {MAX_TOKEN_BYTES}", path.display(), meta.len()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("{}: empty (a token file holds one token)", path.display()));
    }
    if token.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
        return Err(format!("{}: the token holds white space or control characters", path.display()));
    }
    Ok(token.to_owned())
}

/// What identifies a file's version.
type Stamp = (u64, u64, i64, i64);

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
}

#[derive(Debug)]
struct Cached {
    stamp: Option<Stamp>,
    read_at: Instant,
    token: Option<Arc<str>>,
    /// The last problem logged (each new one is logged once).
    problem: Option<String>,
}

/// The token file and the token in force.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    cached: Mutex<Cached>,
    /// Token reloads that changed the token.
    pub rotations: std::sync::atomic::AtomicU64,
}

impl TokenFile {
    /// Reads the token now (a problem is logged; requests are then refused until a good
    /// token is read — the start checks refuse a bad file first).
    #[must_use]
    pub fn new(path: PathBuf) -> Self {
        let f = Self {
            cached: Mutex::new(Cached { stamp: None, read_at: Instant::now(), token: None, problem: None }),
            path,
            rotations: std::sync::atomic::AtomicU64::new(0),
        };
        f.reload(&mut f.lock(), stamp(&f.path));
        f
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cached> {
        self.cached.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn reload(&self, c: &mut Cached, now_stamp: Option<Stamp>) {
        c.stamp = now_stamp;
        c.read_at = Instant::now();
        match read_token(&self.path) {
            Ok(t) => {
                if c.token.as_deref() != Some(t.as_str()) {
                    if c.token.is_some() {
                        self.rotations.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(file = %self.path.display(), "API token rotated");
                    }
                    c.token = Some(t.into());
                }
                c.problem = None;
            }
            Err(e) => {
                if c.problem.as_deref() != Some(e.as_str()) {
                    tracing::warn!(problem = %e, kept = c.token.is_some(), "API token file unusable: the last good token stays in force");
                    c.problem = Some(e);
                }
            }
        }
    }

    /// The token in force (re-read first if the file changed).
    pub fn current(&self) -> Option<Arc<str>> {
        let mut c = self.lock();
        let now_stamp = stamp(&self.path);
        if now_stamp != c.stamp || c.read_at.elapsed() >= REREAD_AFTER {
            self.reload(&mut c, now_stamp);
        }
        c.token.clone()
    }
}

/// Equal, in a time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

/// Whether `value` (an `Authorization` header) carries `token`.
fn carries(value: Option<&HeaderValue>, token: &str) -> bool {
    let Some(v) = value.and_then(|v| v.to_str().ok()) else { return false };
    let Some((scheme, given)) = v.trim().split_once(' ') else { return false };
    scheme.eq_ignore_ascii_case("bearer") && same(given.trim().as_bytes(), token.as_bytes())
}

/// The middleware: a request to a non-exempt path needs the token.
pub async fn require(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let Some(file) = &s.api_token else { return next.run(req).await };
    if EXEMPT.contains(&req.uri().path()) || super::ui::is_public(req.uri().path()) {
        return next.run(req).await;
    }
    let ok = file.current().is_some_and(|t| carries(req.headers().get(header::AUTHORIZATION), &t));
    if ok {
        return next.run(req).await;
    }
    s.http_unauthorized.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut r = ringwatch_transport::http::error(
        StatusCode::UNAUTHORIZED,
        "this API needs a bearer token: Authorization: Bearer <token> (the aggregator's api_token_file)",
    );
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"ringwatch\""));
    r.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"abc", b"abc"));
        for other in [&b"abd"[..], b"ab", b"abcd", b"", b"ABC"] {
            assert!(!same(b"abc", other), "{other:?}");
        }
        let t = "s3cret";
        let h = |v: &str| HeaderValue::from_str(v).unwrap();
        assert!(carries(Some(&h("Bearer s3cret")), t));
        assert!(carries(Some(&h("bearer  s3cret ")), t));
        for bad in ["Bearer s3cre", "Basic s3cret", "s3cret", "Bearer", ""] {
            assert!(!carries(Some(&h(bad)), t), "{bad:?}");
        }
        assert!(!carries(None, t));
    }

    #[test]
    fn a_token_file_is_checked_and_rotates() {
        let dir = std::env::temp_dir().join(format!("rw-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("token");
        for (text, want) in [("", "empty"), ("  \n", "empty"), ("a b", "white space")] {
            std::fs::write(&p, text).unwrap();
            assert!(read_token(&p).unwrap_err().contains(want), "{text:?}");
        }
        assert!(read_token(&dir.join("missing")).is_err());
        std::fs::write(&p, "one\n").unwrap();
        let f = TokenFile::new(p.clone());
        assert_eq!(f.current().as_deref(), Some("one"));
        // Rotation by rename (as a Secret volume does): a new inode.
        std::fs::write(dir.join("next"), "two").unwrap();
        std::fs::rename(dir.join("next"), &p).unwrap();
        assert_eq!(f.current().as_deref(), Some("two"));
        // An empty file keeps the last good token.
        std::fs::write(dir.join("next"), "").unwrap();
        std::fs::rename(dir.join("next"), &p).unwrap();
        assert_eq!(f.current().as_deref(), Some("two"));
        assert_eq!(f.rotations.load(std::sync::atomic::Ordering::Relaxed), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

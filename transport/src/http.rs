//! The HTTP listener both binaries serve their routes on (the aggregator's API, the
//! shipper's `/healthz` and `/readyz`), with the limits `axum::serve` does not set:
//!
//! - a **header-read timeout**: a connection that has not sent a whole request head this
//!   long after it opened, or after its previous response (an idle keep-alive connection),
//!   is closed (hyper's HTTP/1 `header_read_timeout`, driven by tokio's timer);
//! - a **connection cap**: past it a new connection is answered `503` (when the socket
//!   takes the bytes at once) and closed, counted, so half-open clients cannot exhaust the
//!   process's file limit and starve the routes everyone else needs;
//! - accept errors (`EMFILE` and kin) pause the accept loop for 50 ms instead of spinning,
//!   counted;
//! - optional TLS ([`crate::http_tls_config`], mTLS as an option): the handshake must end
//!   within the header-read timeout; failures are counted and the connection closed.
//!
//! And the answers every route shares: JSON error bodies (`{"error": "..."}`) for 400,
//! 404 and 405, and [`params`], which refuses unknown and repeated query parameters.
//!
//! Not covered: a client that sends requests but never reads the answers holds its
//! connection (and one unit of the cap) until it goes away.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use axum::Json;
use axum::extract::Query;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

/// The listener's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// How long a connection may take to send a request head (also: how long an idle
    /// keep-alive connection stays open).
    pub header_read_timeout: Duration,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self { header_read_timeout: Duration::from_secs(10), max_connections: 1024 }
    }
}

/// What the listener counted.
#[derive(Debug, Default)]
pub struct HttpCounters {
    /// Connections accepted and served.
    pub connections: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
    /// Connections turned away at the cap.
    pub refused_at_cap: AtomicU64,
    /// Connections closed for not sending a request head in time.
    pub header_timeouts: AtomicU64,
    /// `accept` failures (the file limit, most often).
    pub accept_errors: AtomicU64,
    /// TLS handshakes that failed or timed out (with TLS on).
    pub tls_handshake_failures: AtomicU64,
}

/// Serves `router` on `listener` until the listener fails for good (never, in practice:
/// accept errors pause and retry) or the future is dropped (its task aborted): every
/// connection it accepted ends with it, keep-alive ones too (a browser must not go on
/// talking to a stopped server's router over a connection it kept open).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: HttpLimits,
    counters: Arc<HttpCounters>,
    tls: Option<crate::reload::SharedServerTls>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut last_error_log = None::<std::time::Instant>;
    // At most `max_connections` (the permits); finished ones are reaped as they end.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            Some(done) = conns.join_next(), if !conns.is_empty() => {
                if let Err(e) = done
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "an HTTP connection's task panicked; its connection is closed");
                }
                continue;
            }
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                counters.accept_errors.fetch_add(1, Relaxed);
                // One line per 10 s at most: a file-limit storm must not flood the log.
                if last_error_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    last_error_log = Some(std::time::Instant::now());
                    tracing::warn!(error = %e, total = counters.accept_errors.load(Relaxed), "HTTP accept failed; pausing 50 ms");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            counters.refused_at_cap.fetch_add(1, Relaxed);
            let body = r#"{"error":"too many HTTP connections"}"#;
            let answer = format!(
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.try_write(answer.as_bytes());
            tracing::debug!(%peer, "HTTP connection refused at the cap");
            continue;
        };
        let _ = stream.set_nodelay(true);
        counters.connections.fetch_add(1, Relaxed);
        counters.open.fetch_add(1, Relaxed);
        // Gives the slot back and counts the connection closed however its task ends:
        // done, panicked, or aborted with the listener.
        let open = OpenConnection { counters: Arc::clone(&counters), _permit: permit };
        let (counters, router) = (Arc::clone(&counters), router.clone());
        // The configuration in force when the connection came (certificates reload).
        let tls = tls.as_ref().map(|t| tokio_rustls::TlsAcceptor::from(crate::reload::current(t)));
        conns.spawn(async move {
            let builder = {
                let mut b = hyper::server::conn::http1::Builder::new();
                b.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
                b
            };
            let service = TowerToHyperService::new(router);
            let served = match tls {
                None => builder.serve_connection(TokioIo::new(stream), service).await,
                Some(acceptor) => match tokio::time::timeout(limits.header_read_timeout, acceptor.accept(stream)).await
                {
                    Ok(Ok(tls_stream)) => builder.serve_connection(TokioIo::new(tls_stream), service).await,
                    Ok(Err(e)) => {
                        counters.tls_handshake_failures.fetch_add(1, Relaxed);
                        tracing::debug!(%peer, error = %e, "HTTP TLS handshake failed");
                        Ok(())
                    }
                    Err(_) => {
                        counters.tls_handshake_failures.fetch_add(1, Relaxed);
                        Ok(())
                    }
                },
            };
            if let Err(e) = served
                && e.is_timeout()
            {
                counters.header_timeouts.fetch_add(1, Relaxed);
            }
            drop(open);
        });
    }
}

/// A served connection's slot: dropping it counts the connection closed.
struct OpenConnection {
    counters: Arc<HttpCounters>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Relaxed);
    }
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

/// An error answer: `status` with `{"error": message}`.
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody { error: message.into() })).into_response()
}

/// The router's fallback: 404 naming the path.
pub async fn not_found(method: Method, uri: Uri) -> Response {
    error(StatusCode::NOT_FOUND, format!("no route for {method} {}", uri.path()))
}

/// The router's method fallback: 405 naming the method.
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {} (GET is)", uri.path()))
}

/// A query refused: answered 400 with what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadQuery(pub String);

impl IntoResponse for BadQuery {
    fn into_response(self) -> Response {
        error(StatusCode::BAD_REQUEST, self.0)
    }
}

/// The query parameters of `uri`, each at most once and each one of `allowed`.
///
/// # Errors
/// A query string that does not parse, an unknown parameter or a repeated one, named.
pub fn params(uri: &Uri, allowed: &[&str]) -> Result<BTreeMap<String, String>, BadQuery> {
    let Query(pairs) =
        Query::<Vec<(String, String)>>::try_from_uri(uri).map_err(|e| BadQuery(format!("query string: {e}")))?;
    let mut out = BTreeMap::new();
    for (k, v) in pairs {
        if !allowed.contains(&k.as_str()) {
            let takes = if allowed.is_empty() { "none".to_owned() } else { allowed.join(", ") };
            return Err(BadQuery(format!("unknown query parameter {k:?} ({} takes: {takes})", uri.path())));
        }
        if out.contains_key(&k) {
            return Err(BadQuery(format!("query parameter {k:?} given more than once")));
        }
        out.insert(k, v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(r: Result<BTreeMap<String, String>, BadQuery>) -> Result<BTreeMap<String, String>, u16> {
        r.map_err(|e| e.into_response().status().as_u16())
    }

    #[test]
    fn params_refuse_unknown_and_repeated_names_and_keep_the_rest() {
        let uri: Uri = "/v1/x?limit=5&node=node-01".parse().unwrap();
        let got = status(params(&uri, &["limit", "node"])).unwrap();
        assert_eq!(got.get("limit").map(String::as_str), Some("5"));
        assert_eq!(got.len(), 2);
        for bad in ["/v1/x?limit=abc&limit=5", "/v1/x?colour=red", "/v1/x?limit=5&limit=5"] {
            assert_eq!(status(params(&bad.parse().unwrap(), &["limit"])), Err(400), "{bad}");
        }
        assert_eq!(status(params(&"/healthz?x".parse().unwrap(), &[])), Err(400));
        assert!(status(params(&"/healthz".parse().unwrap(), &[])).unwrap().is_empty());
    }

    /// A keep-alive connection ends with the listener (an in-process restart must not
    /// leave a browser talking to the stopped router), and is counted closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stopping_the_listener_closes_its_keep_alive_connections() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counters = Arc::new(HttpCounters::default());
        let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let server = tokio::spawn(serve(listener, router, HttpLimits::default(), Arc::clone(&counters), None));
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = c.read(&mut buf).await.unwrap();
        let head = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(head.starts_with("HTTP/1.1 200") && head.ends_with("ok"), "{head}");
        assert_eq!(counters.open.load(Relaxed), 1, "kept alive");
        server.abort();
        let _ = server.await;
        let n = tokio::time::timeout(Duration::from_secs(60), c.read(&mut buf)).await.expect("closed").unwrap_or(0);
        assert_eq!(n, 0, "the connection ended with the listener");
        // Counted as its task's state is dropped, beside the socket.
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while counters.open.load(Relaxed) != 0 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(counters.open.load(Relaxed), 0, "and was counted closed");
    }
}

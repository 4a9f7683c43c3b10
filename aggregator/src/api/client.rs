//! A minimal HTTP/1.1 client for this API (`loadgen` and the tests read verdicts through
//! the same DTOs a scheduler would): `GET`, `Connection: close`, chunked or
//! length-delimited bodies.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("GET {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("GET {path}: not an HTTP response")]
    NotHttp { path: String },
    #[error("GET {path}: status {status}: {body}")]
    Status { path: String, status: u16, body: String },
    #[error("GET {path}: {source}")]
    Json { path: String, source: serde_json::Error },
}

/// `GET path`; returns the status and the body.
///
/// # Errors
/// The server cannot be reached or does not answer HTTP.
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), ClientError> {
    let io = |source| ClientError::Io { path: path.to_owned(), source };
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.map_err(io)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let not_http = || ClientError::NotHttp { path: path.to_owned() };
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(not_http)?;
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(not_http)?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    Ok((status, if chunked { dechunk(body) } else { body.to_owned() }))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(rest.get(..n).unwrap_or(rest));
        body = rest.get(n + 2..).unwrap_or("");
    }
    out
}

/// `GET path`, a 200 answer parsed as JSON into `T`.
///
/// # Errors
/// As [`get`], another status, or a body that is not a `T`.
pub async fn get_json<T: serde::de::DeserializeOwned>(addr: SocketAddr, path: &str) -> Result<T, ClientError> {
    let (status, body) = get(addr, path).await?;
    if status != 200 {
        return Err(ClientError::Status { path: path.to_owned(), status, body });
    }
    serde_json::from_str(&body).map_err(|source| ClientError::Json { path: path.to_owned(), source })
}

/// Every verdict `query` selects (`/v1/verdicts?{query}`), following `next_cursor`
/// page by page (100,000 at a time); `total` and `stored` are the first page's.
///
/// # Errors
/// As [`get_json`].
pub async fn get_all_verdicts(addr: SocketAddr, query: &str) -> Result<super::dto::VerdictsDto, ClientError> {
    let sep = if query.is_empty() { "" } else { "&" };
    let mut all: super::dto::VerdictsDto = get_json(addr, &format!("/v1/verdicts?limit=100000{sep}{query}")).await?;
    while let Some(cursor) = all.next_cursor.take() {
        let page: super::dto::VerdictsDto =
            get_json(addr, &format!("/v1/verdicts?limit=100000{sep}{query}&cursor={cursor}")).await?;
        all.verdicts.extend(page.verdicts);
        all.next_cursor = page.next_cursor;
    }
    Ok(all)
}

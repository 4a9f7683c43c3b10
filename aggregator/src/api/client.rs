//! A minimal HTTP/1.1 client for this API (`loadgen` and the tests read verdicts through
//! the same DTOs a scheduler would): `GET`, `Connection: close`, chunked or
//! length-delimited bodies, optional extra headers (a bearer token); and
//! [`EventStream`], a follower of `GET /v1/events` (Server-Sent Events).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Where the API is: its address, and the TLS client side when it is served over HTTPS
/// (`http_tls_cert`; [`ringwatch_transport::http_client_tls_config`]).
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub tls: Option<(Arc<rustls::ClientConfig>, rustls::pki_types::ServerName<'static>)>,
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        Self { addr, tls: None }
    }
}

/// A connection, plain or TLS.
trait Conn: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Conn for T {}

async fn connect(ep: &Endpoint) -> std::io::Result<Box<dyn Conn>> {
    let tcp = tokio::net::TcpStream::connect(ep.addr).await?;
    Ok(match &ep.tls {
        None => Box::new(tcp),
        Some((cfg, name)) => {
            Box::new(tokio_rustls::TlsConnector::from(Arc::clone(cfg)).connect(name.clone(), tcp).await?)
        }
    })
}

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
    #[error("GET {path}: the response ended before its body did")]
    Truncated { path: String },
    #[error("GET {path}: the response is larger than {MAX_RESPONSE} bytes")]
    TooLarge { path: String },
}

/// The largest response [`get`] reads (a server cannot make the client buffer more).
pub const MAX_RESPONSE: u64 = 1 << 30;

/// `GET path`; returns the status and the body.
///
/// # Errors
/// The server cannot be reached or does not answer HTTP.
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), ClientError> {
    get_with(addr, path, &[]).await
}

/// The request head of `GET path` with `headers`.
fn request(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> String {
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req
}

/// `GET path` with extra request headers (`("Authorization", "Bearer …")`).
///
/// # Errors
/// As [`get`].
pub async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Result<(u16, String), ClientError> {
    get_at(&addr.into(), path, headers).await
}

/// [`get_with`] at an [`Endpoint`] (plain or TLS).
///
/// # Errors
/// As [`get`], and a TLS handshake the server refused.
pub async fn get_at(ep: &Endpoint, path: &str, headers: &[(&str, &str)]) -> Result<(u16, String), ClientError> {
    let io = |source| ClientError::Io { path: path.to_owned(), source };
    let mut s = connect(ep).await.map_err(io)?;
    let req = request(ep.addr, path, headers);
    s.write_all(req.as_bytes()).await.map_err(io)?;
    let mut raw = Vec::new();
    match (&mut s).take(MAX_RESPONSE + 1).read_to_end(&mut raw).await {
        Ok(_) => {}
        // A TLS peer that closes without close_notify: what was read stands if it is
        // whole (checked below).
        Err(e) if ep.tls.is_some() && e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(io(e)),
    }
    if raw.len() as u64 > MAX_RESPONSE {
        return Err(ClientError::TooLarge { path: path.to_owned() });
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let not_http = || ClientError::NotHttp { path: path.to_owned() };
    let truncated = || ClientError::Truncated { path: path.to_owned() };
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(not_http)?;
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(not_http)?;
    let lower = head.to_ascii_lowercase();
    if lower.contains("transfer-encoding: chunked") {
        return Ok((status, dechunk(body).ok_or_else(truncated)?));
    }
    let length =
        lower.lines().find_map(|l| l.strip_prefix("content-length:").and_then(|n| n.trim().parse::<usize>().ok()));
    if length.is_some_and(|n| body.len() < n) {
        return Err(truncated());
    }
    Ok((status, body.to_owned()))
}

/// A chunked body decoded; `None` if it ends before its last (empty) chunk.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        body = rest.get(n..)?.strip_prefix("\r\n")?;
    }
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

/// The most a chunk, or a line not yet ended, may hold (a server cannot make the client
/// buffer more).
const MAX_CHUNK: usize = 16 << 20;

/// One Server-Sent Event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    pub id: Option<String>,
    /// The `event:` field (`message` when absent).
    pub event: String,
    pub data: String,
}

/// A `GET /v1/events` stream being read.
pub struct EventStream {
    reader: tokio::io::BufReader<Box<dyn Conn>>,
    chunked: bool,
    decoded: Vec<u8>,
    ended: bool,
    path: String,
    /// Comment lines (`: heartbeat`) seen.
    pub comments: u64,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("path", &self.path)
            .field("chunked", &self.chunked)
            .field("ended", &self.ended)
            .field("comments", &self.comments)
            .finish_non_exhaustive()
    }
}

impl EventStream {
    /// Opens `GET path` (`/v1/events?…`) with `headers` (`Last-Event-ID`, a token).
    ///
    /// # Errors
    /// The server cannot be reached, answers something else than HTTP, or another
    /// status than 200 (with its body).
    pub async fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Result<Self, ClientError> {
        Self::open_at(&addr.into(), path, headers).await
    }

    /// [`Self::open`] at an [`Endpoint`] (plain or TLS).
    ///
    /// # Errors
    /// As [`Self::open`].
    pub async fn open_at(ep: &Endpoint, path: &str, headers: &[(&str, &str)]) -> Result<Self, ClientError> {
        use tokio::io::AsyncBufReadExt;
        let io = |source| ClientError::Io { path: path.to_owned(), source };
        let mut s = connect(ep).await.map_err(io)?;
        let mut all = headers.to_vec();
        all.push(("Accept", "text/event-stream"));
        s.write_all(request(ep.addr, path, &all).as_bytes()).await.map_err(io)?;
        let mut reader = tokio::io::BufReader::new(s);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.map_err(io)? == 0 || line == "\r\n" {
                break;
            }
            if head.len() > 64 * 1024 {
                return Err(ClientError::NotHttp { path: path.to_owned() });
            }
            head.push_str(&line);
        }
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| ClientError::NotHttp { path: path.to_owned() })?;
        let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
        let mut me = Self { reader, chunked, decoded: Vec::new(), ended: false, path: path.to_owned(), comments: 0 };
        if status != 200 {
            let mut body = Vec::new();
            while let Some(line) = me.line().await? {
                body.push(line);
            }
            return Err(ClientError::Status { path: path.to_owned(), status, body: body.join("\n") });
        }
        Ok(me)
    }

    /// Reads more of the body into `decoded`; false at its end.
    async fn fill(&mut self) -> Result<bool, ClientError> {
        use tokio::io::AsyncBufReadExt;
        let path = self.path.clone();
        let io = |source| ClientError::Io { path: path.clone(), source };
        if self.ended {
            return Ok(false);
        }
        if !self.chunked {
            if self.decoded.len() > MAX_CHUNK {
                return Err(ClientError::NotHttp { path });
            }
            let mut buf = [0u8; 8192];
            let n = self.reader.read(&mut buf).await.map_err(io)?;
            self.decoded.extend_from_slice(buf.get(..n).unwrap_or_default());
            self.ended = n == 0;
            return Ok(n > 0);
        }
        let mut size = String::new();
        if self.reader.read_line(&mut size).await.map_err(io)? == 0 {
            self.ended = true;
            return Ok(false);
        }
        let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
            .ok()
            .filter(|&n| n <= MAX_CHUNK)
            .ok_or_else(|| ClientError::NotHttp { path: path.clone() })?;
        if self.decoded.len().saturating_add(n) > MAX_CHUNK {
            // A line this long is no event stream.
            return Err(ClientError::NotHttp { path });
        }
        if n == 0 {
            self.ended = true;
            return Ok(false);
        }
        let start = self.decoded.len();
        self.decoded.resize(start + n, 0);
        self.reader.read_exact(self.decoded.get_mut(start..).unwrap_or_default()).await.map_err(io)?;
        let mut crlf = [0u8; 2];
        self.reader.read_exact(&mut crlf).await.map_err(io)?;
        Ok(true)
    }

    /// The next line of the body (without its end); `None` at the end.
    async fn line(&mut self) -> Result<Option<String>, ClientError> {
        loop {
            if let Some(i) = self.decoded.iter().position(|&b| b == b'\n') {
                let raw: Vec<u8> = self.decoded.drain(..=i).collect();
                let text = String::from_utf8_lossy(raw.get(..i).unwrap_or_default()).into_owned();
                return Ok(Some(text.strip_suffix('\r').unwrap_or(&text).to_owned()));
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }

    /// The next event; `None` when the server ended the stream.
    ///
    /// # Errors
    /// The connection failed or the chunked framing is broken.
    pub async fn next(&mut self) -> Result<Option<SseEvent>, ClientError> {
        let mut e = SseEvent::default();
        let mut any = false;
        while let Some(line) = self.line().await? {
            if line.is_empty() {
                if any {
                    if e.event.is_empty() {
                        e.event = "message".into();
                    }
                    return Ok(Some(e));
                }
                continue;
            }
            if line.starts_with(':') {
                self.comments += 1;
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((&line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            any = true;
            match field {
                "id" => e.id = Some(value.to_owned()),
                "event" => e.event = value.to_owned(),
                "data" => {
                    if !e.data.is_empty() {
                        e.data.push('\n');
                    }
                    e.data.push_str(value);
                }
                _ => {}
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunked_bodies_decode_only_when_whole() {
        assert_eq!(super::dechunk("5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n").as_deref(), Some("hello world"));
        for cut in ["5\r\nhello\r\n", "5\r\nhel", "5\r\nhello", "zz\r\nhello\r\n0\r\n\r\n", ""] {
            assert_eq!(super::dechunk(cut), None, "{cut:?}");
        }
    }
}

//! `ringwatch-transport`: the QUIC settings node-shipper and aggregator must agree on.
//!
//! What it is: mutual TLS 1.3 with rustls and the ring provider (one crypto provider in
//! the whole workspace), the node identity taken from the client certificate's DNS SAN,
//! the ALPN, the stream layout, and the transport tuning measured on these machines
//! (4 MiB socket buffers, GSO on, MTU discovery up to 6000 with `max_udp_payload_size`
//! raised to match, windows sized so unread bulk never blocks P0).
//!
//! What it is not: a protocol. Frames, batches and control messages are proto-flat's;
//! this crate only opens the pipes.
//!
//! Stream layout on one connection:
//! - the shipper opens one bidirectional **control stream**, writes [`CONTROL_PREFACE`]
//!   (or the preface of an older control protocol it falls back to) and one `resume`
//!   (where its session stands); the aggregator applies it before any batch of the
//!   connection, then answers on it with `hello` (the protocol both speak, and what an
//!   ack promises), then `ack`/`nack` messages;
//! - every batch travels on its own unidirectional stream (the stream's end delimits it),
//!   with priority by lane ([`lane_priority`]): P0 above P1 above bulk.

pub mod check;
pub mod config;
pub mod http;
pub mod memcg;
pub mod metrics;
pub mod pressure;
pub mod psi;
pub mod reload;
pub mod shard;

use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{EndpointConfig, IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// ALPN of ringwatch's protocol, version 1.
pub const ALPN: &[u8] = b"ringwatch/1";

/// First bytes the shipper writes on its control stream: control protocol 3
/// (`proto_flat::control::CONTROL_VERSION`; a `resume` follows, as from protocol 2 on).
/// An aggregator also takes protocol 2's preface (`RWCTL2`), one version back.
pub const CONTROL_PREFACE: [u8; 8] = *b"RWCTL3\0\0";

/// QUIC application close codes.
pub mod close {
    /// Orderly shutdown.
    pub const SHUTDOWN: u32 = 0;
    /// The peer broke the protocol (bad preface, bad control message).
    pub const PROTOCOL: u32 = 1;
    /// The client certificate carries no usable node name, or the node cap is reached.
    pub const REFUSED: u32 = 2;
    /// Too many rejected batches from this peer.
    pub const ABUSE: u32 = 3;
    /// The control preface names a protocol this aggregator does not speak (the reason
    /// names the ones it does). An aggregator one version older closes with `PROTOCOL`.
    pub const VERSION: u32 = 4;
}

/// Errors setting up TLS or sockets.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{what} {path}: {source}")]
    Pem { what: &'static str, path: String, source: rustls::pki_types::pem::Error },
    #[error("{path}: no certificate in the file")]
    NoCertificate { path: String },
    #[error("CA {path}: {source}")]
    BadCa { path: String, source: rustls::Error },
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("QUIC crypto configuration: {0}")]
    QuicCrypto(String),
    #[error("socket {addr}: {source}")]
    Socket { addr: SocketAddr, source: std::io::Error },
}

/// Why a peer's identity was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("no client certificate")]
    NoCertificate,
    #[error("client certificate does not parse: {0}")]
    BadCertificate(String),
    #[error("client certificate has no DNS SAN")]
    NoDnsName,
}

/// Transport tuning. Defaults follow the budgets of docs/design.md and the measurements in
/// docs/quic-notes.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Bytes bulk (P2/P3) may have unacked on a connection.
    pub bulk_window_bytes: u64,
    /// Room kept for P0 and P1 above bulk's window, on both sides.
    pub p0_reserve_bytes: u64,
    pub p1_reserve_bytes: u64,
    /// Per-stream receive window (≥ the largest batch).
    pub stream_window_bytes: u64,
    /// Concurrent batch streams a peer may open.
    pub max_streams: u32,
    /// UDP socket send and receive buffers.
    pub socket_buffer_bytes: usize,
    /// MTU discovery upper bound (and `max_udp_payload_size`).
    pub mtu_upper_bound: u16,
    pub idle_timeout_ms: u32,
    pub keep_alive_ms: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            // 8 MiB: ~1 s of a node's bulk at 8.3 M × 48 B/s would be 400 MiB/s; the window
            // only needs a bandwidth-delay product (≈ 100 µs–10 ms RTT × ~1 GB/s).
            bulk_window_bytes: 8 << 20,
            p0_reserve_bytes: 1 << 20,
            p1_reserve_bytes: 1 << 20,
            stream_window_bytes: 1 << 20,
            max_streams: 1024,
            // docs/quic-notes.md: ≥ 2–4 MiB even on loopback, or quinn loses packets.
            socket_buffer_bytes: 4 << 20,
            // docs/quic-notes.md: MTU 6000 + GSO is 2.4× the throughput of 1452; 8952
            // collapses.
            mtu_upper_bound: 6000,
            idle_timeout_ms: 10_000,
            keep_alive_ms: 1_000,
        }
    }
}

impl Tuning {
    /// The connection send window: bulk's share plus the P0/P1 reserve.
    #[must_use]
    pub fn send_window(&self) -> u64 {
        self.bulk_window_bytes + self.p0_reserve_bytes + self.p1_reserve_bytes
    }

    /// The connection receive window: at least the sum of bulk's stream windows (bounded
    /// by bulk's window) plus the P0/P1 reserve, so unread bulk never blocks P0.
    #[must_use]
    pub fn receive_window(&self) -> u64 {
        self.bulk_window_bytes + self.stream_window_bytes + self.p0_reserve_bytes + self.p1_reserve_bytes
    }

    /// The quinn transport config for these numbers.
    #[must_use]
    pub fn transport(&self) -> TransportConfig {
        let mut t = TransportConfig::default();
        let var = |v: u64| VarInt::from_u64(v).unwrap_or(VarInt::MAX);
        t.send_window(self.send_window())
            .receive_window(var(self.receive_window()))
            .stream_receive_window(var(self.stream_window_bytes))
            .max_concurrent_uni_streams(VarInt::from_u32(self.max_streams))
            .max_concurrent_bidi_streams(VarInt::from_u32(1))
            .max_idle_timeout(Some(IdleTimeout::from(VarInt::from_u32(self.idle_timeout_ms))))
            .keep_alive_interval(Some(Duration::from_millis(self.keep_alive_ms)));
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(self.mtu_upper_bound);
        t.mtu_discovery_config(Some(mtu));
        t
    }

    /// An endpoint bound to `addr` with the socket buffers set; a server when
    /// `server` is given.
    ///
    /// # Errors
    /// The socket cannot be created or bound.
    pub fn endpoint(
        &self,
        addr: SocketAddr,
        server: Option<quinn::ServerConfig>,
    ) -> Result<quinn::Endpoint, TransportError> {
        let err = |source| TransportError::Socket { addr, source };
        let domain = socket2::Domain::for_address(addr);
        let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP)).map_err(err)?;
        // Without CAP_NET_ADMIN the kernel caps these at net.core.*mem_max; set what it
        // allows (the effective size is readable with `ss -um`).
        let _ = socket.set_send_buffer_size(self.socket_buffer_bytes);
        let _ = socket.set_recv_buffer_size(self.socket_buffer_bytes);
        socket.bind(&addr.into()).map_err(err)?;
        let socket: UdpSocket = socket.into();
        let mut config = EndpointConfig::default();
        let _ = config.max_udp_payload_size(self.mtu_upper_bound);
        let runtime = quinn::default_runtime()
            .ok_or_else(|| err(std::io::Error::other("no async runtime (call from inside tokio)")))?;
        quinn::Endpoint::new(config, server, socket, runtime).map_err(err)
    }
}

fn certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TransportError> {
    let p = path.display().to_string();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TransportError::Pem { what, path: p.clone(), source })?;
    if certs.is_empty() {
        return Err(TransportError::NoCertificate { path: p });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TransportError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TransportError::Pem {
        what: "private key",
        path: path.display().to_string(),
        source,
    })
}

fn roots(ca: &Path) -> Result<RootCertStore, TransportError> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca, "CA certificate")? {
        roots.add(c).map_err(|source| TransportError::BadCa { path: ca.display().to_string(), source })?;
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Files of one party's TLS identity.
#[derive(Debug, Clone, Copy)]
pub struct TlsFiles<'a> {
    /// The CA that signs the peer's certificate.
    pub ca: &'a Path,
    pub cert: &'a Path,
    pub key: &'a Path,
}

/// The shipper's client config: verifies the aggregator against `ca`, presents the
/// node's certificate.
///
/// # Errors
/// A file is missing or not PEM, or the key does not match the certificate.
pub fn client_config(files: TlsFiles<'_>, tuning: &Tuning) -> Result<quinn::ClientConfig, TransportError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(files.ca)?)
        .with_client_auth_cert(certs(files.cert, "certificate")?, key(files.key)?)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| TransportError::QuicCrypto(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(tuning.transport()));
    Ok(config)
}

/// The aggregator's server config: requires a client certificate signed by `ca`.
///
/// # Errors
/// A file is missing or not PEM, or the key does not match the certificate.
pub fn server_config(files: TlsFiles<'_>, tuning: &Tuning) -> Result<quinn::ServerConfig, TransportError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(files.ca)?), provider()).build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(files.cert, "certificate")?, key(files.key)?)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| TransportError::QuicCrypto(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(tuning.transport()));
    Ok(config)
}

/// A TLS server configuration (for [`http_tls_config`] and `http::serve`).
pub type TlsServerConfig = rustls::ServerConfig;

/// TLS for an HTTP listener (the aggregator's API): the server's certificate and key,
/// TLS 1.3 and 1.2, ALPN `http/1.1`; with `client_ca`, every client must present a
/// certificate it signs (mTLS), else none is asked.
///
/// # Errors
/// A file is missing or not PEM, the CA is unusable, or the key does not match.
pub fn http_tls_config(
    cert: &Path,
    key_file: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TransportError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider()).build()?,
        ),
        None => builder.with_no_client_auth(),
    };
    let mut tls = builder.with_single_cert(certs(cert, "certificate")?, key(key_file)?)?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(tls))
}

/// The TLS client side of the HTTP API (`aggregator query` against an aggregator with
/// `http_tls_cert`): servers `ca` signed, and with `client` (certificate, key) a client
/// certificate for an aggregator that asks for one (`http_client_ca`).
///
/// # Errors
/// A file that does not load, or a key that does not match its certificate.
pub fn http_client_tls_config(
    ca: &Path,
    client: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, TransportError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_root_certificates(roots(ca)?);
    let mut tls = match client {
        Some((cert, key_file)) => builder.with_client_auth_cert(certs(cert, "certificate")?, key(key_file)?)?,
        None => builder.with_no_client_auth(),
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(tls))
}

/// The node name of a connected peer: the first DNS SAN of its (verified) client
/// certificate.
///
/// # Errors
/// No certificate, one that does not parse, or one without a DNS name.
pub fn peer_name(conn: &quinn::Connection) -> Result<String, IdentityError> {
    let identity = conn.peer_identity().ok_or(IdentityError::NoCertificate)?;
    let chain = identity.downcast::<Vec<CertificateDer<'static>>>().map_err(|_| IdentityError::NoCertificate)?;
    let leaf = chain.first().ok_or(IdentityError::NoCertificate)?;
    name_of(leaf)
}

/// The first DNS SAN of a certificate.
///
/// # Errors
/// The certificate does not parse or has no DNS name.
pub fn name_of(cert: &CertificateDer<'_>) -> Result<String, IdentityError> {
    let ee = webpki::EndEntityCert::try_from(cert).map_err(|e| IdentityError::BadCertificate(format!("{e:?}")))?;
    ee.valid_dns_names().next().map(str::to_owned).ok_or(IdentityError::NoDnsName)
}

/// Priority of the control stream: above every lane, so the preface, acks and nacks
/// never wait behind bulk (quinn sends lower-priority data only when higher has none).
pub const CONTROL_PRIORITY: i32 = 16;

/// Stream priority of a lane (quinn: higher goes first among buffered data).
#[must_use]
pub fn lane_priority(lane: proto_flat::Class) -> i32 {
    use proto_flat::WireEnum;
    3 - i32::from(lane.code().min(3))
}

/// What both service binaries do around their work: logs and the stop signal.
pub mod shell {
    use std::sync::OnceLock;

    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Registry, reload};

    /// The log filter's reload handle and the configured directives (set by
    /// [`init_logs`]).
    static FILTER: OnceLock<(reload::Handle<EnvFilter, Registry>, String)> = OnceLock::new();

    /// Logs to stderr, text or JSON lines, filtered by `RINGWATCH_LOG` (default `info`).
    pub fn init_logs(json: bool) {
        let directives = std::env::var("RINGWATCH_LOG").unwrap_or_else(|_| "info".into());
        let filter = EnvFilter::try_new(&directives).unwrap_or_else(|_| EnvFilter::new("info"));
        let (filter, handle) = reload::Layer::new(filter);
        let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
        let registry = tracing_subscriber::registry().with(filter);
        if json {
            registry.with(fmt.json()).init();
        } else {
            registry.with(fmt.with_ansi(false)).init();
        }
        let _ = FILTER.set((handle, directives));
    }

    /// Memory pressure (P3): logs at WARN and above only (`true`), or back to the
    /// configured filter (`false`). Returns whether the filter changed (there is none to
    /// change without [`init_logs`]: tests, libraries).
    pub fn pressure_log_floor(on: bool) -> bool {
        let Some((handle, directives)) = FILTER.get() else { return false };
        let filter = if on {
            EnvFilter::new("warn")
        } else {
            EnvFilter::try_new(directives).unwrap_or_else(|_| EnvFilter::new("info"))
        };
        handle.reload(filter).is_ok()
    }

    /// Resolves on SIGTERM or SIGINT (never, if the handlers cannot be installed).
    pub async fn terminated() {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use proto_flat::control::{CONTROL_VERSION, control_preface};

    #[test]
    fn the_preface_names_this_builds_control_protocol() {
        assert_eq!(super::CONTROL_PREFACE, control_preface(CONTROL_VERSION));
    }
}

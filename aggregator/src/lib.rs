//! `aggregator`: the central service.
//!
//! What it is: the I/O shell around `ringwatch-core` — QUIC ingest with mutual TLS
//! ([`ingest`]), the core's timers, the HTTP API ([`api`], axum; DTOs in `api/dto.rs`),
//! and `aggregator certs init` ([`certs`]). All decisions are the core's
//! (`aggregator/core`, package `ringwatch-core`), which this crate drives: connection
//! tasks hand it validated batches, a timer task hands it time.
//!
//! What it is not (yet): snapshots on a schedule and restart handling (issue 8),
//! `/metrics` and OTLP export (later issues).

pub mod api;
pub mod certs;
pub mod ingest;
pub mod state;

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ringwatch_core::{Core, IngestConfig, MatcherConfig};
use ringwatch_transport::{TlsFiles, Tuning};
use tokio::task::JoinHandle;

pub use ringwatch_core as core;
pub use state::Shared;

/// Everything an aggregator needs to start.
#[derive(Debug, Clone)]
pub struct AggregatorConfig {
    /// QUIC (UDP) listen address.
    pub listen: SocketAddr,
    /// HTTP listen address.
    pub http: SocketAddr,
    /// The CA that signs node certificates.
    pub ca: PathBuf,
    /// The server certificate and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    pub tuning: Tuning,
    pub ingest: IngestConfig,
    pub matcher: MatcherConfig,
    /// Verdicts kept (latest per op and rank); the oldest ops are evicted beyond it.
    pub verdict_cap: usize,
    /// Test hook: never send acks (shippers' spools then hold every batch).
    pub hold_acks: bool,
}

impl AggregatorConfig {
    /// Defaults around a certificate set, listening on ephemeral loopback ports.
    #[must_use]
    pub fn local(certs: &certs::CertSet) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            ca: certs.ca.clone(),
            cert: certs.server_cert.clone(),
            key: certs.server_key.clone(),
            tuning: Tuning::default(),
            ingest: IngestConfig::default(),
            matcher: MatcherConfig::default(),
            verdict_cap: 1_000_000,
            hold_acks: false,
        }
    }
}

/// Errors starting the service.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("transport: {0}")]
    Transport(#[from] ringwatch_transport::TransportError),
    #[error("HTTP listener {addr}: {source}")]
    Http { addr: SocketAddr, source: std::io::Error },
}

/// A running aggregator.
#[derive(Debug)]
pub struct Aggregator {
    /// Where shippers connect (the bound address).
    pub quic_addr: SocketAddr,
    /// Where the API answers.
    pub http_addr: SocketAddr,
    pub shared: Arc<Shared>,
    endpoint: quinn::Endpoint,
    tasks: Vec<JoinHandle<()>>,
}

impl Aggregator {
    /// Binds both listeners and starts serving.
    ///
    /// # Errors
    /// Certificates that do not load, or addresses that cannot be bound.
    pub async fn start(cfg: AggregatorConfig) -> Result<Self, StartError> {
        let files = TlsFiles { ca: &cfg.ca, cert: &cfg.cert, key: &cfg.key };
        let server = ringwatch_transport::server_config(files, &cfg.tuning)?;
        let endpoint = cfg.tuning.endpoint(cfg.listen, Some(server))?;
        let quic_addr = endpoint.local_addr().map_err(|source| {
            StartError::Transport(ringwatch_transport::TransportError::Socket { addr: cfg.listen, source })
        })?;
        let instance = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let core = Core::new(cfg.ingest, cfg.matcher, 0);
        let shared = Arc::new(Shared::new(core, instance, 1, cfg.verdict_cap, cfg.hold_acks));
        let listener = tokio::net::TcpListener::bind(cfg.http)
            .await
            .map_err(|source| StartError::Http { addr: cfg.http, source })?;
        let http_addr = listener.local_addr().map_err(|source| StartError::Http { addr: cfg.http, source })?;
        let router = api::router(Arc::clone(&shared));
        let tasks = vec![
            tokio::spawn(ingest::serve(endpoint.clone(), Arc::clone(&shared))),
            tokio::spawn(timers(Arc::clone(&shared))),
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    tracing::error!(error = %e, "HTTP server stopped");
                }
            }),
        ];
        Ok(Self { quic_addr, http_addr, shared, endpoint, tasks })
    }

    /// Stops accepting and closes every connection.
    pub fn shutdown(&self) {
        self.endpoint.close(ringwatch_transport::close::SHUTDOWN.into(), b"aggregator shutting down");
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Drives the core's timers: at each due time, and at least every 100 ms.
async fn timers(shared: Arc<Shared>) {
    loop {
        let now = shared.now();
        let due = {
            let mut core = shared.core();
            core.handle_timeout(now);
            shared.drain_events(&mut core);
            core.poll_timeout()
        };
        let wait = due.map_or(100_000_000, |d| d.saturating_sub(now)).clamp(1_000_000, 100_000_000);
        tokio::time::sleep(Duration::from_nanos(wait)).await;
    }
}

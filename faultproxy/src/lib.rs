//! `ringwatch-faultproxy`: a UDP proxy that misbehaves on command.
//!
//! QUIC runs over UDP and this kernel has no netem, so transport fault tests (and
//! `loadgen run`) put this proxy between shippers and the aggregator. Per direction the
//! caller sets [`Faults`]: drop everything (a partition), drop a fraction, delay (with
//! jitter, which reorders), duplicate a fraction, police to a byte rate (a token bucket
//! with a burst: what a congested link does) — and [`FaultProxy::heal`] clears them all.
//!
//! The decisions are a pure, seeded state machine ([`Decider`]: time is an argument);
//! the proxy task only moves datagrams. Every datagram is counted by what became of it
//! ([`ProxyStats`]).
//!
//! Not a general NAT: one upstream address; one upstream socket per client address.
//!
//! The other fault tests inject is memory pressure: [`cgroup`] makes a cgroup with a small
//! memory limit and real page-cache thrash inside it.

pub mod cgroup;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

/// What to do to datagrams going one way.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// Drop every datagram (a partition).
    pub drop_all: bool,
    /// Drop this fraction, at random.
    pub drop_fraction: f64,
    /// Hold each datagram this long …
    pub delay_ms: u64,
    /// … plus up to this much more, at random (datagrams overtake each other: reorder).
    pub jitter_ms: u64,
    /// Send this fraction twice.
    pub duplicate_fraction: f64,
    /// Police to this many bytes per second (token bucket, burst = 1/10 s of rate, at
    /// least 64 KiB); datagrams beyond it are dropped.
    pub rate_limit_bytes_per_s: Option<u64>,
}

/// Which way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client → upstream.
    ToServer,
    /// Upstream → client.
    ToClient,
    Both,
}

/// What became of datagrams, one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DirStats {
    pub received: u64,
    pub forwarded: u64,
    pub dropped_partition: u64,
    pub dropped_random: u64,
    pub dropped_rate: u64,
    pub duplicated: u64,
    pub delayed: u64,
    pub bytes_forwarded: u64,
}

/// Both directions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    pub to_server: DirStats,
    pub to_client: DirStats,
}

/// The fate of one datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Drop,
    /// Send `copies` (1 or 2) after `delay`.
    Send {
        copies: u8,
        delay: Duration,
    },
}

/// The pure decision core for one direction.
#[derive(Debug)]
pub struct Decider {
    pub faults: Faults,
    rng: ChaCha8Rng,
    tokens: f64,
    last_ns: u64,
    pub stats: DirStats,
}

impl Decider {
    /// A decider with no faults.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self {
            faults: Faults::default(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            tokens: 0.0,
            last_ns: 0,
            stats: DirStats::default(),
        }
    }

    /// Decides a datagram of `len` bytes arriving at `now_ns`.
    pub fn decide(&mut self, now_ns: u64, len: usize) -> Fate {
        self.stats.received += 1;
        let f = self.faults;
        if f.drop_all {
            self.stats.dropped_partition += 1;
            return Fate::Drop;
        }
        if f.drop_fraction > 0.0 && self.rng.random::<f64>() < f.drop_fraction {
            self.stats.dropped_random += 1;
            return Fate::Drop;
        }
        #[allow(clippy::cast_precision_loss, reason = "rates and sizes far below 2^52")]
        if let Some(rate) = f.rate_limit_bytes_per_s {
            let rate = rate as f64;
            let burst = (rate / 10.0).max(65_536.0);
            let dt = now_ns.saturating_sub(self.last_ns) as f64 / 1e9;
            self.tokens = (self.tokens + dt * rate).min(burst);
            self.last_ns = now_ns;
            if self.tokens < len as f64 {
                self.stats.dropped_rate += 1;
                return Fate::Drop;
            }
            self.tokens -= len as f64;
        }
        let jitter = if f.jitter_ms > 0 { self.rng.random_range(0..=f.jitter_ms * 1000) } else { 0 };
        let delay = Duration::from_micros(f.delay_ms * 1000 + jitter);
        if !delay.is_zero() {
            self.stats.delayed += 1;
        }
        let copies = if f.duplicate_fraction > 0.0 && self.rng.random::<f64>() < f.duplicate_fraction {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        self.stats.forwarded += 1;
        self.stats.bytes_forwarded += len as u64;
        Fate::Send { copies, delay }
    }
}

struct State {
    to_server: Decider,
    to_client: Decider,
}

/// A running proxy. Dropping it stops it.
#[derive(Debug)]
pub struct FaultProxy {
    /// Where clients send (instead of the upstream).
    pub addr: SocketAddr,
    state: Arc<Mutex<StateBox>>,
    task: JoinHandle<()>,
}

/// `State` behind a Debug-able box.
struct StateBox(State);

impl std::fmt::Debug for StateBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}

fn lock(s: &Mutex<StateBox>) -> MutexGuard<'_, StateBox> {
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FaultProxy {
    /// Listens on `listen` (port 0: any) and forwards to `upstream`.
    ///
    /// # Errors
    /// The socket cannot be bound.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr, seed: u64) -> std::io::Result<Self> {
        let front = Arc::new(UdpSocket::bind(listen).await?);
        let addr = front.local_addr()?;
        let state = Arc::new(Mutex::new(StateBox(State {
            to_server: Decider::new(seed),
            to_client: Decider::new(seed ^ 0x5eed),
        })));
        let task = tokio::spawn(run(front, upstream, Arc::clone(&state)));
        Ok(Self { addr, state, task })
    }

    /// Sets the faults of one direction (or both).
    pub fn set(&self, dir: Direction, faults: Faults) {
        let mut s = lock(&self.state);
        if matches!(dir, Direction::ToServer | Direction::Both) {
            s.0.to_server.faults = faults;
        }
        if matches!(dir, Direction::ToClient | Direction::Both) {
            s.0.to_client.faults = faults;
        }
    }

    /// Clears every fault.
    pub fn heal(&self) {
        self.set(Direction::Both, Faults::default());
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> ProxyStats {
        let s = lock(&self.state);
        ProxyStats { to_server: s.0.to_server.stats, to_client: s.0.to_client.stats }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn send_later(sock: Arc<UdpSocket>, to: Option<SocketAddr>, data: Vec<u8>, fate: Fate) {
    let Fate::Send { copies, delay } = fate else { return };
    let go = async move {
        for _ in 0..copies {
            let _ = match to {
                Some(a) => sock.send_to(&data, a).await,
                None => sock.send(&data).await,
            };
        }
    };
    if delay.is_zero() {
        tokio::spawn(go);
    } else {
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            go.await;
        });
    }
}

async fn run(front: Arc<UdpSocket>, upstream: SocketAddr, state: Arc<Mutex<StateBox>>) {
    let start = Instant::now();
    let now = move || u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let mut clients: HashMap<SocketAddr, (Arc<UdpSocket>, JoinHandle<()>)> = HashMap::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        let Ok((n, from)) = front.recv_from(&mut buf).await else { continue };
        let back = match clients.get(&from) {
            Some((s, _)) => Arc::clone(s),
            None => {
                let bind: SocketAddr = if upstream.is_ipv6() { "[::]:0".parse() } else { "0.0.0.0:0".parse() }
                    .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                let Ok(s) = UdpSocket::bind(bind).await else { continue };
                if s.connect(upstream).await.is_err() {
                    continue;
                }
                let s = Arc::new(s);
                // Upstream → this client.
                let (s2, front2, state2) = (Arc::clone(&s), Arc::clone(&front), Arc::clone(&state));
                let reader = tokio::spawn(async move {
                    let mut buf = vec![0u8; 65_536];
                    while let Ok(n) = s2.recv(&mut buf).await {
                        let fate = lock(&state2).0.to_client.decide(now(), n);
                        send_later(Arc::clone(&front2), Some(from), buf.get(..n).unwrap_or(&[]).to_vec(), fate);
                    }
                });
                clients.insert(from, (Arc::clone(&s), reader));
                s
            }
        };
        let fate = lock(&state).0.to_server.decide(now(), n);
        send_later(back, None, buf.get(..n).unwrap_or(&[]).to_vec(), fate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_fault_does_what_it_says_and_is_counted() {
        let mut d = Decider::new(1);
        assert_eq!(d.decide(0, 100), Fate::Send { copies: 1, delay: Duration::ZERO });
        d.faults.drop_all = true;
        assert_eq!(d.decide(1, 100), Fate::Drop);
        d.faults = Faults { drop_fraction: 0.5, ..Faults::default() };
        let dropped = (0..10_000).filter(|&i| d.decide(i, 100) == Fate::Drop).count();
        assert!((4_500..5_500).contains(&dropped), "{dropped}");
        d.faults = Faults { duplicate_fraction: 1.0, delay_ms: 5, ..Faults::default() };
        assert_eq!(d.decide(2, 100), Fate::Send { copies: 2, delay: Duration::from_millis(5) });
        // 1 MB/s with a 100 KB burst: 1,000 × 1,000-byte datagrams at one instant pass
        // the burst only; a second later another second's worth passes.
        let mut d = Decider::new(2);
        d.faults = Faults { rate_limit_bytes_per_s: Some(1_000_000), ..Faults::default() };
        let t0 = 1_000_000_000;
        let sent = (0..1000).filter(|_| d.decide(t0, 1000) != Fate::Drop).count();
        assert_eq!(sent, 100, "the burst");
        let sent = (0..2000).filter(|_| d.decide(t0 + 1_000_000_000, 1000) != Fate::Drop).count();
        assert_eq!(sent, 100, "capped at the burst again after refilling");
        assert_eq!(d.stats.dropped_rate, 2800);
        let s = d.stats;
        assert_eq!(s.received, s.forwarded + s.dropped_partition + s.dropped_random + s.dropped_rate);
    }

    #[tokio::test]
    async fn net_forwards_both_ways_and_partitions_on_command() {
        let echo = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let mut b = [0u8; 1500];
            while let Ok((n, from)) = echo.recv_from(&mut b).await {
                let _ = echo.send_to(&b[..n], from).await;
            }
        });
        let p = FaultProxy::start("127.0.0.1:0".parse().unwrap(), upstream, 7).await.unwrap();
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(p.addr).await.unwrap();
        let mut b = [0u8; 16];
        c.send(b"ping").await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), c.recv(&mut b)).await.unwrap().unwrap();
        assert_eq!(&b[..n], b"ping");
        p.set(Direction::ToServer, Faults { drop_all: true, ..Faults::default() });
        c.send(b"lost").await.unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(200), c.recv(&mut b)).await.is_err());
        p.heal();
        c.send(b"back").await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), c.recv(&mut b)).await.unwrap().unwrap();
        assert_eq!(&b[..n], b"back");
        let s = p.stats();
        assert_eq!((s.to_server.received, s.to_server.dropped_partition, s.to_client.forwarded), (3, 1, 2));
    }
}

//! `GET /v1/events`: Server-Sent Events over the bounded event log (`crate::events`).
//!
//! Every verdict and revision, recovery, node and GPU health change, node liveness or
//! connection change, P0 loss and per-node loss-rate band change is one event, id
//! `<aggregator_epoch>.<seq>@<instance>`. A subscriber resumes with `Last-Event-ID` (or
//! `after=ID`, for list-then-watch: every list response's `as_of.event_id`; the header
//! wins when both are given, as a browser's `EventSource` reconnects with it); with
//! neither it gets what happens from now on. Ids it can no longer get — evicted from the
//! log, or of another aggregator process — are announced by one `gap` event. A comment
//! line (`: heartbeat`) every `events_heartbeat_ms` keeps proxies from closing a quiet
//! stream.
//!
//! Query parameters (all optional): `after=ID`; `until=ID` (the stream ends once past
//! it: "what is logged up to now", for scripts); `node=NAME` (or a 16-hex-digit id); `kind=K[,K…]` (of
//! [`dto::EVENT_KINDS`]; `gap` is always sent); `final=true|false` (verdict and revision
//! events only; other kinds pass).
//!
//! Verdict events are serialized once, by the first subscriber that sends them (none
//! while nobody subscribes); node events are built by the `events` task.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use ringwatch_core::NodeId;
use ringwatch_core::verdict::MatcherEvent;

use super::dto::{self, GapEventDto, HealthEventDto, LivenessEventDto, LossRateEventDto, P0LossEventDto, VerdictDto};
use crate::events::{EventId, Gap, Logged, NodeChange};
use crate::state::Shared;
use ringwatch_transport::http;

/// The configuration of the event stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventsConfig {
    /// Events the log holds (the oldest go first).
    pub capacity: usize,
    /// The heartbeat comment's period on a quiet stream.
    pub heartbeat_ms: u64,
    /// Streams served at once; more are answered 503.
    pub max_subscribers: u64,
    /// The `events` task's poll of node state (real ms), and the loss-rate window
    /// (aggregator ms).
    pub poll_ms: u64,
    pub loss_window_ms: u64,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self { capacity: 10_000, heartbeat_ms: 15_000, max_subscribers: 256, poll_ms: 250, loss_window_ms: 5_000 }
    }
}

/// An event's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Verdict,
    Revision,
    Recovery,
    Health,
    Liveness,
    P0Loss,
    LossRate,
}

impl Kind {
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Verdict => "verdict",
            Self::Revision => "revision",
            Self::Recovery => "recovery",
            Self::Health => "health",
            Self::Liveness => "liveness",
            Self::P0Loss => "p0_loss",
            Self::LossRate => "loss_rate",
        }
    }

    const ALL: [Self; 7] =
        [Self::Verdict, Self::Revision, Self::Recovery, Self::Health, Self::Liveness, Self::P0Loss, Self::LossRate];

    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// What an event holds until it is first sent.
#[derive(Debug)]
#[allow(clippy::large_enum_variant, reason = "verdicts are the common case; boxing them would cost an allocation each")]
enum Body {
    Matcher(MatcherEvent),
    Json(Arc<str>),
}

/// One event in the log.
#[derive(Debug)]
pub struct Event {
    pub kind: Kind,
    pub node: Option<NodeId>,
    /// A verdict's `final` flag (verdict and revision events).
    pub is_final: Option<bool>,
    /// Aggregator time it was logged at (set by `Shared::push_events`).
    pub at_ns: u64,
    body: Body,
    json: OnceLock<Arc<str>>,
}

impl Event {
    /// A verdict, revision or recovery from the core.
    #[must_use]
    pub fn of_matcher(e: &MatcherEvent) -> Self {
        let (kind, node, is_final) = match e {
            MatcherEvent::Verdict(v) => {
                (if v.revision == 0 { Kind::Verdict } else { Kind::Revision }, v.node, Some(v.is_final))
            }
            MatcherEvent::Recovered { node, .. } => (Kind::Recovery, *node, None),
        };
        Self { kind, node, is_final, at_ns: 0, body: Body::Matcher(e.clone()), json: OnceLock::new() }
    }

    /// A change the `events` task saw on node `id`.
    #[must_use]
    pub fn of_change(id: NodeId, c: &NodeChange) -> Self {
        let (kind, _name, json) = match c {
            NodeChange::Health { node, gpu, health, previous } => (
                Kind::Health,
                node,
                serde_json::to_string(&HealthEventDto {
                    node: node.clone(),
                    gpu_uuid: gpu.clone(),
                    health: (*health).to_owned(),
                    previous: previous.map(str::to_owned),
                }),
            ),
            NodeChange::Liveness { node, liveness, connected, previous } => (
                Kind::Liveness,
                node,
                serde_json::to_string(&LivenessEventDto {
                    node: node.clone(),
                    liveness: (*liveness).to_owned(),
                    connected: *connected,
                    previous_liveness: previous.map(|p| p.0.to_owned()),
                    previous_connected: previous.map(|p| p.1),
                }),
            ),
            NodeChange::P0Loss { node, lost, lost_total, attempted_total } => (
                Kind::P0Loss,
                node,
                serde_json::to_string(&P0LossEventDto {
                    node: node.clone(),
                    frames_lost: *lost,
                    frames_lost_total: *lost_total,
                    frames_attempted_total: *attempted_total,
                }),
            ),
            NodeChange::LossRate { node, band, previous, lost, frames, window_ns } => (
                Kind::LossRate,
                node,
                serde_json::to_string(&LossRateEventDto {
                    node: node.clone(),
                    band: band.name().to_owned(),
                    previous_band: previous.name().to_owned(),
                    frames_lost: *lost,
                    frames: *frames,
                    window_ms: window_ns / 1_000_000,
                }),
            ),
        };
        let json: Arc<str> = json.unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")).into();
        Self {
            kind,
            node: Some(id),
            is_final: None,
            at_ns: 0,
            body: Body::Json(Arc::clone(&json)),
            json: OnceLock::from(json),
        }
    }

    /// The verdict of a verdict or revision event.
    #[must_use]
    pub fn verdict(&self) -> Option<&ringwatch_core::verdict::Verdict> {
        match &self.body {
            Body::Matcher(MatcherEvent::Verdict(v)) => Some(v),
            _ => None,
        }
    }

    /// A health event's node and health (`None` for a GPU's, or another kind).
    #[must_use]
    pub fn node_health(&self) -> Option<HealthEventDto> {
        match (&self.body, self.kind) {
            (Body::Json(j), Kind::Health) => {
                serde_json::from_str::<HealthEventDto>(j).ok().filter(|h| h.gpu_uuid.is_none())
            }
            _ => None,
        }
    }

    /// The event's JSON (serialized at the first call; `names` maps node ids to names).
    pub(crate) fn json(&self, names: &dyn Fn(u64) -> Option<String>) -> Arc<str> {
        Arc::clone(self.json.get_or_init(|| {
            let text = match &self.body {
                Body::Json(j) => return Arc::clone(j),
                Body::Matcher(MatcherEvent::Verdict(v)) => serde_json::to_string(&VerdictDto::from_verdict(v, names)),
                Body::Matcher(MatcherEvent::Recovered { op, rank, node, after_ms }) => {
                    serde_json::to_string(&dto::RecoveryEventDto {
                        op: dto::OpDto::of(op),
                        rank: *rank,
                        node: node.and_then(|n| names(n.0)),
                        after_ms: *after_ms,
                    })
                }
            };
            text.unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")).into()
        }))
    }
}

/// A subscriber's filter.
#[derive(Debug, Clone, Copy)]
struct Filter {
    /// A node's name hashed to its id, and the name read as a 16-hex-digit id (how a
    /// node that has not connected to this process is named).
    node: Option<[NodeId; 2]>,
    kinds: u8,
    is_final: Option<bool>,
}

impl Filter {
    fn keeps(&self, e: &Event) -> bool {
        self.kinds & e.kind.bit() != 0
            && self.node.is_none_or(|n| e.node.is_some_and(|id| n.contains(&id)))
            && (self.is_final.is_none() || e.is_final.is_none() || e.is_final == self.is_final)
    }
}

/// Events read from the log at one time (the log's lock is held for a bounded copy).
const READ_BATCH: usize = 256;

/// A subscriber reads the log at most this often: events that come in a burst (every
/// batch applied can bring some) reach it together, so a hundred subscribers wake a
/// few times a second each instead of once per batch.
const COALESCE: Duration = Duration::from_millis(50);

/// Counts a subscriber while its stream lives.
struct Subscribed(Arc<Shared>);

impl Drop for Subscribed {
    fn drop(&mut self) {
        self.0.events.subscribers.fetch_sub(1, Relaxed);
    }
}

struct Sub {
    s: Arc<Shared>,
    next: u64,
    filter: Filter,
    /// Event-stream text not yet sent (sent as one body chunk: a burst of events is one
    /// write, not one per event).
    pending: String,
    heartbeat: Duration,
    /// When the last bytes went out: the heartbeat is timed from it (a filtered stream
    /// whose events are all dropped still gets one).
    last_sent: tokio::time::Instant,
    /// `until=`: the stream ends once past this sequence number.
    until: Option<u64>,
    wake: tokio::sync::watch::Receiver<u64>,
    /// When the log was last read and found empty past `next`.
    caught_up_at: Option<tokio::time::Instant>,
    names: BTreeMap<u64, String>,
    _counted: Subscribed,
}

impl Sub {
    fn gap(&mut self, g: &Gap) {
        self.s.events.gaps_sent.fetch_add(1, Relaxed);
        let body = GapEventDto {
            from_id: g.from.to_string(),
            to_id: g.to.to_string(),
            reason: g.reason.name().to_owned(),
            missed: g.missed,
        };
        let data = serde_json::to_string(&body).unwrap_or_default();
        self.push(&g.to.to_string(), "gap", &data);
        self.next = g.to.seq.saturating_add(1);
    }

    fn send(&mut self, e: &Logged<Event>, id: EventId) {
        self.next = e.seq.saturating_add(1);
        if !self.filter.keeps(&e.item) {
            return;
        }
        if let Some(NodeId(n)) = e.item.node
            && !self.names.contains_key(&n)
            && let Some(entry) = self.s.nodes.get(&NodeId(n))
        {
            self.names.insert(n, entry.name.clone());
        }
        let names = &self.names;
        let json = e.item.json(&|id| names.get(&id).cloned());
        self.push(&id.to_string(), e.item.kind.name(), &json);
    }

    /// One event in the stream's text (`data` is one line of JSON: serde_json writes no
    /// line breaks; the id and kind are ours).
    fn push(&mut self, id: &str, kind: &str, data: &str) {
        use std::fmt::Write as _;
        let _ = write!(self.pending, "id: {id}\nevent: {kind}\ndata: {data}\n\n");
    }

    /// The next text to send — events, or a heartbeat comment after `heartbeat` without
    /// any; `None` once the aggregator stops.
    async fn next_chunk(&mut self) -> Option<axum::body::Bytes> {
        loop {
            if self.pending.is_empty() && self.last_sent.elapsed() >= self.heartbeat {
                self.pending.push_str(": heartbeat\n\n");
            }
            if !self.pending.is_empty() {
                self.last_sent = tokio::time::Instant::now();
                return Some(std::mem::take(&mut self.pending).into());
            }
            if self.until.is_some_and(|u| self.next > u) {
                return None;
            }
            if self.s.events.closing.load(Relaxed) {
                return None;
            }
            self.wake.borrow_and_update();
            let mut got = Vec::with_capacity(READ_BATCH);
            let (read, ids) = {
                let log = self.s.events_log();
                let r = log.read(self.next, READ_BATCH, &mut got);
                (r, got.iter().map(|e| log.id(e.seq)).collect::<Vec<_>>())
            };
            match read {
                Err(gap) => self.gap(&gap),
                Ok(()) if got.is_empty() => {
                    let wait = self.heartbeat.saturating_sub(self.last_sent.elapsed());
                    match tokio::time::timeout(wait, self.wake.changed()).await {
                        Err(_) => {
                            self.pending.push_str(": heartbeat\n\n");
                            continue;
                        }
                        Ok(Err(_)) => return None,
                        Ok(Ok(())) => {}
                    }
                    if let Some(at) = self.caught_up_at.replace(tokio::time::Instant::now()) {
                        tokio::time::sleep_until(at + COALESCE).await;
                    }
                }
                Ok(()) => {
                    for (e, id) in got.iter().zip(ids) {
                        self.send(e, id);
                    }
                }
            }
        }
    }
}

fn bad(msg: impl Into<String>) -> Response {
    http::error(StatusCode::BAD_REQUEST, msg)
}

/// `GET /v1/events`.
#[utoipa::path(get, path = "/v1/events", tag = "events",
    params(
        ("after" = Option<String>, Query, description = "resume after this event id (Last-Event-ID wins when both are given)"),
        ("until" = Option<String>, Query, description = "end the stream once past this event id (an id of another process ends it at once)"),
        ("node" = Option<String>, Query, description = "a node's name"),
        ("kind" = Option<String>, Query, description = "comma-separated kinds: verdict, revision, recovery, health, liveness, p0_loss, loss_rate (gap is always sent)"),
        ("final" = Option<bool>, Query, description = "verdict and revision events: final ones only, or open ones only"),
        ("Last-Event-ID" = Option<String>, Header, description = "resume after this event id"),
    ),
    responses((status = 200, description = "Server-Sent Events: id <epoch>.<seq>@<instance>, event <kind>, data one JSON object", content_type = "text/event-stream", body = String), (status = 400, description = "a bad query or event id", body = super::dto::ErrorDto), (status = 401, description = "no bearer token, or the wrong one", body = super::dto::ErrorDto), (status = 503, description = "events_max_subscribers streams already", body = super::dto::ErrorDto)))]
pub async fn events(axum::extract::State(s): State<Arc<Shared>>, headers: HeaderMap, uri: Uri) -> Response {
    let q = match http::params(&uri, &["after", "until", "node", "kind", "final"]) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let mut filter = Filter { node: None, kinds: u8::MAX, is_final: None };
    if let Some(n) = q.get("node") {
        let by_name = NodeId(proto_flat::node_id_of(n));
        let as_id = (n.len() == 16).then(|| u64::from_str_radix(n, 16).ok()).flatten().map_or(by_name, NodeId);
        filter.node = Some([by_name, as_id]);
    }
    if let Some(k) = q.get("kind") {
        filter.kinds = 0;
        for want in k.split(',') {
            match Kind::ALL.iter().find(|x| x.name() == want) {
                Some(x) => filter.kinds |= x.bit(),
                None if want == "gap" => {}
                None => {
                    return bad(format!(
                        "kind={want:?}: expected a comma-separated list of {}",
                        dto::EVENT_KINDS.join(", ")
                    ));
                }
            }
        }
    }
    match q.get("final").map(String::as_str) {
        None => {}
        Some("true") => filter.is_final = Some(true),
        Some("false") => filter.is_final = Some(false),
        Some(v) => return bad(format!("final={v:?}: expected true or false")),
    }
    let header = match headers.get("last-event-id").map(|h| h.to_str()) {
        None => None,
        Some(Ok(v)) => Some(v.to_owned()),
        Some(Err(_)) => return bad("Last-Event-ID: not text"),
    };
    let after = match header.as_deref().or(q.get("after").map(String::as_str)) {
        None => None,
        Some(id) => match id.parse::<EventId>() {
            Ok(id) => Some(id),
            Err(e) => return bad(e.to_string()),
        },
    };
    let until = match q.get("until").map(|u| u.parse::<EventId>()) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(e)) => return bad(format!("until: {e}")),
    };
    let cfg = s.events.config;
    if s.events.subscribers.fetch_add(1, Relaxed) >= cfg.max_subscribers {
        s.events.subscribers.fetch_sub(1, Relaxed);
        s.events.refused.fetch_add(1, Relaxed);
        return http::error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{} event subscribers already (events_max_subscribers)", cfg.max_subscribers),
        );
    }
    let counted = Subscribed(Arc::clone(&s));
    let (start, this) = {
        let log = s.events_log();
        (log.start(after), log.last_id())
    };
    let start = match start {
        Ok(st) => st,
        Err(e) => return bad(e.to_string()),
    };
    // `until` of another process: nothing of it is here to wait for.
    let until = until.map(|u| if (u.epoch, u.instance) == (this.epoch, this.instance) { u.seq } else { 0 });
    let mut sub = Sub {
        wake: s.events.wake.subscribe(),
        s: Arc::clone(&s),
        next: start.next,
        filter,
        pending: String::new(),
        heartbeat: Duration::from_millis(cfg.heartbeat_ms.max(1)),
        last_sent: tokio::time::Instant::now(),
        until,
        caught_up_at: None,
        names: BTreeMap::new(),
        _counted: counted,
    };
    if let Some(g) = start.gap {
        sub.gap(&g);
    }
    let stream = futures_util::stream::unfold(sub, |mut sub| async move {
        let chunk = sub.next_chunk().await?;
        Some((Ok::<_, Infallible>(chunk), sub))
    });
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
            // nginx and the like: do not buffer the stream.
            (axum::http::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

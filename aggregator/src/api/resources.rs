//! The scheduler's resources beyond the lists: `GET /v1/nodes/{node}`,
//! `/v1/gpus/{uuid}`, `/v1/collectives` (+ `/{id}`), `/v1/loss`, `/v1/summary`.
//!
//! Each answer carries `as_of` (read under the core's lock with what it reflects) and is
//! bounded: lists page with a cursor and a scan budget, "recent" lists come from the
//! bounded event log, counts over the verdict store stop at a scan budget and say so.
//!
//! `/v1/collectives` query parameters (all optional): `state=open|final`,
//! `outcome=PREFIX` (any rank's outcome; as `/v1/verdicts`), `comm=HEX` (the
//! communicator hash), `node=NAME`, `gpu=UUID` (any rank on it), `from_ms=N` / `to_ms=N`
//! (the op's earliest decision, aggregator ms, inclusive), `limit=N` (1..=10000, default
//! 1000), `cursor=TOKEN`. `/v1/loss`: `node=NAME`, `class=p0|p1|bulk`,
//! `cause=NAME` (rows with frames lost to it).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use proto_flat::codes::LossCause;
use proto_flat::header::StreamId;
use ringwatch_core::verdict::OpRef;
use ringwatch_core::{Cursor, NodeId, PageItem};

use super::dto::{
    API_VERSION, CollectiveDto, CollectiveSummaryDto, CollectivesDto, ErrorDto, GpuDetailDto, LossClassDto, LossDto,
    LossStreamDto, NodeDetailDto, OpDto, OwnerDto, SummaryDto, VerdictDto, health_name,
};
use super::{as_of, node_dto, registry, unavailable};
use crate::state::Shared;
use ringwatch_transport::http;

/// The `outcome` parameter's shape (`/v1/verdicts`, `/v1/collectives`): one of
/// `ringwatch_core::verdict::OUTCOME_KINDS`, optionally followed by `(…)`. The path
/// attributes need it as a literal: tests hold the literal, this and the kinds together.
pub const OUTCOME_PATTERN: &str = "^(completed|completed_inferred|entered_inferred|in_flight|waiting_on|not_joined|stuck|blocked_by|unknown_silent|indeterminate)(\\(.*)?$";

/// Recent verdict events a node or GPU answer lists, at most.
const RECENT: usize = 50;
/// Rank verdicts one `/v1/collectives` request looks at, at most (past it the page ends
/// early with a `next_cursor`), and `/v1/summary` counts, at most.
pub const OP_SCAN_BUDGET: usize = 100_000;

fn bad(msg: impl Into<String>) -> Response {
    http::error(StatusCode::BAD_REQUEST, msg)
}

fn not_found(msg: impl Into<String>) -> Response {
    http::error(StatusCode::NOT_FOUND, msg)
}

/// A collective's id: the op's key, opaque and stable (a verdict cursor without its rank).
#[must_use]
pub fn op_id(op: &OpRef) -> String {
    let c = Cursor { op: *op, rank: 0 }.encode();
    c.strip_suffix(".0").map_or(c.clone(), str::to_owned)
}

fn parse_op_id(id: &str) -> Result<OpRef, String> {
    Cursor::decode(&format!("{id}.0")).map(|c| c.op).map_err(|_| format!("{id:?} is not a collective id this API gave"))
}

/// A GPU uuid from 32 hex digits (either case).
#[must_use]
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    if text.len() != 32 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(text.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

fn hex_uuid(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

/// The node a path names: its registry name, or its id in 16 hex digits.
fn find_node(s: &Shared, core: &ringwatch_core::Core, name: &str) -> Option<(NodeId, String, u32, u64)> {
    registry(s, core).into_iter().find(|(id, n, _, _)| n == name || format!("{:016x}", id.0) == name)
}

fn names(s: &Shared) -> BTreeMap<u64, String> {
    s.nodes.iter().map(|e| (e.key().0, e.name.clone())).collect()
}

fn verdict_dto(i: &PageItem, names: &BTreeMap<u64, String>) -> VerdictDto {
    let mut dto = VerdictDto::from_verdict(&i.stored.verdict, |id| names.get(&id).cloned());
    dto.final_at_ms = i.stored.final_at_ns.map(|t| t / 1_000_000);
    dto.recovered_at_ms = i.stored.recovered_at_ns.map(|t| t / 1_000_000);
    dto.compacted = i.compacted;
    dto
}

/// A rank process's owner as the API shows it.
pub(crate) fn owner_dto(o: &ringwatch_core::ingest::GpuOwner) -> OwnerDto {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    OwnerDto {
        pid: o.pid,
        pod_uid: o.pod_uid.map(|u| {
            let h = hex(&u);
            format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
        }),
        container_id: o.container_id.map(|c| hex(&c)),
        slurm_job_id: o.slurm_job_id,
    }
}

/// The owners of one GPU's processes (one per process), from its node's rows.
pub(crate) fn gpu_owners(rows: &[ringwatch_core::ingest::GpuOwner], gpu: &[u8; 16]) -> Vec<OwnerDto> {
    let mut seen = std::collections::BTreeSet::new();
    rows.iter().filter(|o| o.gpu_uuid == *gpu && seen.insert(o.pid)).map(owner_dto).collect()
}

/// A verdict's key into the owner rows: GPU, communicator (hash, disambiguator), rank.
type OwnerKey = ([u8; 16], u64, u64, u32);

/// Owners by [`OwnerKey`] of `nodes`' rows (under the core's lock; bounded by the
/// nodes' owner caps).
pub(crate) fn owner_index(
    core: &ringwatch_core::Core,
    nodes: impl Iterator<Item = NodeId>,
) -> std::collections::HashMap<OwnerKey, OwnerDto> {
    let mut idx = std::collections::HashMap::new();
    for id in nodes {
        for o in core.node_state(id).map(|n| n.owners.as_slice()).unwrap_or_default() {
            idx.entry((o.gpu_uuid, o.comm_hash, o.comm_disambiguator, o.rank)).or_insert_with(|| owner_dto(o));
        }
    }
    idx
}

/// The nodes `verdicts` are on (for [`owner_index`]).
pub(crate) fn nodes_of(verdicts: &[VerdictDto], names: &BTreeMap<u64, String>) -> Vec<NodeId> {
    let wanted: std::collections::BTreeSet<&str> = verdicts.iter().filter_map(|v| v.node.as_deref()).collect();
    names.iter().filter(|(_, n)| wanted.contains(n.as_str())).map(|(id, _)| NodeId(*id)).collect()
}

/// Each verdict's owner from `idx` ([`owner_index`]).
pub(crate) fn fill_owners(verdicts: &mut [VerdictDto], idx: &std::collections::HashMap<OwnerKey, OwnerDto>) {
    if idx.is_empty() {
        return;
    }
    for v in verdicts {
        let (Some(gpu), Ok(hash), Ok(dis)) = (
            parse_uuid(&v.gpu_uuid),
            u64::from_str_radix(&v.op.comm, 16),
            u64::from_str_radix(&v.op.comm_disambiguator, 16),
        ) else {
            continue;
        };
        v.owner = idx.get(&(gpu, hash, dis, v.rank)).cloned();
    }
}

/// The latest verdict events `keep` accepts, newest first, from the event log.
fn recent_verdicts(
    s: &Shared,
    names: &BTreeMap<u64, String>,
    keep: impl Fn(&ringwatch_core::verdict::Verdict) -> bool,
) -> Vec<VerdictDto> {
    // The log's lock only for copying its handles (ingest pushes under the core's lock
    // and waits on this one); the scan runs after.
    let held: Vec<_> = s.events_log().newest_first().cloned().collect();
    held.iter()
        .filter_map(|e| e.item.verdict())
        .filter(|v| keep(v))
        .take(RECENT)
        .map(|v| VerdictDto::from_verdict(v, |id| names.get(&id).cloned()))
        .collect()
}

/// Per class: frames received and lost by cause, over `streams`.
fn by_class<'a>(streams: impl Iterator<Item = &'a ringwatch_core::SeqTracker>) -> Vec<LossClassDto> {
    let mut out: BTreeMap<String, LossClassDto> = BTreeMap::new();
    for t in streams {
        let class = StreamId(t.key.stream_id).class().to_string();
        let c = t.counts();
        let row = out.entry(class.clone()).or_insert_with(|| LossClassDto {
            class,
            received: 0,
            lost: BTreeMap::new(),
            lost_total: 0,
            lost_share: 0.0,
        });
        row.received = row.received.saturating_add(c.received);
        for (slot, n) in c.lost.iter().enumerate().filter(|(_, n)| **n > 0) {
            if let Some(cause) = LossCause::from_cause_slot(slot) {
                let e = row.lost.entry(cause.to_string()).or_default();
                *e = e.saturating_add(*n);
            }
        }
        row.lost_total = row.lost_total.saturating_add(c.lost_total());
    }
    out.into_values()
        .map(|mut r| {
            let all = r.received.saturating_add(r.lost_total);
            #[allow(clippy::cast_precision_loss, reason = "a share")]
            let share = if all == 0 { 0.0 } else { r.lost_total as f64 / all as f64 };
            r.lost_share = share;
            r
        })
        .collect()
}

/// `GET /v1/nodes/{node}`.
#[utoipa::path(get, path = "/v1/nodes/{node}", tag = "nodes", params(("node" = String, Path, description = "a node's name, or its id in 16 hex digits")), responses((status = 200, description = "one node", body = NodeDetailDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 404, description = "not held or unknown", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
pub async fn node(State(s): State<Arc<Shared>>, Path(name): Path<String>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    let now = s.now();
    let names = names(&s);
    let (dto, fresh, loss, owners) = {
        let core = match s.core() {
            Ok(c) => c,
            Err(e) => return unavailable(e),
        };
        let Some((id, n, live, conns)) = find_node(&s, &core, &name) else {
            return not_found(format!("no node {name:?} (a name, or a 16-hex-digit node id)"));
        };
        let (health, gpu_health) = (core.node_health(now), core.gpu_health(now));
        let fresh = as_of(&s, &core, now);
        let loss = by_class(core.trackers(id));
        let owners = owner_index(&core, std::iter::once(id));
        (node_dto(&s, &core, now, &health, &gpu_health, id, n, live, conns), fresh, loss, owners)
    };
    let id = NodeId(u64::from_str_radix(&dto.node_id, 16).unwrap_or(0));
    let mut recent = recent_verdicts(&s, &names, |v| v.node == Some(id));
    fill_owners(&mut recent, &owners);
    Json(NodeDetailDto { api_version: API_VERSION.into(), as_of: fresh, node: dto, loss, recent_verdicts: recent })
        .into_response()
}

/// `GET /v1/gpus/{uuid}`.
#[utoipa::path(get, path = "/v1/gpus/{uuid}", tag = "nodes", params(("uuid" = String, Path, description = "the GPU uuid, 32 hex digits", pattern = "^[0-9a-fA-F]{32}$")), responses((status = 200, description = "one GPU", body = GpuDetailDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 404, description = "not held or unknown", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
pub async fn gpu(State(s): State<Arc<Shared>>, Path(uuid): Path<String>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    let want = uuid.to_ascii_lowercase();
    if want.len() != 32 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return bad(format!("{uuid:?}: a GPU uuid is 32 hex digits (as in /v1/nodes gpus[].gpu_uuid)"));
    }
    if want.bytes().all(|b| b == b'0') {
        return not_found("GPU uuid 0: the ranks whose GPU was not reported (not one GPU)");
    }
    let now = s.now();
    let names = names(&s);
    let (found, fresh, owners, gpu_rows) = {
        let core = match s.core() {
            Ok(c) => c,
            Err(e) => return unavailable(e),
        };
        let found = core.gpu_health(now).into_iter().find(|((_, u), _)| hex_uuid(u) == want);
        let (owners, gpu_rows) = found
            .as_ref()
            .map(|((n, u), _)| {
                let rows = core.node_state(*n).map(|st| gpu_owners(&st.owners, u)).unwrap_or_default();
                (owner_index(&core, std::iter::once(*n)), rows)
            })
            .unwrap_or_default();
        (found, as_of(&s, &core, now), owners, gpu_rows)
    };
    let Some(((node, raw), health)) = found else { return not_found(format!("no GPU {want}")) };
    let node_name = names.get(&node.0).cloned().unwrap_or_else(|| format!("{:016x}", node.0));
    let mut recent = recent_verdicts(&s, &names, |v| v.gpu_uuid == raw);
    fill_owners(&mut recent, &owners);
    Json(GpuDetailDto {
        api_version: API_VERSION.into(),
        as_of: fresh,
        gpu_uuid: want,
        node: node_name,
        health: health_name(health).into(),
        owners: gpu_rows,
        recent_verdicts: recent,
    })
    .into_response()
}

fn state_of(items: &[PageItem]) -> &'static str {
    if items.iter().all(|i| i.stored.verdict.is_final) { "final" } else { "open" }
}

/// `GET /v1/collectives`.
#[utoipa::path(get, path = "/v1/collectives", tag = "collectives",
    params(
        ("state" = Option<String>, Query, description = "open or final", pattern = "^(open|final)$"),
        ("outcome" = Option<String>, Query, description = "an outcome kind any rank has, optionally followed by (…)", pattern = "^(completed|completed_inferred|entered_inferred|in_flight|waiting_on|not_joined|stuck|blocked_by|unknown_silent|indeterminate)(\\(.*)?$"),
        ("comm" = Option<String>, Query, description = "the communicator hash in hex", pattern = "^[0-9a-fA-F]{1,16}$"),
        ("node" = Option<String>, Query, description = "a node one of its ranks is on"),
        ("gpu" = Option<String>, Query, description = "a GPU one of its ranks is on (32 hex digits)", pattern = "^[0-9a-fA-F]{32}$"),
        ("from_ms" = Option<u64>, Query, description = "earliest decision at or after (aggregator ms)", maximum = 18_446_744_073_709_u64),
        ("to_ms" = Option<u64>, Query, description = "earliest decision at or before (aggregator ms)", maximum = 18_446_744_073_709_u64),
        ("limit" = Option<u32>, Query, description = "1..=10000 (default 1000)", minimum = 1, maximum = 10000),
        ("cursor" = Option<String>, Query, description = "the previous page's next_cursor"),
    ),
    responses((status = 200, description = "a page of ops", body = CollectivesDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 404, description = "not held or unknown", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
pub async fn collectives(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    let q =
        match http::params(&uri, &["state", "outcome", "comm", "node", "gpu", "from_ms", "to_ms", "limit", "cursor"]) {
            Ok(q) => q,
            Err(r) => return r.into_response(),
        };
    let num = |k: &str, max: u64| -> Result<Option<u64>, String> {
        q.get(k)
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|n| *n <= max)
                    .ok_or_else(|| format!("{k}={v:?}: expected a whole number ≤ {max}"))
            })
            .transpose()
    };
    let (from_ms, to_ms) = match (num("from_ms", u64::MAX / 1_000_000), num("to_ms", u64::MAX / 1_000_000)) {
        (Ok(f), Ok(t)) => (f, t),
        (Err(e), _) | (_, Err(e)) => return bad(e),
    };
    let limit = match num("limit", 10_000) {
        Ok(Some(0)) => return bad("limit=0: expected a whole number in 1..=10000"),
        Ok(l) => usize::try_from(l.unwrap_or(1_000)).unwrap_or(1_000),
        Err(e) => return bad(e),
    };
    let state = match q.get("state").map(String::as_str) {
        None => None,
        Some(st @ ("open" | "final")) => Some(st.to_owned()),
        Some(v) => return bad(format!("state={v:?}: expected open or final")),
    };
    let outcome = match q.get("outcome") {
        Some(v) if !ringwatch_core::verdict::OUTCOME_KINDS.contains(&v.split('(').next().unwrap_or_default()) => {
            return bad(format!(
                "outcome={v:?}: expected one of {}, optionally followed by (…)",
                ringwatch_core::verdict::OUTCOME_KINDS.join(", ")
            ));
        }
        o => o.cloned(),
    };
    let comm = match q.get("comm").map(|c| u64::from_str_radix(c, 16)) {
        None => None,
        Some(Ok(c)) => Some(c),
        Some(Err(_)) => return bad("comm: expected the communicator hash in hex (as in op.comm)"),
    };
    let gpu = match q.get("gpu").map(|g| g.to_ascii_lowercase()) {
        Some(g) if g.len() != 32 || !g.bytes().all(|b| b.is_ascii_hexdigit()) => {
            return bad("gpu: expected a GPU uuid of 32 hex digits");
        }
        g => g,
    };
    let after = match q.get("cursor").map(|c| parse_op_id(c)) {
        None => None,
        Some(Ok(op)) => Some(op),
        Some(Err(e)) => return bad(format!("cursor: {e}")),
    };
    let names = names(&s);
    let node = match q.get("node") {
        Some(n) => match names.iter().find(|(_, name)| *name == n) {
            Some((id, _)) => Some(NodeId(*id)),
            None => return not_found(format!("no node named {n:?}")),
        },
        None => None,
    };
    let fresh = match s.core() {
        Ok(core) => as_of(&s, &core, s.now()),
        Err(e) => return unavailable(e),
    };
    let page = s.store().page_ops(after, limit, OP_SCAN_BUDGET.max(limit), |op, items| {
        let comm_of = match op {
            OpRef::Coll { comm, .. } | OpRef::P2p { comm, .. } | OpRef::Graph { comm, .. } => comm.hash,
        };
        let decided = items.iter().map(|i| i.stored.verdict.decided_at_ns / 1_000_000).min().unwrap_or(0);
        comm.is_none_or(|c| c == comm_of)
            && state.as_deref().is_none_or(|st| st == state_of(items))
            && outcome
                .as_ref()
                .is_none_or(|o| items.iter().any(|i| i.stored.verdict.outcome.name().starts_with(o.as_str())))
            && node.is_none_or(|n| items.iter().any(|i| i.stored.verdict.node == Some(n)))
            && gpu.as_ref().is_none_or(|g| items.iter().any(|i| hex_uuid(&i.stored.verdict.gpu_uuid) == *g))
            && from_ms.is_none_or(|f| decided >= f)
            && to_ms.is_none_or(|t| decided <= t)
    });
    let collectives = page
        .ops
        .iter()
        .map(|(op, items)| {
            let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
            for i in items {
                *outcomes.entry(i.stored.verdict.outcome.name()).or_default() += 1;
            }
            CollectiveSummaryDto {
                id: op_id(op),
                op: OpDto::of(op),
                state: state_of(items).into(),
                ranks: items.len() as u64,
                finals: items.iter().filter(|i| i.stored.verdict.is_final).count() as u64,
                outcomes,
                decided_at_ms: items.iter().map(|i| i.stored.verdict.decided_at_ns / 1_000_000).min().unwrap_or(0),
            }
        })
        .collect();
    Json(CollectivesDto {
        api_version: API_VERSION.into(),
        as_of: fresh,
        next_cursor: page.next.map(|op| op_id(&op)),
        collectives,
    })
    .into_response()
}

/// `GET /v1/collectives/{id}`.
#[utoipa::path(get, path = "/v1/collectives/{id}", tag = "collectives", params(("id" = String, Path, description = "a collective id from /v1/collectives")), responses((status = 200, description = "one op", body = CollectiveDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 404, description = "not held or unknown", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
pub async fn collective(State(s): State<Arc<Shared>>, Path(id): Path<String>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    let op = match parse_op_id(&id) {
        Ok(op) => op,
        Err(e) => return bad(e),
    };
    let fresh = match s.core() {
        Ok(core) => as_of(&s, &core, s.now()),
        Err(e) => return unavailable(e),
    };
    let Some(items) = s.store().op(op) else {
        return not_found(format!("collective {id} is not held (never seen, or past the verdict retention)"));
    };
    let names = names(&s);
    let mut verdicts: Vec<VerdictDto> = items.iter().map(|i| verdict_dto(i, &names)).collect();
    let owners = match s.core() {
        Ok(core) => owner_index(&core, nodes_of(&verdicts, &names).into_iter()),
        Err(e) => return unavailable(e),
    };
    fill_owners(&mut verdicts, &owners);
    Json(CollectiveDto {
        api_version: API_VERSION.into(),
        as_of: fresh,
        id: op_id(&op),
        op: OpDto::of(&op),
        state: state_of(&items).into(),
        verdicts,
    })
    .into_response()
}

/// `GET /v1/loss`.
#[utoipa::path(get, path = "/v1/loss", tag = "loss",
    params(
        ("node" = Option<String>, Query, description = "a node's name"),
        ("class" = Option<String>, Query, description = "p0, p1 or bulk", pattern = "^(p0|p1|bulk)$"),
        ("cause" = Option<String>, Query, description = "a loss cause (rows with frames lost to it)"),
    ),
    responses((status = 200, description = "loss by class and stream", body = LossDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 404, description = "not held or unknown", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
pub async fn loss(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    let q = match http::params(&uri, &["node", "class", "cause"]) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    if let Some(c) = q.get("class")
        && !["p0", "p1", "bulk"].contains(&c.as_str())
    {
        return bad(format!("class={c:?}: expected p0, p1 or bulk"));
    }
    let causes: Vec<String> = (0..64).filter_map(LossCause::from_cause_slot).map(|c| c.to_string()).collect();
    if let Some(c) = q.get("cause")
        && !causes.contains(c)
    {
        return bad(format!("cause={c:?}: expected one of {}", causes.join(", ")));
    }
    let now = s.now();
    let core = match s.core() {
        Ok(c) => c,
        Err(e) => return unavailable(e),
    };
    let fresh = as_of(&s, &core, now);
    let mut nodes = registry(&s, &core);
    if let Some(n) = q.get("node") {
        nodes.retain(|(_, name, _, _)| name == n);
        if nodes.is_empty() {
            return not_found(format!("no node named {n:?}"));
        }
    }
    let class_ok = |t: &ringwatch_core::SeqTracker| {
        q.get("class").is_none_or(|c| StreamId(t.key.stream_id).class().to_string() == *c)
    };
    let by = by_class(nodes.iter().flat_map(|(id, ..)| core.trackers(*id)).filter(|t| class_ok(t)));
    let mut streams = Vec::new();
    for (id, name, _, _) in &nodes {
        for t in core.trackers(*id).filter(|t| class_ok(t)) {
            let dto = super::dto::StreamDto::from_tracker(t);
            if q.get("cause").is_some_and(|c| !dto.lost.contains_key(c)) {
                continue;
            }
            streams.push(LossStreamDto {
                node: name.clone(),
                epoch: dto.epoch,
                stream_id: dto.stream_id,
                class: dto.class,
                ring: dto.ring,
                cpu: dto.cpu,
                received: dto.received,
                lost: dto.lost,
                lost_total: dto.lost_total,
            });
        }
    }
    drop(core);
    streams.sort_by(|a, b| (&a.node, a.epoch, a.stream_id).cmp(&(&b.node, b.epoch, b.stream_id)));
    Json(LossDto { api_version: API_VERSION.into(), as_of: fresh, by_class: by, streams }).into_response()
}

/// `GET /v1/summary`.
#[utoipa::path(get, path = "/v1/summary", tag = "summary", responses((status = 200, description = "the cluster at a glance", body = SummaryDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
pub async fn summary(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    match summary_dto(&s) {
        Ok(d) => Json(d).into_response(),
        Err(e) => unavailable(e),
    }
}

/// The body of `GET /v1/summary` (also read by `/metrics`).
pub(crate) fn summary_dto(s: &Shared) -> Result<SummaryDto, crate::state::CoreFailed> {
    let now = s.now();
    let (fresh, health, n_nodes, names) = {
        let core = s.core()?;
        let reg = registry(s, &core);
        let health = core.node_health(now);
        let names: BTreeMap<NodeId, (String, bool, bool)> =
            reg.iter().map(|(id, n, live, _)| (*id, (n.clone(), core.node_state(*id).is_some(), *live > 0))).collect();
        (as_of(s, &core, now), health, reg.len() as u64, names)
    };
    let mut by_health: BTreeMap<String, u64> = BTreeMap::new();
    for (id, (_, heard, connected)) in &names {
        let h = super::health_of(&health, *id, *heard, *connected);
        *by_health.entry(h.to_owned()).or_default() += 1;
    }
    let cfg = s.summary;
    let since = now.saturating_sub(cfg.correlated_window_ns);
    // Handles copied under the log's lock; the health events parsed after it.
    let window: Vec<_> = s.events_log().newest_first().take_while(|e| e.item.at_ns >= since).cloned().collect();
    let mut recent: Vec<String> = {
        window
            .iter()
            .filter_map(|e| e.item.node_health())
            .filter(|h| h.health == "degraded" || h.health == "healthy_lossy")
            .map(|h| h.node)
            .collect()
    };
    recent.sort();
    recent.dedup();
    let correlated =
        n_nodes > 0 && (recent.len() as u64).saturating_mul(100) > n_nodes.saturating_mul(cfg.correlated_share_pct);
    let tally = s.store().tally(OP_SCAN_BUDGET);
    let mut reasons = Vec::new();
    if let Some(p) = super::pressure_dto(s)
        && p.level != "nominal"
    {
        reasons.push(format!("memory pressure: {}", p.level));
    }
    let stalled = super::tasks(s).into_iter().filter(|t| t.stalled).map(|t| t.name).collect::<Vec<_>>();
    if !stalled.is_empty() {
        reasons.push(format!("stalled: {}", stalled.join(", ")));
    }
    let max_http = s.http_max_connections;
    if max_http > 0 && s.http.open.load(Relaxed) >= max_http {
        reasons.push(format!("HTTP connections at the cap ({max_http})"));
    }
    if s.events.subscribers.load(Relaxed) >= s.events.config.max_subscribers {
        reasons.push(format!("event subscribers at the cap ({})", s.events.config.max_subscribers));
    }
    Ok(SummaryDto {
        api_version: API_VERSION.into(),
        as_of: fresh,
        verdicts_by_outcome: tally.by_outcome,
        hung_collectives: tally.hung_ops,
        counts_complete: tally.complete,
        nodes: n_nodes,
        nodes_by_health: by_health,
        recently_degraded_or_lossy: recent,
        correlated_degradation: correlated,
        aggregator_saturated: !reasons.is_empty(),
        saturated_reasons: reasons,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outcome_pattern_names_exactly_the_outcome_kinds() {
        let inner = OUTCOME_PATTERN.strip_prefix("^(").and_then(|p| p.split_once(')')).map(|(k, _)| k).unwrap();
        let listed: Vec<&str> = inner.split('|').collect();
        assert_eq!(listed, ringwatch_core::verdict::OUTCOME_KINDS.to_vec());
        let doc: serde_json::Value = serde_json::from_str(crate::api::openapi()).unwrap();
        for path in ["/v1/verdicts", "/v1/collectives"] {
            let params = doc["paths"][path]["get"]["parameters"].as_array().unwrap();
            let outcome = params.iter().find(|p| p["name"] == "outcome").unwrap();
            assert_eq!(outcome["schema"]["pattern"], OUTCOME_PATTERN, "{path}");
        }
    }

    #[test]
    fn collective_ids_round_trip_and_uuids_parse() {
        use ringwatch_core::records::Comm;
        let comm = Comm { hash: 0xabc, disambiguator: 2, instance: 3 };
        for op in [
            OpRef::Coll { comm, seq: 41 },
            OpRef::P2p { comm, src: 1, dst: 2, p2p_seq: 9 },
            OpRef::Graph { comm, graph_id: 7, graph_node: 1, replay_idx: 4 },
        ] {
            assert_eq!(parse_op_id(&op_id(&op)), Ok(op));
        }
        assert!(parse_op_id("c.1.2").is_err());
        assert_eq!(parse_uuid(&"0f".repeat(16)), Some([0x0f; 16]));
        for bad in ["", "0f", &"zz".repeat(16), &"é".repeat(16)] {
            assert_eq!(parse_uuid(bad), None, "{bad}");
        }
    }
}

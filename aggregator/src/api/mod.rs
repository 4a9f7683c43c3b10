//! The HTTP surface (axum): `GET /healthz`, `GET /readyz`, `GET /v1/nodes`,
//! `GET /v1/verdicts`, `GET /v1/ingest`, the resources, events and metrics, and the live
//! page (`GET /`, [`ui`]).
//!
//! Handlers read shared state and answer with the DTOs of [`dto`]; they never hold the
//! core's lock across an `.await`. Bad queries get `400` with an [`dto::ErrorDto`] that
//! says what was wrong; once the core failed, handlers that read it answer `503`. A
//! handler that panics is answered `500`, counted (`/healthz` `handler_panics`) and
//! logged; the server goes on.
//!
//! Every API route refuses unknown query parameters and a parameter given twice (`400`
//! naming it); unknown paths get `404` and other methods than GET `405`, each with a JSON
//! error body. The listener's limits (header-read timeout, connection cap) are
//! `ringwatch_transport::http`'s.
//!
//! `/v1/verdicts` query parameters (all optional): `node=NAME`, `gpu=UUID`, `outcome=PREFIX` (one of
//! `ringwatch_core::verdict::OUTCOME_KINDS` — `stuck`, `waiting_on`, … — optionally
//! followed by `(…`, e.g. `indeterminate(uninstrumented)`), `final=true|false`, `limit=N` (1..=100000, default
//! 10000), `cursor=TOKEN` (the previous page's `next_cursor`). Pages are in (op, rank)
//! order; a page ends early, with a `next_cursor`, after [`VERDICT_SCAN_BUDGET`]
//! verdicts looked at.

pub mod auth;
pub mod client;
pub mod dto;
pub mod events;
pub mod resources;
pub mod ui;

use std::collections::BTreeMap;
use std::sync::Arc;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering::Relaxed;

use axum::Json;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
#[cfg(feature = "test-hooks")]
use axum::routing::get;
use futures_util::FutureExt;
use ringwatch_core::NodeId;

use self::dto::{
    API_VERSION, ErrorDto, GapDto, GpuDto, HealthzDto, IngestDto, MapSizeDto, NodeDto, NodesDto, ReadyzDto, StreamDto,
    TIMER_STALL_MS, TaskDto, VerdictDto, VerdictStoreDto, VerdictsDto, health_name, liveness_name,
};
use crate::state::{CoreFailed, Shared};
use ringwatch_transport::http;

/// The OpenAPI document's frame; the paths come from the handlers' `#[utoipa::path]`
/// attributes as [`routes`] registers them.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "ringwatch aggregator API",
        version = "v1",
        description = "Verdicts on collectives and GPU health for a cluster scheduler: telemetry loss or real degradation. Act on final verdicts only; every answer says how fresh it is (as_of). With an api_token_file every route but /healthz, /readyz and the page (/, /ui/{asset}) needs Authorization: Bearer <token>."
    ),
    modifiers(&BearerScheme)
)]
#[derive(Debug)]
pub struct ApiDoc;

/// The optional bearer token, as a security scheme.
struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

/// Every API route, each registered with its OpenAPI path (a route cannot be served
/// undocumented), and the document they make.
pub fn routes() -> (Router<Arc<Shared>>, utoipa::openapi::OpenApi) {
    use utoipa::OpenApi as _;
    use utoipa_axum::router::OpenApiRouter;
    use utoipa_axum::routes;
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(nodes))
        .routes(routes!(verdicts))
        .routes(routes!(ingest))
        .routes(routes!(events::events))
        .routes(routes!(resources::node))
        .routes(routes!(resources::gpu))
        .routes(routes!(resources::collectives))
        .routes(routes!(resources::collective))
        .routes(routes!(resources::loss))
        .routes(routes!(resources::summary))
        .routes(routes!(openapi_json))
        .routes(routes!(metrics))
        .routes(routes!(ui::index))
        .routes(routes!(ui::asset))
        .split_for_parts()
}

/// The document, built once.
static OPENAPI: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The OpenAPI 3.1 document of this API.
#[must_use]
pub fn openapi() -> &'static str {
    OPENAPI.get_or_init(|| routes().1.to_pretty_json().unwrap_or_default())
}

#[utoipa::path(get, path = "/openapi.json", tag = "operations", responses((status = 200, description = "this API's OpenAPI 3.1 document", content_type = "application/json", body = Object), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto)))]
async fn openapi_json() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], openapi()).into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "the aggregator's metrics in the Prometheus text format 0.0.4 (every name in docs/metrics.md)", content_type = "text/plain; version=0.0.4; charset=utf-8", body = String), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto)))]
async fn metrics(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    // The scrape takes the core's and the store's locks in turn, like the API's handlers.
    let text = match tokio::task::spawn_blocking(move || crate::metrics::scrape(&s)).await {
        Ok(t) => t,
        Err(e) => return http::error(StatusCode::INTERNAL_SERVER_ERROR, format!("metrics: {e}")),
    };
    ([(axum::http::header::CONTENT_TYPE, ringwatch_transport::metrics::CONTENT_TYPE)], text).into_response()
}

/// The router.
pub fn router(shared: Arc<Shared>) -> Router {
    let r = routes().0;
    #[cfg(feature = "test-hooks")]
    let r = r.route("/test/panic", get(test_panic)).route("/test/arm-timer-panic", get(arm_timer_panic));
    r.fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::clone(&shared), auth::require))
        .layer(middleware::from_fn_with_state(Arc::clone(&shared), catch_panics))
        .with_state(shared)
}

/// Test hook: a handler that panics (without the core's lock).
#[cfg(feature = "test-hooks")]
async fn test_panic() -> &'static str {
    panic!("test hook: an HTTP handler panics")
}

/// Test hook: the timer task panics, holding the core's lock, at its next turn.
#[cfg(feature = "test-hooks")]
async fn arm_timer_panic(State(s): State<Arc<Shared>>) -> &'static str {
    s.test_panic_timer.store(true, Relaxed);
    "armed"
}

/// A handler's panic is answered 500, counted and logged (the core fails instead if the
/// panic poisoned its lock); every answered request is the HTTP task's progress.
async fn catch_panics(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => {
            s.progress(&s.tasks.http);
            r
        }
        Err(p) => {
            s.tasks.handler_panics.fetch_add(1, Relaxed);
            let why = crate::supervise::panic_message(p.as_ref());
            if s.core_poisoned() {
                s.fail(format!("an HTTP handler ({path}) panicked holding the core: {why}"));
            } else {
                tracing::error!(%path, panic = %why, "HTTP handler panicked");
            }
            (StatusCode::INTERNAL_SERVER_ERROR, Json(ErrorDto { error: "internal error (logged)".into() }))
                .into_response()
        }
    }
}

fn bad(msg: String) -> Response {
    http::error(StatusCode::BAD_REQUEST, msg)
}

pub(crate) fn unavailable(e: CoreFailed) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, Json(ErrorDto { error: e.to_string() })).into_response()
}

pub(crate) fn tasks(s: &Shared) -> Vec<TaskDto> {
    let now = s.real_ms();
    s.tasks
        .all()
        .iter()
        .map(|t| {
            let last = t.last_progress_real_ms.load(Relaxed);
            let ago = (last > 0).then(|| now.saturating_sub(last));
            let is_timers = std::ptr::eq(*t, &s.tasks.timers);
            TaskDto {
                name: t.name.into(),
                alive: t.alive.load(Relaxed),
                panics: t.panics.load(Relaxed),
                restarts: t.restarts.load(Relaxed),
                last_progress_ago_ms: ago,
                stalled: is_timers && ago.map_or(now > TIMER_STALL_MS, |a| a > TIMER_STALL_MS),
            }
        })
        .collect()
}

/// Snapshot attempts failing in a row that make the aggregator not ready: past them a
/// restart would lose what the failed snapshots should have held, and with durability
/// `snapshot` no P0/P1 batch is acked durable (shippers' spools fill).
pub const SNAPSHOT_FAILURES_NOT_READY: u64 = 3;

/// Why the aggregator is not serving (empty: it is).
fn not_ready(s: &Shared, tasks: &[TaskDto]) -> Vec<String> {
    let mut why = Vec::new();
    if let Some(f) = s.failure() {
        why.push(format!("core failed: {f}"));
    }
    let failed = s.counters.snapshot_failures_in_a_row.load(Relaxed);
    if failed >= SNAPSHOT_FAILURES_NOT_READY {
        why.push(format!("the last {failed} snapshots failed (the log says why): P0/P1 batches are not acked durable"));
    }
    for t in tasks {
        // Snapshots, the pressure watcher, the OTLP exporter and the certificate reload
        // are optional; a dead watcher, exporter or reload makes `/healthz` degraded
        // (below), not the aggregator unready.
        let optional = matches!(t.name.as_str(), "snapshots" | "pressure" | "otlp" | "tls")
            || (s.cluster_role.is_none() && matches!(t.name.as_str(), "cluster" | "cluster_state"));
        if !optional && !t.alive {
            why.push(format!("task {} is not running", t.name));
        }
        if t.stalled {
            why.push(format!("task {} made no progress for {} ms", t.name, t.last_progress_ago_ms.unwrap_or(0)));
        }
    }
    why
}

#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "ok", body = HealthzDto), (status = 503, description = "degraded or failed (reasons given)", body = HealthzDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto)))]
async fn healthz(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    let tasks = tasks(&s);
    let failure = s.failure();
    let mut reasons = not_ready(&s, &tasks);
    if s.otlp.enabled.load(Relaxed) && !s.tasks.otlp.alive.load(Relaxed) {
        reasons.push("task otlp is not running: events are not exported".to_owned());
    }
    if s.tls_reload_on.load(Relaxed) && !s.tasks.tls.alive.load(Relaxed) {
        reasons.push("task tls is not running: rotated certificates are not picked up".to_owned());
    }
    let mismatches = s.cluster.shard_count_mismatches.load(Relaxed);
    if mismatches > 0 {
        reasons.push(format!(
            "{mismatches} record batches were routed for another matcher shard count: every role must say the same matcher_shards"
        ));
    }
    if s.pressure.armed.load(Relaxed) && !s.tasks.pressure.alive.load(Relaxed) {
        reasons.push("task pressure is not running: memory pressure is no longer followed".to_owned());
    }
    let status = if failure.is_some() {
        "failed"
    } else if reasons.is_empty() {
        "ok"
    } else {
        "degraded"
    };
    let code = if status == "ok" { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = HealthzDto {
        status: status.into(),
        instance: format!("{:016x}", s.instance),
        aggregator_epoch: s.epoch,
        uptime_ms: s.now() / 1_000_000,
        nodes_connected: s.nodes.iter().filter(|e| e.connected()).count() as u64,
        restored: s.restored,
        snapshot_skipped: s
            .snapshot_skipped
            .as_ref()
            .map(|(version, kept_at)| dto::SnapshotSkippedDto { version: *version, kept_at: kept_at.clone() }),
        durability: s.durability.to_string(),
        failure,
        reasons,
        tasks,
        connection_panics: s.tasks.connection_panics.load(Relaxed),
        handler_panics: s.tasks.handler_panics.load(Relaxed),
        pressure: pressure_dto(&s),
        pressure_unavailable: s.pressure.unavailable.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
        api_token_required: s.api_token.is_some(),
    };
    (code, Json(body)).into_response()
}

/// The aggregator's own memory pressure (`None`: the watcher is off or unavailable).
pub(crate) fn pressure_dto(s: &Shared) -> Option<dto::AggregatorPressureDto> {
    let st = s.pressure.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref()?.borrow().clone();
    let shed = s.store().pressure();
    Some(dto::AggregatorPressureDto {
        level: st.level.name().to_owned(),
        file: st.file.display().to_string(),
        some_avg10_ppm: st.reading.some.avg10_ppm(),
        full_avg10_ppm: st.reading.full.avg10_ppm(),
        some_total_us: st.reading.some.total_us,
        full_total_us: st.reading.full.total_us,
        fired: st.fired,
        transitions: st.transitions,
        p3_sheds: s.pressure.sheds.load(Relaxed),
        rss_returned_bytes: s.pressure.rss_returned_bytes.load(Relaxed),
        store_ops_shed: shed.ops,
        store_verdicts_shed: shed.verdicts,
    })
}

#[utoipa::path(get, path = "/readyz", tag = "operations", responses((status = 200, description = "ready", body = ReadyzDto), (status = 503, description = "not ready (reasons given)", body = ReadyzDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto)))]
async fn readyz(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    let reasons = not_ready(&s, &tasks(&s));
    let code = if reasons.is_empty() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(ReadyzDto { ready: reasons.is_empty(), reasons })).into_response()
}

#[utoipa::path(get, path = "/v1/ingest", tag = "operations", responses((status = 200, description = "the aggregator's own counters", body = IngestDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
async fn ingest(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    match ingest_dto(&s) {
        Ok(d) => Json(d).into_response(),
        Err(e) => unavailable(e),
    }
}

/// `/v1/ingest` `cluster`: the shard role's bus traffic (none with role `all`).
fn cluster_dto(s: &Shared) -> Option<dto::ClusterDto> {
    use crate::cluster::ShardRole;
    let role = s.cluster_role?;
    let c = &s.cluster;
    let (unpublished, for_bus, bus) = s.core().map_or((0, 0, ringwatch_core::BusLivenessCounts::default()), |core| {
        (core.unpublished().len() as u64, core.for_bus().len() as u64, core.bus_liveness_counts())
    });
    Some(dto::ClusterDto {
        role: match role {
            ShardRole::Ingest { shard } => format!("ingest-{shard}"),
            ShardRole::Matcher { shard } => format!("matcher-{shard}"),
            ShardRole::Api => "api".into(),
        },
        connected: c.connected.load(Relaxed),
        records_published: c.records_published.load(Relaxed),
        records_kept_local: c.records_kept_local.load(Relaxed),
        record_messages_published: c.record_messages_published.load(Relaxed),
        records_unpublished: unpublished,
        publish_failures: c.publish_failures.load(Relaxed),
        publish_duplicates: c.publish_duplicates.load(Relaxed),
        backpressure_waits: c.backpressure_waits.load(Relaxed),
        node_summaries_published: c.node_summaries_published.load(Relaxed),
        node_summaries_failed: c.node_summaries_failed.load(Relaxed),
        shard_count_mismatches: c.shard_count_mismatches.load(Relaxed),
        records_applied: c.records_applied.load(Relaxed),
        records_not_owned: c.records_not_owned.load(Relaxed),
        events_published: c.events_published.load(Relaxed),
        events_unpublished: for_bus,
        applied_seq: c.applied_seq.load(Relaxed),
        messages_expired: c.messages_expired.load(Relaxed),
        undecodable: c.undecodable.load(Relaxed),
        events_applied: c.events_applied.load(Relaxed),
        node_summaries_applied: c.node_summaries_applied.load(Relaxed),
        health_applied: c.health_applied.load(Relaxed),
        bus_liveness_synthesized: bus.synthesized,
        bus_liveness_restored: bus.restored,
        bus_liveness_turned_away: bus.turned_away,
        bus_liveness_stale_ignored: bus.stale_ignored,
        consumer_remakes: c.consumer_remakes.load(Relaxed),
    })
}

/// The body of `GET /v1/ingest` (also read by `/metrics`).
pub(crate) fn ingest_dto(s: &Shared) -> Result<IngestDto, CoreFailed> {
    let c = &s.counters;
    let (stats, matcher, dedup, evictions, mut maps, fresh) = {
        let core = s.core()?;
        {
            let (ingest, matcher, dedup) = core.stats();
            (ingest, matcher, dedup, core.evictions(), core.map_sizes(), as_of(s, &core, s.now()))
        }
    };
    let (store, store_stats) = {
        let st = s.store();
        let dto = VerdictStoreDto {
            verdicts: st.len(),
            finals: st.finals(),
            ops: u64::try_from(st.ops()).unwrap_or(u64::MAX),
            bytes: st.bytes(),
            max_bytes: st.config().max_bytes,
            retention_s: st.config().retention_ns / 1_000_000_000,
            ops_compacted: st.stats().ops_compacted,
            recoveries: st.stats().recoveries,
        };
        maps.extend(st.map_sizes());
        (dto, (*st.stats(), st.pressure()))
    };
    let (store_stats, store_pressure) = store_stats;
    let maps: BTreeMap<String, MapSizeDto> = maps
        .into_iter()
        .map(|m| {
            let n = |x: usize| u64::try_from(x).unwrap_or(u64::MAX);
            (m.name.to_owned(), MapSizeDto { len: n(m.len), cap: n(m.cap) })
        })
        .collect();
    let mut evictions: BTreeMap<String, u64> = evictions.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    for (k, v) in [
        ("store.ops_aged_out", store_stats.ops_aged_out),
        ("store.verdicts_aged_out", store_stats.verdicts_aged_out),
        ("store.ops_evicted_bytes", store_stats.ops_evicted_bytes),
        ("store.verdicts_evicted_bytes", store_stats.verdicts_evicted_bytes),
        ("store.recoveries_unheld", store_stats.recoveries_unheld),
        ("store.ops_shed_pressure", store_pressure.ops),
        ("store.verdicts_shed_pressure", store_pressure.verdicts),
    ] {
        evictions.insert(k.to_owned(), v);
    }
    Ok(IngestDto {
        api_version: API_VERSION.into(),
        as_of: fresh,
        aggregator_epoch: s.epoch,
        connections: c.connections.load(Relaxed),
        handshake_failures: c.handshake_failures.load(Relaxed),
        identity_refused: c.identity_refused.load(Relaxed),
        node_mismatch: c.node_mismatch.load(Relaxed),
        batches_applied: c.batches_applied.load(Relaxed),
        batches_duplicate: c.batches_duplicate.load(Relaxed),
        rejected: c
            .rejected()
            .into_iter()
            .map(|(code, n)| (<proto_flat::codes::NackReason as proto_flat::WireEnum>::from_code(code).to_string(), n))
            .collect(),
        stream_errors: c.stream_errors.load(Relaxed),
        protocol_errors: c.protocol_errors.load(Relaxed),
        connections_closed_abuse: c.connections_closed_abuse.load(Relaxed),
        snapshots_written: c.snapshots_written.load(Relaxed),
        snapshot_failures: c.snapshot_failures.load(Relaxed),
        last_snapshot_bytes: c.last_snapshot_bytes.load(Relaxed),
        evictions,
        maps,
        verdict_store: store,
        frames: stats.frames,
        duplicate_frames: stats.duplicate_frames,
        malformed_frames: stats.malformed_frames,
        loss_intervals: stats.loss_intervals,
        ops_inferred_from_seq_gap: matcher.ops_inferred_from_seq_gap,
        resumes: dedup.resumes,
        resume_batches_settled: dedup.resume_settled,
        resume_stream_windows: stats.resume_windows,
        dedup_window_full: dedup.window_full,
        clock_samples_stale: stats.clock_samples_stale,
        implausible_batches: stats.implausible_batches,
        implausible_resumes: stats.implausible_resumes,
        owners_turned_away: stats.owners_turned_away,
        last_snapshot_hold_us: c.last_snapshot_hold_us.load(Relaxed),
        last_snapshot_at_ms: c.last_snapshot_at_ms.load(Relaxed),
        batches_durable: c.batches_durable.load(Relaxed),
        durable_untracked: c.durable_untracked.load(Relaxed),
        connections_protocol_2: c.connections_protocol_2.load(Relaxed),
        protocol_refused: c.protocol_refused.load(Relaxed),
        cluster: cluster_dto(s),
        events: {
            let log = s.events_log();
            dto::EventLogDto {
                last_id: log.last_id().to_string(),
                held: log.len() as u64,
                capacity: log.cap() as u64,
                evicted: log.evicted(),
                subscribers: s.events.subscribers.load(Relaxed),
                subscribers_refused: s.events.refused.load(Relaxed),
                gaps_sent: s.events.gaps_sent.load(Relaxed),
            }
        },
        http: dto::HttpDto {
            connections: s.http.connections.load(Relaxed),
            open: s.http.open.load(Relaxed),
            refused_at_cap: s.http.refused_at_cap.load(Relaxed),
            header_timeouts: s.http.header_timeouts.load(Relaxed),
            accept_errors: s.http.accept_errors.load(Relaxed),
            unauthorized: s.http_unauthorized.load(Relaxed),
            tls_handshake_failures: s.http.tls_handshake_failures.load(Relaxed),
            token_rotations: s.api_token.as_ref().map_or(0, |t| t.rotations.load(Relaxed)),
        },
    })
}

/// [`dto::AsOfDto`] from the core (its lock held by the caller) at aggregator time `now`.
pub(crate) fn as_of(s: &Shared, core: &ringwatch_core::Core, now: u64) -> dto::AsOfDto {
    let mut min: Option<(i64, NodeId)> = None;
    let mut with = 0u64;
    for id in core.node_ids() {
        let Some(n) = core.node_state(id) else { continue };
        let w = n.watermark_ns[0];
        if w == 0 {
            continue;
        }
        with = with.saturating_add(1);
        let c = n.clock.to_cluster(w);
        if min.is_none_or(|(m, _)| c < m) {
            min = Some((c, id));
        }
    }
    let name = |id: NodeId| s.nodes.get(&id).map_or_else(|| format!("{:016x}", id.0), |e| e.name.clone());
    dto::AsOfDto {
        aggregator_epoch: s.epoch,
        aggregator_ms: now / 1_000_000,
        p0_watermark_min_cluster_ns: min.map(|(c, _)| c),
        p0_watermark_min_node: min.map(|(_, id)| name(id)),
        nodes_with_watermark: with,
        event_id: s.events_log().last_id().to_string(),
    }
}

#[utoipa::path(get, path = "/v1/nodes", tag = "nodes", responses((status = 200, description = "every node", body = NodesDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
async fn nodes(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if let Err(r) = http::params(&uri, &[]) {
        return r.into_response();
    }
    match nodes_dto(&s) {
        Ok(d) => Json(d).into_response(),
        Err(e) => unavailable(e),
    }
}

/// The body of `GET /v1/nodes` (also read by `/metrics`).
pub(crate) fn nodes_dto(s: &Shared) -> Result<NodesDto, CoreFailed> {
    let now = s.now();
    let core = s.core()?;
    let health = core.node_health(now);
    let gpu_health = core.gpu_health(now);
    let fresh = as_of(s, &core, now);
    let registry = registry(s, &core);
    let mut out: Vec<NodeDto> = registry
        .into_iter()
        .map(|(id, name, live, connections)| node_dto(s, &core, now, &health, &gpu_health, id, name, live, connections))
        .collect();
    drop(core);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(NodesDto { api_version: API_VERSION.into(), as_of: fresh, nodes: out })
}

/// The registry's node list: (id, name, live connections, connections), with the nodes
/// the core knows that never connected to this instance listed under their id — a node
/// that never came back after an aggregator restart must not vanish from the answer.
pub(crate) fn registry(s: &Shared, core: &ringwatch_core::Core) -> Vec<(NodeId, String, u32, u64)> {
    let mut registry: Vec<(NodeId, String, u32, u64)> =
        s.nodes.iter().map(|e| (*e.key(), e.name.clone(), e.live, e.connections)).collect();
    let named: std::collections::BTreeSet<NodeId> = registry.iter().map(|r| r.0).collect();
    registry.extend(core.node_ids().filter(|id| !named.contains(id)).map(|id| (id, format!("{:016x}", id.0), 0, 0)));
    registry
}

/// A node's health name. A node the core has heard nothing from (its shipper connected,
/// or connected and went away, before its first batch) is not `healthy`: it is
/// `silent` while connected and `unreachable` after — under a CPU hog a node that died
/// that early was reported `healthy` (a demo sweep, seed 5).
pub(crate) fn health_of(
    health: &BTreeMap<NodeId, ringwatch_core::Health>,
    id: NodeId,
    heard: bool,
    connected: bool,
) -> &'static str {
    match health.get(&id) {
        Some(h) => health_name(*h),
        None if heard => health_name(ringwatch_core::Health::Healthy),
        None if connected => health_name(ringwatch_core::Health::Silent),
        None => health_name(ringwatch_core::Health::Unreachable),
    }
}

/// One node's [`NodeDto`] (the caller holds the core's lock).
#[allow(clippy::too_many_arguments, reason = "the pieces one /v1/nodes answer computes once for every node")]
pub(crate) fn node_dto(
    s: &Shared,
    core: &ringwatch_core::Core,
    now: u64,
    health: &BTreeMap<NodeId, ringwatch_core::Health>,
    gpu_health: &BTreeMap<(NodeId, [u8; 16]), ringwatch_core::Health>,
    id: NodeId,
    name: String,
    live: u32,
    connections: u64,
) -> NodeDto {
    let state = core.node_state(id);
    let p0 = core.p0_loss(id);
    NodeDto {
        name,
        node_id: format!("{:016x}", id.0),
        connected: live > 0,
        live_connections: live,
        liveness: state.map_or("unreachable", |n| liveness_name(n.liveness)).into(),
        health: health_of(health, id, state.is_some(), live > 0).into(),
        connections,
        watermark_p0_node_ns: state.map_or(0, |n| n.watermark_ns[0]),
        watermark_bulk_node_ns: state.map_or(0, |n| n.watermark_ns[2]),
        clock_offset_ns: state.and_then(|n| n.clock.offset_ns()),
        clock_epsilon_ns: state.and_then(|n| n.clock.epsilon_ns(now)),
        knowledge_gaps: core
            .knowledge_gaps(id)
            .iter()
            .filter(|(from, to)| to > from)
            .map(|&(from, to)| GapDto { from_ms: from / 1_000_000, to_ms: to / 1_000_000 })
            .collect(),
        gpus: gpu_health
            .range((id, [0u8; 16])..=(id, [0xff; 16]))
            .map(|((_, uuid), h)| GpuDto {
                gpu_uuid: uuid.iter().map(|b| format!("{b:02x}")).collect(),
                health: health_name(*h).into(),
                owners: state.map(|n| resources::gpu_owners(&n.owners, uuid)).unwrap_or_default(),
            })
            .collect(),
        awaiting_first_batch: s.restored && state.is_some_and(|n| !n.heard_since_start),
        prior_instance: core.trackers(id).fold(0u64, |a, t| a.saturating_add(t.counts().prior_instance)),
        p0_frames_lost: p0.0,
        p0_frames_attempted: p0.1,
        shipper: state.and_then(|n| n.shipper).map(|st| dto::ShipperStateDto {
            pressure: st.pressure_level().into(),
            psi_some_avg10: f64::from(st.psi_some_avg10_ppm) / 10_000.0,
            psi_full_avg10: f64::from(st.psi_full_avg10_ppm) / 10_000.0,
            shed_tier: st.shed_tier,
            sampling_level: st.sampling_level,
            spool_bytes: st.spool_bytes,
            spool_cap_bytes: st.spool_cap_bytes,
            age_ms: now.saturating_sub(st.at_ns) / 1_000_000,
        }),
        bulk: state.map(|n| bulk_dto(core, id, n)),
        streams: core.trackers(id).map(StreamDto::from_tracker).collect(),
    }
}

/// A node's bulk (P2) events: the rate from its heartbeats' counters, and the share of
/// them received, lost and sampled out.
pub fn bulk_dto(core: &ringwatch_core::Core, id: NodeId, n: &ringwatch_core::ingest::NodeState) -> dto::BulkDto {
    let (mut attempted, mut sampled_out, mut received, mut lost) = (0u64, 0u64, 0u64, 0u64);
    for t in core.trackers(id).filter(|t| proto_flat::StreamId(t.key.stream_id).class() == proto_flat::Class::P2) {
        if let Some(hb) = t.heartbeat() {
            attempted = attempted.saturating_add(hb.attempted);
            sampled_out = sampled_out.saturating_add(hb.sampled_out);
        }
        received = received.saturating_add(t.counts().received);
        lost = lost.saturating_add(t.counts().lost_total());
    }
    #[allow(clippy::cast_precision_loss, reason = "shares for a dashboard")]
    let share = |a: u64, b: u64| (b > 0).then(|| (a as f64 / b as f64).min(1.0));
    let rate = n.bulk_rate.rate();
    #[allow(clippy::cast_precision_loss, reason = "seconds")]
    dto::BulkDto {
        events_per_second: rate.map(|r| r.events_per_second),
        window_s: rate.map_or(0.0, |r| r.window_ns as f64 / 1e9),
        attempted,
        sampled_out,
        received,
        lost,
        coverage: share(received, attempted),
        lost_share: share(lost, attempted),
        sampled_share: share(sampled_out, attempted.saturating_add(sampled_out)),
        interfaces: n
            .interfaces
            .iter()
            .map(|i| dto::InterfaceRateDto {
                ifindex: i.ifindex,
                packets: i.packets,
                bytes: i.bytes,
                packets_per_second: i.packets_per_second,
                bytes_per_second: i.bytes_per_second,
                window_s: i.window_ns as f64 / 1e9,
            })
            .collect(),
        interfaces_turned_away: n.interfaces.turned_away,
    }
}

#[utoipa::path(get, path = "/v1/verdicts", tag = "verdicts",
    params(
        ("node" = Option<String>, Query, description = "a node's name"),
        ("gpu" = Option<String>, Query, description = "a GPU uuid (32 hex digits)", pattern = "^[0-9a-fA-F]{32}$"),
        ("outcome" = Option<String>, Query, description = "an outcome kind, optionally followed by (…)", pattern = "^(completed|completed_inferred|entered_inferred|in_flight|waiting_on|not_joined|stuck|blocked_by|unknown_silent|indeterminate)(\\(.*)?$"),
        ("final" = Option<bool>, Query, description = "final verdicts only, or open ones only"),
        ("limit" = Option<u32>, Query, description = "1..=100000 (default 10000)", minimum = 1, maximum = 100000),
        ("cursor" = Option<String>, Query, description = "the previous page's next_cursor"),
    ),
    responses((status = 200, description = "a page of rank verdicts", body = VerdictsDto), (status = 400, description = "a bad query (the parameter named)", body = ErrorDto), (status = 404, description = "no such node", body = ErrorDto), (status = 401, description = "a bearer token is configured and the request has none, or the wrong one", body = ErrorDto), (status = 503, description = "the core failed: the aggregator is restarting", body = ErrorDto)))]
async fn verdicts(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    let q = match http::params(&uri, &["node", "gpu", "outcome", "final", "limit", "cursor"]) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    if s.failure().is_some() {
        return unavailable(CoreFailed);
    }
    let mut node = None;
    let mut gpu: Option<[u8; 16]> = None;
    let mut outcome = None;
    let mut fin = None;
    let mut limit = 10_000usize;
    let mut after = None;
    for (k, v) in &q {
        match k.as_str() {
            "node" => node = Some(v.clone()),
            "gpu" => match resources::parse_uuid(v) {
                Some(u) => gpu = Some(u),
                None => return bad(format!("gpu={v:?}: expected a GPU uuid of 32 hex digits")),
            },
            "outcome" => {
                let kind = v.split('(').next().unwrap_or_default();
                if !ringwatch_core::verdict::OUTCOME_KINDS.contains(&kind) {
                    return bad(format!(
                        "outcome={v:?}: expected one of {}, optionally followed by (…)",
                        ringwatch_core::verdict::OUTCOME_KINDS.join(", ")
                    ));
                }
                outcome = Some(v.clone());
            }
            "final" => match v.as_str() {
                "true" => fin = Some(true),
                "false" => fin = Some(false),
                _ => return bad(format!("final={v:?}: expected true or false")),
            },
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=100_000).contains(&n) => limit = n,
                _ => return bad(format!("limit={v:?}: expected a whole number in 1..=100000")),
            },
            "cursor" => match ringwatch_core::Cursor::decode(v) {
                Ok(c) => after = Some(c),
                Err(e) => return bad(e),
            },
            _ => {}
        }
    }
    let names: BTreeMap<u64, String> = s.nodes.iter().map(|e| (e.key().0, e.name.clone())).collect();
    let node_id = match &node {
        Some(n) => match names.iter().find(|(_, name)| *name == n) {
            Some((id, _)) => Some(NodeId(*id)),
            None => return http::error(StatusCode::NOT_FOUND, format!("no node named {n:?}")),
        },
        None => None,
    };
    // Freshness first (the core's lock, briefly): the page reflects at least this.
    let fresh = match s.core() {
        Ok(core) => as_of(&s, &core, s.now()),
        Err(e) => return unavailable(e),
    };
    // One bounded page under the store's lock (owned), the DTOs after it is released.
    let (page, total, stored) = {
        let store = s.store();
        let total = match (&node, &outcome, fin, gpu) {
            (None, None, None, None) => Some(store.len()),
            (None, None, Some(true), None) => Some(store.finals()),
            (None, None, Some(false), None) => Some(store.len().saturating_sub(store.finals())),
            _ => None,
        };
        let page = store.page(after, limit, VERDICT_SCAN_BUDGET.max(limit), |st| {
            let v = &st.verdict;
            node_id.is_none_or(|n| v.node == Some(n))
                && gpu.is_none_or(|g| v.gpu_uuid == g)
                && fin.is_none_or(|f| v.is_final == f)
                && outcome.as_ref().is_none_or(|o| v.outcome.name().starts_with(o.as_str()))
        });
        (page, total, store.len())
    };
    let mut verdicts: Vec<VerdictDto> = page
        .items
        .iter()
        .map(|i| {
            let mut dto = VerdictDto::from_verdict(&i.stored.verdict, |id| names.get(&id).cloned());
            dto.final_at_ms = i.stored.final_at_ns.map(|t| t / 1_000_000);
            dto.recovered_at_ms = i.stored.recovered_at_ns.map(|t| t / 1_000_000);
            dto.compacted = i.compacted;
            dto
        })
        .collect();
    // The owners of the page's ranks as of now (the core's lock again, for their nodes).
    let owners = match s.core() {
        Ok(core) => resources::owner_index(&core, resources::nodes_of(&verdicts, &names).into_iter()),
        Err(e) => return unavailable(e),
    };
    resources::fill_owners(&mut verdicts, &owners);
    Json(VerdictsDto {
        api_version: API_VERSION.into(),
        as_of: fresh,
        total,
        stored,
        next_cursor: page.next.map(|c| c.encode()),
        verdicts,
    })
    .into_response()
}

/// Verdicts one `/v1/verdicts` request looks at, at most (past it the page ends early
/// with a `next_cursor`): a selective filter costs a bounded time under the store's lock.
pub const VERDICT_SCAN_BUDGET: usize = 100_000;

#[cfg(test)]
mod tests {
    /// A node the core has not heard from is never `healthy`.
    #[test]
    fn a_node_never_heard_from_is_silent_or_unreachable_not_healthy() {
        use ringwatch_core::{Health, NodeId};
        let mut h = std::collections::BTreeMap::new();
        h.insert(NodeId(1), Health::Degraded);
        assert_eq!(super::health_of(&h, NodeId(1), true, true), "degraded");
        assert_eq!(super::health_of(&h, NodeId(2), true, false), "healthy");
        assert_eq!(super::health_of(&h, NodeId(2), false, true), "silent");
        assert_eq!(super::health_of(&h, NodeId(2), false, false), "unreachable");
    }

    /// Every route is documented and every documented path is a route: the router is
    /// built only from `routes()` (each route registered with its path document by
    /// utoipa-axum; test hooks apart), and the document holds exactly these paths.
    #[test]
    fn the_openapi_document_and_the_router_agree() {
        let doc: serde_json::Value = serde_json::from_str(super::openapi()).expect("JSON");
        let paths: std::collections::BTreeSet<&str> =
            doc["paths"].as_object().expect("paths").keys().map(String::as_str).collect();
        let want: std::collections::BTreeSet<&str> = [
            "/healthz",
            "/readyz",
            "/openapi.json",
            "/v1/nodes",
            "/v1/nodes/{node}",
            "/v1/gpus/{uuid}",
            "/v1/verdicts",
            "/v1/collectives",
            "/v1/collectives/{id}",
            "/v1/loss",
            "/v1/summary",
            "/v1/events",
            "/v1/ingest",
            "/metrics",
            "/",
            "/ui/{asset}",
        ]
        .into_iter()
        .collect();
        assert_eq!(paths, want);
        for (path, item) in doc["paths"].as_object().expect("paths") {
            let get = &item["get"];
            assert!(get.is_object(), "{path}: GET");
            assert!(get["responses"]["200"].is_object(), "{path}: a 200 answer");
            if !["/healthz", "/readyz", "/", "/ui/{asset}"].contains(&path.as_str()) {
                assert!(get["responses"]["401"].is_object(), "{path}: the token's 401");
            }
        }
        // The only routes added beside `routes()` are the test hooks.
        let src = include_str!("mod.rs");
        let extra: Vec<&str> =
            src.lines().filter(|l| l.contains(".route(\"") && !l.contains(".route(\"/test/")).collect();
        assert_eq!(extra, Vec::<&str>::new(), "a route outside routes(): it would be undocumented");
    }
}

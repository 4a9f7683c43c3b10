//! `aggregator query …`: the API from a shell — tables for people, `--json` for scripts,
//! `events --follow` for a resumable stream.
//!
//! Exit codes: 0 ok; 1 the aggregator cannot be reached, broke the stream, or answered
//! 5xx; 2 usage, or the aggregator refused the query (400, the reason printed);
//! 3 not found (404); 4 unauthorized (401: give `--token-file`).
//!
//! The renderers are pure (DTO → text) and tested here; [`run`] does the I/O.

use std::fmt::Write as _;
use std::net::SocketAddr;

use crate::api::client::{self, ClientError, EventStream};
use crate::api::dto::{
    CollectiveDto, CollectivesDto, LossClassDto, LossDto, NodeDetailDto, NodesDto, SummaryDto, VerdictDto,
};

/// What to ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    Nodes,
    Node(String),
    Collectives { all: bool },
    Collective(String),
    Loss,
    Summary,
    Events { follow: bool },
}

/// A query.
#[derive(Debug, Clone)]
pub struct Query {
    pub http: SocketAddr,
    /// Over HTTPS: the client side ([`client::Endpoint::tls`]).
    pub tls: Option<(std::sync::Arc<rustls::ClientConfig>, rustls::pki_types::ServerName<'static>)>,
    pub token: Option<String>,
    pub json: bool,
    /// Query parameters passed through (the server checks them).
    pub params: Vec<(String, String)>,
    pub what: What,
}

impl Query {
    fn endpoint(&self) -> client::Endpoint {
        client::Endpoint { addr: self.http, tls: self.tls.clone() }
    }
}

/// How a query failed, with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("{0}")]
    Client(#[from] ClientError),
    #[error("{0}")]
    Usage(String),
}

impl QueryError {
    /// The exit code (module docs).
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Usage(_) => 2,
            Self::Client(ClientError::Status { status: 400, .. }) => 2,
            Self::Client(ClientError::Status { status: 404, .. }) => 3,
            Self::Client(ClientError::Status { status: 401, .. }) => 4,
            Self::Client(_) => 1,
        }
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved characters and `(`, `)`, `,`, `:`,
/// `@` pass).
#[must_use]
pub fn encode(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~(),:@".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The path (with query string) of `q`.
#[must_use]
pub fn path(q: &Query) -> String {
    let base = match &q.what {
        What::Nodes => "/v1/nodes".to_owned(),
        What::Node(n) => format!("/v1/nodes/{}", encode(n)),
        What::Collectives { .. } => "/v1/collectives".to_owned(),
        What::Collective(id) => format!("/v1/collectives/{}", encode(id)),
        What::Loss => "/v1/loss".to_owned(),
        What::Summary => "/v1/summary".to_owned(),
        What::Events { .. } => "/v1/events".to_owned(),
    };
    if q.params.is_empty() {
        return base;
    }
    let qs: Vec<String> = q.params.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect();
    format!("{base}?{}", qs.join("&"))
}

fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = width.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |cells: &mut dyn Iterator<Item = String>, out: &mut String| {
        let cells: Vec<String> = cells.collect();
        let last = cells.len().saturating_sub(1);
        for (i, c) in cells.iter().enumerate() {
            let w = width.get(i).copied().unwrap_or(0);
            if i == last {
                out.push_str(c);
            } else {
                let _ = write!(out, "{c:<w$}  ");
            }
        }
        out.push('\n');
    };
    line(&mut header.iter().map(|h| (*h).to_owned()), &mut out);
    for r in rows {
        line(&mut r.iter().cloned(), &mut out);
    }
    out
}

/// `nodes` as a table.
#[must_use]
pub fn render_nodes(n: &NodesDto) -> String {
    let rows: Vec<Vec<String>> = n
        .nodes
        .iter()
        .map(|x| {
            let unwell = x.gpus.iter().filter(|g| g.health != "healthy" && g.health != "healthy_lossy").count();
            vec![
                x.name.clone(),
                x.health.clone(),
                x.liveness.clone(),
                if x.connected { "yes" } else { "no" }.to_owned(),
                format!("{}/{}", x.p0_frames_lost, x.p0_frames_attempted),
                format!("{unwell}/{}", x.gpus.len()),
            ]
        })
        .collect();
    let mut out = table(&["NODE", "HEALTH", "LIVENESS", "CONNECTED", "P0 LOST/ATTEMPTED", "GPUS UNWELL"], &rows);
    let _ = writeln!(out, "as of aggregator {} ms, event {}", n.as_of.aggregator_ms, n.as_of.event_id);
    out
}

fn loss_rows(l: &[LossClassDto]) -> Vec<Vec<String>> {
    l.iter()
        .map(|c| {
            let causes: Vec<String> = c.lost.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vec![
                c.class.clone(),
                c.received.to_string(),
                c.lost_total.to_string(),
                format!("{:.4}%", c.lost_share * 100.0),
                causes.join(" "),
            ]
        })
        .collect()
}

fn verdict_rows(v: &[VerdictDto]) -> Vec<Vec<String>> {
    v.iter()
        .map(|v| {
            vec![
                format!("{}:{}", v.op.kind, v.op.seq),
                v.rank.to_string(),
                v.node.clone().unwrap_or_else(|| "?".into()),
                v.outcome.clone(),
                if v.is_final { "final" } else { "open" }.to_owned(),
                v.revision.to_string(),
                v.evidence.clone(),
            ]
        })
        .collect()
}

const VERDICT_HEADER: &[&str] = &["OP", "RANK", "NODE", "OUTCOME", "STATE", "REV", "EVIDENCE"];

/// `node NAME` as text.
#[must_use]
pub fn render_node(d: &NodeDetailDto) -> String {
    let n = &d.node;
    let mut out = format!(
        "{} ({}): {}, {}, {}\n",
        n.name,
        n.node_id,
        n.health,
        n.liveness,
        if n.connected { "connected" } else { "not connected" }
    );
    let _ = writeln!(out, "P0 frames lost {} of {}", n.p0_frames_lost, n.p0_frames_attempted);
    let gpus: Vec<Vec<String>> = n.gpus.iter().map(|g| vec![g.gpu_uuid.clone(), g.health.clone()]).collect();
    out.push('\n');
    out.push_str(&table(&["GPU", "HEALTH"], &gpus));
    out.push('\n');
    out.push_str(&table(&["CLASS", "RECEIVED", "LOST", "SHARE", "BY CAUSE"], &loss_rows(&d.loss)));
    out.push('\n');
    out.push_str(&table(VERDICT_HEADER, &verdict_rows(&d.recent_verdicts)));
    out
}

/// `collectives` as a table.
#[must_use]
pub fn render_collectives(c: &CollectivesDto) -> String {
    let rows: Vec<Vec<String>> = c
        .collectives
        .iter()
        .map(|x| {
            let outcomes: Vec<String> = x.outcomes.iter().map(|(k, v)| format!("{k}×{v}")).collect();
            vec![x.id.clone(), x.state.clone(), format!("{}/{}", x.finals, x.ranks), outcomes.join(" ")]
        })
        .collect();
    let mut out = table(&["ID", "STATE", "FINAL/RANKS", "OUTCOMES"], &rows);
    if let Some(next) = &c.next_cursor {
        let _ = writeln!(out, "more: -q cursor={next} (or --all)");
    }
    out
}

/// `collective ID` as text.
#[must_use]
pub fn render_collective(c: &CollectiveDto) -> String {
    let mut out = format!(
        "{} {} comm {} instance {} seq {}: {}\n\n",
        c.id, c.op.kind, c.op.comm, c.op.comm_instance, c.op.seq, c.state
    );
    out.push_str(&table(VERDICT_HEADER, &verdict_rows(&c.verdicts)));
    out
}

/// `loss` as tables.
#[must_use]
pub fn render_loss(l: &LossDto) -> String {
    let mut out = table(&["CLASS", "RECEIVED", "LOST", "SHARE", "BY CAUSE"], &loss_rows(&l.by_class));
    let rows: Vec<Vec<String>> = l
        .streams
        .iter()
        .filter(|s| s.lost_total > 0)
        .map(|s| {
            let causes: Vec<String> = s.lost.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vec![
                s.node.clone(),
                format!("{}/{}/{}", s.class, s.ring, s.cpu),
                s.received.to_string(),
                s.lost_total.to_string(),
                causes.join(" "),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table(&["NODE", "STREAM (CLASS/RING/CPU)", "RECEIVED", "LOST", "BY CAUSE"], &rows));
    out
}

/// `summary` as text.
#[must_use]
pub fn render_summary(s: &SummaryDto) -> String {
    let kv = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
    };
    let mut out = String::new();
    let _ = writeln!(out, "nodes                    {} ({})", s.nodes, kv(&s.nodes_by_health));
    let _ = writeln!(out, "verdicts                 {}", kv(&s.verdicts_by_outcome));
    let _ = writeln!(out, "hung collectives         {}", s.hung_collectives);
    let _ = writeln!(out, "recently degraded/lossy  {}", s.recently_degraded_or_lossy.join(", "));
    let _ = writeln!(out, "correlated degradation   {}", if s.correlated_degradation { "YES" } else { "no" });
    let sat = if s.aggregator_saturated { s.saturated_reasons.join("; ") } else { "no".to_owned() };
    let _ = writeln!(out, "aggregator saturated     {sat}");
    let _ = writeln!(out, "as of aggregator {} ms, event {}", s.as_of.aggregator_ms, s.as_of.event_id);
    out
}

/// One event as a line: `<id> <event> <data>` for people, a JSON object for scripts.
#[must_use]
pub fn render_event(e: &client::SseEvent, json: bool) -> String {
    let id = e.id.clone().unwrap_or_default();
    if json {
        let data: serde_json::Value =
            serde_json::from_str(&e.data).unwrap_or(serde_json::Value::String(e.data.clone()));
        serde_json::json!({ "id": id, "event": e.event, "data": data }).to_string()
    } else {
        format!("{id} {} {}", e.event, e.data)
    }
}

async fn get_text(q: &Query, path: &str) -> Result<String, QueryError> {
    let auth = q.token.as_ref().map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.as_deref().map(|a| vec![("Authorization", a)]).unwrap_or_default();
    let (status, body) = client::get_at(&q.endpoint(), path, &headers).await?;
    if status != 200 {
        return Err(ClientError::Status { path: path.to_owned(), status, body }.into());
    }
    Ok(body)
}

fn parse<T: serde::de::DeserializeOwned>(path: &str, body: &str) -> Result<T, QueryError> {
    serde_json::from_str(body).map_err(|source| ClientError::Json { path: path.to_owned(), source }.into())
}

/// Runs `q`, printing to stdout.
///
/// # Errors
/// See [`QueryError::exit_code`].
pub async fn run(q: &Query) -> Result<(), QueryError> {
    let p = path(q);
    match &q.what {
        What::Events { follow } => return events(q, &p, *follow).await,
        What::Collectives { all: true } => {
            let mut page: CollectivesDto = parse(&p, &get_text(q, &p).await?)?;
            while let Some(cursor) = page.next_cursor.take() {
                let mut next = q.clone();
                next.params.retain(|(k, _)| k != "cursor");
                next.params.push(("cursor".into(), cursor));
                let np = path(&next);
                let more: CollectivesDto = parse(&np, &get_text(q, &np).await?)?;
                page.collectives.extend(more.collectives);
                page.next_cursor = more.next_cursor;
            }
            if q.json {
                println!("{}", serde_json::to_string_pretty(&page).unwrap_or_default());
            } else {
                print!("{}", render_collectives(&page));
            }
            return Ok(());
        }
        _ => {}
    }
    let body = get_text(q, &p).await?;
    if q.json {
        println!("{body}");
        return Ok(());
    }
    let text = match &q.what {
        What::Nodes => render_nodes(&parse(&p, &body)?),
        What::Node(_) => render_node(&parse(&p, &body)?),
        What::Collectives { .. } => render_collectives(&parse(&p, &body)?),
        What::Collective(_) => render_collective(&parse(&p, &body)?),
        What::Loss => render_loss(&parse(&p, &body)?),
        What::Summary => render_summary(&parse(&p, &body)?),
        What::Events { .. } => String::new(),
    };
    print!("{text}");
    Ok(())
}

/// `events`: without `--follow`, the events the log holds (after `-q after=ID` if
/// given; a `gap` line first if some are gone) up to the newest when asked (`until=`: the
/// server ends the stream there, filters or not); with it, on and on (from now, or after
/// `after=`), resuming after the last id seen whenever the connection drops (a `gap`
/// event says what was missed).
async fn events(q: &Query, path: &str, follow: bool) -> Result<(), QueryError> {
    let auth = q.token.as_ref().map(|t| format!("Bearer {t}"));
    let ingest: crate::api::dto::IngestDto = parse("/v1/ingest", &get_text(q, "/v1/ingest").await?)?;
    let newest: crate::events::EventId =
        ingest.events.last_id.parse().map_err(|e: crate::events::BadEventId| QueryError::Usage(e.to_string()))?;
    let given_after = q.params.iter().any(|(k, _)| k == "after");
    // Where to start: `after=` if given (the server reads it); else the newest event now
    // with --follow (a drop before the first event resumes from there, missing nothing),
    // or the start of this process's log without.
    let mut last: Option<String> = match (given_after, follow) {
        (true, _) => None,
        (false, true) => Some(newest.to_string()),
        (false, false) => Some(crate::events::EventId { seq: 0, ..newest }.to_string()),
    };
    // Without --follow the server ends the stream once past the newest event now.
    let path = if follow {
        path.to_owned()
    } else {
        let sep = if path.contains('?') { '&' } else { '?' };
        format!("{path}{sep}until={}", encode(&newest.to_string()))
    };
    let mut failures = 0u32;
    loop {
        let mut headers: Vec<(&str, &str)> = auth.as_deref().map(|a| vec![("Authorization", a)]).unwrap_or_default();
        if let Some(l) = &last {
            headers.push(("Last-Event-ID", l.as_str()));
        }
        let mut s = match EventStream::open_at(&q.endpoint(), &path, &headers).await {
            Ok(s) => s,
            Err(e @ ClientError::Status { .. }) => return Err(e.into()),
            Err(e) if follow && failures < 30 => {
                failures += 1;
                eprintln!("aggregator query: {e}; retrying ({failures})");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        failures = 0;
        loop {
            match s.next().await {
                Ok(Some(e)) => {
                    println!("{}", render_event(&e, q.json));
                    if e.id.is_some() {
                        last.clone_from(&e.id);
                    }
                }
                Ok(None) | Err(_) if follow => break,
                Ok(None) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::dto::{AsOfDto, GpuDto, NodeDto};

    fn node(name: &str, health: &str) -> NodeDto {
        NodeDto {
            name: name.into(),
            node_id: "00000000000000aa".into(),
            connected: true,
            live_connections: 1,
            liveness: "fresh".into(),
            health: health.into(),
            connections: 1,
            watermark_p0_node_ns: 0,
            watermark_bulk_node_ns: 0,
            clock_offset_ns: None,
            clock_epsilon_ns: None,
            knowledge_gaps: vec![],
            gpus: vec![GpuDto { gpu_uuid: "ab".into(), health: "degraded".into(), owners: Vec::new() }],
            awaiting_first_batch: false,
            prior_instance: 0,
            p0_frames_lost: 3,
            p0_frames_attempted: 100,
            shipper: None,
            bulk: None,
            streams: vec![],
        }
    }

    #[test]
    fn tables_line_up_and_say_how_fresh() {
        let n = NodesDto {
            api_version: "v1".into(),
            as_of: AsOfDto { aggregator_ms: 42, event_id: "1.7@00000000000000ff".into(), ..AsOfDto::default() },
            nodes: vec![node("node-00", "healthy"), node("node-long-name", "degraded")],
        };
        let t = render_nodes(&n);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        let col = |l: &str| l.find("HEALTH").or_else(|| l.find("healthy")).or_else(|| l.find("degraded"));
        assert_eq!(col(lines[0]), col(lines[1]));
        assert_eq!(col(lines[1]), col(lines[2]));
        assert!(lines[1].contains("3/100") && lines[1].contains("1/1"), "{t}");
        assert!(lines[3].contains("42 ms") && lines[3].contains("1.7@"), "{t}");
    }

    #[test]
    fn paths_encode_parameters() {
        let q = Query {
            http: SocketAddr::from(([127, 0, 0, 1], 1)),
            tls: None,
            token: None,
            json: false,
            params: vec![("outcome".into(), "waiting_on(3)".into()), ("node".into(), "a b&c".into())],
            what: What::Collectives { all: false },
        };
        assert_eq!(path(&q), "/v1/collectives?outcome=waiting_on(3)&node=a%20b%26c");
        let one = Query { what: What::Node("n/1".into()), params: vec![], ..q };
        assert_eq!(path(&one), "/v1/nodes/n%2F1");
    }

    #[test]
    fn exit_codes_follow_the_status() {
        let st = |status| QueryError::Client(ClientError::Status { path: String::new(), status, body: String::new() });
        assert_eq!(st(400).exit_code(), 2);
        assert_eq!(st(404).exit_code(), 3);
        assert_eq!(st(401).exit_code(), 4);
        assert_eq!(st(503).exit_code(), 1);
        assert_eq!(QueryError::Usage(String::new()).exit_code(), 2);
    }

    #[test]
    fn events_render_as_lines_or_json() {
        let e = client::SseEvent { id: Some("1.2@00".into()), event: "health".into(), data: "{\"node\":\"n\"}".into() };
        assert_eq!(render_event(&e, false), "1.2@00 health {\"node\":\"n\"}");
        let j: serde_json::Value = serde_json::from_str(&render_event(&e, true)).unwrap();
        assert_eq!(j["data"]["node"], "n");
        assert_eq!(j["id"], "1.2@00");
    }
}

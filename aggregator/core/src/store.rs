//! `VerdictStore`: the verdicts the API serves, latest per (op, rank), bounded by age and
//! by bytes.
//!
//! Fed from [`crate::Core::poll_event`] ([`VerdictStore::apply`]); the aggregator keeps it
//! behind its own lock, apart from the core's, so ingest never waits on a query. Rules:
//! - an op is forgotten `retention_ns` after its last update, and the least recently
//!   updated ops go first while the store is over `max_bytes` (both counted);
//! - under memory pressure ([`VerdictStore::set_pressure`], the aggregator's P3) both
//!   limits are a quarter of the configured ones: what goes for that alone is counted
//!   apart ([`PressureShed`]);
//! - an op whose every held verdict is final `completed` with no tags — the common case —
//!   is compacted to a summary of `(rank, node, gpu)` ([`CompactRank`], ≈ 40 B a rank
//!   instead of ≈ 400 B): its per-rank evidence (frame references, watermarks) is
//!   dropped, the outcome, finality and decision time are kept;
//! - `Recovered` events set the rank's `recovered_at` (counted when the verdict is no
//!   longer held);
//! - queries return owned pages (cursor, limit, a scan budget), so no lock is held while
//!   they are turned into responses, and a query costs what it returns, not what the
//!   store holds.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use rkyv::{Archive, Deserialize, Serialize};

use crate::records::NodeId;
use crate::tally::Tally;
use crate::verdict::{Evidence, MatcherEvent, OpRef, Outcome, Rule, Verdict, VerdictTag};

/// Limits.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// An op is forgotten this long (aggregator time) after its last update.
    pub retention_ns: u64,
    /// The store's estimated size ([`VerdictStore::bytes`]) is kept under this.
    pub max_bytes: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self { retention_ns: 3_600_000_000_000, max_bytes: 256 << 20 }
    }
}

/// Counters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Verdict events applied.
    pub verdicts: u64,
    /// Recoveries applied to a held verdict.
    pub recoveries: u64,
    /// Recoveries of a verdict no longer held (aged out or evicted).
    pub recoveries_unheld: u64,
    /// Ops compacted to a summary (every verdict final `completed`, untagged).
    pub ops_compacted: u64,
    /// Ops (and their rank verdicts) forgotten `retention_ns` after their last update.
    pub ops_aged_out: u64,
    pub verdicts_aged_out: u64,
    /// Ops (and their rank verdicts) forgotten, least recently updated first, to stay
    /// under `max_bytes`.
    pub ops_evicted_bytes: u64,
    pub verdicts_evicted_bytes: u64,
}

/// Memory pressure's shedding of the store: whether it is on, and the ops (and their
/// rank verdicts) forgotten only because it was (the configured limits would have kept
/// them). Not part of snapshots: pressure is this process's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PressureShed {
    pub on: bool,
    pub ops: u64,
    pub verdicts: u64,
}

/// The share of the configured limits kept under memory pressure.
pub const PRESSURE_DIVISOR: u64 = 4;

/// A rank of a compacted op: final `completed`, untagged.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactRank {
    pub rank: u32,
    pub node: Option<NodeId>,
    pub gpu_uuid: [u8; 16],
}

/// A held verdict with the store's times.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub verdict: Verdict,
    /// Aggregator time it became final.
    pub final_at_ns: Option<u64>,
    /// Aggregator time its rank completed after all (a final unfinished verdict).
    pub recovered_at_ns: Option<u64>,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
enum Entry {
    Full(BTreeMap<u32, Stored>),
    Completed { ranks: Vec<CompactRank>, decided_at_ns: u64, final_at_ns: u64, revision: u32 },
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
struct OpEntry {
    touched_ns: u64,
    bytes: u64,
    entry: Entry,
}

/// One verdict of a page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageItem {
    pub stored: Stored,
    /// From a compacted op: the evidence is the rule only.
    pub compacted: bool,
}

/// Where a page ends: the next page starts after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor {
    pub op: OpRef,
    pub rank: u32,
}

impl Cursor {
    /// The cursor as an opaque token for an API (`c.` / `p.` / `g.` and the key's fields
    /// in hex, dot-separated).
    #[must_use]
    pub fn encode(&self) -> String {
        let c = |comm: &crate::records::Comm| format!("{:x}.{:x}.{:x}", comm.hash, comm.disambiguator, comm.instance);
        match self.op {
            OpRef::Coll { comm, seq } => format!("c.{}.{seq:x}.{:x}", c(&comm), self.rank),
            OpRef::P2p { comm, src, dst, p2p_seq } => {
                format!("p.{}.{src:x}.{dst:x}.{p2p_seq:x}.{:x}", c(&comm), self.rank)
            }
            OpRef::Graph { comm, graph_id, graph_node, replay_idx } => {
                format!("g.{}.{graph_id:x}.{graph_node:x}.{replay_idx:x}.{:x}", c(&comm), self.rank)
            }
        }
    }

    /// Parses [`Self::encode`]'s token.
    ///
    /// # Errors
    /// What is wrong with the token.
    pub fn decode(token: &str) -> Result<Self, String> {
        let parts: Vec<&str> = token.split('.').collect();
        let hex64 = |i: usize| -> Result<u64, String> {
            let p = parts.get(i).ok_or_else(|| format!("cursor {token:?}: too few fields"))?;
            u64::from_str_radix(p, 16).map_err(|_| format!("cursor {token:?}: field {i} is not hex"))
        };
        let hex32 = |i: usize| -> Result<u32, String> {
            u32::try_from(hex64(i)?).map_err(|_| format!("cursor {token:?}: field {i} is out of range"))
        };
        let comm = || -> Result<crate::records::Comm, String> {
            Ok(crate::records::Comm { hash: hex64(1)?, disambiguator: hex64(2)?, instance: hex64(3)? })
        };
        let (op, fields) = match parts.first().copied() {
            Some("c") => (OpRef::Coll { comm: comm()?, seq: hex64(4)? }, 6),
            Some("p") => (OpRef::P2p { comm: comm()?, src: hex32(4)?, dst: hex32(5)?, p2p_seq: hex64(6)? }, 8),
            Some("g") => {
                (OpRef::Graph { comm: comm()?, graph_id: hex64(4)?, graph_node: hex32(5)?, replay_idx: hex32(6)? }, 8)
            }
            _ => return Err(format!("cursor {token:?}: not a cursor this API gave")),
        };
        if parts.len() != fields {
            return Err(format!("cursor {token:?}: expected {fields} fields, got {}", parts.len()));
        }
        Ok(Self { op, rank: hex32(fields.saturating_sub(1))? })
    }
}

/// A page of verdicts, in (op, rank) order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    pub items: Vec<PageItem>,
    /// Set when more may follow (the limit or the scan budget was reached).
    pub next: Option<Cursor>,
    /// Rank verdicts looked at.
    pub scanned: usize,
}

/// A page of ops ([`VerdictStore::page_ops`]), in op order, each with its verdicts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpPage {
    pub ops: Vec<(OpRef, Vec<PageItem>)>,
    /// Set when more may follow: pass it as `after` for the next page.
    pub next: Option<OpRef>,
    /// Rank verdicts looked at, and the last op.
    pub scanned: usize,
    last: Option<OpRef>,
}

/// Counts over the store ([`VerdictStore::tally`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoreTally {
    pub by_outcome: BTreeMap<String, u64>,
    pub hung_ops: u64,
    pub ops_scanned: u64,
    /// Every op was looked at (false: the scan budget ended it).
    pub complete: bool,
}

/// An op's verdicts, in rank order.
fn op_items(op: OpRef, e: &Entry) -> Vec<PageItem> {
    match e {
        Entry::Full(m) => m.values().map(|s| PageItem { stored: s.clone(), compacted: false }).collect(),
        Entry::Completed { .. } => expand(op, e).collect(),
    }
}

/// Estimated bytes of a B-tree entry beyond its key and value (node slack, pointers).
const TREE_ENTRY_OVERHEAD: u64 = 24;

fn stored_bytes(s: &Stored) -> u64 {
    let v = &s.verdict;
    let tags: usize = v
        .tags
        .iter()
        .map(|t| match t {
            VerdictTag::TelemetryLoss { ids } => ids.len().saturating_mul(8),
            VerdictTag::Mismatch { field } => field.len(),
            _ => 0,
        })
        .fold(v.tags.len().saturating_mul(size_of::<VerdictTag>()), usize::saturating_add);
    let e = &v.evidence;
    let evidence = [
        e.frames.len().saturating_mul(size_of::<crate::verdict::FrameRef>()),
        e.loss_intervals.len().saturating_mul(8),
        e.watermarks.len().saturating_mul(size_of::<(NodeId, i64)>()),
        e.progress.len().saturating_mul(size_of::<crate::verdict::ProgressRef>()),
    ]
    .into_iter()
    .fold(tags, usize::saturating_add);
    u64::try_from(size_of::<(u32, Stored)>().saturating_add(evidence))
        .unwrap_or(u64::MAX)
        .saturating_add(TREE_ENTRY_OVERHEAD)
}

fn entry_bytes(e: &Entry) -> u64 {
    let base =
        u64::try_from(size_of::<(OpRef, OpEntry)>().saturating_add(size_of::<(u64, OpRef)>())).unwrap_or(u64::MAX);
    let body = match e {
        Entry::Full(m) => m.values().map(stored_bytes).fold(0u64, u64::saturating_add),
        Entry::Completed { ranks, .. } => {
            u64::try_from(ranks.len().saturating_mul(size_of::<CompactRank>())).unwrap_or(u64::MAX)
        }
    };
    base.saturating_add(TREE_ENTRY_OVERHEAD.saturating_mul(2)).saturating_add(body)
}

/// The verdict store. See the module docs.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct VerdictStore {
    config: StoreConfig,
    ops: BTreeMap<OpRef, OpEntry>,
    /// (last update, op): the ageing and eviction order.
    by_age: BTreeSet<(u64, OpRef)>,
    bytes: u64,
    /// Rank verdicts held, and how many of them are final.
    held: u64,
    finals: u64,
    stats: StoreStats,
    #[rkyv(with = rkyv::with::Skip)]
    pressure: PressureShed,
}

impl VerdictStore {
    /// An empty store.
    #[must_use]
    pub fn new(config: StoreConfig) -> Self {
        Self {
            config,
            ops: BTreeMap::new(),
            by_age: BTreeSet::new(),
            bytes: 0,
            held: 0,
            finals: 0,
            stats: StoreStats::default(),
            pressure: PressureShed::default(),
        }
    }

    /// Memory pressure on (`true`: both limits a quarter of the configured ones, applied
    /// at once) or off.
    pub fn set_pressure(&mut self, on: bool, now: u64) {
        self.pressure.on = on;
        self.expire(now);
    }

    /// What memory pressure shed.
    #[must_use]
    pub fn pressure(&self) -> PressureShed {
        self.pressure
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &StoreStats {
        &self.stats
    }

    /// The limits.
    #[must_use]
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Replaces the limits (configuration, not state: a restored store takes the running
    /// service's); applied at the next [`Self::expire`].
    pub fn set_config(&mut self, config: StoreConfig) {
        self.config = config;
    }

    /// Rank verdicts held.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.held
    }

    /// Final rank verdicts held.
    #[must_use]
    pub fn finals(&self) -> u64 {
        self.finals
    }

    /// Whether nothing is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// Ops held.
    #[must_use]
    pub fn ops(&self) -> usize {
        self.ops.len()
    }

    /// Estimated bytes held (entries and their heap parts, with B-tree overhead).
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its sizes against its caps (see [`crate::bounds`]); the cap of `store.bytes` is
    /// `max_bytes`, and the op count follows from it.
    #[must_use]
    pub fn map_sizes(&self) -> Vec<crate::MapSize> {
        let min_op = usize::try_from(entry_bytes(&Entry::Full(BTreeMap::new()))).unwrap_or(1).max(1);
        let max_bytes = usize::try_from(self.config.max_bytes).unwrap_or(usize::MAX);
        vec![
            crate::MapSize::new("store.bytes", usize::try_from(self.bytes).unwrap_or(usize::MAX), max_bytes),
            crate::MapSize::new("store.ops", self.ops.len(), max_bytes.checked_div(min_op).unwrap_or(max_bytes)),
        ]
    }

    /// Applies a batch of the core's events at `now`, then compacts the ops they touched
    /// and enforces the limits.
    pub fn apply(&mut self, now: u64, events: impl IntoIterator<Item = MatcherEvent>) {
        let mut touched: Vec<OpRef> = Vec::new();
        for e in events {
            match e {
                MatcherEvent::Verdict(v) => {
                    let op = v.op;
                    self.put(now, v);
                    if touched.last() != Some(&op) {
                        touched.push(op);
                    }
                }
                MatcherEvent::Recovered { op, rank, .. } => self.recover(now, op, rank),
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for op in touched {
            self.compact(op);
        }
        self.expire(now);
    }

    /// Forgets ops past the retention, then the least recently updated while over
    /// `max_bytes`.
    pub fn expire(&mut self, now: u64) {
        let div = if self.pressure.on { PRESSURE_DIVISOR } else { 1 };
        let quarter = |x: u64| x.checked_div(div).unwrap_or(x);
        let (retention, max_bytes) = (quarter(self.config.retention_ns), quarter(self.config.max_bytes));
        let cutoff = now.saturating_sub(self.config.retention_ns);
        let pressure_cutoff = now.saturating_sub(retention);
        while let Some(&(t, op)) = self.by_age.first() {
            let aged = now >= self.config.retention_ns && t < cutoff;
            let configured_keeps = !aged && self.bytes <= self.config.max_bytes;
            if configured_keeps && !(now >= retention && t < pressure_cutoff) && self.bytes <= max_bytes {
                break;
            }
            let n = self.remove(op);
            if configured_keeps {
                self.pressure.ops = self.pressure.ops.saturating_add(1);
                self.pressure.verdicts = self.pressure.verdicts.saturating_add(n);
            } else if aged {
                self.stats.ops_aged_out.inc();
                self.stats.verdicts_aged_out = self.stats.verdicts_aged_out.saturating_add(n);
            } else {
                self.stats.ops_evicted_bytes.inc();
                self.stats.verdicts_evicted_bytes = self.stats.verdicts_evicted_bytes.saturating_add(n);
            }
        }
    }

    /// One rank's verdict, if held.
    #[must_use]
    pub fn get(&self, op: OpRef, rank: u32) -> Option<PageItem> {
        match &self.ops.get(&op)?.entry {
            Entry::Full(m) => m.get(&rank).map(|s| PageItem { stored: s.clone(), compacted: false }),
            e @ Entry::Completed { .. } => expand(op, e).find(|i| i.stored.verdict.rank == rank),
        }
    }

    /// Up to `limit` verdicts after `after` (from the start without one) that `keep`
    /// accepts, looking at no more than `max_scan` of them; owned, so the caller can
    /// release its lock before using them.
    pub fn page(
        &self,
        after: Option<Cursor>,
        limit: usize,
        max_scan: usize,
        mut keep: impl FnMut(&Stored) -> bool,
    ) -> Page {
        let mut page = Page::default();
        let (first_op, resume) = match after {
            Some(c) => (Bound::Included(c.op), Some(c)),
            None => (Bound::Unbounded, None),
        };
        let mut last: Option<Cursor> = None;
        for (op, e) in self.ops.range((first_op, Bound::Unbounded)) {
            let from = match resume {
                Some(c) if c.op == *op => Bound::Excluded(c.rank),
                _ => Bound::Unbounded,
            };
            let mut visit = |rank: u32, stored: &Stored, compacted: bool, page: &mut Page| -> bool {
                if page.items.len() >= limit || page.scanned >= max_scan {
                    // Resume after the last one looked at.
                    page.next = last;
                    return false;
                }
                page.scanned = page.scanned.saturating_add(1);
                last = Some(Cursor { op: *op, rank });
                if keep(stored) {
                    page.items.push(PageItem { stored: stored.clone(), compacted });
                }
                true
            };
            match &e.entry {
                Entry::Full(m) => {
                    for (rank, stored) in m.range((from, Bound::Unbounded)) {
                        if !visit(*rank, stored, false, &mut page) {
                            return page;
                        }
                    }
                }
                Entry::Completed { .. } => {
                    for item in expand(*op, &e.entry) {
                        let rank = item.stored.verdict.rank;
                        let after_from = match from {
                            Bound::Excluded(r) => rank > r,
                            _ => true,
                        };
                        if after_from && !visit(rank, &item.stored, true, &mut page) {
                            return page;
                        }
                    }
                }
            }
        }
        page
    }

    /// One op's held verdicts, in rank order (`None`: not held).
    #[must_use]
    pub fn op(&self, op: OpRef) -> Option<Vec<PageItem>> {
        Some(op_items(op, &self.ops.get(&op)?.entry))
    }

    /// Up to `limit` ops after `after` (from the first without one) whose verdicts `keep`
    /// accepts, looking at no more than `max_scan` rank verdicts (whole ops: at least
    /// one); owned.
    pub fn page_ops(
        &self,
        after: Option<OpRef>,
        limit: usize,
        max_scan: usize,
        mut keep: impl FnMut(&OpRef, &[PageItem]) -> bool,
    ) -> OpPage {
        let mut page = OpPage::default();
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        for (op, e) in self.ops.range((from, Bound::Unbounded)) {
            if page.ops.len() >= limit || page.scanned >= max_scan {
                page.next = page.last;
                return page;
            }
            page.last = Some(*op);
            let items = op_items(*op, &e.entry);
            page.scanned = page.scanned.saturating_add(items.len().max(1));
            if keep(op, &items) {
                page.ops.push((*op, items));
            }
        }
        page
    }

    /// Rank verdicts by outcome kind (the outcome's name up to `(`), and ops with a
    /// final unfinished verdict (`stuck`, `waiting_on`, `blocked_by`, `not_joined`) whose
    /// rank has not recovered: at most `max_scan` rank verdicts looked at (a compacted
    /// op counts one).
    #[must_use]
    pub fn tally(&self, max_scan: usize) -> StoreTally {
        let mut t = StoreTally { complete: true, ..StoreTally::default() };
        let mut scanned = 0usize;
        for e in self.ops.values() {
            if scanned >= max_scan {
                t.complete = false;
                break;
            }
            scanned = scanned.saturating_add(match &e.entry {
                Entry::Full(m) => m.len().max(1),
                Entry::Completed { .. } => 1,
            });
            t.ops_scanned = t.ops_scanned.saturating_add(1);
            match &e.entry {
                Entry::Completed { ranks, .. } => {
                    let n = u64::try_from(ranks.len()).unwrap_or(u64::MAX);
                    let c = t.by_outcome.entry("completed".to_owned()).or_default();
                    *c = c.saturating_add(n);
                }
                Entry::Full(m) => {
                    let mut hung = false;
                    for s in m.values() {
                        let name = s.verdict.outcome.name();
                        let kind = name.split('(').next().unwrap_or_default().to_owned();
                        let c = t.by_outcome.entry(kind).or_default();
                        *c = c.saturating_add(1);
                        hung |= s.verdict.is_final
                            && s.recovered_at_ns.is_none()
                            && matches!(
                                s.verdict.outcome,
                                Outcome::Stuck | Outcome::WaitingOn(_) | Outcome::BlockedBy(_) | Outcome::NotJoined
                            );
                    }
                    t.hung_ops = t.hung_ops.saturating_add(u64::from(hung));
                }
            }
        }
        t
    }

    // ---------------------------------------------------------------- internals

    fn touch(&mut self, now: u64, op: OpRef) {
        if let Some(e) = self.ops.get_mut(&op) {
            self.by_age.remove(&(e.touched_ns, op));
            e.touched_ns = now;
            self.by_age.insert((now, op));
        }
    }

    fn put(&mut self, now: u64, v: Verdict) {
        self.stats.verdicts.inc();
        let op = v.op;
        let e = self.ops.entry(op).or_insert_with(|| OpEntry {
            touched_ns: now,
            bytes: 0,
            entry: Entry::Full(BTreeMap::new()),
        });
        if e.bytes == 0 {
            self.by_age.insert((now, op));
        }
        // A compacted op that gets another verdict is expanded again (none is expected:
        // a final op takes no more frames; this keeps the store right if one comes).
        if let Entry::Completed { .. } = e.entry {
            e.entry = Entry::Full(expand(op, &e.entry).map(|i| (i.stored.verdict.rank, i.stored)).collect());
        }
        let Entry::Full(ranks) = &mut e.entry else { return };
        let rank = v.rank;
        let old = ranks.remove(&rank);
        let final_at_ns = old.as_ref().and_then(|s| s.final_at_ns).or(v.is_final.then_some(now));
        let recovered_at_ns = old.as_ref().and_then(|s| s.recovered_at_ns);
        if old.is_none() {
            self.held.inc();
        }
        if old.as_ref().is_some_and(|o| o.verdict.is_final) {
            self.finals = self.finals.saturating_sub(1);
        }
        if v.is_final {
            self.finals.inc();
        }
        ranks.insert(rank, Stored { verdict: v, final_at_ns, recovered_at_ns });
        let before = e.bytes;
        e.bytes = entry_bytes(&e.entry);
        self.bytes = self.bytes.saturating_sub(before).saturating_add(e.bytes);
        self.touch(now, op);
    }

    fn recover(&mut self, now: u64, op: OpRef, rank: u32) {
        let held = self.ops.get_mut(&op).and_then(|e| match &mut e.entry {
            Entry::Full(ranks) => ranks.get_mut(&rank),
            Entry::Completed { .. } => None,
        });
        match held {
            Some(s) => {
                s.recovered_at_ns.get_or_insert(now);
                self.stats.recoveries.inc();
            }
            None => self.stats.recoveries_unheld.inc(),
        }
    }

    /// Compacts `op` if every verdict it holds is final `completed`, untagged.
    fn compact(&mut self, op: OpRef) {
        let Some(e) = self.ops.get_mut(&op) else { return };
        let Entry::Full(ranks) = &e.entry else { return };
        let plain = |s: &Stored| {
            s.verdict.is_final
                && s.verdict.outcome == Outcome::Completed
                && s.verdict.tags.is_empty()
                && s.recovered_at_ns.is_none()
        };
        if ranks.is_empty() || !ranks.values().all(plain) {
            return;
        }
        let decided_at_ns = ranks.values().map(|s| s.verdict.decided_at_ns).max().unwrap_or(0);
        let final_at_ns = ranks.values().filter_map(|s| s.final_at_ns).max().unwrap_or(0);
        let revision = ranks.values().map(|s| s.verdict.revision).max().unwrap_or(0);
        let compact: Vec<CompactRank> = ranks
            .values()
            .map(|s| CompactRank { rank: s.verdict.rank, node: s.verdict.node, gpu_uuid: s.verdict.gpu_uuid })
            .collect();
        e.entry = Entry::Completed { ranks: compact, decided_at_ns, final_at_ns, revision };
        let before = e.bytes;
        e.bytes = entry_bytes(&e.entry);
        self.bytes = self.bytes.saturating_sub(before).saturating_add(e.bytes);
        self.stats.ops_compacted.inc();
    }

    /// Forgets `op`; returns how many rank verdicts it held.
    fn remove(&mut self, op: OpRef) -> u64 {
        let Some(e) = self.ops.remove(&op) else { return 0 };
        self.by_age.remove(&(e.touched_ns, op));
        self.bytes = self.bytes.saturating_sub(e.bytes);
        let (n, finals) = match &e.entry {
            Entry::Full(m) => (m.len(), m.values().filter(|s| s.verdict.is_final).count()),
            Entry::Completed { ranks, .. } => (ranks.len(), ranks.len()),
        };
        let (n, finals) = (u64::try_from(n).unwrap_or(u64::MAX), u64::try_from(finals).unwrap_or(u64::MAX));
        self.held = self.held.saturating_sub(n);
        self.finals = self.finals.saturating_sub(finals);
        n
    }
}

/// A compacted op's verdicts, rebuilt.
fn expand(op: OpRef, e: &Entry) -> Box<dyn Iterator<Item = PageItem> + '_> {
    let Entry::Completed { ranks, decided_at_ns, final_at_ns, revision } = e else {
        return Box::new(std::iter::empty());
    };
    Box::new(ranks.iter().map(move |r| PageItem {
        stored: Stored {
            verdict: Verdict {
                op,
                rank: r.rank,
                node: r.node,
                gpu_uuid: r.gpu_uuid,
                outcome: Outcome::Completed,
                tags: Vec::new(),
                is_final: true,
                decided_at_ns: *decided_at_ns,
                evidence: Evidence { rule: Rule::CompletionFrame, ..Evidence::default() },
                revision: *revision,
            },
            final_at_ns: Some(*final_at_ns),
            recovered_at_ns: None,
        },
        compacted: true,
    }))
}

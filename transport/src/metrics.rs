//! `/metrics` for both binaries: each binary lists every metric it serves once, in a
//! table of [`Spec`]s (name, type, unit, labels, help); a scrape fills a [`Families`]
//! from the counters the binary already keeps and renders the classic Prometheus text
//! format (version 0.0.4) with the `prometheus` crate's encoder. Nothing here is on a
//! per-frame path: values are read when scraped.
//!
//! The text format, not OpenMetrics: Debian's `promtool check metrics` (2.42) parses the
//! classic format only — an OpenMetrics counter (`# TYPE x counter` over `x_total`
//! samples) fails its lint with "no help text", and its `info` type does not parse.
//!
//! A name outside the table is not served (and fails the binaries' tests); a family in
//! the table with no sample is left out of the output, as Prometheus clients do.

use prometheus::proto::{Bucket, LabelPair, Metric, MetricFamily, MetricType};
use std::collections::BTreeMap;

/// A metric's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    /// As the text format names it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric: defined once per binary, in its table.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub name: &'static str,
    pub kind: Kind,
    /// The base unit (`seconds`, `bytes`, `frames`, `ratio`, `1` for a plain count or a
    /// state set); a counter's name ends in `_total`, a unit's suffix comes before it.
    pub unit: &'static str,
    /// The label names, in order.
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

impl Spec {
    /// A counter (its name ends in `_total`).
    #[must_use]
    pub const fn counter(
        name: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Self {
        Spec { name, kind: Kind::Counter, unit, labels, help }
    }

    /// A gauge.
    #[must_use]
    pub const fn gauge(
        name: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Self {
        Spec { kind: Kind::Gauge, ..Self::counter(name, unit, labels, help) }
    }

    /// A histogram.
    #[must_use]
    pub const fn histogram(
        name: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Self {
        Spec { kind: Kind::Histogram, ..Self::counter(name, unit, labels, help) }
    }
}

/// `ringwatch_build_info{binary, version}` 1: served by both binaries (in [`STANDARD`]).
pub const BUILD_INFO: Spec = Spec {
    name: "ringwatch_build_info",
    kind: Kind::Gauge,
    unit: "1",
    labels: &["binary", "version"],
    help: "Always 1; the labels name the binary and its version.",
};

/// The process collector's metrics (procfs), served by both binaries (in [`STANDARD`]).
pub const PROCESS: [Spec; 7] = [
    Spec {
        name: "process_cpu_seconds_total",
        kind: Kind::Counter,
        unit: "seconds",
        labels: &[],
        help: "Total user and system CPU time spent in seconds.",
    },
    Spec {
        name: "process_open_fds",
        kind: Kind::Gauge,
        unit: "1",
        labels: &[],
        help: "Number of open file descriptors.",
    },
    Spec {
        name: "process_max_fds",
        kind: Kind::Gauge,
        unit: "1",
        labels: &[],
        help: "Maximum number of open file descriptors.",
    },
    Spec {
        name: "process_virtual_memory_bytes",
        kind: Kind::Gauge,
        unit: "bytes",
        labels: &[],
        help: "Virtual memory size in bytes.",
    },
    Spec {
        name: "process_resident_memory_bytes",
        kind: Kind::Gauge,
        unit: "bytes",
        labels: &[],
        help: "Resident memory size in bytes.",
    },
    Spec {
        name: "process_start_time_seconds",
        kind: Kind::Gauge,
        unit: "seconds",
        labels: &[],
        help: "Start time of the process since unix epoch in seconds.",
    },
    Spec {
        name: "process_threads",
        kind: Kind::Gauge,
        unit: "1",
        labels: &[],
        help: "Number of OS threads in the process.",
    },
];

/// What both binaries serve besides their own tables: [`BUILD_INFO`] and [`PROCESS`]
/// (filled by [`Families::standard`]).
pub const STANDARD: [Spec; 8] =
    [BUILD_INFO, PROCESS[0], PROCESS[1], PROCESS[2], PROCESS[3], PROCESS[4], PROCESS[5], PROCESS[6]];

/// The families of one scrape, checked against a binary's table and [`STANDARD`].
#[derive(Debug)]
pub struct Families {
    specs: &'static [Spec],
    fams: BTreeMap<&'static str, MetricFamily>,
    /// Samples refused: a name outside the table, a label count that does not match, or
    /// a kind that differs (a programming error, caught by the binaries' tests).
    refused: Vec<String>,
}

impl Families {
    #[must_use]
    pub fn new(specs: &'static [Spec]) -> Self {
        Families { specs, fams: BTreeMap::new(), refused: Vec::new() }
    }

    fn family(&mut self, name: &str, kind: Kind, labels: &[&str]) -> Option<&mut MetricFamily> {
        let Some(spec) = self.specs.iter().chain(&STANDARD).find(|s| s.name == name) else {
            self.refused.push(format!("{name}: not in the table"));
            return None;
        };
        if spec.kind != kind || spec.labels.len() != labels.len() {
            self.refused.push(format!(
                "{name}: {} with {} labels, the table says {:?}",
                kind.name(),
                labels.len(),
                spec
            ));
            return None;
        }
        Some(self.fams.entry(spec.name).or_insert_with(|| {
            let mut f = MetricFamily::default();
            f.set_name(spec.name.to_owned());
            f.set_help(spec.help.to_owned());
            f.set_field_type(match spec.kind {
                Kind::Counter => MetricType::COUNTER,
                Kind::Gauge => MetricType::GAUGE,
                Kind::Histogram => MetricType::HISTOGRAM,
            });
            f
        }))
    }

    fn metric(spec_labels: &[&str], values: &[&str]) -> Metric {
        let mut m = Metric::default();
        m.set_label(
            spec_labels
                .iter()
                .zip(values)
                .map(|(k, v)| {
                    let mut l = LabelPair::default();
                    l.set_name((*k).to_owned());
                    l.set_value((*v).to_owned());
                    l
                })
                .collect(),
        );
        m
    }

    fn labels_of(&self, name: &str) -> &'static [&'static str] {
        self.specs.iter().chain(&STANDARD).find(|s| s.name == name).map_or(&[], |s| s.labels)
    }

    /// A counter's value now (`labels` in the table's order).
    pub fn counter(&mut self, name: &str, labels: &[&str], value: f64) {
        let names = self.labels_of(name);
        if let Some(f) = self.family(name, Kind::Counter, labels) {
            let mut m = Self::metric(names, labels);
            let mut c = prometheus::proto::Counter::default();
            c.set_value(value);
            m.set_counter(c);
            f.mut_metric().push(m);
        }
    }

    /// A counter from an integer count (exact below 2⁵³, as every float sample is).
    #[allow(clippy::cast_precision_loss, reason = "the text format carries float samples")]
    pub fn count(&mut self, name: &str, labels: &[&str], value: u64) {
        self.counter(name, labels, value as f64);
    }

    /// A gauge's value now.
    pub fn gauge(&mut self, name: &str, labels: &[&str], value: f64) {
        let names = self.labels_of(name);
        if let Some(f) = self.family(name, Kind::Gauge, labels) {
            let mut m = Self::metric(names, labels);
            let mut g = prometheus::proto::Gauge::default();
            g.set_value(value);
            m.set_gauge(g);
            f.mut_metric().push(m);
        }
    }

    /// A gauge from an integer.
    #[allow(clippy::cast_precision_loss, reason = "the text format carries float samples")]
    pub fn level(&mut self, name: &str, labels: &[&str], value: u64) {
        self.gauge(name, labels, value as f64);
    }

    /// A histogram: `buckets` as (upper bound, cumulative count), ascending, without
    /// `+Inf` (the encoder adds it from `count`).
    pub fn histogram(&mut self, name: &str, labels: &[&str], buckets: &[(f64, u64)], sum: f64, count: u64) {
        let names = self.labels_of(name);
        if let Some(f) = self.family(name, Kind::Histogram, labels) {
            let mut m = Self::metric(names, labels);
            let mut h = prometheus::proto::Histogram::default();
            h.set_sample_count(count);
            h.set_sample_sum(sum);
            h.set_bucket(
                buckets
                    .iter()
                    .map(|&(le, n)| {
                        let mut b = Bucket::default();
                        b.set_upper_bound(le);
                        b.set_cumulative_count(n);
                        b
                    })
                    .collect(),
            );
            m.set_histogram(h);
            f.mut_metric().push(m);
        }
    }

    /// A histogram from [`Buckets`].
    pub fn buckets(&mut self, name: &str, labels: &[&str], b: &Buckets) {
        self.histogram(name, labels, &b.cumulative(), b.sum, b.count);
    }

    /// A histogram from an hdrhistogram of integers in `1 / per_unit` of the metric's
    /// unit (microseconds of a `_seconds` metric: `per_unit` 1e6), at `bounds` (in the
    /// metric's unit). Bucket edges are as exact as the hdrhistogram's precision.
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "bounds and counts far inside f64's exact range"
    )]
    pub fn hdr(
        &mut self,
        name: &str,
        labels: &[&str],
        h: &hdrhistogram::Histogram<u64>,
        per_unit: f64,
        bounds: &[f64],
    ) {
        let buckets: Vec<(f64, u64)> =
            bounds.iter().map(|&le| (le, h.count_between(0, (le * per_unit).max(0.0) as u64))).collect();
        let sum = h.mean() * h.len() as f64 / per_unit;
        self.histogram(name, labels, &buckets, sum, h.len());
    }

    /// Families gathered by a `prometheus` collector (the process collector, a
    /// histogram the binary observes itself): each must be in the table, with its kind.
    pub fn extend(&mut self, gathered: Vec<MetricFamily>) {
        for g in gathered {
            let kind = match g.get_field_type() {
                MetricType::COUNTER => Kind::Counter,
                MetricType::GAUGE => Kind::Gauge,
                MetricType::HISTOGRAM => Kind::Histogram,
                other => {
                    self.refused.push(format!("{}: type {other:?} is not used here", g.name()));
                    continue;
                }
            };
            let n_labels = g.get_metric().first().map_or(0, |m| m.get_label().len());
            let labels = vec![""; n_labels];
            let name = g.name().to_owned();
            if let Some(f) = self.family(&name, kind, &labels) {
                f.mut_metric().extend(g.get_metric().iter().cloned());
            }
        }
    }

    /// `ringwatch_build_info` and the process collector's families.
    pub fn standard(&mut self, binary: &str, version: &str) {
        self.gauge(BUILD_INFO.name, &[binary, version], 1.0);
        #[cfg(target_os = "linux")]
        {
            use prometheus::core::Collector as _;
            self.extend(prometheus::process_collector::ProcessCollector::for_self().collect());
        }
    }

    /// What was refused (empty when every sample matched the table).
    #[must_use]
    pub fn refused(&self) -> &[String] {
        &self.refused
    }

    /// The names with at least one sample.
    #[must_use]
    pub fn names(&self) -> Vec<&'static str> {
        self.fams.keys().copied().collect()
    }

    /// The text format.
    #[must_use]
    pub fn render(self) -> String {
        use prometheus::Encoder as _;
        let fams: Vec<MetricFamily> = self.fams.into_values().collect();
        let mut out = Vec::new();
        // The encoder fails only on a family without samples or a writer error; neither
        // happens here (families are made with their first sample, a Vec never fails).
        if let Err(e) = prometheus::TextEncoder::new().encode(&fams, &mut out) {
            return format!("# encoding failed: {e}\n");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// A fixed-bound histogram a hot loop can observe into cheaply (a scan of a dozen
/// bounds, no allocation) and a scrape can copy: what the shipper's ring reader keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Buckets {
    /// Upper bounds, ascending (`+Inf` implied).
    pub bounds: &'static [f64],
    /// Observations per bound (not cumulative); one more for above the last bound.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Buckets {
    #[must_use]
    pub fn new(bounds: &'static [f64]) -> Self {
        Buckets { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    /// One observation.
    #[inline]
    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.iter().position(|&le| v <= le).unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// (upper bound, cumulative count), ascending, without `+Inf`.
    #[must_use]
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut n = 0;
        self.bounds
            .iter()
            .zip(&self.counts)
            .map(|(&le, &c)| {
                n += c;
                (le, n)
            })
            .collect()
    }
}

/// The content type of [`Families::render`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A markdown table of `specs` (docs/metrics.md holds one per binary; a test checks it).
#[must_use]
pub fn markdown(specs: &[Spec]) -> String {
    let mut s = String::from("| name | type | unit | labels | meaning |\n| --- | --- | --- | --- | --- |\n");
    for m in specs {
        let labels = if m.labels.is_empty() { "—".to_owned() } else { m.labels.join(", ") };
        s.push_str(&format!("| `{}` | {} | {} | {} | {} |\n", m.name, m.kind.name(), m.unit, labels, m.help));
    }
    s
}

/// A table's own problems: a name twice, a counter without `_total`, a non-counter with
/// it, a unit whose suffix the name lacks (Prometheus' naming rules, which
/// `promtool check metrics` lints).
#[must_use]
pub fn problems(specs: &[Spec]) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for m in specs {
        if !seen.insert(m.name) {
            out.push(format!("{}: defined twice", m.name));
        }
        let base = m.name.strip_suffix("_total");
        match (m.kind, base) {
            (Kind::Counter, None) => out.push(format!("{}: a counter's name ends in _total", m.name)),
            (Kind::Gauge | Kind::Histogram, Some(_)) => out.push(format!("{}: only counters end in _total", m.name)),
            _ => {}
        }
        let base = base.unwrap_or(m.name);
        if matches!(m.unit, "seconds" | "bytes" | "ratio") && !base.ends_with(&format!("_{}", m.unit)) {
            out.push(format!("{}: unit {} but the name does not end in _{}", m.name, m.unit, m.unit));
        }
        if !m.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            out.push(format!("{}: not snake case", m.name));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[Spec] = &[
        Spec { name: "t_frames_total", kind: Kind::Counter, unit: "frames", labels: &["node"], help: "Frames." },
        Spec { name: "t_fill_ratio", kind: Kind::Gauge, unit: "ratio", labels: &[], help: "Fill." },
        Spec { name: "t_lag_seconds", kind: Kind::Histogram, unit: "seconds", labels: &[], help: "Lag." },
    ];

    #[test]
    fn samples_render_in_the_text_format_and_strays_are_refused() {
        let mut f = Families::new(SPECS);
        f.count("t_frames_total", &["a\"b"], 5);
        f.gauge("t_fill_ratio", &[], 0.5);
        f.histogram("t_lag_seconds", &[], &[(0.1, 1), (1.0, 3)], 1.5, 4);
        f.count("t_unknown_total", &[], 1);
        f.count("t_frames_total", &[], 1);
        f.gauge("t_frames_total", &["x"], 1.0);
        assert_eq!(f.refused().len(), 3, "{:?}", f.refused());
        assert_eq!(f.names(), vec!["t_fill_ratio", "t_frames_total", "t_lag_seconds"]);
        let text = f.render();
        assert!(text.contains("# TYPE t_frames_total counter\nt_frames_total{node=\"a\\\"b\"} 5\n"), "{text}");
        assert!(text.contains("t_lag_seconds_bucket{le=\"+Inf\"} 4\n"), "{text}");
        assert!(text.contains("t_lag_seconds_bucket{le=\"0.1\"} 1\n"), "{text}");
    }

    #[test]
    fn buckets_and_hdr_histograms_render_cumulative_counts() {
        let mut b = Buckets::new(&[0.1, 0.5, 1.0]);
        for v in [0.05, 0.1, 0.3, 0.7, 2.0] {
            b.observe(v);
        }
        assert_eq!(b.cumulative(), vec![(0.1, 2), (0.5, 3), (1.0, 4)]);
        assert_eq!(b.count, 5);
        assert!((b.sum - 3.15).abs() < 1e-9);
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 2).unwrap();
        for us in [50, 100, 300_000, 2_000_000] {
            h.record(us).unwrap();
        }
        let mut f = Families::new(SPECS);
        f.hdr("t_lag_seconds", &[], &h, 1e6, &[0.0001, 0.5, 1.0]);
        assert_eq!(f.refused(), &[] as &[String]);
        let mut g = Families::new(SPECS);
        g.buckets("t_lag_seconds", &[], &b);
        assert!(g.render().contains("t_lag_seconds_bucket{le=\"1\"} 4\nt_lag_seconds_bucket{le=\"+Inf\"} 5\n"));
        let text = f.render();
        assert!(text.contains("t_lag_seconds_bucket{le=\"0.0001\"} 2\n"), "{text}");
        assert!(text.contains("t_lag_seconds_bucket{le=\"0.5\"} 3\n"), "{text}");
        assert!(text.contains("t_lag_seconds_bucket{le=\"+Inf\"} 4\n"), "{text}");
        assert!(text.contains("t_lag_seconds_count 4\n"), "{text}");
    }

    #[test]
    fn naming_rules_are_checked() {
        assert_eq!(problems(SPECS), Vec::<String>::new());
        let bad: &[Spec] = &[
            Spec { name: "x_frames", kind: Kind::Counter, unit: "frames", labels: &[], help: "" },
            Spec { name: "x_lag_total", kind: Kind::Gauge, unit: "seconds", labels: &[], help: "" },
            Spec { name: "x_frames", kind: Kind::Counter, unit: "frames", labels: &[], help: "" },
        ];
        let p = problems(bad);
        assert_eq!(p.len(), 5, "{p:?}");
        assert_eq!(problems(&STANDARD), Vec::<String>::new());
    }

    #[test]
    fn the_process_collector_fits_its_table() {
        let mut f = Families::new(&[]);
        f.extend({
            use prometheus::core::Collector as _;
            prometheus::process_collector::ProcessCollector::for_self().collect()
        });
        assert_eq!(f.refused(), &[] as &[String]);
        assert!(f.names().contains(&"process_resident_memory_bytes"));
    }
}

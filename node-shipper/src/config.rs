//! The shipper's configuration: flags, environment and a TOML file, validated into one
//! type, with every problem reported at once.
//!
//! Precedence, highest first: command-line flag, environment variable
//! (`RINGWATCH_SHIPPER_<FIELD>`, upper case), TOML file (`--config`), built-in default.
//! Each layer is read as text per field and parsed once, here, so a bad value in any layer
//! is reported with the layer it came from; unknown TOML keys are errors too (a typo must
//! not silently fall back to a default).
//!
//! Pure: callers hand in the file's text and the environment; nothing here reads either.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::core::batcher::BatcherConfig;
use crate::core::spool::SpoolConfig;

/// Where a value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Layer {
    Default,
    File,
    Env,
    Flag,
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Default => "default",
            Self::File => "config file",
            Self::Env => "environment",
            Self::Flag => "command line",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    /// Text that may be empty (an optional value).
    OptText,
    Addr,
    Int {
        min: u64,
        max: u64,
    },
}

/// Every field: name (TOML key; flag `--name-with-dashes`; env upper case), kind, default,
/// help.
const FIELDS: &[(&str, Kind, Option<&str>, &str)] = &[
    ("aggregator", Kind::Addr, None, "aggregator address, host:port (IP literal)"),
    ("server_name", Kind::Text, Some("aggregator"), "name in the aggregator's certificate"),
    ("node_name", Kind::Text, None, "this node's name; must equal its client certificate's DNS SAN"),
    ("ca", Kind::Text, None, "CA certificate (PEM) that signed the aggregator's certificate"),
    ("cert", Kind::Text, None, "this node's client certificate (PEM)"),
    ("key", Kind::Text, None, "this node's private key (PEM)"),
    ("source", Kind::Text, None, "frame source: bpf (the eBPF rings), capture:PATH or sim:SCENARIO"),
    ("source_node", Kind::Int { min: 0, max: 1 << 20 }, Some("0"), "which node of the capture or scenario to ship"),
    (
        "sim_bulk_scale_ppm",
        Kind::Int { min: 1, max: 1_000_000 },
        Some("1000"),
        "sim source: bulk rate, ppm of link rate",
    ),
    ("sim_seed", Kind::Int { min: 0, max: u64::MAX }, Some("0"), "sim source: seed (0 = the scenario's own)"),
    (
        "replay_speed_pct",
        Kind::Int { min: 0, max: 100_000 },
        Some("100"),
        "capture source: pace, % of real time (0 = unpaced)",
    ),
    ("max_batch_bytes", Kind::Int { min: 4096, max: 1 << 20 }, Some("65536"), "payload bytes per P0/P1 batch"),
    (
        "bulk_batch_bytes",
        Kind::Int { min: 4096, max: 1 << 20 },
        Some("262144"),
        "payload bytes per bulk (P2/P3) batch (at least max_batch_bytes)",
    ),
    ("flush_interval_ms", Kind::Int { min: 1, max: 10_000 }, Some("5"), "longest a batch stays open"),
    ("spool_bytes", Kind::Int { min: 1 << 20, max: 1 << 40 }, Some("268435456"), "spool cap"),
    ("p0_reserve_bytes", Kind::Int { min: 0, max: 1 << 40 }, Some("8388608"), "spool room only P0 may use"),
    ("p1_reserve_bytes", Kind::Int { min: 0, max: 1 << 40 }, Some("8388608"), "spool room only P1 may use"),
    ("heartbeat_interval_ms", Kind::Int { min: 10, max: 60_000 }, Some("1000"), "heartbeat period"),
    ("shutdown_deadline_ms", Kind::Int { min: 0, max: 600_000 }, Some("5000"), "SIGTERM flush deadline"),
    ("log_format", Kind::Text, Some("text"), "logs on stderr: text or json"),
    (
        "bpf_pin_dir",
        Kind::Text,
        Some("/sys/fs/bpf/ringwatch"),
        "bpf source: bpffs directory of the pinned rings, counters and programs (one per shipper)",
    ),
    (
        "p0_ring_bytes",
        Kind::Int { min: 4096, max: 1 << 30 },
        Some("1048576"),
        "bpf source: P0 ring size, a power of two (a pinned ring keeps its size)",
    ),
    (
        "bulk_ring_bytes",
        Kind::Int { min: 4096, max: 1 << 31 },
        Some("16777216"),
        "bpf source: bulk ring size, a power of two: peak bytes/s × p99.9 drain gap × 3",
    ),
    (
        "bpf_object",
        Kind::OptText,
        Some(""),
        "bpf source: a compiled ringwatch.bpf.o to load instead of the embedded one",
    ),
    ("kernel_btf", Kind::Text, Some("/sys/kernel/btf/vmlinux"), "bpf source: the kernel's BTF, checked before loading"),
    (
        "ring_drain_interval_us",
        Kind::Int { min: 50, max: 1_000_000 },
        Some("1000"),
        "bpf source: drain period (producers submit without wakeups)",
    ),
    ("reader_cpus", Kind::OptText, Some(""), "CPUs to pin the ring reader thread to, e.g. 2,3 (empty: not pinned)"),
    (
        "xdp_interfaces",
        Kind::OptText,
        Some(""),
        "bpf source: interfaces to attach the bulk XDP program to, comma-separated (links pinned)",
    ),
    (
        "nccl_profiler_shim",
        Kind::OptText,
        Some(""),
        "bpf source: libnccl-profiler-ringwatch.so to put uprobes on (the path NCCL_PROFILER_PLUGIN names)",
    ),
    ("bulk_sampling_level", Kind::Int { min: 0, max: 15 }, Some("0"), "bulk keeps 1 in 2^level events (the floor)"),
    (
        "bulk_sampling_max_level",
        Kind::Int { min: 0, max: 15 },
        Some("8"),
        "spool pressure may raise bulk sampling up to this level",
    ),
];

/// The field names, in documentation order, with their help (for `--help` and docs).
pub fn fields() -> impl Iterator<Item = (&'static str, &'static str)> {
    FIELDS.iter().map(|&(name, _, _, help)| (name, help))
}

/// The environment variable of a field.
#[must_use]
pub fn env_name(field: &str) -> String {
    format!("RINGWATCH_SHIPPER_{}", field.to_ascii_uppercase())
}

/// Where the frames come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A capture file, paced at `speed_pct` % of real time (0: unpaced).
    Capture { path: PathBuf, node: u32, speed_pct: u64 },
    /// A built-in scenario name or a scenario file, one node of it (feature `sim-source`).
    Sim { scenario: String, node: u32, bulk_scale_ppm: u64, seed: Option<u64> },
    /// The eBPF rings.
    Bpf(crate::bpf::BpfConfig),
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShipperConfig {
    pub aggregator: SocketAddr,
    pub server_name: String,
    pub node_name: String,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub source: Source,
    pub batcher: BatcherConfig,
    pub spool: SpoolConfig,
    pub heartbeat_interval_ms: u64,
    pub shutdown_deadline_ms: u64,
    /// JSON log lines (production) instead of text.
    pub log_json: bool,
    /// CPUs the ring reader thread is pinned to (empty: not pinned).
    pub reader_cpus: Vec<usize>,
    /// Bulk sampling: the floor and how far spool pressure may raise it.
    pub sampling: crate::core::SamplingConfig,
}

/// One problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub layer: Layer,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.field, self.layer, self.message)
    }
}

/// Every problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} configuration problem(s):", self.0.len())?;
        for e in &self.0 {
            writeln!(f, "  {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// The raw inputs, one text value per field and layer.
#[derive(Debug, Default, Clone)]
pub struct Inputs {
    values: BTreeMap<&'static str, (Layer, String)>,
    errors: Vec<ConfigError>,
}

fn field(name: &str) -> Option<&'static str> {
    FIELDS.iter().map(|f| f.0).find(|&f| f == name)
}

impl Inputs {
    fn set(&mut self, name: &'static str, layer: Layer, value: String) {
        if self.values.get(name).is_none_or(|(l, _)| *l <= layer) {
            self.values.insert(name, (layer, value));
        }
    }

    /// A TOML file's text.
    pub fn file(&mut self, text: &str) {
        let table = match text.parse::<toml::Table>() {
            Ok(t) => t,
            Err(e) => {
                self.errors.push(ConfigError {
                    field: "(file)".into(),
                    layer: Layer::File,
                    message: e.to_string().trim().to_string(),
                });
                return;
            }
        };
        for (key, value) in table {
            let Some(name) = field(&key) else {
                self.errors.push(ConfigError { field: key, layer: Layer::File, message: "unknown key".into() });
                continue;
            };
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                other => {
                    self.errors.push(ConfigError {
                        field: key,
                        layer: Layer::File,
                        message: format!("expected a string or an integer, found {}", other.type_str()),
                    });
                    continue;
                }
            };
            self.set(name, Layer::File, text);
        }
    }

    /// The environment (only `RINGWATCH_SHIPPER_*` variables are looked at; unknown ones
    /// with that prefix are errors).
    pub fn env<'a>(&mut self, vars: impl IntoIterator<Item = (&'a str, &'a str)>) {
        for (k, v) in vars {
            let Some(rest) = k.strip_prefix("RINGWATCH_SHIPPER_") else { continue };
            match field(&rest.to_ascii_lowercase()) {
                Some(name) => self.set(name, Layer::Env, v.to_string()),
                None => self.errors.push(ConfigError {
                    field: k.to_string(),
                    layer: Layer::Env,
                    message: "unknown variable".into(),
                }),
            }
        }
    }

    /// A command-line value for `name` (a field name).
    pub fn flag(&mut self, name: &str, value: &str) {
        match field(name) {
            Some(f) => self.set(f, Layer::Flag, value.to_string()),
            None => self.errors.push(ConfigError {
                field: name.to_string(),
                layer: Layer::Flag,
                message: "unknown option".into(),
            }),
        }
    }

    /// Validates everything, reporting every problem.
    ///
    /// # Errors
    /// All problems found, each with its field and layer.
    pub fn validate(&self) -> Result<ShipperConfig, ConfigErrors> {
        let mut errors = self.errors.clone();
        let mut text: BTreeMap<&str, (Layer, String)> = BTreeMap::new();
        let mut ints: BTreeMap<&str, u64> = BTreeMap::new();
        let mut addr = None;
        for &(name, kind, default, _) in FIELDS {
            let Some((layer, value)) =
                self.values.get(name).cloned().or_else(|| default.map(|d| (Layer::Default, d.to_string())))
            else {
                // A value that was given but unreadable is already reported.
                if !self.errors.iter().any(|e| e.field == name) {
                    errors.push(ConfigError { field: name.into(), layer: Layer::Default, message: "required".into() });
                }
                continue;
            };
            let bad = |message: String| ConfigError { field: name.into(), layer, message };
            match kind {
                Kind::Text if value.trim().is_empty() => errors.push(bad("must not be empty".into())),
                Kind::Text | Kind::OptText => {
                    text.insert(name, (layer, value));
                }
                Kind::Addr => match value.parse::<SocketAddr>() {
                    Ok(a) => addr = Some(a),
                    Err(_) => errors.push(bad(format!("{value:?} is not ip:port"))),
                },
                Kind::Int { min, max } => match value.trim().parse::<u64>() {
                    Ok(v) if (min..=max).contains(&v) => {
                        ints.insert(name, v);
                    }
                    Ok(v) => errors.push(bad(format!("{v} is outside {min}..={max}"))),
                    Err(_) => errors.push(bad(format!("{value:?} is not a whole number"))),
                },
            }
        }
        let node = u32::try_from(ints.get("source_node").copied().unwrap_or(0)).unwrap_or(u32::MAX);
        let source = text.get("source").and_then(|(layer, s)| {
            let parsed = match s.split_once(':') {
                Some(("capture", p)) if !p.is_empty() => Some(Source::Capture {
                    path: PathBuf::from(p),
                    node,
                    speed_pct: ints.get("replay_speed_pct").copied().unwrap_or(100),
                }),
                Some(("sim", n)) if !n.is_empty() => Some(Source::Sim {
                    scenario: n.to_string(),
                    node,
                    bulk_scale_ppm: ints.get("sim_bulk_scale_ppm").copied().unwrap_or(1000),
                    seed: ints.get("sim_seed").copied().filter(|&s| s != 0),
                }),
                None if s == "bpf" => Some(Source::Bpf(crate::bpf::BpfConfig {
                    pin_dir: PathBuf::from(text.get("bpf_pin_dir").map(|t| t.1.clone()).unwrap_or_default()),
                    p0_ring_bytes: u32::try_from(ints.get("p0_ring_bytes").copied().unwrap_or(0)).unwrap_or(0),
                    bulk_ring_bytes: u32::try_from(ints.get("bulk_ring_bytes").copied().unwrap_or(0)).unwrap_or(0),
                    object: text.get("bpf_object").map(|t| t.1.trim()).filter(|t| !t.is_empty()).map(PathBuf::from),
                    kernel_btf: PathBuf::from(text.get("kernel_btf").map(|t| t.1.clone()).unwrap_or_default()),
                    drain_interval_us: ints.get("ring_drain_interval_us").copied().unwrap_or(1000),
                    counters_interval_ms: ints.get("heartbeat_interval_ms").copied().unwrap_or(1000),
                    xdp_interfaces: text
                        .get("xdp_interfaces")
                        .map(|t| t.1.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect())
                        .unwrap_or_default(),
                    nccl_shim: text
                        .get("nccl_profiler_shim")
                        .map(|t| t.1.trim())
                        .filter(|t| !t.is_empty())
                        .map(PathBuf::from),
                })),
                _ => None,
            };
            if parsed.is_none() {
                errors.push(ConfigError {
                    field: "source".into(),
                    layer: *layer,
                    message: format!("{s:?} is none of bpf, capture:PATH, sim:SCENARIO"),
                });
            }
            parsed
        });
        let int = |n: &str| ints.get(n).copied().unwrap_or(0);
        let as_usize = |n: &str| usize::try_from(int(n)).unwrap_or(usize::MAX);
        if let Some((layer, f)) = text.get("log_format")
            && f != "text"
            && f != "json"
        {
            errors.push(ConfigError {
                field: "log_format".into(),
                layer: *layer,
                message: format!("{f:?} is neither text nor json"),
            });
        }
        for ring in ["p0_ring_bytes", "bulk_ring_bytes"] {
            if let Some(&v) = ints.get(ring)
                && let Err(e) = crate::bpf::check_ring_size(ring, u32::try_from(v).unwrap_or(u32::MAX))
            {
                let layer = self.values.get(ring).map_or(Layer::Default, |v| v.0);
                errors.push(ConfigError { field: ring.into(), layer, message: e.to_string() });
            }
        }
        let mut reader_cpus = Vec::new();
        if let Some((layer, list)) = text.get("reader_cpus") {
            for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                match part.parse::<usize>() {
                    Ok(c) if c < 1024 => reader_cpus.push(c),
                    _ => errors.push(ConfigError {
                        field: "reader_cpus".into(),
                        layer: *layer,
                        message: format!("{part:?} is not a CPU number (0..1023)"),
                    }),
                }
            }
        }
        if ints.contains_key("spool_bytes") && ints.contains_key("max_batch_bytes") {
            let reserves = int("p0_reserve_bytes") + int("p1_reserve_bytes");
            let batch = int("max_batch_bytes").max(ints.get("bulk_batch_bytes").map_or(0, |_| int("bulk_batch_bytes")));
            // Bulk needs room for at least one whole batch beyond both reserves.
            if reserves + 2 * batch > int("spool_bytes") {
                let layer = self.values.get("spool_bytes").map_or(Layer::Default, |v| v.0);
                errors.push(ConfigError {
                    field: "spool_bytes".into(),
                    layer,
                    message: format!(
                        "{} cannot hold both reserves ({reserves}) plus two batches of max_batch_bytes / bulk_batch_bytes",
                        int("spool_bytes")
                    ),
                });
            }
        }
        if !errors.is_empty() {
            return Err(ConfigErrors(errors));
        }
        let path = |n: &str| PathBuf::from(text.get(n).map(|t| t.1.clone()).unwrap_or_default());
        let string = |n: &str| text.get(n).map(|t| t.1.clone()).unwrap_or_default();
        let (Some(aggregator), Some(source)) = (addr, source) else {
            return Err(ConfigErrors(vec![ConfigError {
                field: "(internal)".into(),
                layer: Layer::Default,
                message: "validated fields missing".into(),
            }]));
        };
        Ok(ShipperConfig {
            aggregator,
            server_name: string("server_name"),
            node_name: string("node_name"),
            ca: path("ca"),
            cert: path("cert"),
            key: path("key"),
            source,
            batcher: BatcherConfig {
                max_batch_bytes: as_usize("max_batch_bytes"),
                bulk_batch_bytes: as_usize("bulk_batch_bytes"),
                flush_interval_ns: int("flush_interval_ms") * 1_000_000,
                ..BatcherConfig::default()
            },
            spool: SpoolConfig {
                cap_bytes: as_usize("spool_bytes"),
                p0_reserve_bytes: as_usize("p0_reserve_bytes"),
                p1_reserve_bytes: as_usize("p1_reserve_bytes"),
            },
            heartbeat_interval_ms: int("heartbeat_interval_ms"),
            shutdown_deadline_ms: int("shutdown_deadline_ms"),
            log_json: string("log_format") == "json",
            reader_cpus,
            sampling: crate::core::SamplingConfig {
                floor: u8::try_from(int("bulk_sampling_level")).unwrap_or(0),
                ceiling: u8::try_from(int("bulk_sampling_max_level")).unwrap_or(0),
                ..crate::core::SamplingConfig::default()
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
aggregator = "127.0.0.1:4433"
node_name = "node-0"
ca = "ca.pem"
cert = "node-0.pem"
key = "node-0.key"
source = "sim:demo"
flush_interval_ms = 2
"#;

    #[test]
    fn a_good_file_validates_with_defaults_filled_in() {
        let mut i = Inputs::default();
        i.file(GOOD);
        let c = i.validate().unwrap();
        assert_eq!(c.aggregator, "127.0.0.1:4433".parse().unwrap());
        assert_eq!(c.source, Source::Sim { scenario: "demo".into(), node: 0, bulk_scale_ppm: 1000, seed: None });
        assert_eq!(c.batcher.flush_interval_ns, 2_000_000);
        assert_eq!(c.batcher.max_batch_bytes, 65_536);
        assert_eq!(c.server_name, "aggregator");
    }

    #[test]
    fn the_documented_example_validates_and_names_every_field() {
        let text = include_str!("../../deploy/node-shipper.example.toml");
        let mut i = Inputs::default();
        i.file(text);
        i.validate().unwrap();
        for (name, _) in fields() {
            assert!(text.contains(&format!("\n{name} = ")), "{name} missing from the example");
        }
    }

    #[test]
    fn flags_beat_env_beat_file() {
        let mut i = Inputs::default();
        i.flag("flush_interval_ms", "7");
        i.file(GOOD);
        i.env([
            ("RINGWATCH_SHIPPER_FLUSH_INTERVAL_MS", "3"),
            ("RINGWATCH_SHIPPER_NODE_NAME", "node-9"),
            ("PATH", "/x"),
        ]);
        let c = i.validate().unwrap();
        assert_eq!(c.batcher.flush_interval_ns, 7_000_000, "flag wins, whatever the call order");
        assert_eq!(c.node_name, "node-9", "env beats file");
    }

    #[test]
    fn every_problem_is_reported_at_once_with_its_layer() {
        let mut i = Inputs::default();
        i.file(
            "aggregator = \"nowhere\"\nmax_batch_bytes = 12\nflush_intervall_ms = 5\nca = [1]\nsource = \"kafka:x\"\n",
        );
        i.env([("RINGWATCH_SHIPPER_HEARTBEAT_INTERVAL_MS", "soon"), ("RINGWATCH_SHIPPER_BOGUS", "1")]);
        i.flag("cert", "");
        let e = i.validate().unwrap_err();
        let got: Vec<(String, Layer)> = e.0.iter().map(|e| (e.field.clone(), e.layer)).collect();
        for want in [
            ("aggregator", Layer::File),
            ("max_batch_bytes", Layer::File),
            ("flush_intervall_ms", Layer::File),
            ("ca", Layer::File),
            ("source", Layer::File),
            ("heartbeat_interval_ms", Layer::Env),
            ("RINGWATCH_SHIPPER_BOGUS", Layer::Env),
            ("cert", Layer::Flag),
            ("node_name", Layer::Default),
            ("key", Layer::Default),
        ] {
            assert!(got.contains(&(want.0.to_string(), want.1)), "missing {want:?} in {e}");
        }
        assert_eq!(got.len(), 10, "{e}");
        assert!(e.to_string().starts_with("10 configuration problem(s):"));
    }

    #[test]
    fn the_bpf_source_validates_its_rings_cpus_and_shim() {
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("source", "bpf");
        i.flag("bulk_ring_bytes", "33554432");
        i.flag("reader_cpus", "2, 3");
        i.flag("xdp_interfaces", "eth0,eth1");
        i.flag("nccl_profiler_shim", "/opt/rw/libnccl-profiler-ringwatch.so");
        i.flag("heartbeat_interval_ms", "250");
        let c = i.validate().unwrap();
        let Source::Bpf(b) = &c.source else { panic!("{:?}", c.source) };
        assert_eq!((b.bulk_ring_bytes, b.p0_ring_bytes, b.counters_interval_ms), (32 << 20, 1 << 20, 250));
        assert_eq!(b.xdp_interfaces, vec!["eth0".to_owned(), "eth1".to_owned()]);
        assert_eq!(b.nccl_shim.as_deref(), Some(std::path::Path::new("/opt/rw/libnccl-profiler-ringwatch.so")));
        assert_eq!(b.object, None, "empty means the embedded object");
        assert_eq!(c.reader_cpus, vec![2, 3]);

        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("source", "bpf");
        i.flag("bulk_ring_bytes", "3000000");
        i.flag("reader_cpus", "2,x");
        i.flag("bulk_sampling_level", "16");
        let e = i.validate().unwrap_err();
        let fields: Vec<&str> = e.0.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["bulk_sampling_level", "bulk_ring_bytes", "reader_cpus"], "{e}");
        assert!(e.to_string().contains("power of two"), "{e}");
    }

    #[test]
    fn a_spool_too_small_for_its_reserves_is_refused_and_broken_toml_is_one_error() {
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("spool_bytes", "1048576");
        i.flag("p0_reserve_bytes", "1048576");
        let e = i.validate().unwrap_err();
        assert_eq!(e.0.len(), 1, "{e}");
        assert_eq!(e.0[0].field, "spool_bytes");
        let mut i = Inputs::default();
        i.file("aggregator = ");
        assert_eq!(i.validate().unwrap_err().0[0].field, "(file)");
    }
}

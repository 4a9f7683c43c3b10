//! The memory-pressure watcher: the kernel's PSI triggers on the process's own cgroup v2
//! `memory.pressure` (or `/proc/pressure/memory`), woken by `POLLPRI` through tokio's
//! [`AsyncFd`] — nothing reads the file on a timer while the state is nominal. The
//! state, with its hysteresis, is [`crate::pressure::Policy`]; this is its I/O shell.
//!
//! How it works (Documentation/accounting/psi.rst): a trigger is written once to a file
//! opened read-write and non-blocking (`some 100000 2000000`: wake when tasks stalled on
//! memory for 100 ms within any 2 s window); the fd then polls `POLLPRI` at most once per
//! window while the stall stays over the threshold. Without `CAP_SYS_RESOURCE` the kernel
//! accepts only windows that are whole multiples of 2 s. On a wake the totals are read
//! through the same fd. While the state is above nominal, the watcher also reads the
//! totals once per trigger window to see the pressure end (the policy needs quiet windows
//! to step down); at nominal it only waits on the fds.
//!
//! Why trigger fds and not an eBPF hook on PSI: the kernel computes PSI's windowed
//! averages itself and exposes exactly this wake-up as a stable ABI; a BPF program on
//! `psi_group_change` (a hot scheduler path, an internal function whose signature changes
//! between releases) would re-implement that accounting per task switch at a cost on
//! every context switch, for a signal that arrives at most once per window anyway.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use crate::pressure::{Level, Policy, PolicyConfig, Totals, Transition};

/// Where cgroup v2 is mounted: `/sys/fs/cgroup/unified` on a hybrid hierarchy (these
/// machines), `/sys/fs/cgroup` on a unified one.
pub const CGROUP2_MOUNTS: [&str; 2] = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"];

/// The system-wide file, used when the process's cgroup has none.
pub const SYSTEM_FILE: &str = "/proc/pressure/memory";

/// One trigger: wake when tasks stalled at least `stall_us` within a `window_us` window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TriggerSpec {
    pub stall_us: u64,
    pub window_us: u64,
}

impl TriggerSpec {
    /// The line written to the pressure file.
    #[must_use]
    pub fn line(&self, level: Level) -> String {
        format!("{} {} {}", level.name(), self.stall_us, self.window_us)
    }

    /// Checks the spec against the kernel's rules: the window within 0.5–10 s, the stall
    /// above 0 and within the window, and — unless the process has `CAP_SYS_RESOURCE` —
    /// the window a whole multiple of 2 s.
    ///
    /// # Errors
    /// What is wrong, in words an operator can act on.
    pub fn validate(&self, privileged: bool) -> Result<(), String> {
        if !(500_000..=10_000_000).contains(&self.window_us) {
            return Err(format!("window {} ms is outside the kernel's 500..=10000 ms", self.window_us / 1000));
        }
        if self.stall_us == 0 || self.stall_us > self.window_us {
            return Err(format!(
                "stall {} ms must be above 0 and at most the window ({} ms)",
                self.stall_us / 1000,
                self.window_us / 1000
            ));
        }
        if !privileged && !self.window_us.is_multiple_of(2_000_000) {
            return Err(format!(
                "window {} ms: without CAP_SYS_RESOURCE the kernel accepts only whole multiples of 2000 ms",
                self.window_us / 1000
            ));
        }
        Ok(())
    }
}

/// The watcher's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PsiConfig {
    pub some: TriggerSpec,
    pub full: TriggerSpec,
    pub policy: PolicyConfig,
    /// The pressure file; `None`: the process's own cgroup's, else the system's.
    pub file: Option<PathBuf>,
}

impl Default for PsiConfig {
    fn default() -> Self {
        Self {
            some: TriggerSpec { stall_us: 100_000, window_us: 2_000_000 },
            full: TriggerSpec { stall_us: 100_000, window_us: 2_000_000 },
            policy: PolicyConfig::default(),
            file: None,
        }
    }
}

/// The configuration fields of the watcher, shared by both binaries
/// ([`crate::config::Schema::SHARED_FIELDS`]); read with [`config_from`].
pub const CONFIG_FIELDS: &[crate::config::Field] = &[
    (
        "psi",
        crate::config::Kind::Text,
        Some("on"),
        "memory pressure: on (PSI triggers on this process's cgroup memory.pressure, else /proc/pressure/memory; tiers shed under pressure) or off",
    ),
    (
        "psi_window_ms",
        crate::config::Kind::Int { min: 500, max: 10_000 },
        Some("2000"),
        "PSI trigger window (without CAP_SYS_RESOURCE the kernel takes only whole multiples of 2000)",
    ),
    (
        "psi_some_stall_ms",
        crate::config::Kind::Int { min: 1, max: 10_000 },
        Some("100"),
        "enter `some` pressure when tasks stalled on memory this long within a window",
    ),
    (
        "psi_full_stall_ms",
        crate::config::Kind::Int { min: 1, max: 10_000 },
        Some("100"),
        "enter `full` pressure when all tasks stalled on memory at once this long within a window",
    ),
    (
        "psi_quiet_windows",
        crate::config::Kind::Int { min: 1, max: 100 },
        Some("3"),
        "windows in a row without a trigger (and stall growth under half the some threshold) before pressure steps down a level",
    ),
];

/// The watcher's configuration from [`CONFIG_FIELDS`] (`None`: `psi = "off"`), adding
/// contradictions (a stall longer than its window, `psi` neither on nor off) to `v`.
pub fn config_from(v: &mut crate::config::Values) -> Option<PsiConfig> {
    let on = match v.text("psi") {
        Some("on") => true,
        Some("off") | None => false,
        Some(other) => {
            let other = other.to_owned();
            v.problem("psi", format!("{other:?} is neither on nor off"));
            false
        }
    };
    if let Some(window) = v.int("psi_window_ms") {
        for f in ["psi_some_stall_ms", "psi_full_stall_ms"] {
            if let Some(stall) = v.int(f)
                && stall > window
            {
                v.problem(f, format!("{stall} is above psi_window_ms ({window})"));
            }
        }
    }
    let int = |f: &str| v.int(f).unwrap_or(0);
    let trigger = |f: &str| TriggerSpec { stall_us: int(f) * 1000, window_us: int("psi_window_ms") * 1000 };
    let some = trigger("psi_some_stall_ms");
    on.then(|| PsiConfig {
        some,
        full: trigger("psi_full_stall_ms"),
        policy: PolicyConfig {
            quiet_windows: u32::try_from(int("psi_quiet_windows")).unwrap_or(3),
            quiet_stall_us: some.stall_us / 2,
        },
        file: None,
    })
}

/// Checks a configuration's triggers against this process's capabilities (the kernel's
/// rules depend on `CAP_SYS_RESOURCE`): the field and the problem.
#[must_use]
pub fn check_config(cfg: &PsiConfig) -> Option<(&'static str, String)> {
    let privileged = has_cap_sys_resource();
    if let Err(e) = cfg.some.validate(privileged) {
        Some(("psi_window_ms", e))
    } else if let Err(e) = cfg.full.validate(privileged) {
        Some(("psi_full_stall_ms", e))
    } else {
        None
    }
}

/// One line of a pressure file.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Line {
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    pub total_us: u64,
}

impl Line {
    /// `avg10` in parts per million of the time (the heartbeat's unit).
    #[must_use]
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn avg10_ppm(&self) -> u32 {
        // avg10 is a percentage with two decimals, 0..=100.
        (self.avg10.clamp(0.0, 100.0) * 10_000.0).round() as u32
    }
}

/// A pressure file's content.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Reading {
    pub some: Line,
    /// Absent in old kernels' system-wide CPU file; present for memory.
    pub full: Line,
}

impl Reading {
    #[must_use]
    pub const fn totals(&self) -> Totals {
        Totals { some_us: self.some.total_us, full_us: self.full.total_us }
    }
}

/// Parses `some avg10=0.00 avg60=0.00 avg300=0.00 total=0` lines.
///
/// # Errors
/// A line or field that is not what the kernel writes.
pub fn parse(text: &str) -> Result<Reading, String> {
    let mut out = Reading::default();
    let mut seen_some = false;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.split_ascii_whitespace();
        let which = parts.next().unwrap_or_default();
        let mut l = Line::default();
        for kv in parts {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("{kv:?} is not key=value"))?;
            let float = || v.parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| format!("{k}={v:?}"));
            match k {
                "avg10" => l.avg10 = float()?,
                "avg60" => l.avg60 = float()?,
                "avg300" => l.avg300 = float()?,
                "total" => l.total_us = v.parse().map_err(|_| format!("total={v:?}"))?,
                _ => {}
            }
        }
        match which {
            "some" => {
                out.some = l;
                seen_some = true;
            }
            "full" => out.full = l,
            other => return Err(format!("unknown line {other:?}")),
        }
    }
    if seen_some { Ok(out) } else { Err("no \"some\" line".into()) }
}

/// The cgroup v2 path in `/proc/self/cgroup` (the `0::` line).
#[must_use]
pub fn own_cgroup(proc_self_cgroup: &str) -> Option<&str> {
    proc_self_cgroup.lines().find_map(|l| l.strip_prefix("0::")).map(str::trim)
}

/// The pressure file to watch: the process's cgroup v2 `memory.pressure` if one of
/// [`CGROUP2_MOUNTS`] has it and this process may write a trigger into it, else
/// [`SYSTEM_FILE`] (a service under systemd's `DynamicUser=` or a container whose
/// cgroupfs is read-only cannot arm its own cgroup's file).
///
/// # Errors
/// Why neither exists (PSI is off: `psi=0` on the kernel command line, or no
/// `CONFIG_PSI`).
pub fn locate() -> Result<PathBuf, String> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok();
    if let Some(cg) = own.as_deref().and_then(own_cgroup) {
        for mount in CGROUP2_MOUNTS {
            let p = Path::new(mount).join(cg.trim_start_matches('/')).join("memory.pressure");
            // Opening read-write arms nothing (a trigger is armed by a write).
            if std::fs::OpenOptions::new().read(true).write(true).open(&p).is_ok() {
                return Ok(p);
            }
        }
    }
    if Path::new(SYSTEM_FILE).exists() {
        return Ok(PathBuf::from(SYSTEM_FILE));
    }
    Err(format!(
        "no memory.pressure for this process's cgroup ({}) and no {SYSTEM_FILE}: PSI is off in this kernel",
        own.as_deref().and_then(own_cgroup).unwrap_or("unknown")
    ))
}

/// Whether this process has `CAP_SYS_RESOURCE` (then trigger windows need not be 2 s
/// multiples).
#[must_use]
pub fn has_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status").ok().is_some_and(|s| cap_eff_has(&s, 24))
}

fn cap_eff_has(status: &str, bit: u32) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .is_some_and(|caps| caps & (1u64 << bit) != 0)
}

/// An armed trigger.
#[derive(Debug)]
pub struct TriggerFd {
    fd: AsyncFd<File>,
}

impl TriggerFd {
    /// Opens `path` read-write and non-blocking and writes the trigger.
    ///
    /// # Errors
    /// The open or the write failed (`EINVAL`: the kernel refused the trigger).
    pub fn arm(path: &Path, level: Level, spec: TriggerSpec) -> std::io::Result<Self> {
        let mut f = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NONBLOCK).open(path)?;
        f.write_all(spec.line(level).as_bytes())?;
        // SAFETY: `f` is an owned `File`: its fd is open and stays the same open file
        // description until the `AsyncFd` (which owns the `File`) is dropped, and
        // `as_raw_fd` always returns it — what `register_with_interest` requires.
        #[allow(unsafe_code, reason = "tokio's AsyncFd registration is unsafe since 1.54 (I/O safety)")]
        let fd = unsafe { AsyncFd::register_with_interest(f, Interest::PRIORITY) }.map_err(std::io::Error::from)?;
        Ok(Self { fd })
    }

    /// Waits until the trigger fires.
    ///
    /// # Errors
    /// The fd failed (the cgroup was removed: `POLLERR`).
    pub async fn fired(&self) -> std::io::Result<()> {
        let mut guard = self.fd.ready(Interest::PRIORITY).await?;
        guard.clear_ready();
        Ok(())
    }

    /// Reads the pressure file through this fd.
    ///
    /// # Errors
    /// The read failed or the content did not parse.
    pub fn read(&self) -> std::io::Result<Reading> {
        let mut f = self.fd.get_ref();
        f.seek(SeekFrom::Start(0))?;
        let mut text = String::with_capacity(160);
        f.read_to_string(&mut text)?;
        parse(&text).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }
}

/// What the watcher publishes.
#[derive(Debug, Clone, PartialEq)]
pub struct PressureState {
    pub level: Level,
    /// The last reading (on a wake or at a window's end).
    pub reading: Reading,
    /// Triggers fired so far, by level (`some`, `full`).
    pub fired: [u64; 2],
    /// Level changes so far.
    pub transitions: u64,
    /// The last change, on the watcher's clock (ns since it started).
    pub last_transition: Option<Transition>,
    /// The file watched.
    pub file: PathBuf,
}

/// A running watcher: the state, and the task.
#[derive(Debug)]
pub struct Watcher {
    pub state: watch::Receiver<PressureState>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Why the watcher is not running.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    #[error("{0}")]
    NoFile(String),
    #[error("{level} trigger: {reason}")]
    BadTrigger { level: &'static str, reason: String },
    #[error("arming the {level} trigger on {file}: {error}")]
    Arm { level: &'static str, file: String, error: std::io::Error },
}

/// Arms both triggers and spawns the watcher task (on the current tokio runtime).
/// Transitions are logged at WARN (entering) and INFO (leaving).
///
/// # Errors
/// PSI is unavailable here, a trigger is invalid, or the kernel refused one.
pub fn start(cfg: &PsiConfig) -> Result<Watcher, Unavailable> {
    let privileged = has_cap_sys_resource();
    for (level, spec) in [("some", cfg.some), ("full", cfg.full)] {
        spec.validate(privileged).map_err(|reason| Unavailable::BadTrigger { level, reason })?;
    }
    let file = match &cfg.file {
        Some(f) => f.clone(),
        None => locate().map_err(Unavailable::NoFile)?,
    };
    let arm = |level: Level, spec| {
        TriggerFd::arm(&file, level, spec).map_err(|error| Unavailable::Arm {
            level: level.name(),
            file: file.display().to_string(),
            error,
        })
    };
    let (some, full) = (arm(Level::Some, cfg.some)?, arm(Level::Full, cfg.full)?);
    let reading = some.read().unwrap_or_default();
    let (tx, rx) = watch::channel(PressureState {
        level: Level::Nominal,
        reading,
        fired: [0; 2],
        transitions: 0,
        last_transition: None,
        file: file.clone(),
    });
    let window = Duration::from_micros(cfg.some.window_us.max(cfg.full.window_us));
    let policy = Policy::new(cfg.policy);
    let task = tokio::spawn(run(some, full, policy, window, tx));
    Ok(Watcher { state: rx, task })
}

async fn run(
    some: TriggerFd,
    full: TriggerFd,
    mut policy: Policy,
    window: Duration,
    tx: watch::Sender<PressureState>,
) -> std::io::Result<()> {
    let started = Instant::now();
    let now_ns = || u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let mut next_window = tokio::time::Instant::now() + window;
    loop {
        let windows = policy.needs_windows();
        let (fired, reading) = tokio::select! {
            r = some.fired() => { r?; (Some(Level::Some), some.read()?) }
            r = full.fired() => { r?; (Some(Level::Full), some.read()?) }
            () = tokio::time::sleep_until(next_window), if windows => (None, some.read()?),
        };
        let now = now_ns();
        let change = match fired {
            Some(level) => {
                if policy.level() == Level::Nominal {
                    next_window = tokio::time::Instant::now() + window;
                }
                policy.trigger(level, Some(reading.totals()), now)
            }
            None => {
                next_window += window;
                policy.window(reading.totals(), now)
            }
        };
        if let Some(t) = change {
            if t.to > t.from {
                tracing::warn!(
                    from = t.from.name(),
                    to = t.to.name(),
                    some_avg10 = reading.some.avg10,
                    full_avg10 = reading.full.avg10,
                    "memory pressure: shedding {}",
                    if t.to == Level::Full { "P3 and P2, coalescing P1" } else { "P3 and P2" }
                );
            } else {
                tracing::info!(from = t.from.name(), to = t.to.name(), "memory pressure eased");
            }
        }
        tx.send_modify(|s| {
            s.level = policy.level();
            s.reading = reading;
            s.transitions = policy.transitions();
            if let Some(l) = fired {
                let i = usize::from(l == Level::Full);
                s.fired[i] = s.fired[i].saturating_add(1);
            }
            if change.is_some() {
                s.last_transition = change;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_kernel_writes_and_refuses_the_rest() {
        let r = parse(
            "some avg10=1.25 avg60=0.50 avg300=0.00 total=123456\nfull avg10=0.01 avg60=0.00 avg300=0.00 total=789\n",
        )
        .unwrap();
        assert_eq!(r.totals(), Totals { some_us: 123_456, full_us: 789 });
        assert_eq!((r.some.avg10_ppm(), r.full.avg10_ppm()), (12_500, 100));
        for bad in ["", "some avg10=x total=1", "some total=-1", "odd avg10=0 total=0", "some avg10=inf total=0"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn finds_the_cgroup_v2_line() {
        let text = "9:name=systemd:/\n4:memory:/process_api/abc\n0::/ringwatch/test\n";
        assert_eq!(own_cgroup(text), Some("/ringwatch/test"));
        assert_eq!(own_cgroup("4:memory:/x\n"), None);
    }

    #[test]
    fn triggers_follow_the_kernels_rules() {
        let t = |stall_us, window_us| TriggerSpec { stall_us, window_us };
        assert!(t(100_000, 2_000_000).validate(false).is_ok());
        assert!(t(100_000, 4_000_000).validate(false).is_ok());
        let e = t(150_000, 1_000_000).validate(false).unwrap_err();
        assert!(e.contains("CAP_SYS_RESOURCE") && e.contains("2000 ms"), "{e}");
        assert!(t(150_000, 1_000_000).validate(true).is_ok());
        assert!(t(0, 2_000_000).validate(true).is_err());
        assert!(t(3_000_000, 2_000_000).validate(true).is_err());
        assert!(t(100_000, 12_000_000).validate(true).is_err());
        assert!(t(100_000, 400_000).validate(true).is_err());
        assert_eq!(t(100_000, 2_000_000).line(Level::Full), "full 100000 2000000");
    }

    #[test]
    fn reads_cap_eff() {
        let status = "Name:\tx\nCapEff:\t000001ffff7fffff\n";
        assert!(!cap_eff_has(status, 23), "bit 23 clear");
        assert!(cap_eff_has(status, 24));
        assert!(!cap_eff_has("CapEff:\t0000000000000000\n", 24));
    }
}

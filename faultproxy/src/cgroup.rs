//! Real memory pressure for tests: a cgroup with a small memory limit and page-cache
//! thrashers inside it (the recipe measured on these machines: two `cat` loops over an
//! 80 MiB file on the root disk in a 64 MiB memcg stall on memory within 2–4 s).
//!
//! On a hybrid hierarchy (these machines) the memory controller is bound to cgroup v1
//! and PSI lives in cgroup v2, so a pressure cgroup is a pair: a v2 child of the root
//! (`memory.pressure`) and a v1 memcg child of this process's memcg
//! (`memory.limit_in_bytes`), with the same processes in both. On a unified hierarchy
//! with the memory controller enabled it is one v2 cgroup with `memory.max`. Everything
//! is removed on drop: every process in it killed, then the directories.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

const V2_HYBRID: &str = "/sys/fs/cgroup/unified";
const V1_MEMORY: &str = "/sys/fs/cgroup/memory";

/// Whether this is CI (`CI=true`): kernel tests must run there, never skip.
#[must_use]
pub fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Prints why `test` skips; under `CI=true`, fails instead.
pub fn skip(test: &str, reason: &str) {
    assert!(!ci(), "CI=true: {test} must run, but cannot here: {reason}");
    println!("SKIP {test}: {reason}");
}

/// A cgroup (pair) with a memory limit, and what runs in it.
#[derive(Debug)]
pub struct PressureCgroup {
    /// The v2 cgroup: its `memory.pressure` is what to watch.
    pub v2: PathBuf,
    /// The v1 memcg on a hybrid hierarchy (`None`: `memory.max` on the v2 cgroup).
    pub v1: Option<PathBuf>,
    /// v2 child cgroups made by [`Self::child`] (the v1 memcg is shared).
    children: Vec<PathBuf>,
    thrashers: Vec<Child>,
    file: Option<PathBuf>,
}

impl PressureCgroup {
    /// Creates the cgroup(s) named `ringwatch-<tag>-<pid>` with `limit` bytes of memory.
    ///
    /// # Errors
    /// Why it cannot be done here (not root, no cgroup v2, no memory controller).
    pub fn new(tag: &str, limit: u64) -> Result<Self, String> {
        let name = format!("ringwatch-{tag}-{}", std::process::id());
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        if Path::new(V2_HYBRID).join("cgroup.procs").exists() {
            // Hybrid: v2 for PSI, v1 for the memory limit.
            let memcg = own
                .lines()
                .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.trim().to_owned()))
                .ok_or("hybrid hierarchy without a v1 memory controller")?;
            let v2 = Path::new(V2_HYBRID).join(&name);
            let v1 = Path::new(V1_MEMORY).join(memcg.trim_start_matches('/')).join(&name);
            std::fs::create_dir(&v2).map_err(|e| format!("mkdir {}: {e}", v2.display()))?;
            let mut cg = Self { v2, v1: None, children: Vec::new(), thrashers: Vec::new(), file: None };
            std::fs::create_dir(&v1).map_err(|e| format!("mkdir {}: {e}", v1.display()))?;
            cg.v1 = Some(v1.clone());
            std::fs::write(v1.join("memory.limit_in_bytes"), limit.to_string())
                .map_err(|e| format!("{}/memory.limit_in_bytes: {e}", v1.display()))?;
            if !cg.v2.join("memory.pressure").exists() {
                return Err(format!("{}/memory.pressure missing: PSI is off", cg.v2.display()));
            }
            return Ok(cg);
        }
        let root = Path::new("/sys/fs/cgroup");
        let controllers = std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
        if !controllers.split_whitespace().any(|c| c == "memory") {
            return Err("cgroup v2 without the memory controller enabled for children".into());
        }
        let v2 = root.join(&name);
        std::fs::create_dir(&v2).map_err(|e| format!("mkdir {}: {e}", v2.display()))?;
        let cg = Self { v2, v1: None, children: Vec::new(), thrashers: Vec::new(), file: None };
        std::fs::write(cg.v2.join("memory.max"), limit.to_string()).map_err(|e| format!("memory.max: {e}"))?;
        Ok(cg)
    }

    /// The file to watch.
    #[must_use]
    pub fn pressure_file(&self) -> PathBuf {
        self.v2.join("memory.pressure")
    }

    /// Makes a v2 child cgroup `name` (a background pod, say) whose processes share this
    /// cgroup's memory limit and pressure; removed on drop.
    ///
    /// # Panics
    /// The directory cannot be made.
    pub fn child(&mut self, name: &str) -> PathBuf {
        let p = self.v2.join(name);
        std::fs::create_dir(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        self.children.push(p.clone());
        p
    }

    /// The shell line that moves a shell into this cgroup (both halves).
    fn enter(&self) -> String {
        self.enter_in(&self.v2)
    }

    /// The same into `v2` (this cgroup or one of its children) and the memcg.
    fn enter_in(&self, v2: &Path) -> String {
        let mut s = format!("echo $$ > {}/cgroup.procs", v2.display());
        if let Some(v1) = &self.v1 {
            s.push_str(&format!(" && echo $$ > {}/cgroup.procs", v1.display()));
        }
        s
    }

    /// A command that runs `program` with `args` inside the cgroup (a shell enters it,
    /// then `exec`s the program, so the child's pid is the program's). The caller spawns
    /// it and owns the child; [`Self::stop_all`] and drop still kill it.
    #[must_use]
    pub fn command(&self, program: &Path, args: &[String]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!("{} && exec \"$0\" \"$@\"", self.enter())).arg(program).args(args);
        c
    }

    /// Runs `command` (a shell line) inside the cgroup; killed on drop or by
    /// [`Self::stop_all`].
    ///
    /// # Panics
    /// The shell cannot be spawned.
    pub fn spawn(&mut self, command: &str) -> u32 {
        let v2 = self.v2.clone();
        self.spawn_in(&v2, command)
    }

    /// [`Self::spawn`] in `v2`: this cgroup or one of its [`Self::child`]ren.
    ///
    /// # Panics
    /// The shell cannot be spawned.
    pub fn spawn_in(&mut self, v2: &Path, command: &str) -> u32 {
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("{} && exec sh -c '{command}'", self.enter_in(v2)))
            .spawn()
            .expect("sh");
        let pid = child.id();
        self.thrashers.push(child);
        pid
    }

    /// Starts `loops` page-cache thrashers reading a `bytes` file on the root disk (not
    /// tmpfs: its pages would be shared memory, not reclaimable cache) in `dir`, written
    /// and dropped from the cache first so its pages are charged to the readers. Their `cat`s
    /// run with `oom_score_adj` 1000 (the loops at 999): when the kernel's reclaim gives
    /// up under the thrash (on the v1 memcg here it sometimes does with tens of MiB of
    /// clean cache left), the OOM killer takes a `cat` before anything else in the
    /// cgroup, and its loop starts another.
    ///
    /// # Panics
    /// The file cannot be written.
    pub fn thrash(&mut self, dir: &Path, bytes: u64, loops: usize) {
        let v2 = self.v2.clone();
        self.thrash_in(&v2, dir, bytes, loops);
    }

    /// [`Self::thrash`] in `v2`: this cgroup or one of its [`Self::child`]ren.
    ///
    /// # Panics
    /// The file cannot be written.
    pub fn thrash_in(&mut self, v2: &Path, dir: &Path, bytes: u64, loops: usize) {
        let file = dir.join(format!("thrash-{}.bin", std::process::id()));
        let mib = bytes.div_ceil(1 << 20);
        let st = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "dd if=/dev/urandom of={f} bs=1M count={mib} conv=fsync status=none && dd if={f} iflag=nocache count=0 status=none",
                f = file.display()
            ))
            .status()
            .expect("dd");
        assert!(st.success(), "writing {}", file.display());
        self.file = Some(file.clone());
        // The thrashers stand for the workload beside the shipper: the OOM killer's first
        // choice (`oom_score_adj` 1000, what the kubelet gives BestEffort pods). Each
        // loop's shell sits one below its `cat`, so a kill takes a `cat` and the loop
        // starts the next: a run of OOM kills (this v1 memcg's reclaim can give up
        // several times in a row) does not use the thrashers up and leave the shipper the
        // only task to kill.
        for _ in 0..loops {
            self.spawn_in(
                v2,
                &format!(
                    "echo 999 > /proc/self/oom_score_adj && while :; do sh -c \"echo 1000 > /proc/self/oom_score_adj && exec cat {}\" > /dev/null; done",
                    file.display()
                ),
            );
        }
    }

    /// OOM kills in this cgroup so far: v1 `memory.oom_control`'s `oom_kill`, or v2
    /// `memory.events`' `oom_kill`.
    #[must_use]
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match &self.v1 {
            Some(v1) => (v1.join("memory.oom_control"), "oom_kill "),
            None => (self.v2.join("memory.events"), "oom_kill "),
        };
        std::fs::read_to_string(file)
            .ok()
            .and_then(|t| t.lines().find_map(|l| l.strip_prefix(key)).and_then(|n| n.trim().parse().ok()))
            .unwrap_or(0)
    }

    /// The processes in this cgroup and its children now.
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        std::iter::once(&self.v2)
            .chain(&self.children)
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|t| t.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
            .collect()
    }

    /// Stops the thrashers only (what [`Self::spawn`] and [`Self::thrash`] started; a
    /// `cat` in flight finishes its read and exits), leaving anything else in the cgroup
    /// running.
    pub fn stop_thrashers(&mut self) {
        for mut c in self.thrashers.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills every process in the cgroup (the thrashers and anything they started), until
    /// the kernel reports it empty (a loop may fork once more between a read and a kill).
    pub fn stop_all(&mut self) {
        for mut c in self.thrashers.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        // A frozen child's processes die on SIGKILL, but thaw it so nothing waits on it.
        for c in &self.children {
            let _ = std::fs::write(c.join("cgroup.freeze"), "0");
        }
        for _ in 0..500 {
            let mut left = 0;
            for dir in self.children.iter().chain(std::iter::once(&self.v2)).chain(self.v1.as_ref()) {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                for pid in procs.split_whitespace() {
                    left += 1;
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            if left == 0 {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for PressureCgroup {
    fn drop(&mut self) {
        self.stop_all();
        for dir in self.children.iter().chain(self.v1.iter()).chain(std::iter::once(&self.v2)) {
            let _ = std::fs::remove_dir(dir);
        }
        if let Some(f) = &self.file {
            let _ = std::fs::remove_file(f);
        }
    }
}

//! The process's memory limit from its cgroup: cgroup v2 `memory.max`, or on a hybrid
//! hierarchy (the memory controller bound to cgroup v1, as on these machines) v1
//! `memory.limit_in_bytes`. The limit that binds is the lowest one on the path from the
//! process's cgroup up to the root, so every ancestor is read too.
//!
//! Read once at start and again on each memory-pressure event (an operator may change a
//! limit under a running process); never on a timer.

use std::path::{Path, PathBuf};

/// The v1 memory controller's mount on a hybrid hierarchy.
pub const V1_MEMORY: &str = "/sys/fs/cgroup/memory";

/// v1 writes "no limit" as `PAGE_COUNTER_MAX` pages rounded down to the page size
/// (9223372036854771712 on 4 KiB pages); anything at or above 2^62 is no limit.
const V1_UNLIMITED: u64 = 1 << 62;

/// A memory limit and the file it was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub bytes: u64,
    pub file: PathBuf,
}

/// Parses one limit file's content: `max` (v2's "no limit") and v1's huge value are
/// `None`.
///
/// # Errors
/// Content that is neither a number nor `max`.
pub fn parse_limit(text: &str) -> Result<Option<u64>, String> {
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    let n: u64 = t.parse().map_err(|_| format!("{t:?} is neither a byte count nor \"max\""))?;
    Ok((n < V1_UNLIMITED).then_some(n))
}

/// The cgroup paths in `/proc/self/cgroup`: the v2 one (`0::/path`) and the v1 memory
/// controller's (`N:memory:/path`, possibly shared with other controllers).
#[must_use]
pub fn own_paths(proc_self_cgroup: &str) -> (Option<&str>, Option<&str>) {
    let mut v2 = None;
    let mut v1 = None;
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        if controllers.is_empty() {
            v2 = Some(path.trim());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.trim());
        }
    }
    (v2, v1)
}

/// The lowest limit in `file_name` from `root/path` up to `root` (the root itself has no
/// limit file in v2; in v1 its file says unlimited).
fn lowest_on_path(root: &Path, path: &str, file_name: &str) -> Option<Limit> {
    let mut dir = root.join(path.trim_start_matches('/'));
    let mut best: Option<Limit> = None;
    loop {
        let file = dir.join(file_name);
        if let Ok(text) = std::fs::read_to_string(&file)
            && let Ok(Some(bytes)) = parse_limit(&text)
            && best.as_ref().is_none_or(|b| bytes < b.bytes)
        {
            best = Some(Limit { bytes, file });
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            return best;
        }
    }
}

/// The limit that binds a process whose `/proc/self/cgroup` reads `proc_self_cgroup`,
/// given where cgroup v2 and the v1 memory controller are mounted: the lower of v2
/// `memory.max` and v1 `memory.limit_in_bytes` on the process's paths (`None`: no limit
/// anywhere, or no cgroup to read).
#[must_use]
pub fn limit_of(proc_self_cgroup: &str, v2_mounts: &[&Path], v1_memory: &Path) -> Option<Limit> {
    let (v2, v1) = own_paths(proc_self_cgroup);
    let from_v2 = v2.and_then(|p| {
        v2_mounts.iter().find(|m| m.join("cgroup.procs").exists()).and_then(|m| lowest_on_path(m, p, "memory.max"))
    });
    let from_v1 = v1.and_then(|p| lowest_on_path(v1_memory, p, "memory.limit_in_bytes"));
    match (from_v2, from_v1) {
        (Some(a), Some(b)) => Some(if b.bytes < a.bytes { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// This process's memory limit ([`limit_of`] on this machine's mounts).
#[must_use]
pub fn own_limit() -> Option<Limit> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts: Vec<&Path> = crate::psi::CGROUP2_MOUNTS.iter().map(Path::new).collect();
    limit_of(&text, &mounts, Path::new(V1_MEMORY))
}

/// This process's resident memory, from `/proc/self/statm` (pages × the page size).
#[must_use]
pub fn rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions; it reads a constant of the system.
    #[allow(unsafe_code, reason = "libc::sysconf")]
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|p| pages.saturating_mul(p))
}

/// Memory pressure (P3): returns the allocator's free memory to the kernel (glibc's
/// `malloc_trim`; freed heap otherwise stays resident, charged to the cgroup). Returns
/// the resident bytes it gave back, as `/proc/self/statm` saw them before and after
/// (`None` where the allocator has no such call).
#[must_use]
pub fn trim() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let before = rss_bytes()?;
        // SAFETY: malloc_trim only walks glibc's own arenas under their locks; it takes
        // no pointers and is safe to call from any thread at any time.
        #[allow(unsafe_code, reason = "glibc's malloc_trim has no safe wrapper")]
        unsafe {
            libc::malloc_trim(0);
        }
        let after = rss_bytes()?;
        Some(before.saturating_sub(after))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trimming_gives_freed_heap_back() {
        // 64 MiB in 64 KiB blocks (below the mmap threshold: heap), touched, then freed,
        // with a block allocated after them kept: the heap's top cannot shrink by
        // itself, only malloc_trim gives the freed pages below it back.
        let blocks: Vec<Vec<u8>> = (0..1024).map(|_| vec![1u8; 64 << 10]).collect();
        let pin = vec![1u8; 4096];
        let held = rss_bytes().unwrap();
        drop(blocks);
        let returned = trim().unwrap();
        assert!(returned >= 16 << 20, "gave back {returned} of {held} resident");
        drop(pin);
    }

    #[test]
    fn limits_parse_and_unlimited_is_none() {
        assert_eq!(parse_limit("67108864\n"), Ok(Some(64 << 20)));
        assert_eq!(parse_limit("max\n"), Ok(None));
        assert_eq!(parse_limit("9223372036854771712\n"), Ok(None));
        assert!(parse_limit("lots").is_err());
        assert!(parse_limit("-1").is_err());
    }

    #[test]
    fn finds_both_paths_in_a_hybrid_proc_self_cgroup() {
        let text = "12:pids:/a\n4:cpu,memory:/k8s/pod1\n0::/k8s/pod1/c\n";
        assert_eq!(own_paths(text), (Some("/k8s/pod1/c"), Some("/k8s/pod1")));
        assert_eq!(own_paths("0::/\n"), (Some("/"), None));
    }

    #[test]
    fn the_lowest_limit_on_the_path_binds_in_either_hierarchy() {
        let root = std::env::temp_dir().join(format!("ringwatch-memcg-{}", std::process::id()));
        let v2 = root.join("v2");
        let v1 = root.join("v1");
        let write = |p: PathBuf, s: &str| {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, s).unwrap();
        };
        write(v2.join("cgroup.procs"), "");
        write(v2.join("pod/memory.max"), "268435456\n");
        write(v2.join("pod/c/memory.max"), "max\n");
        write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n");
        write(v1.join("pod/memory.limit_in_bytes"), "9223372036854771712\n");
        let text = "4:memory:/pod\n0::/pod/c\n";
        let got = limit_of(text, &[v2.as_path()], &v1).unwrap();
        assert_eq!((got.bytes, got.file.clone()), (256 << 20, v2.join("pod/memory.max")), "the ancestor's v2 limit");
        write(v1.join("pod/memory.limit_in_bytes"), "67108864\n");
        let got = limit_of(text, &[v2.as_path()], &v1).unwrap();
        assert_eq!((got.bytes, got.file), (64 << 20, v1.join("pod/memory.limit_in_bytes")), "v1 is lower");
        assert_eq!(limit_of("0::/other\n", &[v2.as_path()], &v1), None, "no limit anywhere on the path");
        assert_eq!(limit_of("", &[v2.as_path()], &v1), None);
        std::fs::remove_dir_all(root).unwrap();
    }
}

//! The background-cgroup throttle's I/O (the plan is [`crate::core::throttle`]): a listed
//! cgroup v2 directory is held by lowering `memory.high` where the v2 memory controller
//! runs in it (the kernel then reclaims from it and slows its allocations), else by
//! freezing it (`cgroup.freeze`); released by restoring `memory.high` or thawing. Opt-in:
//! nothing is touched unless listed, and a listed path is checked at start — a cgroup v2
//! directory, not this process's own cgroup nor one of its ancestors (that would freeze
//! the shipper itself).

use std::path::{Path, PathBuf};

use crate::core::throttle::Tier;

/// How a listed cgroup is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mechanism {
    /// `memory.high` lowered to three quarters of `memory.current`; the value it had is
    /// restored on release.
    MemoryHigh { saved: Option<String> },
    /// `cgroup.freeze` = 1; 0 on release.
    Freeze,
}

/// One listed cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub tier: Tier,
    pub path: PathBuf,
    pub mechanism: Mechanism,
}

/// The least `memory.high` the throttle sets (below it the cgroup would thrash rather
/// than slow down).
const MIN_HIGH: u64 = 16 << 20;

/// Checks a listed path and picks how to hold it: `memory.high` if the file exists there
/// (the v2 memory controller is enabled for it), else `cgroup.freeze`.
///
/// # Errors
/// What is wrong with the path, in words an operator can act on.
pub fn check(tier: Tier, path: &Path, own_cgroup_dir: Option<&Path>) -> Result<Target, String> {
    if !path.is_absolute() || path.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        return Err(format!("{}: give the cgroup's absolute path, without `..`", path.display()));
    }
    if !path.join("cgroup.procs").exists() {
        return Err(format!("{}: not a cgroup directory (no cgroup.procs)", path.display()));
    }
    if let Some(own) = own_cgroup_dir
        && own.starts_with(path)
    {
        return Err(format!(
            "{}: this process's own cgroup ({}) is in it: throttling it would throttle the shipper",
            path.display(),
            own.display()
        ));
    }
    let mechanism = if path.join("memory.high").exists() {
        Mechanism::MemoryHigh { saved: None }
    } else if path.join("cgroup.freeze").exists() {
        Mechanism::Freeze
    } else {
        return Err(format!(
            "{}: neither memory.high nor cgroup.freeze (a cgroup v2 child directory is needed)",
            path.display()
        ));
    };
    Ok(Target { tier, path: path.to_path_buf(), mechanism })
}

/// This process's cgroup v2 directory, if cgroup v2 is mounted where expected.
#[must_use]
pub fn own_cgroup_dir() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let own = ringwatch_transport::psi::own_cgroup(&text)?.to_owned();
    ringwatch_transport::psi::CGROUP2_MOUNTS
        .iter()
        .map(Path::new)
        .find(|m| m.join("cgroup.procs").exists())
        .map(|m| m.join(own.trim_start_matches('/')))
}

/// Holds a target; returns what was written, for the log.
///
/// # Errors
/// A read or write of the cgroup's files failed.
pub fn hold(t: &mut Target) -> std::io::Result<String> {
    match &mut t.mechanism {
        Mechanism::Freeze => {
            std::fs::write(t.path.join("cgroup.freeze"), "1")?;
            Ok("cgroup.freeze=1".into())
        }
        Mechanism::MemoryHigh { saved } => {
            let current: u64 = std::fs::read_to_string(t.path.join("memory.current"))?
                .trim()
                .parse()
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "memory.current is not a number"))?;
            let before = std::fs::read_to_string(t.path.join("memory.high"))?.trim().to_owned();
            let high = (current / 4 * 3).max(MIN_HIGH);
            std::fs::write(t.path.join("memory.high"), high.to_string())?;
            *saved = Some(before);
            Ok(format!("memory.high={high}"))
        }
    }
}

/// Releases a held target.
///
/// # Errors
/// A write failed.
pub fn release(t: &mut Target) -> std::io::Result<String> {
    match &mut t.mechanism {
        Mechanism::Freeze => {
            std::fs::write(t.path.join("cgroup.freeze"), "0")?;
            Ok("cgroup.freeze=0".into())
        }
        Mechanism::MemoryHigh { saved } => {
            let back = saved.clone().unwrap_or_else(|| "max".to_owned());
            std::fs::write(t.path.join("memory.high"), &back)?;
            *saved = None;
            Ok(format!("memory.high={back}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory shaped like a cgroup v2 child (the kernel's files are plain files
    /// here: this machine has no v2 memory controller, so `memory.high` is tested only
    /// this way).
    fn fake(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rw-throttle-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (f, v) in files {
            std::fs::write(d.join(f), v).unwrap();
        }
        d
    }

    #[test]
    fn memory_high_is_lowered_to_three_quarters_of_current_and_restored() {
        let d = fake("high", &[("cgroup.procs", ""), ("memory.high", "max\n"), ("memory.current", "134217728\n")]);
        let mut t = check(Tier::P3, &d, None).unwrap();
        assert_eq!(t.mechanism, Mechanism::MemoryHigh { saved: None });
        assert_eq!(hold(&mut t).unwrap(), "memory.high=100663296");
        assert_eq!(std::fs::read_to_string(d.join("memory.high")).unwrap(), "100663296");
        assert_eq!(release(&mut t).unwrap(), "memory.high=max");
        assert_eq!(std::fs::read_to_string(d.join("memory.high")).unwrap(), "max");
        // A small cgroup keeps the floor.
        std::fs::write(d.join("memory.current"), "1048576").unwrap();
        assert_eq!(hold(&mut t).unwrap(), format!("memory.high={MIN_HIGH}"));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn freeze_writes_cgroup_freeze_and_bad_paths_are_refused() {
        let d = fake("freeze", &[("cgroup.procs", ""), ("cgroup.freeze", "0\n")]);
        let mut t = check(Tier::P2, &d, None).unwrap();
        assert_eq!(t.mechanism, Mechanism::Freeze);
        hold(&mut t).unwrap();
        assert_eq!(std::fs::read_to_string(d.join("cgroup.freeze")).unwrap(), "1");
        release(&mut t).unwrap();
        assert_eq!(std::fs::read_to_string(d.join("cgroup.freeze")).unwrap(), "0");

        let e = check(Tier::P2, &d, Some(&d.join("shipper"))).unwrap_err();
        assert!(e.contains("throttle the shipper"), "{e}");
        assert!(check(Tier::P2, &d, Some(&d)).is_err(), "its own cgroup");
        assert!(check(Tier::P2, Path::new("relative/x"), None).unwrap_err().contains("absolute"));
        assert!(check(Tier::P2, &d.join("../x"), None).unwrap_err().contains("absolute"));
        assert!(check(Tier::P2, &d.join("missing"), None).unwrap_err().contains("cgroup.procs"));
        std::fs::remove_file(d.join("cgroup.freeze")).unwrap();
        assert!(check(Tier::P2, &d, None).unwrap_err().contains("neither"));
        std::fs::remove_dir_all(d).unwrap();
    }
}

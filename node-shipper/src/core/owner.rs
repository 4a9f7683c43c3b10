//! Who owns a rank process: its Kubernetes pod and container, or its Slurm job, read from
//! the process's cgroup path (`/proc/<pid>/cgroup`), so a scheduler acts on jobs, not
//! ranks. PROGRESS entries carry each rank's pid; the reader resolves every pid once
//! (again when its cgroup id changes: a reused pid) and the heartbeat carries the
//! answers in an `owner` section.
//!
//! Pure: [`parse`] reads the file's text, [`OwnerCache`] takes the lookup as a function
//! (the reader thread's reads `/proc/<pid>/cgroup`). What the paths look like:
//!
//! - kubelet, systemd cgroup driver: `/kubepods.slice/kubepods-burstable.slice/
//!   kubepods-burstable-pod<uid, '_' for '-'>.slice/cri-containerd-<64 hex>.scope`
//!   (`crio-`, `docker-` for other runtimes);
//! - kubelet, cgroupfs driver: `/kubepods/burstable/pod<uid>/<64 hex>`;
//! - Slurm: `/slurm/uid_<u>/job_<id>/step_<s>/…` (cgroup v1) or
//!   `/system.slice/slurmstepd.scope/job_<id>/step_<s>/…` (v2).
//!
//! Every line of the file is read (on a hybrid hierarchy v1 controllers and the v2
//! unified path may differ). Each pattern is anchored where kubelet or Slurm puts it and
//! the outermost match wins ([`parse_path`]): a process cannot name another owner by
//! creating cgroups below its own.

use std::collections::HashMap;

use proto_flat::sections::{OWNER_CONTAINER, OWNER_POD, OWNER_SLURM_JOB, OwnerEntry};
use zerocopy::little_endian::{U32, U64};

/// What a process's cgroup says about its owner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Owner {
    pub pod_uid: Option<[u8; 16]>,
    pub container_id: Option<[u8; 32]>,
    pub slurm_job_id: Option<u64>,
}

impl Owner {
    /// Anything known.
    #[must_use]
    pub fn is_known(&self) -> bool {
        self.pod_uid.is_some() || self.container_id.is_some() || self.slurm_job_id.is_some()
    }

    /// The wire entry for `pid`.
    #[must_use]
    pub fn entry(&self, pid: u32) -> OwnerEntry {
        let mut flags = 0;
        if self.pod_uid.is_some() {
            flags |= OWNER_POD;
        }
        if self.container_id.is_some() {
            flags |= OWNER_CONTAINER;
        }
        if self.slurm_job_id.is_some() {
            flags |= OWNER_SLURM_JOB;
        }
        OwnerEntry {
            pid: U32::new(pid),
            flags: U32::new(flags),
            slurm_job_id: U64::new(self.slurm_job_id.unwrap_or(0)),
            pod_uid: self.pod_uid.unwrap_or_default(),
            container_id: self.container_id.unwrap_or([0; 32]),
        }
    }
}

fn hex_nibble(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// `s` as hex into `out` (exactly twice its length in digits).
fn hex_into(s: &[u8], out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 {
        return None;
    }
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = hex_nibble(pair[0])? << 4 | hex_nibble(pair[1])?;
    }
    Some(())
}

/// A pod UID (36 characters, `-` or `_` between the 8-4-4-4-12 groups) at the start of `s`.
fn uuid(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let mut digits = [0u8; 32];
    let mut n = 0;
    for (i, &c) in b.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' && c != b'_' {
                return None;
            }
        } else {
            *digits.get_mut(n)? = c;
            n += 1;
        }
    }
    let mut out = [0u8; 16];
    hex_into(&digits, &mut out)?;
    Some(out)
}

/// The pod UID a path component names: `pod<uid>` (cgroupfs) or `…-pod<uid>.slice`
/// (systemd).
fn pod_of(component: &str) -> Option<[u8; 16]> {
    let c = component.strip_suffix(".slice").unwrap_or(component);
    let at = c.rfind("pod")?;
    if at != 0 && !c[..at].ends_with('-') {
        return None;
    }
    uuid(&c[at + 3..])
}

/// The container id a path component names: 64 hex digits, bare (cgroupfs) or as
/// `<runtime>-<id>.scope` (systemd). Not `crio-conmon-<id>`: the monitor, not the
/// container.
fn container_of(component: &str) -> Option<[u8; 32]> {
    if component.contains("conmon") {
        return None;
    }
    let c = component.strip_suffix(".scope").unwrap_or(component);
    let id = c.rsplit_once('-').map_or(c, |(_, id)| id);
    let mut out = [0u8; 32];
    hex_into(id.as_bytes(), &mut out)?;
    Some(out)
}

/// The Slurm job id of `job_<id>`.
fn job_of(component: &str) -> Option<u64> {
    component.strip_prefix("job_")?.parse().ok().filter(|&j| j > 0)
}

/// Runtimes' systemd scope prefixes, for containers outside Kubernetes.
const RUNTIME_SCOPES: [&str; 4] = ["docker-", "libpod-", "cri-containerd-", "crio-"];

/// What one cgroup path names, into `o` (fields already known are kept). Each pattern is
/// anchored where its manager puts it and the outermost match wins, so cgroups a
/// process creates below its own (a delegated subtree) cannot claim another owner:
/// - the pod: the first `pod<uid>` component below a `kubepods` one; its container: the
///   component right below the pod;
/// - the Slurm job: `job_<id>` right after `slurmstepd.scope` (v2) or after `uid_<n>`
///   below a `slurm` component (v1); of a pod and a job, the outer one owns the process;
/// - outside Kubernetes, a container: the first runtime scope (`docker-<id>.scope`, …)
///   or a 64-hex component right below `docker`.
fn parse_path(comps: &[&str], o: &mut Owner) {
    // Each manager's outermost match: (position, …).
    let mut kube = None;
    if let Some(k) = comps.iter().position(|c| c.contains("kubepods")) {
        kube = comps
            .iter()
            .enumerate()
            .skip(k + 1)
            .find_map(|(i, c)| pod_of(c).map(|uid| (i, uid, comps.get(i + 1).and_then(|c| container_of(c)))));
    }
    let slurm_at = comps.iter().position(|c| c.contains("slurm"));
    let slurm = comps.windows(2).enumerate().find_map(|(i, w)| {
        let v2 = w[0] == "slurmstepd.scope";
        let v1 = w[0].starts_with("uid_") && slurm_at.is_some_and(|s| s < i);
        if v1 || v2 { job_of(w[1]).map(|j| (i + 1, j)) } else { None }
    });
    // The outer manager owns the process; a match of the other below it is the
    // process's own making.
    match (kube, slurm) {
        (Some((k, ..)), Some((j, _))) if j < k => kube = None,
        (Some((k, ..)), Some((j, _))) if k < j => {
            if o.pod_uid.is_none() {
                o.pod_uid = kube.map(|(_, uid, _)| uid);
                o.container_id = o.container_id.or(kube.and_then(|(.., c)| c));
            }
            return;
        }
        _ => {}
    }
    if o.pod_uid.is_none()
        && let Some((_, uid, container)) = kube
    {
        o.pod_uid = Some(uid);
        o.container_id = o.container_id.or(container);
    }
    if o.slurm_job_id.is_none()
        && let Some((_, j)) = slurm
    {
        o.slurm_job_id = Some(j);
    }
    if kube.is_none() && o.pod_uid.is_none() && o.container_id.is_none() {
        for (i, c) in comps.iter().enumerate() {
            let scope = c.ends_with(".scope") && RUNTIME_SCOPES.iter().any(|p| c.starts_with(p));
            let under_docker = i > 0 && comps[i - 1] == "docker";
            if (scope || under_docker)
                && let Some(id) = container_of(c)
            {
                o.container_id = Some(id);
                break;
            }
        }
    }
}

/// The owner a `/proc/<pid>/cgroup` text names (pure).
#[must_use]
pub fn parse(cgroup_file: &str) -> Owner {
    let mut o = Owner::default();
    for line in cgroup_file.lines() {
        // hierarchy-ID:controllers:path (the path may hold ':').
        let Some(path) = line.splitn(3, ':').nth(2) else { continue };
        let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        parse_path(&comps, &mut o);
    }
    o
}

/// The most processes one heartbeat's `owner` section names.
pub const MAX_OWNERS: usize = 4096;

/// At most this many lookups per refresh (the rest wait for the next one).
pub const MAX_LOOKUPS_PER_REFRESH: usize = 64;

/// The answers per `(pid, cgroup_id)`: kept only for the processes the latest PROGRESS
/// entries name, so it is bounded by them and by [`MAX_OWNERS`]. A lookup that failed
/// (the process was gone, or procfs unreadable) is not kept: it is tried again.
#[derive(Debug, Default)]
pub struct OwnerCache {
    known: HashMap<(u32, u64), Owner>,
    /// Processes past [`MAX_OWNERS`] in one refresh: not resolved, not sent.
    pub turned_away: u64,
    /// Lookups made (a process seen for the first time, in a new cgroup, or again after
    /// a failed read), failed, and put off past [`MAX_LOOKUPS_PER_REFRESH`].
    pub lookups: u64,
    pub failed: u64,
    pub deferred: u64,
}

impl OwnerCache {
    /// The entries for the processes `keys` names (`(pid, cgroup_id)`, repeats allowed),
    /// resolving new ones with `resolve`. Processes with nothing known are left out.
    /// Returns `None` when the answer equals the last one.
    pub fn refresh(
        &mut self,
        keys: impl IntoIterator<Item = (u32, u64)>,
        mut resolve: impl FnMut(u32) -> Option<Owner>,
    ) -> Option<Vec<OwnerEntry>> {
        let before: Vec<(u32, u64)> = self.known.keys().copied().collect();
        let mut next: HashMap<(u32, u64), Owner> = HashMap::new();
        let mut looked = 0usize;
        let mut seen = std::collections::HashSet::new();
        for key in keys {
            if key.0 == 0 || !seen.insert(key) {
                continue;
            }
            if seen.len() > MAX_OWNERS {
                self.turned_away += 1;
                continue;
            }
            if let Some(a) = self.known.remove(&key) {
                next.insert(key, a);
                continue;
            }
            if looked >= MAX_LOOKUPS_PER_REFRESH {
                self.deferred += 1;
                continue;
            }
            looked += 1;
            self.lookups += 1;
            match resolve(key.0) {
                Some(a) => {
                    next.insert(key, a);
                }
                None => self.failed += 1,
            }
        }
        // A key's answer never changes while it is kept: the same keys, the same entries.
        let same = next.len() == before.len() && before.iter().all(|k| next.contains_key(k));
        self.known = next;
        if same {
            return None;
        }
        let mut out: Vec<OwnerEntry> =
            self.known.iter().filter(|(_, o)| o.is_known()).map(|(&(pid, _), o)| o.entry(pid)).collect();
        out.sort_by_key(|e| e.pid.get());
        out.dedup_by_key(|e| e.pid.get());
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTR: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn ctr() -> [u8; 32] {
        let mut out = [0u8; 32];
        hex_into(CTR.as_bytes(), &mut out).unwrap();
        out
    }

    const UID: [u8; 16] =
        [0x1f, 0x2e, 0x3d, 0x4c, 0x5b, 0x6a, 0x79, 0x88, 0x97, 0xa6, 0xb5, 0xc4, 0xd3, 0xe2, 0xf1, 0x00];

    #[test]
    fn kubelet_paths_of_both_cgroup_drivers_and_three_runtimes() {
        for text in [
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e3d4c_5b6a_7988_97a6_b5c4d3e2f100.slice/cri-containerd-{CTR}.scope\n"
            ),
            format!("0::/kubepods.slice/kubepods-pod1f2e3d4c_5b6a_7988_97a6_b5c4d3e2f100.slice/crio-{CTR}.scope\n"),
            format!("12:memory:/kubepods/besteffort/pod1f2e3d4c-5b6a-7988-97a6-b5c4d3e2f100/{CTR}\n0::/\n"),
            format!("0::/kubepods/pod1f2e3d4c-5b6a-7988-97a6-b5c4d3e2f100/docker-{CTR}.scope\n"),
        ] {
            let o = parse(&text);
            assert_eq!(o, Owner { pod_uid: Some(UID), container_id: Some(ctr()), slurm_job_id: None }, "{text}");
        }
    }

    #[test]
    fn slurm_paths_of_v1_and_v2() {
        for text in [
            "4:memory:/slurm/uid_1000/job_4242/step_0/task_0\n0::/\n",
            "0::/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0\n",
        ] {
            assert_eq!(parse(text), Owner { slurm_job_id: Some(4242), ..Owner::default() }, "{text}");
        }
    }

    #[test]
    fn the_outermost_anchored_match_wins_so_cgroups_made_below_cannot_claim_another_owner() {
        // A rank in a pod makes cgroups below its own, shaped like another pod and job.
        let spoof = format!(
            "0::/kubepods/burstable/pod1f2e3d4c-5b6a-7988-97a6-b5c4d3e2f100/{CTR}/x/kubepods/pod00000000-0000-0000-0000-000000000001/{}/slurm/uid_0/job_9\n",
            "f".repeat(64)
        );
        assert_eq!(parse(&spoof), Owner { pod_uid: Some(UID), container_id: Some(ctr()), slurm_job_id: None });
        // Below a Slurm step (a delegated subtree on v2): the job of the step.
        let t = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0/slurmstepd.scope/job_1\n";
        assert_eq!(parse(t).slurm_job_id, Some(4242));
        // kind / k3d: a Kubernetes node in a container; the pod's container, not the node's.
        let kind = format!(
            "0::/docker/{}/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod1f2e3d4c_5b6a_7988_97a6_b5c4d3e2f100.slice/cri-containerd-{CTR}.scope\n",
            "e".repeat(64)
        );
        assert_eq!(parse(&kind), Owner { pod_uid: Some(UID), container_id: Some(ctr()), slurm_job_id: None });
        // cri-o's monitor is not the container.
        let conmon = format!(
            "0::/kubepods.slice/kubepods-pod1f2e3d4c_5b6a_7988_97a6_b5c4d3e2f100.slice/crio-conmon-{CTR}.scope\n"
        );
        assert_eq!(parse(&conmon), Owner { pod_uid: Some(UID), container_id: None, slurm_job_id: None });
    }

    #[test]
    fn nothing_is_claimed_without_its_pattern() {
        for text in [
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            // `job_` outside Slurm's tree, `pod` outside kubepods, short or bad hex, a
            // 64-hex component that is no runtime's scope.
            "0::/system.slice/job_12/pod1f2e3d4c-5b6a-7988-97a6-b5c4d3e2f100\n",
            "0::/system.slice/uid_3/job_12\n",
            "0::/user.slice/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n",
            "0::/kubepods/podnot-a-uuid/0123\n",
            "0::/kubepods/pod1f2e3d4c-5b6a-7988-97a6-b5c4d3e2f10g/\n",
            "garbage without colons\n\n::\n",
            "0::/slurm/job_0/job_x/job_18446744073709551616\n",
        ] {
            assert_eq!(parse(text), Owner::default(), "{text}");
        }
        // A container id outside Kubernetes is still a container (docker, podman).
        assert_eq!(parse(&format!("0::/system.slice/docker-{CTR}.scope\n")).container_id, Some(ctr()));
    }

    #[test]
    fn entries_carry_flags_for_what_is_known() {
        let o = Owner { pod_uid: Some(UID), container_id: None, slurm_job_id: Some(7) };
        let e = o.entry(99);
        assert_eq!((e.pid.get(), e.flags.get(), e.slurm_job_id.get()), (99, OWNER_POD | OWNER_SLURM_JOB, 7));
        assert_eq!(e.pod_uid, UID);
    }

    #[test]
    fn the_cache_resolves_each_process_once_and_again_in_a_new_cgroup_or_after_a_failure() {
        let mut c = OwnerCache::default();
        let job = |j| Some(Owner { slurm_job_id: Some(j), ..Owner::default() });
        let mut asked = Vec::new();
        let first = c.refresh([(10, 1), (11, 1), (10, 1), (0, 1), (13, 1)], |p| {
            asked.push(p);
            if p == 13 { None } else { job(u64::from(p)) }
        });
        assert_eq!(first.map(|v| v.len()), Some(2));
        assert_eq!(asked, [10, 11, 13]);
        assert_eq!(c.failed, 1);
        // The same processes: only the failed one asked again; nothing new to send.
        let mut again = Vec::new();
        assert!(
            c.refresh([(11, 1), (10, 1), (13, 1)], |p| {
                again.push(p);
                None
            })
            .is_none()
        );
        assert_eq!(again, [13]);
        // pid 10 in another cgroup (reused), pid 11 gone, pid 12 has no owner.
        let v = c.refresh([(10, 2), (12, 1)], |p| if p == 12 { Some(Owner::default()) } else { job(5) }).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].pid.get(), v[0].slurm_job_id.get()), (10, 5));
        assert_eq!(c.lookups, 6);
        // The caps: lookups per refresh, then processes per heartbeat.
        let mut c = OwnerCache::default();
        let v = c.refresh((1..=100).map(|p| (p, 1)), |_| job(1)).unwrap();
        assert_eq!((v.len(), c.deferred), (MAX_LOOKUPS_PER_REFRESH, 100 - MAX_LOOKUPS_PER_REFRESH as u64));
        let many = (1..=u32::try_from(MAX_OWNERS).unwrap() + 3).map(|p| (p, 1));
        let mut rounds = 0;
        let mut v = Vec::new();
        while let Some(next) = c.refresh(many.clone(), |_| job(1)) {
            v = next;
            rounds += 1;
        }
        assert_eq!(v.len(), MAX_OWNERS);
        assert!(rounds > 1 && c.turned_away >= 3, "{rounds} rounds, {} turned away", c.turned_away);
    }
}

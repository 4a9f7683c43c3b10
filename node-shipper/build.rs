//! Compiles the eBPF programs (`bpf/*.bpf.c`) with clang when it is installed.
//!
//! A machine with only Rust still builds the shipper: the build then carries no BPF object
//! (`cfg(ringwatch_bpf)` unset), the `bpf` source says why it cannot load, and the kernel
//! tests skip with that reason (under `CI=true` they fail instead). Nothing compiled is
//! committed, so there is no stale object to check: every build compiles its own.
//!
//! `RINGWATCH_CLANG` names another clang; `RINGWATCH_NO_BPF=1` builds without the object
//! (to try the fallback).

use std::path::PathBuf;
use std::process::Command;

const PROGRAMS: &[&str] = &["ringwatch"];

/// The NCCL profiler shim and the workload that stands in for NCCL (C, built with the
/// system C compiler; `make -C nccl-shim` builds the same for operators).
fn build_nccl_shim(manifest: &std::path::Path, out: &std::path::Path) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let dir = manifest.join("nccl-shim");
    for f in [
        "ringwatch_profiler.c",
        "workload.c",
        "check_layout.c",
        "nccl_profiler_api.h",
        "fake_cuda.c",
        "fake_cuda.h",
        "chain_test_plugin.c",
    ] {
        println!("cargo::rerun-if-changed={}", dir.join(f).display());
    }
    let include = manifest.join("../proto-flat/include");
    let common = ["-std=gnu11", "-O2", "-g", "-Wall", "-Wextra", "-Werror"];
    let shim = out.join("libnccl-profiler-ringwatch.so");
    let workload = out.join("rw-nccl-workload");
    let shim_ok = Command::new(&cc)
        .args(common)
        // -z nodelete: NCCL dlcloses the plugin after the last communicator; the shim's
        // copy-engine poller thread must never find its code unmapped.
        .args(["-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-z,nodelete", "-I"])
        .arg(&dir)
        .arg("-I")
        .arg(&include)
        .arg(dir.join("ringwatch_profiler.c"))
        .arg("-o")
        .arg(&shim)
        .args(["-lpthread", "-ldl"])
        .output();
    let workload_ok = Command::new(&cc)
        .args(common)
        .arg("-I")
        .arg(&dir)
        .arg("-I")
        .arg(&include)
        .arg(dir.join("workload.c"))
        .arg("-o")
        .arg(&workload)
        .arg("-ldl")
        .output();
    let checker = out.join("check-layout");
    let checker_ok = Command::new(&cc)
        .args(common)
        .arg("-rdynamic")
        .arg("-I")
        .arg(&include)
        .arg(dir.join("check_layout.c"))
        .arg("-o")
        .arg(&checker)
        .arg("-ldl")
        .output()
        .is_ok_and(|o| o.status.success());
    // The workload's stand-in CUDA driver (copy-engine collectives): soname libcuda.so.1,
    // in a directory of its own so nothing else finds it by that name.
    let fake_dir = out.join("fake-cuda");
    let fake_cuda = fake_dir.join("libcuda.so.1");
    let fake_ok = std::fs::create_dir_all(&fake_dir).is_ok()
        && Command::new(&cc)
            .args(common)
            .args(["-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1"])
            .arg(dir.join("fake_cuda.c"))
            .arg("-o")
            .arg(&fake_cuda)
            .output()
            .is_ok_and(|o| o.status.success());
    // A second profiler plugin for the shim's chaining checks.
    let chain = out.join("libchain-test-plugin.so");
    let chain_ok = Command::new(&cc)
        .args(common)
        .args(["-fPIC", "-shared", "-fvisibility=hidden"])
        .arg(dir.join("chain_test_plugin.c"))
        .arg("-o")
        .arg(&chain)
        .output()
        .is_ok_and(|o| o.status.success());
    match (shim_ok, workload_ok) {
        (Ok(a), Ok(b)) if a.status.success() && b.status.success() && checker_ok && fake_ok && chain_ok => {
            println!("cargo::rustc-env=RINGWATCH_NCCL_SHIM={}", shim.display());
            println!("cargo::rustc-env=RINGWATCH_NCCL_WORKLOAD={}", workload.display());
            println!("cargo::rustc-env=RINGWATCH_NCCL_CHECK_LAYOUT={}", checker.display());
            println!("cargo::rustc-env=RINGWATCH_NCCL_FAKE_CUDA={}", fake_cuda.display());
            println!("cargo::rustc-env=RINGWATCH_NCCL_CHAIN_TEST={}", chain.display());
        }
        other => {
            let why = match other {
                (Ok(a), Ok(b)) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&a.stderr).lines().take(4).collect::<Vec<_>>().join(" | "),
                    String::from_utf8_lossy(&b.stderr).lines().take(4).collect::<Vec<_>>().join(" | ")
                ),
                (Err(e), _) | (_, Err(e)) => format!("{cc} not runnable: {e}"),
            };
            println!("cargo::warning=the NCCL profiler shim was not built: {why}");
            println!("cargo::rustc-env=RINGWATCH_NCCL_SHIM=");
            println!("cargo::rustc-env=RINGWATCH_NCCL_WORKLOAD=");
            println!("cargo::rustc-env=RINGWATCH_NCCL_CHECK_LAYOUT=");
            println!("cargo::rustc-env=RINGWATCH_NCCL_FAKE_CUDA=");
            println!("cargo::rustc-env=RINGWATCH_NCCL_CHAIN_TEST=");
        }
    }
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ringwatch_bpf)");
    println!("cargo::rerun-if-env-changed=RINGWATCH_CLANG");
    println!("cargo::rerun-if-env-changed=RINGWATCH_NO_BPF");
    println!("cargo::rerun-if-env-changed=CC");
    println!("cargo::rerun-if-changed=../proto-flat/include/ringwatch.h");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    build_nccl_shim(&manifest, &out);
    let clang = std::env::var("RINGWATCH_CLANG").unwrap_or_else(|_| "clang".to_owned());
    let why_not = if std::env::var_os("RINGWATCH_NO_BPF").is_some_and(|v| v == "1") {
        Some("RINGWATCH_NO_BPF=1".to_owned())
    } else {
        let mut failed = None;
        for p in PROGRAMS {
            let src = manifest.join("bpf").join(format!("{p}.bpf.c"));
            println!("cargo::rerun-if-changed={}", src.display());
            let obj = out.join(format!("{p}.bpf.o"));
            let arch = match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
                Ok("aarch64") => ("arm64", "aarch64-linux-gnu"),
                _ => ("x86", "x86_64-linux-gnu"),
            };
            let result = Command::new(&clang)
                .args(["-O2", "-g", "-target", "bpf", "-mcpu=v3", "-Wall", "-Werror"])
                .arg(format!("-D__TARGET_ARCH_{}", arch.0))
                .arg(format!("-I/usr/include/{}", arch.1))
                .arg("-I")
                .arg(manifest.join("../proto-flat/include"))
                .arg("-c")
                .arg(&src)
                .arg("-o")
                .arg(&obj)
                .output();
            match result {
                Ok(o) if o.status.success() => {}
                Ok(o) => {
                    failed = Some(format!(
                        "{clang} failed on {}: {}",
                        src.display(),
                        String::from_utf8_lossy(&o.stderr).lines().take(8).collect::<Vec<_>>().join(" | ")
                    ));
                    break;
                }
                Err(e) => {
                    failed = Some(format!("{clang} not runnable ({e}); install clang and libbpf-dev"));
                    break;
                }
            }
        }
        failed
    };
    let clang_version = Command::new(&clang)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_default();
    match why_not {
        None => {
            println!("cargo::rustc-cfg=ringwatch_bpf");
            println!("cargo::rustc-env=RINGWATCH_BPF_BUILT_WITH={clang_version}");
            println!("cargo::rustc-env=RINGWATCH_BPF_MISSING=");
        }
        Some(why) => {
            println!("cargo::warning=node-shipper is built without its eBPF object: {why}");
            println!("cargo::rustc-env=RINGWATCH_BPF_BUILT_WITH=");
            println!("cargo::rustc-env=RINGWATCH_BPF_MISSING={why}");
        }
    }
}

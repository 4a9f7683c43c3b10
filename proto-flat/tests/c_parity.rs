//! Layout parity between the Rust structs and `include/ringwatch.h`.
//!
//! - gcc: a generated C program prints `sizeof`/`offsetof` of every struct and field and
//!   the value of every enum constant; they must equal the Rust layout and codes.
//! - A copy of the header with one field moved must make that comparison fail.
//! - clang -target bpf -g + `bpftool btf dump`: the BTF the eBPF programs will carry
//!   must agree too. Mandatory under `CI=true`; elsewhere it skips, saying why, when
//!   clang or bpftool is missing.

#![allow(clippy::cast_possible_truncation, reason = "BTF sizes and offsets of these small structs fit usize")]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use proto_flat::batch::BatchHeader;
use proto_flat::codes::{ALL_ENUMS, activation, flags};
use proto_flat::control::{AckHead, AckRange, ControlHeader, HelloBody, HelloExt, NackBody, ResumeHead, ResumeStream};
use proto_flat::frames::{
    BulkPacketFrame, BulkProxyFrame, CollectiveFrame, EpochStartFrame, LossRecordFrame, P2pFrame, ShipperGapFrame,
};
use proto_flat::header::FrameHeader;
use proto_flat::kernel::{EpochMeta, IfCounters, ProgressKey, ProgressStats, RingCounters, SamplingControl};
use proto_flat::sections::{
    ClockGpuEntry, ClockRealtimeEntry, HeartbeatHead, InterfaceEntry, OwnerEntry, ProgressEntry, SectionHeader,
    SessionStartHead, SessionStreamEntry, ShipperStateEntry, StreamEntry, StreamSummaryEntry,
};

#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    name: &'static str,
    offset: usize,
    size: usize,
}

#[derive(Debug, Clone)]
struct Layout {
    c: &'static str,
    size: usize,
    fields: Vec<Field>,
}

fn field_size<T, F>(_: impl Fn(&T) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! layout {
    ($ty:ty, $c:literal, [$($f:ident),* $(,)?]) => {
        Layout {
            c: $c,
            size: size_of::<$ty>(),
            fields: vec![$(Field {
                name: stringify!($f),
                offset: offset_of!($ty, $f),
                size: field_size(|s: &$ty| &s.$f),
            }),*],
        }
    };
}

fn rust_layouts() -> Vec<Layout> {
    vec![
        layout!(FrameHeader, "rw_frame_header", [version, kind, flags, length, stream_id, seq, ts_ns]),
        layout!(RingCounters, "rw_ring_counters", [seq, drops, sampled_out, sample_tick, shedding]),
        layout!(SamplingControl, "rw_sampling_control", [bulk_level, _reserved0]),
        layout!(EpochMeta, "rw_epoch_meta", [epoch, start_realtime_ns, start_mono_ns, sessions, boot_id]),
        layout!(ProgressKey, "rw_progress_key", [comm_hash, comm_disambiguator, comm_instance, rank, _reserved0]),
        layout!(ProgressStats, "rw_progress_stats", [inserted, exits]),
        layout!(IfCounters, "rw_if_counters", [packets, bytes]),
        layout!(
            CollectiveFrame,
            "rw_collective_frame",
            [
                hdr,
                comm_hash,
                comm_disambiguator,
                comm_instance,
                comm_op_seq,
                local_op_seq,
                nccl_seq,
                count,
                group_id,
                graph_id,
                rank,
                nranks,
                root,
                pid,
                status,
                graph_node,
                replay_idx,
                local_rank,
                cuda_dev,
                channel,
                n_channels,
                op,
                dtype,
                phase,
                _reserved0
            ]
        ),
        layout!(
            P2pFrame,
            "rw_p2p_frame",
            [
                hdr,
                comm_hash,
                comm_disambiguator,
                comm_instance,
                local_op_seq,
                p2p_seq,
                count,
                group_id,
                rank,
                src,
                dst,
                pid,
                status,
                channel,
                n_channels,
                op,
                phase,
                dtype,
                _reserved0
            ]
        ),
        layout!(BulkPacketFrame, "rw_bulk_packet_frame", [hdr, ifindex, pkt_len, flow_hash, weight, queue]),
        layout!(
            BulkProxyFrame,
            "rw_bulk_proxy_frame",
            [hdr, comm_hash, comm_disambiguator, comm_instance, step, bytes, rank, peer, channel, weight, _reserved0]
        ),
        layout!(
            LossRecordFrame,
            "rw_loss_record_frame",
            [hdr, first_seq, last_seq, first_ts, last_ts, count, shipper_session, batch_seq, stream_id, cause, reason]
        ),
        layout!(ShipperGapFrame, "rw_shipper_gap_frame", [hdr, from_ns, to_ns, reason, _reserved0]),
        layout!(EpochStartFrame, "rw_epoch_start_frame", [hdr, epoch, start_realtime_ns, boot_id]),
        layout!(SectionHeader, "rw_section_header", [tag, entry_len, count]),
        layout!(HeartbeatHead, "rw_heartbeat_head", [head_len, section_count, snapshot_ns]),
        layout!(SessionStartHead, "rw_session_start_head", [head_len, section_count, shipper_session]),
        layout!(
            StreamEntry,
            "rw_stream_entry",
            [stream_id, fill_max_ppm, attempted_seq, drops, sampled_out, held_from_seq]
        ),
        layout!(
            ProgressEntry,
            "rw_progress_entry",
            [
                comm_hash,
                comm_disambiguator,
                comm_instance,
                cgroup_id,
                last_enqueued_op,
                last_kernel_started_op,
                last_completed_op,
                last_update_ns,
                gpu_uuid,
                rank,
                pid,
                exit_code,
                activation_mask,
                proc_state,
                _reserved0
            ]
        ),
        layout!(ClockRealtimeEntry, "rw_clock_realtime_entry", [mono_ns, realtime_ns]),
        layout!(ClockGpuEntry, "rw_clock_gpu_entry", [gpu_uuid, gpu_ns, mono_ns]),
        layout!(
            ShipperStateEntry,
            "rw_shipper_state_entry",
            [
                spool_bytes,
                spool_cap_bytes,
                psi_some_avg10_ppm,
                psi_full_avg10_ppm,
                shed_tier,
                sampling_level,
                _reserved0
            ]
        ),
        layout!(SessionStreamEntry, "rw_session_stream_entry", [stream_id, _reserved0, attempted_seq]),
        layout!(OwnerEntry, "rw_owner_entry", [pid, flags, slurm_job_id, pod_uid, container_id]),
        layout!(InterfaceEntry, "rw_interface_entry", [ifindex, _reserved0, packets, bytes]),
        layout!(
            StreamSummaryEntry,
            "rw_stream_summary_entry",
            [stream_id, frame_count, first_seq, last_seq, first_ts, last_ts]
        ),
        layout!(
            BatchHeader,
            "rw_batch_header",
            [
                magic,
                version,
                header_len,
                node_id,
                epoch,
                shipper_session,
                batch_seq,
                frame_count,
                payload_len,
                crc32c,
                lane,
                _reserved0,
                lost_total,
                shipped_total,
                sampled_out_total,
                clock_mono_ns,
                clock_realtime_ns
            ]
        ),
        layout!(ControlHeader, "rw_control_header", [msg_type, _reserved0, length]),
        layout!(HelloBody, "rw_hello_body", [aggregator_instance, aggregator_epoch]),
        layout!(HelloExt, "rw_hello_ext", [control_version, durability, _reserved0]),
        layout!(AckHead, "rw_ack_head", [shipper_session, range_count, status, _reserved0]),
        layout!(AckRange, "rw_ack_range", [first, last]),
        layout!(NackBody, "rw_nack_body", [shipper_session, batch_seq, reason, _reserved0]),
        layout!(
            ResumeHead,
            "rw_resume_head",
            [shipper_session, epoch, next_batch_seq, range_count, stream_count, sent_ns]
        ),
        layout!(ResumeStream, "rw_resume_stream", [stream_id, _reserved0, floor_seq]),
    ]
}

/// Every constant the C header must define, with its value.
fn rust_consts() -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for table in ALL_ENUMS {
        for &(value, code) in table.values {
            out.insert(format!("RW_{}_{}", table.name, value).to_uppercase(), code);
        }
    }
    for &(bit, name) in flags::ALL {
        out.insert(format!("RW_FLAG_{}", name.to_uppercase()), u64::from(bit));
    }
    for &(bit, name) in activation::ALL {
        out.insert(format!("RW_ACTIVATION_{}", name.to_uppercase()), u64::from(bit));
    }
    out.insert("RW_OWNER_POD".into(), u64::from(proto_flat::sections::OWNER_POD));
    out.insert("RW_OWNER_CONTAINER".into(), u64::from(proto_flat::sections::OWNER_CONTAINER));
    out.insert("RW_OWNER_SLURM_JOB".into(), u64::from(proto_flat::sections::OWNER_SLURM_JOB));
    out.insert("RW_WIRE_VERSION".into(), u64::from(proto_flat::WIRE_VERSION));
    out.insert("RW_BATCH_MAGIC".into(), u64::from(proto_flat::BATCH_MAGIC));
    out.insert("RW_DROP_SLOTS".into(), proto_flat::codes::DROP_SLOTS as u64);
    out.insert("RW_FRAME_ALIGN".into(), proto_flat::header::FRAME_ALIGN as u64);
    out.insert("RW_RING_P0".into(), u64::from(proto_flat::kernel::RING_P0));
    out.insert("RW_RING_BULK".into(), u64::from(proto_flat::kernel::RING_BULK));
    out.insert("RW_RING_COUNT".into(), u64::from(proto_flat::kernel::RING_COUNT));
    out.insert("RW_MAX_SAMPLING_LEVEL".into(), u64::from(proto_flat::kernel::MAX_SAMPLING_LEVEL));
    out.insert("RW_PIN_LAYOUT".into(), u64::from(proto_flat::kernel::PIN_LAYOUT));
    out.insert("RW_MAX_INTERFACES".into(), u64::from(proto_flat::kernel::MAX_INTERFACES));
    out.insert("RW_IFINDEX_OVERFLOW".into(), u64::from(proto_flat::sections::IFINDEX_OVERFLOW));
    out
}

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("c_parity_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The C program that prints the C side's view of every struct, field and constant.
fn probe_program(layouts: &[Layout], consts: &BTreeMap<String, u64>) -> String {
    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"ringwatch.h\"\nint main(void) {\n");
    for l in layouts {
        writeln!(c, "  printf(\"struct {0} %zu\\n\", sizeof(struct {0}));", l.c).unwrap();
        for f in &l.fields {
            writeln!(
                c,
                "  printf(\"field {0} {1} %zu %zu\\n\", offsetof(struct {0}, {1}), sizeof(((struct {0} *)0)->{1}));",
                l.c, f.name
            )
            .unwrap();
        }
    }
    for name in consts.keys() {
        writeln!(c, "  printf(\"const {name} %llu\\n\", (unsigned long long)({name}));").unwrap();
    }
    c.push_str("  return 0;\n}\n");
    c
}

/// What the Rust side says, in the probe's output format.
fn expected_lines(layouts: &[Layout], consts: &BTreeMap<String, u64>) -> Vec<String> {
    let mut out = Vec::new();
    for l in layouts {
        out.push(format!("struct {} {}", l.c, l.size));
        for f in &l.fields {
            out.push(format!("field {} {} {} {}", l.c, f.name, f.offset, f.size));
        }
    }
    for (name, value) in consts {
        out.push(format!("const {name} {value}"));
    }
    out
}

/// Compiles the probe against the header in `include` with gcc, runs it, and returns the
/// differences from the Rust layout (empty = parity).
fn gcc_differences(include: &Path, work: &Path) -> Result<Vec<String>, String> {
    let layouts = rust_layouts();
    let consts = rust_consts();
    let src = work.join("probe.c");
    let bin = work.join("probe");
    std::fs::write(&src, probe_program(&layouts, &consts)).unwrap();
    let out = Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg("-I")
        .arg(include)
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run gcc: {e}"))?;
    if !out.status.success() {
        return Err(format!("gcc failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    let run = Command::new(&bin).output().unwrap();
    assert!(run.status.success());
    let got: Vec<String> = String::from_utf8(run.stdout).unwrap().lines().map(str::to_owned).collect();
    let want = expected_lines(&layouts, &consts);
    let mut diffs = Vec::new();
    for (w, g) in want.iter().zip(got.iter()) {
        if w != g {
            diffs.push(format!("rust: {w:<60} c: {g}"));
        }
    }
    if want.len() != got.len() {
        diffs.push(format!("line count: rust {} c {}", want.len(), got.len()));
    }
    Ok(diffs)
}

#[test]
fn rust_layouts_list_every_byte() {
    // Rust fields are alignment 1, so the listed fields must tile each struct exactly:
    // a field missing from the table (and so from the C comparison) fails here.
    for l in rust_layouts() {
        let mut at = 0;
        for f in &l.fields {
            assert_eq!(f.offset, at, "{}: field {} not contiguous", l.c, f.name);
            at += f.size;
        }
        assert_eq!(at, l.size, "{}: fields do not cover the struct", l.c);
        assert_eq!(l.size % 8, 0, "{}: size not a multiple of 8", l.c);
        // C alignment needs no check here: C would insert padding where a field is not
        // naturally aligned, and the gcc comparison would then differ.
    }
}

#[test]
fn c_header_matches_rust_layout_gcc() {
    let work = scratch_dir("gcc");
    let diffs = gcc_differences(&include_dir(), &work).unwrap();
    assert!(diffs.is_empty(), "C header and Rust layout differ:\n{}", diffs.join("\n"));
}

#[test]
fn moved_field_in_header_copy_is_detected() {
    let header = std::fs::read_to_string(include_dir().join("ringwatch.h")).unwrap();
    // Move `rank` below `pid` in the collective frame: same size, different offsets.
    let start = header.find("struct rw_collective_frame {").unwrap();
    let (before, body) = header.split_at(start);
    let moved = body.replacen("\t__u32 rank;\n", "", 1).replacen("\t__u32 pid;\n", "\t__u32 pid;\n\t__u32 rank;\n", 1);
    assert_ne!(moved, body, "the mutation must change the header");
    let work = scratch_dir("moved");
    let include = work.join("include");
    std::fs::create_dir_all(&include).unwrap();
    std::fs::write(include.join("ringwatch.h"), format!("{before}{moved}")).unwrap();
    let diffs = gcc_differences(&include, &work).unwrap();
    assert!(!diffs.is_empty(), "moving a field must break parity");
    assert!(diffs.iter().any(|d| d.contains("rw_collective_frame rank")), "{diffs:?}");
}

fn tool_available(tool: &str, arg: &str) -> bool {
    Command::new(tool).arg(arg).output().map(|o| o.status.success()).unwrap_or(false)
}

/// Resolves a BTF type id to its size in bytes.
fn btf_size(types: &BTreeMap<u64, serde_json::Value>, id: u64) -> usize {
    let t = &types[&id];
    match t["kind"].as_str().unwrap() {
        "INT" | "STRUCT" | "UNION" | "ENUM" => t["size"].as_u64().unwrap() as usize,
        "ARRAY" => t["nr_elems"].as_u64().unwrap() as usize * btf_size(types, t["type_id"].as_u64().unwrap()),
        "TYPEDEF" | "CONST" | "VOLATILE" => btf_size(types, t["type_id"].as_u64().unwrap()),
        other => panic!("unexpected BTF kind {other}"),
    }
}

#[test]
fn c_header_btf_matches_rust_layout() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let have = tool_available("clang", "--version") && tool_available("bpftool", "version");
    if !have {
        assert!(
            !ci,
            "CI=true: the BTF parity check is mandatory but clang or bpftool is missing (.ci/run installs them)"
        );
        println!(
            "SKIP c_header_btf_matches_rust_layout: clang or bpftool not installed (apt-get install clang bpftool)"
        );
        return;
    }
    let layouts = rust_layouts();
    let consts = rust_consts();
    let work = scratch_dir("btf");
    let mut src = String::from("#include \"ringwatch.h\"\n");
    for (i, l) in layouts.iter().enumerate() {
        writeln!(src, "struct {} rw_keep_{i} __attribute__((used));", l.c).unwrap();
    }
    for table in ALL_ENUMS {
        writeln!(src, "enum rw_{0} rw_keep_enum_{0} __attribute__((used));", table.name).unwrap();
    }
    std::fs::write(work.join("probe.bpf.c"), src).unwrap();
    let obj = work.join("probe.bpf.o");
    let out = Command::new("clang")
        .args(["-O2", "-g", "-target", "bpf", "-D__TARGET_ARCH_x86", "-I/usr/include/x86_64-linux-gnu", "-I"])
        .arg(include_dir())
        .arg("-c")
        .arg(work.join("probe.bpf.c"))
        .arg("-o")
        .arg(&obj)
        .output()
        .unwrap();
    assert!(out.status.success(), "clang -target bpf failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let dump = Command::new("bpftool").args(["-j", "btf", "dump", "file"]).arg(&obj).output().unwrap();
    assert!(dump.status.success(), "bpftool failed:\n{}", String::from_utf8_lossy(&dump.stderr));
    let json: serde_json::Value = serde_json::from_slice(&dump.stdout).unwrap();
    let types: BTreeMap<u64, serde_json::Value> =
        json["types"].as_array().unwrap().iter().map(|t| (t["id"].as_u64().unwrap(), t.clone())).collect();

    let mut diffs = Vec::new();
    for l in &layouts {
        let Some(t) = types.values().find(|t| t["kind"] == "STRUCT" && t["name"] == l.c) else {
            diffs.push(format!("{}: not in BTF", l.c));
            continue;
        };
        if t["size"].as_u64().unwrap() as usize != l.size {
            diffs.push(format!("{}: BTF size {} rust {}", l.c, t["size"], l.size));
        }
        let members = t["members"].as_array().unwrap();
        if members.len() != l.fields.len() {
            diffs.push(format!("{}: BTF has {} members, rust {}", l.c, members.len(), l.fields.len()));
        }
        for (m, f) in members.iter().zip(&l.fields) {
            let name = m["name"].as_str().unwrap();
            let offset = m["bits_offset"].as_u64().unwrap() as usize / 8;
            let size = btf_size(&types, m["type_id"].as_u64().unwrap());
            if (name, offset, size) != (f.name, f.offset, f.size) {
                diffs.push(format!(
                    "{}: BTF member {name}@{offset}+{size}, rust {}@{}+{}",
                    l.c, f.name, f.offset, f.size
                ));
            }
        }
    }
    let mut btf_consts = BTreeMap::new();
    for t in types.values().filter(|t| t["kind"] == "ENUM") {
        for v in t["values"].as_array().unwrap() {
            btf_consts.insert(v["name"].as_str().unwrap().to_owned(), v["val"].as_u64().unwrap());
        }
    }
    for (name, value) in consts.iter().filter(|(n, _)| {
        !n.starts_with("RW_FLAG_")
            && !n.starts_with("RW_ACTIVATION_")
            && !n.starts_with("RW_OWNER_")
            && !n.contains("RW_WIRE")
    }) {
        if [
            "RW_BATCH_MAGIC",
            "RW_DROP_SLOTS",
            "RW_FRAME_ALIGN",
            "RW_RING_P0",
            "RW_RING_BULK",
            "RW_RING_COUNT",
            "RW_MAX_SAMPLING_LEVEL",
            "RW_PIN_LAYOUT",
            "RW_MAX_INTERFACES",
            "RW_IFINDEX_OVERFLOW",
        ]
        .contains(&name.as_str())
        {
            continue; // preprocessor constants leave no BTF; the gcc probe checks them.
        }
        match btf_consts.get(name) {
            Some(v) if v == value => {}
            other => diffs.push(format!("{name}: BTF {other:?}, rust {value}")),
        }
    }
    assert!(diffs.is_empty(), "BTF and Rust layout differ:\n{}", diffs.join("\n"));
    println!("BTF parity: {} structs, {} enum constants checked", layouts.len(), btf_consts.len());
}

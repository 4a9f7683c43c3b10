//! The documentation is part of the contract: the wire README lists every enum value the
//! code knows (and no other), and the top README's test command is what CI runs.

use std::collections::BTreeMap;

use proto_flat::codes::ALL_ENUMS;
use ringwatch_tests::repo_root;

/// `### \`name\` (type)` headings followed by `| \`value\` | code |` rows.
fn readme_enums(text: &str) -> BTreeMap<String, Vec<(String, u64)>> {
    let mut out: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("### `") {
            current = rest.split('`').next().map(str::to_owned);
            continue;
        }
        if line.starts_with('#') {
            current = None;
            continue;
        }
        let Some(name) = &current else { continue };
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if let [_, value, code, _] = cells.as_slice()
            && let (Some(value), Ok(code)) = (value.strip_prefix('`').and_then(|v| v.strip_suffix('`')), code.parse())
        {
            out.entry(name.clone()).or_default().push((value.to_owned(), code));
        }
    }
    out
}

#[test]
fn wire_readme_lists_every_enum_value() {
    let text = std::fs::read_to_string(repo_root().join("proto-flat/README.md")).unwrap();
    let code: BTreeMap<String, Vec<(String, u64)>> = ALL_ENUMS
        .iter()
        .map(|t| (t.name.to_owned(), t.values.iter().map(|&(n, c)| (n.to_owned(), c)).collect()))
        .collect();
    assert_eq!(readme_enums(&text), code, "proto-flat/README.md enum tables disagree with proto_flat::codes");
}

#[test]
fn wire_readme_struct_sizes_match_the_code() {
    use proto_flat::{batch, control, frames, header, sections};
    let text = std::fs::read_to_string(repo_root().join("proto-flat/README.md")).unwrap();
    let sizes = [
        ("rw_frame_header", size_of::<header::FrameHeader>()),
        ("rw_collective_frame", size_of::<frames::CollectiveFrame>()),
        ("rw_p2p_frame", size_of::<frames::P2pFrame>()),
        ("rw_bulk_packet_frame", size_of::<frames::BulkPacketFrame>()),
        ("rw_bulk_proxy_frame", size_of::<frames::BulkProxyFrame>()),
        ("rw_loss_record_frame", size_of::<frames::LossRecordFrame>()),
        ("rw_shipper_gap_frame", size_of::<frames::ShipperGapFrame>()),
        ("rw_epoch_start_frame", size_of::<frames::EpochStartFrame>()),
        ("rw_stream_entry", size_of::<sections::StreamEntry>()),
        ("rw_progress_entry", size_of::<sections::ProgressEntry>()),
        ("rw_owner_entry", size_of::<sections::OwnerEntry>()),
        ("rw_interface_entry", size_of::<sections::InterfaceEntry>()),
        ("rw_batch_header", size_of::<batch::BatchHeader>()),
        ("rw_ack_head", size_of::<control::AckHead>()),
        ("rw_resume_head", size_of::<control::ResumeHead>()),
        ("rw_resume_stream", size_of::<control::ResumeStream>()),
    ];
    for (name, size) in sizes {
        let heading = format!("#### `{name}` ({size} B)");
        assert!(text.contains(&heading), "proto-flat/README.md lacks {heading:?}");
    }
}

#[test]
fn readme_test_command_is_what_ci_runs() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let ci = std::fs::read_to_string(repo_root().join(".ci/run")).unwrap();
    let command = "scripts/test";
    assert!(readme.lines().any(|l| l.trim() == command), "README.md must hold the test command on a line of its own");
    let script = std::fs::read_to_string(repo_root().join(command)).unwrap();
    assert!(
        script.contains("cargo install cargo-nextest --locked")
            && script.contains("exec cargo nextest run --workspace --profile ci"),
        "scripts/test must install cargo-nextest when missing and run the ci profile"
    );
    assert!(ci.lines().any(|l| l.trim() == command), ".ci/run must run the README's test command verbatim");
    for step in ["cargo fmt --all -- --check", "cargo clippy --workspace --all-targets --locked -- -D warnings"] {
        assert!(ci.contains(step), ".ci/run must run {step}");
    }
}

/// `docs/metrics.md` as the metric tables make it: the prose around two generated
/// tables. `RINGWATCH_WRITE_DOCS=1` rewrites the tables in place.
#[test]
fn metrics_doc_lists_every_metric_of_both_binaries() {
    use ringwatch_transport::metrics::{markdown, problems};
    let path = repo_root().join("docs/metrics.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut want = text.clone();
    for (binary, specs) in [
        ("both binaries", &ringwatch_transport::metrics::STANDARD[..]),
        ("aggregator", aggregator::metrics::SPECS),
        ("node-shipper", node_shipper::metrics::SPECS),
    ] {
        assert_eq!(problems(specs), Vec::<String>::new(), "{binary}");
        let begin = format!("<!-- {binary} metrics: generated -->\n");
        let end = format!("<!-- end {binary} metrics -->");
        let from = want.find(&begin).unwrap_or_else(|| panic!("docs/metrics.md lacks {begin:?}")) + begin.len();
        let to = want[from..].find(&end).unwrap_or_else(|| panic!("docs/metrics.md lacks {end:?}")) + from;
        want.replace_range(from..to, &markdown(specs));
    }
    if std::env::var_os("RINGWATCH_WRITE_DOCS").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    assert!(text == want, "docs/metrics.md is out of date: rerun with RINGWATCH_WRITE_DOCS=1");
}

/// The repository stands alone: no file refers to notes that live outside it (the design
/// and the measured platform facts are in `docs/`). Walks the tree, skipping build output,
/// git's own files and fuzz corpora (binary inputs).
#[test]
fn nothing_refers_to_files_outside_the_repository() {
    const OUTSIDE: [&str; 8] =
        ["../shared", "DESIGN.md", "/quic.md", "/kernel.md", "/nccl.md", "anchors.md", "STYLE.md", "nccl-layouts.md"];
    const BARE: [&str; 3] = ["quic.md", "kernel.md", "nccl.md"];
    let root = repo_root();
    let mut stack = vec![root.clone()];
    let mut offenders = Vec::new();
    let mut files = 0usize;
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if entry.file_type().unwrap().is_dir() {
                if !matches!(name.as_ref(), "target" | ".git" | "corpus" | "artifacts" | "node_modules" | "coverage") {
                    stack.push(path);
                }
                continue;
            }
            if path.ends_with("tests/tests/docs.rs") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else { continue };
            files += 1;
            for (n, line) in text.lines().enumerate() {
                let bare = BARE.iter().any(|b| {
                    line.match_indices(b).any(|(i, _)| {
                        i == 0 || !line.as_bytes()[i - 1].is_ascii_alphanumeric() && line.as_bytes()[i - 1] != b'-'
                    })
                });
                if bare || OUTSIDE.iter().any(|o| line.contains(o)) {
                    offenders.push(format!(
                        "{}:{}: {}",
                        path.strip_prefix(&root).unwrap().display(),
                        n + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(files > 100, "walked only {files} files from {}", root.display());
    assert!(offenders.is_empty(), "references to files outside the repository:\n{}", offenders.join("\n"));
}

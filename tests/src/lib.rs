//! Cross-crate end-to-end tests live in `tests/tests/`; this library holds their shared
//! helpers (test-only crate, never published).

/// The repository root (the workspace directory), for tests that read the project's
/// own files.
#[must_use]
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

//! The `ledger` example as a binary for the tests that run it as a real
//! process (`kill_loop`, the rolling restarts, the replicas' chaos).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

/// `<target>/<profile>/examples/ledger`, built by cargo first (cargo
/// decides whether anything is to be built; `cargo test --test …` alone
/// does not build examples). The package's default features, which
/// include `postgres`, are those of the test build.
pub(crate) fn ledger_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("<target>/<profile>/deps/<test>")?;
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--example", "ledger"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    // Cargo gives the test process its package's variables; build scripts
    // that watch them (ring does) would rebuild if the nested cargo saw
    // them, and the outer one again afterwards.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        let from_cargo = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"].contains(&name.as_str());
        if from_cargo {
            cmd.env_remove(&name);
        }
    }
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    if let Some(target) = profile_dir.parent() {
        cmd.arg("--target-dir").arg(target);
    }
    ensure!(
        cmd.status()?.success(),
        "cargo build --example ledger failed"
    );
    let bin = profile_dir.join("examples").join("ledger");
    ensure!(bin.exists(), "no ledger example at {}", bin.display());
    Ok(bin)
}

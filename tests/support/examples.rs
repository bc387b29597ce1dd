//! The examples as binaries, for the tests that run them as real
//! processes.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

/// `<target>/<profile>/examples/<name>` for each of `names`, built by cargo
/// first (cargo decides whether anything is to be built; `cargo test
/// --test …` alone does not build examples). The package's default
/// features, which include `postgres`, are those of the test build.
pub(crate) fn example_binaries(names: &[&str]) -> Result<Vec<PathBuf>> {
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("<target>/<profile>/deps/<test>")?;
    let mut cmd = Command::new(env!("CARGO"));
    cmd.arg("build").current_dir(env!("CARGO_MANIFEST_DIR"));
    for name in names {
        cmd.args(["--example", name]);
    }
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
        "cargo build --example {} failed",
        names.join(" --example ")
    );
    names
        .iter()
        .map(|name| {
            let bin = profile_dir.join("examples").join(name);
            ensure!(bin.exists(), "no {name} example at {}", bin.display());
            Ok(bin)
        })
        .collect()
}

//! The process's CPU time and resident memory (Linux `/proc/self`).

use super::*;

/// This process's CPU time (user + system), from `/proc/self/stat`.
pub(crate) fn cpu_time() -> Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The fields after the command name (which may hold spaces).
    let rest = stat.rsplit_once(')').context("/proc/self/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks =
        |i: usize| -> Result<u64> { Ok(fields.get(i).context("/proc/self/stat field")?.parse()?) };
    // utime and stime are fields 14 and 15 (1-based), in clock ticks of
    // 1/100 s on Linux.
    let total = ticks(11)? + ticks(12)?;
    Ok(Duration::from_millis(total * 10))
}

/// The resident memory now, from `/proc/self/status`.
pub(crate) fn rss_kib() -> Result<u64> {
    status_kib("VmRSS:")
}

/// A `/proc/self/status` figure in KiB.
pub(crate) fn status_kib(name: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with(name))
        .with_context(|| name.to_owned())?;
    Ok(line.split_whitespace().nth(1).context("a value")?.parse()?)
}

/// The peak resident memory since the last reset, from `/proc/self/status`.
pub(crate) fn peak_rss_kib() -> Result<u64> {
    status_kib("VmHWM:")
}

/// Starts the peak resident memory afresh (`/proc/self/clear_refs`, 5).
pub(crate) fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

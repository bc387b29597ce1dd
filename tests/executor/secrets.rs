//! The executor's token and the platform's grants never show up in logs or
//! in `Debug` output.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[path = "../support/leaks.rs"]
mod leaks;

use anyhow::Result;
use serde_json::json;
use toolrunner::Executor;
use toolrunner::testing::store::{CallFilter, Store};
use tracing_subscriber::fmt::format::FmtSpan;

use crate::fixture::*;
use crate::tools::*;

const TOKEN: &str = "tok-SECRET-1234";
const WRONG_TOKEN: &str = "tok-SECRET-WRONG-5678";

/// Appends everything written to a shared buffer.
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures all tracing output (TRACE, span events, `log` records too) of a
/// full run with completed, progress, refused and panicking calls, plus the
/// `Debug` of the builder, executor, running executor, call contexts,
/// errors and everything the store holds; neither the token (nor a wrong
/// token that was refused) nor any grant the store received appears.
///
/// The subscriber is process-global (the executor logs from spawned tasks
/// and sqlx from its own threads); only this test installs one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_reach_logs_or_debug_output() -> Result<()> {
    let logs = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = logs.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_span_events(FmtSpan::FULL)
        .with_writer(move || Capture(sink.clone()))
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the global subscriber: {e}"))?;

    let opts = Opts {
        exec_token: TOKEN.to_owned(),
        heartbeat_interval_ms: 200,
        ..Opts::default()
    };
    let env = Env::start(opts, &[READ, WRITE]).await?;
    let reads = Probe::new();
    let writes = Probe::new();
    let mut debug = Vec::<String>::new();

    let builder = env
        .builder("exe-secrets")
        .tool(ReadTool {
            probe: reads.clone(),
        })
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Progress,
        });
    debug.push(format!("{builder:?}"));
    let exec = builder.build()?;
    debug.push(format!("{exec:?}"));
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run_with(
            &agv,
            "user_42",
            vec![
                json!({"tool_name": READ, "arguments": {"cursor": "c"}}),
                json!({"tool_name": WRITE, "arguments": {"amount": 5, "memo": "fine"}}),
                json!({"tool_name": WRITE, "arguments": {"amount": 6, "memo": "panic"}}),
                json!({"tool_name": WRITE, "arguments": {"amount": 0, "memo": "bad"}, "unchecked": true}),
            ],
        )
        .await?;
    let running = exec.start().await?;
    debug.push(format!("{running:?}"));
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    let states: Vec<String> = calls(&run).iter().map(state).collect();
    assert_eq!(
        states,
        [
            "completed",
            "completed",
            "reconciliation_required",
            "failed"
        ],
        "{run:#}"
    );

    // Errors: a builder error, and a token the platform refuses.
    let e = Executor::builder()
        .token(TOKEN)
        .build()
        .expect_err("no base url");
    debug.push(format!("{e:?} {e}"));
    let refused = env
        .builder("exe-secrets-wrong")
        .token(WRONG_TOKEN)
        .store_url(env.other_store_url("wrong.db"))
        .tool(ReadTool {
            probe: Probe::new(),
        })
        .build()?;
    debug.push(format!("{refused:?}"));
    let e = bounded(Duration::from_secs(10), "refused start", refused.start())
        .await
        .expect_err("the platform refuses an unknown token");
    assert!(e.is_configuration(), "{e:?}");
    debug.push(format!("{e:?} {e}"));

    // Everything the store holds, through its Debug.
    let store = env.open_store().await?;
    let stored = store.calls(&CallFilter::default()).await?;
    debug.push(format!("{store:?} {stored:?}"));
    let mut grants = Vec::new();
    for c in &stored {
        debug.push(format!(
            "{:?}",
            store.receipts(&c.run_id, &c.call_id).await?
        ));
        debug.push(format!("{:?}", store.events(&c.run_id, &c.call_id).await?));
        if let Some(a) = &c.assignment {
            debug.push(format!("{a:?} {:?}", a.grant));
            grants.push(a.grant.expose().to_owned());
        }
    }
    debug.extend(writes.debug.lock().unwrap().iter().cloned());
    debug.extend(reads.debug.lock().unwrap().iter().cloned());
    assert_eq!(grants.len(), 4, "one assignment per call: {stored:?}");
    assert!(grants.iter().all(|g| g.len() > 8), "{}", grants.len());

    // The store keeps grants (it must, to deliver receipts) but never the token.
    for entry in std::fs::read_dir(env.dir.path())? {
        let path = entry?.path();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            // A WAL file a closing store removed after the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        assert!(
            !bytes.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes()),
            "the token is stored in {}",
            path.display()
        );
    }
    env.shutdown().await;
    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    // The capture works, also for the executor's spawned tasks.
    assert!(
        logs.contains("refused before start") && logs.contains(&run_id),
        "the executor's logs were not captured ({} bytes)",
        logs.len()
    );
    let debug = debug.join("\n");
    assert!(
        debug.contains("Grant(<redacted>)"),
        "the assignment's Debug was captured"
    );
    let planted: Vec<(&str, &str)> = [("the token", TOKEN), ("the refused token", WRONG_TOKEN)]
        .into_iter()
        .chain(grants.iter().map(|g| ("a grant", g.as_str())))
        .collect();
    let leaks = leaks::leaks(&[("logs", &logs), ("Debug output", &debug)], &planted);
    assert!(
        leaks.is_empty(),
        "{} secret occurrence(s):\n{}",
        leaks.len(),
        leaks.join("\n---\n")
    );
    Ok(())
}

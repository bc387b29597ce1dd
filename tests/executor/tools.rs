//! Typed test tools that count their invocations and record their side
//! effects, so a test can say exactly what ran.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use toolrunner::{
    AuthorizationRequest, Authorizer, CallContext, CommitPointError, Denied, Effect, Tool,
    ToolError, async_trait,
};

pub const READ: &str = "tasks.read";
pub const WRITE: &str = "ledger.append";
pub const BAD_OUTPUT: &str = "ledger.bad_output";

/// What a handler saw of its call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub run_id: String,
    pub call_id: String,
    pub subject: String,
    pub agent_id: String,
    pub agent_version: String,
    pub tool_name: String,
    pub operation_key: String,
}

impl Seen {
    fn of(ctx: &CallContext) -> Seen {
        Seen {
            run_id: ctx.run_id().to_owned(),
            call_id: ctx.call_id().to_owned(),
            subject: ctx.subject().to_owned(),
            agent_id: ctx.agent_id().to_owned(),
            agent_version: ctx.agent_version().to_owned(),
            tool_name: ctx.tool_name().to_owned(),
            operation_key: ctx.operation_key().to_owned(),
        }
    }
}

/// Shared record of what a tool's handler did.
#[derive(Debug, Default)]
pub struct Probe {
    /// Handler invocations (entries into `call`).
    pub calls: AtomicUsize,
    /// Side effects taken (one per irreversible step).
    pub effects: Mutex<Vec<Value>>,
    /// Free-form notes (`cancelled`, `commit_point: ...`).
    pub notes: Mutex<Vec<String>>,
    /// The contexts of the calls.
    pub seen: Mutex<Vec<Seen>>,
    /// `format!("{ctx:?}")` of every call's context.
    pub debug: Mutex<Vec<String>>,
}

impl Probe {
    pub fn new() -> Arc<Probe> {
        Arc::new(Probe::default())
    }
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
    pub fn effects(&self) -> Vec<Value> {
        self.effects.lock().unwrap().clone()
    }
    pub fn notes(&self) -> Vec<String> {
        self.notes.lock().unwrap().clone()
    }
    pub fn note(&self, s: impl Into<String>) {
        self.notes.lock().unwrap().push(s.into());
    }
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    fn enter(&self, ctx: &CallContext) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push(Seen::of(ctx));
        self.debug.lock().unwrap().push(format!("{ctx:?}"));
    }
    fn effect(&self, v: Value) -> u64 {
        let mut e = self.effects.lock().unwrap();
        e.push(v);
        e.len() as u64
    }
}

// ------------------------------------------------------------------ read

/// `tasks.read` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadTasks {
    /// Page cursor.
    pub cursor: Option<String>,
}

/// `tasks.read` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TaskPage {
    pub tasks: Vec<String>,
    pub next_cursor: Option<String>,
}

/// A read tool: pages of tasks derived from the cursor.
pub struct ReadTool {
    pub probe: Arc<Probe>,
}

/// What [`ReadTool`] answers for a cursor.
pub fn page_for(cursor: Option<&str>) -> Value {
    let c = cursor.unwrap_or("start");
    json!({"tasks": [format!("{c}-1"), format!("{c}-2")], "next_cursor": format!("after-{c}")})
}

#[async_trait]
impl Tool for ReadTool {
    type Input = ReadTasks;
    type Output = TaskPage;
    fn name(&self) -> &str {
        READ
    }
    fn description(&self) -> &str {
        "Read tasks page by page"
    }
    fn effect(&self) -> Effect {
        Effect::Read
    }
    async fn call(&self, ctx: &CallContext, input: ReadTasks) -> Result<TaskPage, ToolError> {
        self.probe.enter(ctx);
        let c = input.cursor.unwrap_or_else(|| "start".to_owned());
        Ok(TaskPage {
            tasks: vec![format!("{c}-1"), format!("{c}-2")],
            next_cursor: Some(format!("after-{c}")),
        })
    }
}

// ----------------------------------------------------------------- write

/// `ledger.append` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Append {
    /// Amount in minor units.
    #[schemars(range(min = 1))]
    pub amount: u64,
    /// Free text; `panic` makes the handler panic.
    pub memo: String,
}

/// `ledger.append` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Appended {
    /// The position of the new entry (1-based).
    pub entry: u64,
    /// The amount appended.
    pub amount: u64,
}

/// How [`WriteTool`] behaves.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// Append at once.
    Append,
    /// Two progress receipts, then append.
    Progress,
    /// Wait for the cancellation token (at most this long), then return a
    /// business cancellation; append only if never cancelled.
    WaitCancel(Duration),
    /// Sleep, then `commit_point()`, then append only if it said yes.
    LateCommit(Duration),
    /// Sleep, then append.
    Slow(Duration),
    /// Note a cancellation if it comes but keep going for this long, then
    /// append.
    IgnoreCancel(Duration),
}

/// A write tool appending to an in-memory ledger (the probe's effects).
pub struct WriteTool {
    pub probe: Arc<Probe>,
    pub mode: Mode,
}

#[async_trait]
impl Tool for WriteTool {
    type Input = Append;
    type Output = Appended;
    fn name(&self) -> &str {
        WRITE
    }
    fn description(&self) -> &str {
        "Append one entry to the ledger"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, ctx: &CallContext, input: Append) -> Result<Appended, ToolError> {
        self.probe.enter(ctx);
        if input.memo == "panic" {
            panic!("test handler panics on purpose");
        }
        match self.mode {
            Mode::Append => {}
            Mode::Progress => {
                ctx.progress(
                    toolrunner::Progress::new("validated")
                        .fraction(0.25)
                        .data(json!({"step": 1})),
                )
                .await?;
                ctx.progress(
                    toolrunner::Progress::new("half way")
                        .fraction(0.5)
                        .data(json!({"step": 2})),
                )
                .await?;
            }
            Mode::WaitCancel(max) => {
                let start = Instant::now();
                tokio::select! {
                    _ = ctx.cancelled() => {
                        self.probe.note(format!("cancelled after {} ms", start.elapsed().as_millis()));
                        return Err(ToolError::cancelled("the run was cancelled"));
                    }
                    _ = tokio::time::sleep(max) => {
                        self.probe.note("timed out waiting for cancellation");
                    }
                }
            }
            Mode::LateCommit(d) => {
                tokio::time::sleep(d).await;
                let answer = ctx.commit_point().await;
                self.probe.note(format!("commit_point: {answer:?}"));
                if let Err(e) = answer {
                    return Err(e.into());
                }
            }
            Mode::Slow(d) => {
                tokio::time::sleep(d).await;
            }
            Mode::IgnoreCancel(d) => {
                let end = tokio::time::sleep(d);
                tokio::pin!(end);
                tokio::select! {
                    _ = ctx.cancelled() => {
                        self.probe.note("cancel signalled");
                        end.await;
                    }
                    _ = &mut end => {}
                }
            }
        }
        let entry = self.probe.effect(json!({
            "operation_key": ctx.operation_key(), "call_id": ctx.call_id(),
            "amount": input.amount, "memo": input.memo,
        }));
        Ok(Appended {
            entry,
            amount: input.amount,
        })
    }
}

/// Whether a note reports `commit_point` refusing for a lost lease.
pub fn is_lease_lost_note(n: &str) -> bool {
    n == format!(
        "commit_point: {:?}",
        Err::<(), _>(CommitPointError::LeaseLost)
    )
}

// ------------------------------------------------------- bad output

/// An output whose declared schema requires `entry` but which serializes
/// as `{}`: a handler bug the executor must not deliver as `completed`.
#[derive(Debug)]
pub struct Bogus;

impl Serialize for Bogus {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        s.serialize_map(Some(0))?.end()
    }
}

impl JsonSchema for Bogus {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Bogus".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "properties": {"entry": {"type": "integer"}},
            "required": ["entry"]
        })
    }
}

/// A write tool whose result violates its own output schema.
pub struct BadOutputTool {
    pub probe: Arc<Probe>,
}

#[async_trait]
impl Tool for BadOutputTool {
    type Input = Append;
    type Output = Bogus;
    fn name(&self) -> &str {
        BAD_OUTPUT
    }
    fn description(&self) -> &str {
        "Append, then return a result that breaks the output schema"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, ctx: &CallContext, input: Append) -> Result<Bogus, ToolError> {
        self.probe.enter(ctx);
        self.probe
            .effect(json!({"call_id": ctx.call_id(), "amount": input.amount}));
        Ok(Bogus)
    }
}

// ------------------------------------------------------- authorizer

/// Refuses every call whose subject is `denied_subject`; records every
/// request it was asked about.
pub struct SubjectAuthorizer {
    pub denied_subject: String,
    pub asked: Arc<Mutex<Vec<AuthorizationRequest>>>,
}

#[async_trait]
impl Authorizer for SubjectAuthorizer {
    async fn authorize(&self, request: &AuthorizationRequest) -> Result<(), Denied> {
        self.asked.lock().unwrap().push(request.clone());
        if request.subject == self.denied_subject {
            return Err(Denied::new("this user may not append to the ledger"));
        }
        Ok(())
    }
}

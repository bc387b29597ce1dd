//! Function tools end to end: `#[toolrunner::tool]` and `tool::write` with
//! shared `State<T>`, a reconcile hook, and the checks made at `build()`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::{CallContext, Reconciled, State, ToolError};

use crate::fixture::*;

/// The business ledger the tools write to.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Vec<(String, u64)>>>);

impl Ledger {
    fn entries(&self) -> Vec<(String, u64)> {
        self.0.lock().expect("not poisoned").clone()
    }
}

/// What to post.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Post {
    /// Amount in minor units.
    amount: u64,
}

/// The entry made.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
struct Posted {
    /// Its line number.
    entry: usize,
}

/// Posts an amount to the ledger (the model reads this).
#[toolrunner::tool(name = "ledger.post", effect = write, reconcile = find_post)]
async fn post(
    State(ledger): State<Ledger>,
    ctx: CallContext,
    input: Post,
) -> Result<Posted, ToolError> {
    let mut lines = ledger.0.lock().expect("not poisoned");
    lines.push((ctx.operation_key().to_owned(), input.amount));
    if input.amount == 13 {
        return Err(ToolError::unknown("the ledger timed out after writing"));
    }
    Ok(Posted { entry: lines.len() })
}

async fn find_post(State(ledger): State<Ledger>, ctx: CallContext) -> Reconciled<Posted> {
    let lines = ledger.entries();
    match lines.iter().position(|(k, _)| k == ctx.operation_key()) {
        Some(i) => Reconciled::Happened(Posted { entry: i + 1 }),
        None => Reconciled::DidNotHappen,
    }
}

/// The macro's tool and `tool::read` serve calls; the description is the
/// doc comment; a handler's unknown outcome is settled once by its hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_tools_serve_calls_and_their_hook_settles_the_unknown() -> Result<()> {
    let env = Env::start(Opts::default(), &["ledger.post", "ledger.total"]).await?;
    let ledger = Ledger::default();
    async fn total(
        State(ledger): State<Ledger>,
        _ctx: CallContext,
        _input: Empty,
    ) -> Result<Total, ToolError> {
        Ok(Total {
            total: ledger.entries().iter().map(|(_, a)| a).sum(),
        })
    }
    let exec = env
        .builder("exe-functions")
        .state(ledger.clone())
        .tool(post)
        .tool(toolrunner::tool::read("ledger.total", total).describe("The ledger's total"))
        .build()?;
    let post_def = exec
        .tool_definitions()
        .iter()
        .find(|d| d.name == "ledger.post")
        .expect("ledger.post");
    assert_eq!(
        post_def.description,
        "Posts an amount to the ledger (the model reads this)."
    );
    assert_eq!(
        post_def.input_schema["properties"]["amount"]["description"],
        "Amount in minor units."
    );
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_1",
            &[
                ("ledger.post", json!({"amount": 5})),
                ("ledger.post", json!({"amount": 13})),
            ],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(10)).await?;
    let states: Vec<String> = calls(&run).iter().map(state).collect();
    assert_eq!(states, ["completed", "completed"], "{run:#}");
    assert_eq!(ledger.entries().len(), 2, "each posted once");
    let total_run = env
        .run(&agv, "user_1", &[("ledger.total", json!({}))])
        .await?;
    let run = env
        .wait_settled(&total_run, Duration::from_secs(10))
        .await?;
    assert_eq!(
        receipt_body(&call_of(&run, "ledger.total"), "completed")["result"],
        json!({"total": 18})
    );
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    env.shutdown().await;
    Ok(())
}

/// No arguments.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Empty {}

/// A total.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
struct Total {
    /// The sum of every amount.
    total: u64,
}

/// A tool that takes a state nobody gave is refused at `build()`, naming
/// the tool and the state's type.
#[tokio::test]
async fn a_missing_state_is_refused_at_build() -> Result<()> {
    let err = toolrunner::Executor::builder()
        .base_url("http://127.0.0.1:1")
        .token("t")
        .executor_id("exe")
        .binding_id("bnd_1")
        .allow_all()
        .tool(post)
        .build()
        .expect_err("no State<Ledger>");
    let msg = err.to_string();
    assert!(
        msg.contains("ledger.post") && msg.contains("Ledger") && msg.contains(".state("),
        "{msg}"
    );
    Ok(())
}

/// An executor built only to tell its definitions needs no platform
/// settings: its definitions name the placeholder binding, and it never
/// starts (`--print-definitions` gives such a builder from the
/// environment).
#[tokio::test]
async fn definitions_need_no_platform() -> Result<()> {
    let exec = toolrunner::Executor::builder()
        .state(Ledger::default())
        .tool(post)
        .definitions_only()
        .build()?;
    let defs = exec.tool_definitions();
    assert_eq!(defs.len(), 1, "{defs:?}");
    assert_eq!(defs[0].name, "ledger.post");
    assert_eq!(defs[0].binding_id, toolrunner::UNBOUND);
    let refused = exec.start().await.expect_err("it does not start");
    assert!(
        refused.is_builder() && refused.to_string().contains("--print-definitions"),
        "{refused}"
    );
    // A binding id given is kept.
    let exec = toolrunner::Executor::builder()
        .binding_id("bnd_7")
        .state(Ledger::default())
        .tool(post)
        .definitions_only()
        .build()?;
    assert_eq!(exec.tool_definitions()[0].binding_id, "bnd_7");
    Ok(())
}
/// A nested part of [`Strict`].
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Part {
    /// Its label.
    label: String,
}

/// A shape, with a variant of named fields.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Shape {
    /// A point.
    Point,
    /// A box.
    Boxed {
        /// Its width.
        width: u64,
    },
}

/// No `#[serde(deny_unknown_fields)]` anywhere: the macro alone closes
/// every object it derives, and leaves a map open to any key.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Strict {
    /// A nested struct.
    part: Part,
    /// An enum with a struct variant.
    shape: Shape,
    /// Any keys, integer values.
    tags: std::collections::HashMap<String, u64>,
}

/// A handler that takes [`Strict`].
async fn take_strict(_ctx: CallContext, input: Strict) -> Result<Total, ToolError> {
    let width = match input.shape {
        Shape::Point => 0,
        Shape::Boxed { width } => width,
    };
    let _ = input.part.label;
    Ok(Total {
        total: input.tags.values().sum::<u64>() + width,
    })
}

/// An executor built (never started) with one tool, for its definitions.
fn definitions_of(tool: impl toolrunner::IntoTool) -> Vec<toolrunner::platform::ToolDefinition> {
    toolrunner::Executor::builder()
        .base_url("http://127.0.0.1:1")
        .token("t")
        .executor_id("exe")
        .binding_id("bnd_1")
        .allow_all()
        .tool(tool)
        .build()
        .expect("builds")
        .tool_definitions()
        .to_vec()
}

/// `#[toolrunner::schema]` is strict by default: the root, a nested
/// struct (in `$defs`) and an enum's struct variant each say
/// `"additionalProperties": false`; a `HashMap` field still takes any key;
/// the output type's schema is open (a result is what serde wrote).
#[test]
fn schema_types_are_closed_by_default() {
    let def =
        &definitions_of(toolrunner::tool::read("shapes.take", take_strict).describe("Takes"))[0];
    let input = &def.input_schema;
    let defs = &input["$defs"];
    let boxed = defs["Shape"]["oneOf"]
        .as_array()
        .expect("Shape is a oneOf")
        .iter()
        .find(|v| v["properties"]["boxed"].is_object())
        .expect("the boxed variant")["properties"]["boxed"]
        .clone();
    let closed = [
        ("the root", input["additionalProperties"].clone()),
        (
            "the nested struct",
            defs["Part"]["additionalProperties"].clone(),
        ),
        ("the struct variant", boxed["additionalProperties"].clone()),
    ];
    let output = def.output_schema.as_ref().expect("an output schema");
    assert!(
        output.get("additionalProperties").is_none(),
        "the output is open: {output:#}"
    );
    for (what, additional) in closed {
        assert_eq!(additional, json!(false), "{what} is not closed: {input:#}");
    }
    let tags = &input["properties"]["tags"];
    assert_eq!(tags["type"], "object", "{tags:#}");
    assert_eq!(
        tags["additionalProperties"]["type"], "integer",
        "a map takes any key: {tags:#}"
    );
}

/// A note, strict only through `#[toolrunner::schema]`.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Note {
    /// The text.
    text: String,
}

/// A call with an argument the tool does not declare fails the schema
/// check before the handler, and its message names the argument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_argument_fails_the_schema_check() -> Result<()> {
    let env = Env::start(Opts::default(), &["notes.add"]).await?;
    let ran = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = ran.clone();
    let add = move |_ctx: CallContext, note: Note| {
        let seen = seen.clone();
        async move {
            seen.lock().expect("not poisoned").push(note.text);
            Ok::<_, ToolError>(Total { total: 1 })
        }
    };
    let exec = env
        .builder("exe-unknown-arg")
        .tool(toolrunner::tool::write("notes.add", add).describe("Adds a note"))
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run_with(
            &agv,
            "user_1",
            vec![json!({"tool_name": "notes.add", "unchecked": true,
                        "arguments": {"text": "hi", "admin": true}})],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(10)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    let call = call_of(&run, "notes.add");
    assert_eq!(state(&call), "failed", "{call:#}");
    let error = &receipt_body(&call, "failed")["error"];
    assert_eq!(error["code"], "invalid_arguments", "{call:#}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("admin") && message.contains("not allowed"),
        "the message names the unknown argument: {message}"
    );
    assert!(
        ran.lock().expect("not poisoned").is_empty(),
        "the handler ran"
    );
    env.shutdown().await;
    Ok(())
}

/// Open on purpose: `#[toolrunner::schema(open)]`.
#[toolrunner::schema(open)]
#[derive(Debug, Deserialize)]
struct Loose {
    /// Its kind.
    kind: String,
}

/// Named fields, and any other key with a string value.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct WithExtras {
    /// Its kind.
    kind: String,
    /// Every other key.
    #[serde(flatten)]
    extras: std::collections::HashMap<String, String>,
}

/// A closed struct flattened into another.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct WithPart {
    /// The part's fields, inline.
    #[serde(flatten)]
    part: Part,
    /// A note.
    note: String,
}

/// The opt-out leaves the type open; a flattened map leaves the type open
/// to the map's values; a flattened struct keeps it closed; serde reads
/// each as before.
#[test]
fn open_and_flattened_types_accept_what_serde_accepts() {
    let schema = |s: toolrunner::schemars::Schema| serde_json::to_value(s).expect("json");
    let loose = schema(toolrunner::schemars::schema_for!(Loose));
    assert!(loose.get("additionalProperties").is_none(), "{loose:#}");
    let extras = schema(toolrunner::schemars::schema_for!(WithExtras));
    assert_eq!(
        extras["additionalProperties"],
        json!({"type": "string"}),
        "{extras:#}"
    );
    let with_part = schema(toolrunner::schemars::schema_for!(WithPart));
    assert_eq!(
        with_part["additionalProperties"],
        json!(false),
        "{with_part:#}"
    );
    assert!(
        with_part["properties"]["label"].is_object() && with_part["properties"]["note"].is_object(),
        "{with_part:#}"
    );
    let read: WithExtras =
        serde_json::from_value(json!({"kind": "k", "colour": "red"})).expect("reads");
    assert_eq!(
        (read.kind.as_str(), read.extras["colour"].as_str()),
        ("k", "red")
    );
    let read: Loose = serde_json::from_value(json!({"kind": "k", "x": 1})).expect("reads");
    assert_eq!(read.kind, "k");
    let read: WithPart = serde_json::from_value(json!({"label": "l", "note": "n"})).expect("reads");
    assert_eq!((read.part.label.as_str(), read.note.as_str()), ("l", "n"));
}

/// A result as serde writes it: a field serde writes but never reads, and
/// a struct's tag.
#[toolrunner::schema]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type")]
struct Receipt {
    /// Its id.
    id: String,
    /// Computed, never read back.
    #[serde(skip_deserializing)]
    total: i64,
}

/// A write tool's result is checked against a schema of how its type
/// serializes, not closed by `#[toolrunner::schema]`: a done effect whose
/// result carries a key the deserializing schema leaves out completes,
/// instead of going to reconciliation (review of issue 30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_as_serde_writes_it_completes() -> Result<()> {
    let env = Env::start(Opts::default(), &["receipts.make"]).await?;
    let make = |_ctx: CallContext, _e: Empty| async move {
        Ok::<_, ToolError>(Receipt {
            id: "r1".into(),
            total: 3,
        })
    };
    let exec = env
        .builder("exe-serde-output")
        .tool(toolrunner::tool::write("receipts.make", make).describe("Makes a receipt"))
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(&agv, "user_1", &[("receipts.make", json!({}))])
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(10)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    let call = call_of(&run, "receipts.make");
    assert_eq!(state(&call), "completed", "{call:#}");
    assert_eq!(
        receipt_body(&call, "completed")["result"],
        json!({"type": "Receipt", "id": "r1", "total": 3})
    );
    env.shutdown().await;
    Ok(())
}

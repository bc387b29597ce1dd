//! Quickstart: a read tool and a write tool, each an `async fn`, served by
//! the executor.
//!
//! ```text
//! cargo run --example quickstart                       # the embedded platform
//! cargo run --example quickstart -- --base-url URL     # a real one (TOOLRUNNER_* variables)
//! cargo run --example quickstart -- --print-definitions # {"tools": [...]} for `toolrunner tools publish`
//! ```
//!
//! On the embedded platform it runs four calls and prints how each ended.
//! One write (`memo: "boom"`) fails after its effect: nobody knows whether
//! it happened, so it waits in `reconciliation_required`, and the example
//! prints the operator's command that settles it.

use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::TestKit;
use toolrunner::{CallContext, Executor, State, ToolError};

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Serve a read and a write tool with toolrunner")]
struct Args {
    /// A real platform (with TOOLRUNNER_TOKEN, _EXECUTOR_ID, _BINDING_ID):
    /// serve until SIGTERM instead of the demo.
    #[arg(long)]
    base_url: Option<String>,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// The tasks to list.
#[toolrunner::schema]
#[derive(Deserialize)]
struct ListTasks {
    /// Only tasks whose title contains this.
    contains: String,
}

/// Tasks.
#[toolrunner::schema]
#[derive(Serialize)]
struct Tasks {
    /// Their titles.
    titles: Vec<String>,
}

/// A task to add.
#[toolrunner::schema]
#[derive(Deserialize)]
struct AddTask {
    /// Its title.
    title: String,
    /// `boom` makes the handler fail after writing (an unknown outcome).
    memo: String,
}

/// The task added.
#[toolrunner::schema]
#[derive(Serialize)]
struct Added {
    /// Its number.
    number: usize,
}

/// The product's task list.
#[derive(Clone, Default)]
struct TaskList(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

/// Lists the tasks whose title contains a word.
#[toolrunner::tool(name = "tasks.list", effect = read)]
async fn list(
    State(tasks): State<TaskList>,
    _ctx: CallContext,
    q: ListTasks,
) -> Result<Tasks, ToolError> {
    let all = tasks.0.lock().expect("not poisoned").clone();
    Ok(Tasks {
        titles: all
            .into_iter()
            .filter(|t| t.contains(&q.contains))
            .collect(),
    })
}

/// Adds a task to the list.
#[toolrunner::tool(name = "tasks.add", effect = write)]
async fn add(
    State(tasks): State<TaskList>,
    ctx: CallContext,
    task: AddTask,
) -> Result<Added, ToolError> {
    ctx.commit_point().await?; // nothing irreversible before this line
    let number = {
        let mut all = tasks.0.lock().expect("not poisoned");
        all.push(task.title);
        all.len()
    };
    if task.memo == "boom" {
        return Err(ToolError::unknown(
            "the task list timed out after the write",
        ));
    }
    Ok(Added { number })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    support::quiet_logs();
    let args = Args::parse();
    let tasks = TaskList::default();
    if args.print_definitions {
        return support::print_definitions(|b| b.state(tasks).tool(list).tool(add));
    }
    if let Some(url) = args.base_url {
        let executor = Executor::from_env()
            .base_url(url)
            .state(tasks)
            .allow_all()
            .tool(list)
            .tool(add)
            .build()?;
        executor.serve(toolrunner::shutdown_signal()).await?;
        return Ok(());
    }
    let state = tasks.clone();
    let kit = TestKit::start(move |b| b.state(state.clone()).tool(list).tool(add)).await?;
    let asked = [
        (
            "tasks.add",
            json!({"title": "write the report", "memo": ""}),
        ),
        (
            "tasks.add",
            json!({"title": "review the report", "memo": ""}),
        ),
        (
            "tasks.add",
            json!({"title": "file the expenses", "memo": "boom"}),
        ),
        ("tasks.list", json!({"contains": "report"})),
    ];
    let mut lines = Vec::new();
    for (tool, arguments) in asked {
        let outcome = kit.call(tool, arguments.clone()).await?;
        lines.push(support::Line {
            tool: tool.into(),
            asked: arguments.to_string(),
            outcome,
        });
    }
    support::print(&lines);
    for l in lines
        .iter()
        .filter(|l| l.outcome.state.as_str() == "reconciliation_required")
    {
        println!(
            "\n{} waits for a human: look the task up, then settle it, e.g.\n  toolrunner reconcile resolve {}/{} --db {} --completed result.json --evidence \"the task is in the list\" --base-url … --token …",
            l.tool,
            l.outcome.run_id,
            l.outcome.call.call_id,
            kit.store_path().display()
        );
    }
    kit.shutdown().await?;
    Ok(())
}

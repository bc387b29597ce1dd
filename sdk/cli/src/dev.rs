//! `toolrunner dev up|run`: a development platform set up for a crate's
//! tools, and one call of a tool run through it.
use std::time::Duration;

use serde_json::Value;
use toolrunner::platform::{CallState, NewToolCall, Platform, RunCall};
use toolrunner_protocol::wire::ReceiptKind;

use crate::tools;
use crate::{Failure, Outcome};

/// Where `toolrunner devserver` listens by default.
const DEFAULT_BASE_URL: &str = "http://127.0.0.1:8700";
/// The development platform's default admin token (`dev-admin=*`).
const DEFAULT_ADMIN_TOKEN: &str = "dev-admin";
/// The development platform's default executor token
/// (`dev-executor=executors:connect,tools:execute`).
const DEFAULT_EXECUTOR_TOKEN: &str = "dev-executor";
/// Whom the runs of `dev run` act for.
const SUBJECT: &str = "dev-user";
/// The binding id the definitions are checked with before the binding
/// exists (each tool's is then the new binding's).
const PENDING_BINDING: &str = "bnd_created_by_dev_up";

#[derive(Debug, clap::Subcommand)]
pub(crate) enum DevCommand {
    /// Set up a development platform for a crate's tools: an agent, a
    /// binding for the executor id and a version of the tools. Prints the
    /// executor's environment as shell lines on stdout, for
    /// `eval "$(toolrunner dev up --tools tools.json)"`, and a summary on
    /// stderr.
    Up(UpArgs),
    /// Start a run with one call of a tool (the agent's latest published
    /// version), wait until the call settles, and print
    /// `call CALL_ID STATE RESULT|ERROR`; exit 0 only if it completed.
    Run(RunArgs),
}

/// Flags of `toolrunner dev up`.
#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// The tool definitions: a JSON file holding {"tools": [...]} or the
    /// array itself, or - for stdin (as `tools publish` reads them); each
    /// tool's binding_id, if it has one, becomes the new binding's.
    #[arg(long, value_name = "FILE")]
    tools: String,
    /// The development platform.
    #[arg(long, env = "TOOLRUNNER_BASE_URL", default_value = DEFAULT_BASE_URL)]
    base_url: String,
    /// An admin token (configuration:write).
    #[arg(
        long,
        env = "TOOLRUNNER_ADMIN_TOKEN",
        hide_env_values = true,
        default_value = DEFAULT_ADMIN_TOKEN
    )]
    token: String,
    /// The name of the agent to create.
    #[arg(long, value_name = "NAME", default_value = "dev-agent")]
    agent: String,
    /// The executor id the binding is for (also the binding's name).
    #[arg(long, value_name = "ID", default_value = "dev-01")]
    executor_id: String,
    /// The executor's token (executors:connect, tools:execute), printed as
    /// TOOLRUNNER_TOKEN.
    #[arg(long, value_name = "TOKEN", default_value = DEFAULT_EXECUTOR_TOKEN)]
    executor_token: String,
}

/// Flags of `toolrunner dev run`.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// The tool to call.
    #[arg(long, value_name = "NAME")]
    tool: String,
    /// The call's arguments, as JSON text or @FILE.
    #[arg(long, value_name = "JSON|@FILE", default_value = "{}")]
    arguments: String,
    /// The agent (`dev up` prints it as TOOLRUNNER_AGENT_ID).
    #[arg(long, value_name = "ID", env = "TOOLRUNNER_AGENT_ID")]
    agent: Option<String>,
    /// The development platform.
    #[arg(long, env = "TOOLRUNNER_BASE_URL", default_value = DEFAULT_BASE_URL)]
    base_url: String,
    /// An admin token (configuration:read, runs:write, runtime:read).
    #[arg(
        long,
        env = "TOOLRUNNER_ADMIN_TOKEN",
        hide_env_values = true,
        default_value = DEFAULT_ADMIN_TOKEN
    )]
    token: String,
    /// How long to wait for the call to settle.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    wait: u64,
}

pub(crate) async fn run(cmd: DevCommand) -> Outcome {
    match cmd {
        DevCommand::Up(args) => up(args).await,
        DevCommand::Run(args) => run_call(args).await,
    }
}

fn platform(base_url: &str, token: &str) -> Result<Platform, Failure> {
    Platform::new(base_url, token).map_err(|e| Failure::Usage(e.to_string()))
}

/// The failure of a request to the development platform at `base_url`:
/// one that nobody answered says how to start it.
fn refusal(base_url: &str, what: &str, e: &toolrunner::Error) -> Failure {
    if e.is_unreachable() {
        Failure::Usage(format!(
            "no development platform answers at {base_url}: start it with `toolrunner devserver` (or pass --base-url, or set TOOLRUNNER_BASE_URL); {e}"
        ))
    } else if e.status() == Some(401) {
        Failure::Usage(format!(
            "the platform at {base_url} does not know the admin token: pass --token or set TOOLRUNNER_ADMIN_TOKEN (the development platform's default is {DEFAULT_ADMIN_TOKEN})"
        ))
    } else {
        Failure::Refused(format!("{what}: {e}"))
    }
}

/// Whether `id` is an executor id an executor accepts: 1–128 characters
/// of `[A-Za-z0-9_.:-]`.
fn is_executor_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

async fn up(args: UpArgs) -> Outcome {
    if !is_executor_id(&args.executor_id) {
        return Err(Failure::Usage(format!(
            "--executor-id {:?} is not an executor id: 1-128 characters of [A-Za-z0-9_.:-] (nothing was created)",
            args.executor_id
        )));
    }
    let mut definitions = tools::definitions(&args.tools)?;
    // The binding is made below: each tool serves from it.
    for tool in definitions.as_array_mut().into_iter().flatten() {
        if let Some(fields) = tool.as_object_mut() {
            fields.insert("binding_id".into(), Value::from(PENDING_BINDING));
        }
    }
    let mut checked = tools::checked(&args.tools, &definitions, "nothing was created")?;
    let names: Vec<&str> = checked.tools.iter().map(|t| t.name.as_str()).collect();
    let platform = platform(&args.base_url, &args.token)?;
    let agent = platform
        .create_agent(&args.agent)
        .await
        .map_err(|e| refusal(&args.base_url, "no agent was created", &e))?;
    let binding = platform
        .create_binding(&agent.agent_id, &args.executor_id, &names)
        .await
        .map_err(|e| {
            refusal(
                &args.base_url,
                &format!("agent {} was created, but no binding", agent.agent_id),
                &e,
            )
        })?;
    let tool_names = names.join(", ");
    for tool in &mut checked.tools {
        tool.binding_id.clone_from(&binding.binding_id);
    }
    let version = platform
        .publish(&agent.agent_id, &checked.tools)
        .await
        .map_err(|e| {
            refusal(
                &args.base_url,
                &format!(
                    "agent {} and binding {} were created, but no version",
                    agent.agent_id, binding.binding_id
                ),
                &e,
            )
        })?;
    for (name, value) in [
        ("TOOLRUNNER_BASE_URL", platform.base_url()),
        ("TOOLRUNNER_TOKEN", args.executor_token.as_str()),
        ("TOOLRUNNER_EXECUTOR_ID", args.executor_id.as_str()),
        ("TOOLRUNNER_BINDING_ID", binding.binding_id.as_str()),
        ("TOOLRUNNER_AGENT_ID", agent.agent_id.as_str()),
    ] {
        println!("export {name}={}", shell_word(value));
    }
    eprintln!(
        "agent   {} ({})\nbinding {} for executor {}\nversion {}\ntools   {tool_names}\nnext: serve your executor, then `toolrunner dev run --tool NAME --arguments JSON`",
        args.agent, agent.agent_id, binding.binding_id, args.executor_id, version.agent_version,
    );
    Ok(())
}

/// `value` as one shell word: as is when it holds only characters no
/// shell treats specially, single-quoted otherwise.
fn shell_word(value: &str) -> String {
    let plain = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./:@%+,=-".contains(&b));
    if plain {
        value.to_owned()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

async fn run_call(args: RunArgs) -> Outcome {
    let agent = args.agent.filter(|a| !a.is_empty()).ok_or_else(|| {
        Failure::Usage(
            "no agent: pass --agent ID or set TOOLRUNNER_AGENT_ID (`eval \"$(toolrunner dev up --tools FILE)\"` sets it)"
                .into(),
        )
    })?;
    let arguments = tools::inline_or_file(&args.arguments)?;
    let platform = platform(&args.base_url, &args.token)?;
    let versions = platform
        .versions(&agent)
        .await
        .map_err(|e| refusal(&args.base_url, "no run was started", &e))?;
    let Some(version) = versions.last() else {
        return Err(Failure::Refused(format!(
            "agent {agent} has no published version: publish the tools with `toolrunner dev up` (or `toolrunner tools publish`)"
        )));
    };
    let run = platform
        .create_run(
            &version.agent_version,
            SUBJECT,
            vec![NewToolCall::new(args.tool.as_str(), arguments)],
        )
        .await
        .map_err(|e| refusal(&args.base_url, "no run was started", &e))?;
    let call_id = run
        .tool_calls
        .first()
        .map(|c| c.call_id.clone())
        .ok_or_else(|| {
            Failure::Usage(format!(
                "the platform started run {} without the call",
                run.run_id
            ))
        })?;
    let within = Duration::from_secs(args.wait);
    // A call not settled in time is read once more, to say where it is.
    let seen = match platform.wait_settled(&run.run_id, within).await {
        Ok(seen) => seen,
        Err(_) => platform
            .run(&run.run_id)
            .await
            .map_err(|e| refusal(&args.base_url, "the run cannot be read", &e))?,
    };
    let call = seen
        .tool_calls
        .iter()
        .find(|c| c.call_id == call_id)
        .ok_or_else(|| {
            Failure::Usage(format!("run {} no longer has call {call_id}", run.run_id))
        })?;
    let state = call.state.as_str();
    if !toolrunner::platform::settled(call.state) {
        println!("call {call_id} {state}");
        let next = if call.state == CallState::Pending {
            format!(
                "no executor claimed it: one must be serving the binding of {} (TOOLRUNNER_BINDING_ID, as `toolrunner dev up` printed it); start it, then run this again",
                args.tool
            )
        } else {
            "an executor holds it and its handler has not finished: wait longer (--wait SECONDS), or read it with `toolrunner calls show`".to_owned()
        };
        return Err(Failure::Usage(format!(
            "the call {call_id} (run {}) is still {state} after {} s: {next}",
            run.run_id, args.wait
        )));
    }
    let detail = outcome(call);
    match &detail {
        Some(d) => println!("call {call_id} {state} {d}"),
        None => println!("call {call_id} {state}"),
    }
    if call.state == CallState::Completed {
        return Ok(());
    }
    let why = detail.map(|d| format!(": {d}")).unwrap_or_default();
    Err(Failure::Refused(match call.state {
        CallState::ReconciliationRequired => format!(
            "the call {call_id} ended reconciliation_required: its executor does not know whether the effect happened; its reconcile hook settles it, or an operator does with `toolrunner reconcile resolve {}/{call_id} --db toolrunner.db (--completed RESULT.json | --failed CODE --message TEXT) --evidence \"WHAT YOU CHECKED\"` (see `toolrunner reconcile resolve --help`)",
            run.run_id
        ),
        _ => format!("the call {call_id} ended {state}{why}"),
    }))
}

/// What a settled call ended with: its result as compact JSON
/// (completed), `CODE: MESSAGE` (failed), the reason (cancelled).
fn outcome(call: &RunCall) -> Option<String> {
    let kind = match call.state {
        CallState::Completed => ReceiptKind::Completed,
        CallState::Failed => ReceiptKind::Failed,
        CallState::Cancelled => ReceiptKind::Cancelled,
        _ => return None,
    };
    let body: Value = call
        .receipts
        .iter()
        .rev()
        .find(|r| r.kind == kind)
        .and_then(|r| serde_json::from_str(r.body.get()).ok())?;
    match kind {
        ReceiptKind::Completed => body.get("result").map(Value::to_string),
        ReceiptKind::Failed => Some(format!(
            "{}: {}",
            body["error"]["code"].as_str().unwrap_or_default(),
            body["error"]["message"].as_str().unwrap_or_default()
        )),
        _ => body["reason"].as_str().map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn a_value_is_quoted_only_when_a_shell_would_read_it_otherwise() {
        assert_eq!(shell_word("http://127.0.0.1:8700"), "http://127.0.0.1:8700");
        assert_eq!(shell_word("bnd_0190ab"), "bnd_0190ab");
        assert_eq!(shell_word("pay.01"), "pay.01");
        assert_eq!(shell_word(""), "''");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("$HOME"), "'$HOME'");
        assert_eq!(shell_word("~x"), "'~x'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
    }
}

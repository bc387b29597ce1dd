//! `toolrunner tools check|dry-run|publish`, and the definitions reader
//! `toolrunner dev up` shares.
use serde::Serialize;
use serde_json::{Value, json};
use toolrunner::platform::Platform;
use toolrunner_protocol::tooldef::{CheckedVersion, ProblemKind, check_version};

use crate::output;
use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ToolsCommand {
    /// Check tool definitions (a JSON file holding {"tools": [...]} or the
    /// array itself): every problem, plus lint warnings.
    Check {
        /// The file, or - for stdin.
        file: String,
        /// Stable JSON: {"valid", "problems": [...], "warnings": [...]}.
        #[arg(long)]
        json: bool,
    },
    /// Ask a platform to check arguments and preview a result (runs nothing).
    DryRun {
        /// The platform.
        #[arg(long, env = "TOOLRUNNER_BASE_URL")]
        base_url: String,
        /// Bearer token (runtime:read, configuration:read or tools:execute).
        #[arg(long, env = "TOOLRUNNER_TOKEN", hide_env_values = true)]
        token: String,
        /// The published agent version.
        #[arg(long)]
        agent_version: String,
        /// The tool.
        #[arg(long)]
        tool: String,
        /// Arguments as JSON text, or @FILE.
        #[arg(long, default_value = "{}")]
        arguments: String,
        /// A result to preview, as JSON text or @FILE.
        #[arg(long)]
        mock_result: Option<String>,
    },
    /// Publish tool definitions (a JSON file holding {"tools": [...]} or the
    /// array itself, checked first) as a new version of an agent; prints
    /// the version's id.
    Publish {
        /// The file, or - for stdin.
        file: String,
        /// The platform.
        #[arg(long, env = "TOOLRUNNER_BASE_URL")]
        base_url: String,
        /// Bearer token (configuration:write).
        #[arg(long, env = "TOOLRUNNER_TOKEN", hide_env_values = true)]
        token: String,
        /// The agent.
        #[arg(long)]
        agent: String,
        /// Stable JSON: the published version as the platform answered it.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Serialize)]
struct Finding {
    param: String,
    code: String,
    #[serde(rename = "type")]
    kind: &'static str,
    message: String,
}

fn read(source: &str) -> Result<String, Failure> {
    if source == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| Failure::Usage(e.to_string()))?;
        return Ok(s);
    }
    std::fs::read_to_string(source)
        .map_err(|e| Failure::Usage(format!("cannot read {source}: {e}")))
}

/// JSON text, or the content of the file after `@`.
pub(crate) fn inline_or_file(arg: &str) -> Result<Value, Failure> {
    let text = match arg.strip_prefix('@') {
        Some(path) => read(path)?,
        None => arg.to_owned(),
    };
    toolrunner_protocol::json::parse_strict(text.trim().as_bytes())
        .map_err(|e| Failure::Usage(format!("not acceptable JSON: {e}")))
}

/// A problem's text for a person: its message, which names where when the
/// protocol's check wrote it so, else `param: message`.
fn located(param: &str, message: &str) -> String {
    if message.starts_with(param) {
        message.to_owned()
    } else {
        format!("{param}: {message}")
    }
}

fn check(file: &str, as_json: bool) -> Outcome {
    let doc = toolrunner_protocol::json::parse_strict(read(file)?.trim().as_bytes())
        .map_err(|e| Failure::Refused(format!("{file} is not acceptable JSON: {e}")))?;
    let (tools, tool_search) = match &doc {
        Value::Array(_) => (doc.clone(), None),
        Value::Object(o) => (
            o.get("tools").cloned().unwrap_or(Value::Null),
            o.get("tool_search").cloned(),
        ),
        _ => (Value::Null, None),
    };
    let problems: Vec<Finding> = match check_version(&tools, tool_search.as_ref()) {
        Ok(_) => Vec::new(),
        Err(list) => list
            .into_iter()
            .map(|p| Finding {
                param: p.param,
                code: p.code,
                kind: match p.kind {
                    ProblemKind::InvalidRequest => "invalid_request_error",
                    ProblemKind::UnsupportedConfiguration => "unsupported_or_invalid_configuration",
                },
                message: p.message,
            })
            .collect(),
    };
    let warnings = toolrunner_protocol::tooldef::lint_version(&tools);
    if as_json {
        output::json(
            &json!({"valid": problems.is_empty(), "problems": problems, "warnings": warnings}),
        )?;
    } else {
        for p in &problems {
            println!("error   {} ({})", located(&p.param, &p.message), p.code);
        }
        for w in &warnings {
            println!("warning {}", located(&w.param, &w.message));
        }
        println!("{} problems, {} warnings", problems.len(), warnings.len());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Failure::Refused(format!(
            "{} problems in {file}",
            problems.len()
        )))
    }
}

fn platform(base_url: &str, token: &str) -> Result<Platform, Failure> {
    Platform::new(base_url, token).map_err(|e| Failure::Usage(e.to_string()))
}

async fn dry_run(base_url: &str, token: &str, body: Value) -> Outcome {
    let resp = platform(base_url, token)?
        .request(toolrunner::platform::Method::POST, "/tools/dry-run")
        .json(&body)
        .send()
        .await
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let answer = resp.json();
    output::json(&answer)?;
    if !(200..300).contains(&resp.status) {
        return Err(Failure::Refused(format!(
            "the platform answered {}",
            resp.status
        )));
    }
    if answer["arguments_valid"] != json!(true) {
        return Err(Failure::Refused(
            "the arguments do not match the tool's input_schema".into(),
        ));
    }
    Ok(())
}

/// The tool definitions in `file` (`-` for stdin): the `tools` of
/// `{"tools": [...]}`, or the array itself.
pub(crate) fn definitions(file: &str) -> Result<Value, Failure> {
    let doc = toolrunner_protocol::json::parse_strict(read(file)?.trim().as_bytes())
        .map_err(|e| Failure::Refused(format!("{} is not acceptable JSON: {e}", named(file))))?;
    Ok(match doc {
        Value::Object(mut o) => o.remove("tools").unwrap_or(Value::Null),
        doc => doc,
    })
}

/// `tools` of `file` checked by the protocol's rules, or refused with
/// every problem, saying that `nothing` happened.
pub(crate) fn checked(file: &str, tools: &Value, nothing: &str) -> Result<CheckedVersion, Failure> {
    check_version(tools, None).map_err(|problems| {
        let list: Vec<String> = problems
            .iter()
            .map(|p| located(&p.param, &p.message))
            .collect();
        Failure::Refused(format!(
            "{} fails the protocol's checks ({nothing}): {}",
            named(file),
            list.join("; ")
        ))
    })
}

/// A definitions file as messages name it.
fn named(file: &str) -> String {
    if file == "-" {
        "the definitions on stdin".into()
    } else {
        file.to_owned()
    }
}

async fn publish(file: &str, base_url: &str, token: &str, agent: &str, as_json: bool) -> Outcome {
    let tools = definitions(file)?;
    let checked = checked(file, &tools, "nothing was published")?;
    let version = platform(base_url, token)?
        .publish(agent, &checked.tools)
        .await
        .map_err(|e| Failure::Refused(format!("not published: {e}")))?;
    if as_json {
        output::json(&serde_json::to_value(&version).unwrap_or(Value::Null))?;
    } else {
        println!(
            "published {} tools as {} of agent {}",
            version.tools.len(),
            version.agent_version,
            version.agent_id
        );
    }
    Ok(())
}

pub(crate) async fn run(cmd: ToolsCommand) -> Outcome {
    match cmd {
        ToolsCommand::Check { file, json } => check(&file, json),
        ToolsCommand::DryRun {
            base_url,
            token,
            agent_version,
            tool,
            arguments,
            mock_result,
        } => {
            let mut body = json!({"agent_version": agent_version, "tool_name": tool, "arguments": inline_or_file(&arguments)?});
            if let Some(m) = mock_result {
                body["mock_receipts"] = json!([{"receipt_id": "dry-run-1", "kind": "completed", "result": inline_or_file(&m)?}]);
            }
            dry_run(&base_url, &token, body).await
        }
        ToolsCommand::Publish {
            file,
            base_url,
            token,
            agent,
            json,
        } => publish(&file, &base_url, &token, &agent, json).await,
    }
}

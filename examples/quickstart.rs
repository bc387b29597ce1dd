//! Starts the development platform in-process and walks one tool call
//! through the protocol with plain HTTP: configure an agent, start a run,
//! connect an executor, claim the call, send `accepted` and `completed`,
//! and print the run as the platform stores it.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
        grant: Option<&str>,
    ) -> Result<Value> {
        let mut req = self
            .http
            .request(method.clone(), format!("{}/v1{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        if let Some(grant) = grant {
            req = req.header("Tool-Grant", grant);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let value: Value = resp.json().await?;
        println!("{method} {path} -> {status}");
        if !status.is_success() {
            bail!("{method} {path} answered {status}: {value}");
        }
        Ok(value)
    }
}

fn text<'a>(v: &'a Value, field: &str) -> Result<&'a str> {
    v[field]
        .as_str()
        .with_context(|| format!("the answer has no {field}: {v}"))
}

#[tokio::main]
async fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = toolrunner_devserver::DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    println!("development platform at {}", server.base_url());
    let api = Api {
        http: reqwest::Client::new(),
        base: server.base_url(),
    };
    let (admin, exec) = ("dev-admin", "dev-executor");
    use reqwest::Method as M;

    let agent = api
        .call(
            M::POST,
            "/agents",
            admin,
            Some(json!({"name": "ledger-agent"})),
            None,
        )
        .await?;
    let agent_id = text(&agent, "agent_id")?;
    let binding = api
        .call(
            M::POST,
            "/executor-bindings",
            admin,
            Some(json!({"agent_id": agent_id, "name": "ledger", "tool_names": ["ledger.append"]})),
            None,
        )
        .await?;
    let binding_id = text(&binding, "binding_id")?;
    let tool = json!({
        "name": "ledger.append", "description": "Append one entry to the ledger", "binding_id": binding_id,
        "input_schema": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1}, "memo": {"type": "string"}},
                         "required": ["amount", "memo"], "additionalProperties": false},
        "output_schema": {"type": "object", "properties": {"entry": {"type": "integer"}}, "required": ["entry"]}
    });
    let version = api
        .call(
            M::POST,
            &format!("/agents/{agent_id}/versions"),
            admin,
            Some(json!({"tools": [tool]})),
            None,
        )
        .await?;
    let agent_version = text(&version, "agent_version")?;
    let run = api
        .call(M::POST, "/runs", admin, Some(json!({"agent_version": agent_version, "subject": "user_42",
            "tool_calls": [{"tool_name": "ledger.append", "arguments": {"amount": 1200, "memo": "coffee"}}]})), None)
        .await?;
    let run_id = text(&run, "run_id")?;
    let call_id = text(&run["tool_calls"][0], "call_id")?;

    let connected = api
        .call(M::POST, "/executors/connect", exec, Some(json!({"executor_id": "exe_quickstart", "instance_id": "ins_quickstart",
            "binding_id": binding_id, "tools": ["ledger.append"], "capacity": 4, "sdk": {"name": "quickstart", "version": "0"}})), None)
        .await?;
    let connection_id = text(&connected, "connection_id")?;
    let pending = api
        .call(
            M::GET,
            &format!("/executors/exe_quickstart/pending?connection_id={connection_id}"),
            exec,
            None,
            None,
        )
        .await?;
    println!(
        "  pending candidates: {}",
        pending["data"].as_array().map_or(0, Vec::len)
    );

    let claimed = api
        .call(M::POST, &format!("/runs/{run_id}/tool-calls/{call_id}/claim"), exec,
            Some(json!({"executor_id": "exe_quickstart", "connection_id": connection_id, "operation_key": "op_quickstart_1"})), None)
        .await?;
    let assignment = &claimed["assignment"];
    let grant = text(assignment, "grant")?;
    let receipts = format!("/runs/{run_id}/tool-calls/{call_id}/receipts");
    let base =
        json!({"executor_id": "exe_quickstart", "assignment_id": assignment["assignment_id"]});
    let with = |extra: Value| {
        let mut body = base.clone();
        body.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        body
    };
    let accepted = api
        .call(
            M::POST,
            &receipts,
            exec,
            Some(with(
                json!({"receipt_id": "rcp_q0", "sequence": 0, "kind": "accepted"}),
            )),
            Some(grant),
        )
        .await?;
    if accepted["accepted"] != json!(true) {
        bail!("the platform did not confirm accepted: {accepted}");
    }
    println!("  accepted confirmed: the side effect may run now");
    api.call(M::POST, &receipts, exec, Some(with(json!({"receipt_id": "rcp_q1", "sequence": 1, "kind": "completed", "result": {"entry": 1}}))), Some(grant))
        .await?;

    let stored = api
        .call(M::GET, &format!("/runs/{run_id}"), admin, None, None)
        .await?;
    println!(
        "run {} is {}; call state {}",
        run_id, stored["status"], stored["tool_calls"][0]["state"]
    );
    println!(
        "{}",
        serde_json::to_string_pretty(&stored["tool_calls"][0]["context_projection"])?
    );
    server.shutdown().await;
    Ok(())
}

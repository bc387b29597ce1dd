//! The checks before anything runs: schema, digest, the product's own
//! authorization. A failure settles the call `failed` at sequence 0.
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::Value;
use toolrunner_protocol::json::arguments_digest;
use toolrunner_protocol::tooldef::Schema;
use toolrunner_protocol::wire::Assignment;

use super::Core;
use crate::api::authorizer::AuthorizationRequest;
use crate::api::handler::ErasedTool;

/// A refusal before start: `(code, message)` for the `failed` receipt,
/// or [`AWAITS_APPROVAL`] with the reason a person must decide.
pub(crate) type Refusal = (&'static str, String);

/// Not a refusal: the call waits for a person's approval (its claim goes
/// back, nothing is saved as a receipt). Never a receipt's code.
pub(crate) const AWAITS_APPROVAL: &str = "awaits_approval";

/// Schemas compiled once: every call of a tool version brings the same
/// schema, and compiling one costs far more than checking a value.
static COMPILED: LazyLock<Mutex<HashMap<String, Arc<Schema>>>> = LazyLock::new(Mutex::default);

/// At most this many compiled schemas are kept (then the cache starts
/// afresh).
const COMPILED_MAX: usize = 256;

/// `schema` compiled, from the cache when it was compiled before; why it
/// cannot be used otherwise.
fn compiled(schema: &Value) -> Result<Arc<Schema>, Unfit> {
    let text = schema.to_string();
    if let Some(s) = COMPILED.lock().expect("not poisoned").get(&text) {
        return Ok(s.clone());
    }
    let s = Arc::new(Schema::compile(schema).map_err(Unfit)?);
    let mut cache = COMPILED.lock().expect("not poisoned");
    if cache.len() >= COMPILED_MAX {
        cache.clear();
    }
    cache.insert(text, s.clone());
    Ok(s)
}

pub(crate) async fn before_start(
    core: &Core,
    tool: &dyn ErasedTool,
    asg: &Assignment,
) -> Result<(), Refusal> {
    let schema = compiled(&asg.input_schema).map_err(|e| {
        (
            "invalid_arguments",
            format!("the tool's input schema cannot be used: {e}"),
        )
    })?;
    if let Some(v) = schema.violations(&asg.arguments).first() {
        let at = if v.path.is_empty() {
            "the arguments".to_owned()
        } else {
            format!("argument {}", v.path)
        };
        return Err(("invalid_arguments", format!("{at}: {}", v.message)));
    }
    super::unwind::catch_sync(|| tool.check_input(&asg.arguments))
        .unwrap_or_else(|panic| Err(format!("reading them panicked: {panic}")))
        .map_err(|e| ("invalid_arguments", input_mismatch(tool, asg, &e)))?;
    if arguments_digest(&asg.arguments) != asg.arguments_digest {
        return Err((
            "digest_mismatch",
            "the arguments do not match their digest".to_owned(),
        ));
    }
    let request = AuthorizationRequest {
        subject: asg.subject.clone(),
        agent_id: asg.agent_id.clone(),
        agent_version: asg.agent_version.clone(),
        tool_name: asg.tool_name.clone(),
        arguments: asg.arguments.clone(),
        arguments_digest: asg.arguments_digest.clone(),
        run_id: asg.run_id.clone(),
        call_id: asg.call_id.clone(),
    };
    match super::unwind::catch(core.authorizer.authorize(&request)).await {
        Ok(Err(d)) if d.approval.is_some() => {
            let window = d.approval.unwrap_or_default();
            core.calls.approvals.consult(asg, &d.message, window).await
        }
        Ok(answer) => answer.map_err(|d| ("forbidden", d.message)),
        // Refused on error: nothing ran, and the product could not say yes.
        Err(panic) => {
            tracing::error!(%panic, "the authorizer panicked; the call is refused");
            Err(("forbidden", "the authorization check failed".to_owned()))
        }
    }
}

/// Why arguments that passed the published `input_schema` do not
/// deserialize into the tool's input type (`error`, serde's words). When
/// the published schema is not the one the code derives, the definition
/// was changed without republishing: every call of that version fails
/// alike, so the message says how to fix it and a warning names the tool
/// (never the arguments: a log line holds none).
fn input_mismatch(tool: &dyn ErasedTool, asg: &Assignment, error: &str) -> String {
    if asg.input_schema == tool.input_schema() {
        return format!(
            "the arguments do not match this tool's input type ({error}), though they match its input_schema"
        );
    }
    tracing::warn!(
        tool = %asg.tool_name,
        agent_version = %asg.agent_version,
        "the published definition of this tool differs from the code, and its calls fail on it: republish the tool definitions (`toolrunner tools publish`)"
    );
    format!(
        "the arguments do not match this tool's input type ({error}): the published definition differs from the code; republish the tool definitions (`toolrunner tools publish`)"
    )
}

/// Why a result cannot be a final receipt's (the outcome is unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unfit(pub(crate) String);

impl std::fmt::Display for Unfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A final result must match `output_schema`, fit 4 MiB and nest at most
/// 128 deep; otherwise the outcome is unknown.
pub(crate) fn check_output(asg: &Assignment, result: &Value) -> Result<(), Unfit> {
    use toolrunner_protocol::json::{MAX_BODY_BYTES, MAX_DEPTH, compact_len, depth};
    // The receipt body wraps the result one level deeper.
    if depth(result) >= MAX_DEPTH {
        return Err(Unfit(format!(
            "the result nests deeper than {MAX_DEPTH} levels"
        )));
    }
    if compact_len(result) > MAX_BODY_BYTES - 4096 {
        return Err(Unfit(
            "the result does not fit in a 4 MiB receipt".to_owned(),
        ));
    }
    if let Some(schema) = &asg.output_schema {
        let schema = compiled(schema)
            .map_err(|e| Unfit(format!("the output schema cannot be used: {e}")))?;
        if let Some(v) = schema.violations(result).first() {
            return Err(Unfit(format!(
                "the result does not match output_schema at '{}': {}",
                v.path, v.masked
            )));
        }
    }
    Ok(())
}

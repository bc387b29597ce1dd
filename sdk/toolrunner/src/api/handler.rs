//! Typed tool handlers.
use std::sync::Arc;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::api::context::CallContext;

/// Whether a tool has side effects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Effect {
    /// Free of side effects: may be run again after a crash.
    Read,
    /// Has side effects: runs at most once; an unknown outcome goes to
    /// `reconciliation_required`.
    Write,
    /// Its only side effects are writes in the store's database, made in
    /// [`CallContext::transaction`]: they commit in one transaction with
    /// the call's `completed` receipt, or not at all. So a crash or an
    /// error never leaves its outcome unknown: after a crash nothing of it
    /// was written and the handler runs again; an error rolls the
    /// transaction back and the call fails. (A closure that ends the
    /// transaction itself, with its own `COMMIT` or `ROLLBACK`, makes the
    /// outcome unknown: see [`CallContext::transaction`].)
    Transactional,
}

/// The cause kept with a [`ToolError`].
type Source = std::sync::Arc<dyn std::error::Error + Send + Sync>;

/// How a handler call ended when it did not return an output.
///
/// `?` on an ordinary error gives [`ToolError::Unknown`] (the outcome is
/// unknown, never guessed). [`OutcomeExt`] says otherwise where you know
/// better, and works with `anyhow::Error` and boxed errors too:
///
/// ```rust
/// use toolrunner::{OutcomeExt, ToolError};
///
/// fn send(amount: u64) -> Result<String, std::io::Error> {
///     Ok(format!("sent {amount}"))
/// }
///
/// fn charge(amount: u64) -> Result<String, ToolError> {
///     if amount == 0 {
///         return Err(ToolError::failed("invalid_amount", "the amount must be positive"));
///     }
///     let receipt = send(amount).unknown_outcome()?; // same as plain `?`
///     Ok(receipt)
/// }
/// # assert!(charge(5).is_ok());
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ToolError {
    /// A business failure the product has confirmed: nothing (more) will
    /// happen. Becomes a `failed` receipt the model can read, so `message`
    /// must be short and free of secrets, stack traces and internals.
    Failed {
        /// Product-chosen code, e.g. `insufficient_funds`.
        code: String,
        /// A short sentence for the model.
        message: String,
    },
    /// A business cancellation the product has confirmed.
    Cancelled {
        /// Why.
        reason: String,
    },
    /// Nothing happened and trying again may work: the executor retries,
    /// bounded, with backoff and the same operation key.
    Retry {
        /// Why (logged, never sent).
        reason: String,
        /// The cause, if there was one.
        source: Option<Source>,
    },
    /// Anything else: the outcome is unknown. The call goes to
    /// `reconciliation_required`; it is never retried blindly. A read
    /// tool's (`effect = read`) is the exception: a read changed nothing,
    /// so it is tried again as [`Retry`](ToolError::Retry) is, and then
    /// fails with the code `read_failed` (`docs/protocol.md`, choice 75).
    Unknown {
        /// What went wrong (logged and kept locally, never sent to the model).
        error: String,
        /// The cause, if there was one.
        source: Option<Source>,
    },
}

impl ToolError {
    /// A confirmed business failure.
    pub fn failed(code: impl Into<String>, message: impl Into<String>) -> ToolError {
        ToolError::Failed {
            code: code.into(),
            message: message.into(),
        }
    }

    /// A confirmed business cancellation.
    pub fn cancelled(reason: impl Into<String>) -> ToolError {
        ToolError::Cancelled {
            reason: reason.into(),
        }
    }

    /// "Nothing happened, retry."
    pub fn retry(reason: impl Into<String>) -> ToolError {
        ToolError::Retry {
            reason: reason.into(),
            source: None,
        }
    }

    /// An outcome nobody knows.
    pub fn unknown(error: impl std::fmt::Display) -> ToolError {
        ToolError::Unknown {
            error: error.to_string(),
            source: None,
        }
    }

    /// The cause it keeps, if any.
    pub fn source(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        match self {
            ToolError::Retry { source, .. } | ToolError::Unknown { source, .. } => {
                source.as_deref()
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToolError::Failed { code, message } => write!(f, "failed ({code}): {message}"),
            ToolError::Cancelled { reason } => write!(f, "cancelled: {reason}"),
            ToolError::Retry { reason, .. } => write!(f, "nothing happened, retry: {reason}"),
            ToolError::Unknown { error, .. } => write!(f, "outcome unknown: {error}"),
        }
    }
}

/// Any ordinary error means the outcome is unknown, so `?` is safe.
impl<E: std::error::Error + Send + Sync + 'static> From<E> for ToolError {
    fn from(e: E) -> Self {
        ToolError::Unknown {
            error: e.to_string(),
            source: Some(std::sync::Arc::new(e)),
        }
    }
}

/// Says what an error means for a tool call, on any `Result` whose error
/// converts into a boxed error (`std` errors, `anyhow::Error`,
/// `Box<dyn Error + Send + Sync>`).
pub trait OutcomeExt<T> {
    /// The outcome is unknown (the call goes to `reconciliation_required`).
    ///
    /// # Errors
    /// [`ToolError::Unknown`] keeping the error as its source.
    fn unknown_outcome(self) -> Result<T, ToolError>;

    /// Nothing happened; the executor may try again.
    ///
    /// # Errors
    /// [`ToolError::Retry`] keeping the error as its source.
    fn retry_later(self) -> Result<T, ToolError>;

    /// A confirmed business failure with `code`; the error's text is the
    /// message the model reads (keep it short and free of internals).
    ///
    /// # Errors
    /// [`ToolError::Failed`].
    fn business_failure(self, code: &str) -> Result<T, ToolError>;
}

impl<T, E> OutcomeExt<T> for Result<T, E>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn unknown_outcome(self) -> Result<T, ToolError> {
        self.map_err(|e| {
            let e: Source = e.into().into();
            ToolError::Unknown {
                error: e.to_string(),
                source: Some(e),
            }
        })
    }

    fn retry_later(self) -> Result<T, ToolError> {
        self.map_err(|e| {
            let e: Source = e.into().into();
            ToolError::Retry {
                reason: e.to_string(),
                source: Some(e),
            }
        })
    }

    fn business_failure(self, code: &str) -> Result<T, ToolError> {
        self.map_err(|e| ToolError::failed(code, e.into().to_string()))
    }
}

/// What an automatic reconciliation check found, and what the executor
/// then does. Answer only what you have confirmed: when the lookup itself
/// fails (a read error, a timeout, a half-written record), answer
/// [`Unknown`](Reconciled::Unknown), never "not found".
#[derive(Debug)]
#[non_exhaustive]
pub enum Reconciled<T> {
    /// Confirmed done: the effect happened, with this output. The call
    /// completes with it.
    Happened(T),
    /// Confirmed not done: the effect did not happen and never will (the
    /// handler is not running anywhere). The call fails with the code
    /// `not_performed` (or, for a tool that asks for it, runs again), so
    /// the model may ask again: a wrong answer here makes the effect
    /// happen twice.
    DidNotHappen,
    /// Cannot tell: the call stays in `reconciliation_required`, the hook
    /// is asked again later, and an operator can settle it with evidence.
    Unknown,
}

impl<T> Reconciled<T> {
    /// [`Happened`](Reconciled::Happened) with the output found, or
    /// [`DidNotHappen`](Reconciled::DidNotHappen) when nothing was found:
    /// use it only after a lookup that succeeded (a failed lookup is
    /// [`Unknown`](Reconciled::Unknown)).
    pub fn found(output: Option<T>) -> Reconciled<T> {
        match output {
            Some(o) => Reconciled::Happened(o),
            None => Reconciled::DidNotHappen,
        }
    }
}

/// A typed tool, the escape hatch below function tools: its input and
/// output schemas come from the types.
///
/// # Examples
///
/// ```rust
/// use toolrunner::{CallContext, Effect, Reconciled, Tool, ToolError, async_trait};
///
/// /// A greeting to send.
/// #[toolrunner::schema]
/// #[derive(serde::Deserialize)]
/// struct Greet { name: String }
///
/// /// Sent.
/// #[toolrunner::schema]
/// #[derive(serde::Serialize)]
/// struct Sent { id: String }
///
/// struct Greeter;
///
/// #[async_trait]
/// impl Tool for Greeter {
///     type Input = Greet;
///     type Output = Sent;
///     fn name(&self) -> &str { "greetings.send" }
///     fn description(&self) -> &str { "Sends a greeting" }
///     fn effect(&self) -> Effect { Effect::Write }
///     async fn call(&self, ctx: &CallContext, input: Greet) -> Result<Sent, ToolError> {
///         ctx.commit_point().await?;
///         Ok(Sent { id: format!("{}:{}", ctx.operation_key(), input.name) })
///     }
///     async fn reconcile(&self, _ctx: &CallContext) -> Reconciled<Sent> {
///         Reconciled::Unknown // a human decides
///     }
/// }
/// # let _ = toolrunner::Executor::builder().tool(Greeter);
/// ```
#[async_trait]
pub trait Tool: Send + Sync + 'static {
    /// Arguments: a struct marked `#[toolrunner::schema]` (see
    /// [`ToolSchema`]).
    type Input: DeserializeOwned + ToolSchema + Send + 'static;
    /// `completed` result: a struct marked `#[toolrunner::schema]`.
    type Output: Serialize + ToolSchema + Send + 'static;

    /// The tool's name, e.g. `payments.charge`.
    fn name(&self) -> &str;

    /// What the model reads about the tool.
    fn description(&self) -> &str;

    /// Read or write.
    fn effect(&self) -> Effect;

    /// Runs the tool. Called only after the platform confirmed `accepted`.
    async fn call(&self, ctx: &CallContext, input: Self::Input) -> Result<Self::Output, ToolError>;

    /// Looks the operation key up in the business system to settle an
    /// unknown outcome. The default cannot tell.
    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Self::Output> {
        let _ = ctx;
        Reconciled::Unknown
    }

    /// Whether a call that [`reconcile`](Tool::reconcile) found
    /// [`DidNotHappen`](Reconciled::DidNotHappen) may run again (with the
    /// same operation key) instead of settling `failed` with code
    /// `not_performed`. Default `false`.
    fn rerun_when_not_performed(&self) -> bool {
        false
    }

    /// How long this tool's handler may take from
    /// [`commit_point()`](CallContext::commit_point), or from its start
    /// when it has none, to its effect. Default 30 s.
    ///
    /// On a PostgreSQL store shared by replicas, whoever takes an executor
    /// identity over (a replica adopting it, a restart taking it back)
    /// asks this tool's `reconcile` hook only once the old holder's lease
    /// lapsed plus this window: a holder that was only slow (paused,
    /// stalled, cut off from the database) has made its effect by then,
    /// and the hook finds it. Set it above the slowest path from the
    /// commit point (or the start) to the effect; a longer window only
    /// delays automatic reconciliation after a takeover. The handler's
    /// timeout (`ExecutorBuilder::handler_timeout`, 300 s by default)
    /// bounds every handler: a tool without a commit point whose effect may
    /// come later than 30 s after its start needs a longer window.
    fn commit_window(&self) -> std::time::Duration {
        DEFAULT_COMMIT_WINDOW
    }

    /// The tool's flow-control limits (see [`Limits`](crate::Limits)):
    /// how many of its calls this process holds at once, and how many
    /// first `accepted` it sends a second. Default: none, only the
    /// executor's capacity. Configuration overrides them
    /// ([`ExecutorBuilder::limit`](crate::ExecutorBuilder::limit)).
    fn limits(&self) -> crate::Limits {
        crate::Limits::none()
    }
}

/// A tool's [`commit_window`](Tool::commit_window) unless it sets another.
pub const DEFAULT_COMMIT_WINDOW: std::time::Duration = crate::store::DEFAULT_COMMIT_WINDOW;

/// A tool with its types erased, as the runner holds it.
#[async_trait]
pub(crate) trait ErasedTool: Send + Sync {
    fn name(&self) -> &str;
    fn description(&self) -> &str;
    fn effect(&self) -> Effect;
    fn input_schema(&self) -> Value;
    fn output_schema(&self) -> Value;
    /// The input and output types' names (`std::any::type_name`), for
    /// messages.
    fn type_names(&self) -> (&'static str, &'static str);
    /// Whether the arguments deserialize into the input type.
    fn check_input(&self, arguments: &Value) -> Result<(), String>;
    async fn call(&self, ctx: &CallContext, arguments: Value) -> Result<Value, ToolError>;
    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Value>;
    fn rerun_when_not_performed(&self) -> bool;
    fn commit_window(&self) -> std::time::Duration;
    fn limits(&self) -> crate::Limits;
    /// The call's concurrency key from its arguments (`None`: the tool
    /// has no key function; an error: the arguments do not read as its
    /// type).
    fn concurrency_key(&self, arguments: &Value) -> Option<Result<String, String>> {
        let _ = arguments;
        None
    }
    /// The type the key function reads, if there is one.
    fn key_reads(&self) -> Option<&'static str> {
        None
    }
}

pub(crate) struct Erased<T>(pub(crate) T);

/// A tool's input type's schema, as the platform checks arguments against
/// it (closed where `#[toolrunner::schema]` closed the type).
pub(crate) fn input_schema_of<S: JsonSchema>() -> Value {
    serde_json::to_value(schemars::schema_for!(S)).unwrap_or(Value::Null)
}

/// A tool's output type's schema, as its values serialize (with the
/// fields serde writes but never reads, and a struct's tag), and open: a
/// result is what the tool's own serializer wrote, so a key the schema
/// does not list must not turn a done effect into an unknown outcome
/// (`#[toolrunner::schema]` closes a type for arguments only;
/// `docs/protocol.md`, choice 74).
pub(crate) fn output_schema_of<S: JsonSchema>() -> Value {
    let generator = schemars::generate::SchemaSettings::default()
        .for_serialize()
        .into_generator();
    let mut schema =
        serde_json::to_value(generator.into_root_schema_for::<S>()).unwrap_or(Value::Null);
    open(&mut schema);
    schema
}

/// Removes every `"additionalProperties": false` of a schema.
fn open(schema: &mut Value) {
    match schema {
        Value::Object(fields) => {
            if fields.get("additionalProperties") == Some(&Value::Bool(false)) {
                fields.remove("additionalProperties");
            }
            fields.values_mut().for_each(open);
        }
        Value::Array(items) => items.iter_mut().for_each(open),
        _ => {}
    }
}

fn to_value<O: Serialize>(output: O) -> Result<Value, ToolError> {
    serde_json::to_value(output)
        .map_err(|e| ToolError::unknown(format!("the output does not serialize: {e}")))
}

#[async_trait]
impl<T: Tool> ErasedTool for Erased<T> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn description(&self) -> &str {
        self.0.description()
    }

    fn effect(&self) -> Effect {
        self.0.effect()
    }

    fn input_schema(&self) -> Value {
        input_schema_of::<T::Input>()
    }

    fn output_schema(&self) -> Value {
        output_schema_of::<T::Output>()
    }

    fn type_names(&self) -> (&'static str, &'static str) {
        (
            std::any::type_name::<T::Input>(),
            std::any::type_name::<T::Output>(),
        )
    }

    fn check_input(&self, arguments: &Value) -> Result<(), String> {
        T::Input::deserialize(arguments)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    async fn call(&self, ctx: &CallContext, arguments: Value) -> Result<Value, ToolError> {
        let input = T::Input::deserialize(arguments)
            .map_err(|e| ToolError::unknown(format!("arguments changed shape: {e}")))?;
        to_value(self.0.call(ctx, input).await?)
    }

    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Value> {
        match self.0.reconcile(ctx).await {
            Reconciled::Happened(output) => match serde_json::to_value(output) {
                Ok(v) => Reconciled::Happened(v),
                Err(_) => Reconciled::Unknown,
            },
            Reconciled::DidNotHappen => Reconciled::DidNotHappen,
            Reconciled::Unknown => Reconciled::Unknown,
        }
    }

    fn rerun_when_not_performed(&self) -> bool {
        self.0.rerun_when_not_performed()
    }

    fn commit_window(&self) -> std::time::Duration {
        self.0.commit_window()
    }

    fn limits(&self) -> crate::Limits {
        self.0.limits()
    }
}

use serde::Deserialize as _;

/// The registered tools by name.
pub(crate) type Tools = Arc<std::collections::BTreeMap<String, Arc<dyn ErasedTool>>>;

/// Why `build()` refuses the tool definitions: each problem the protocol's
/// checks found, said of the tool by its name (`tools[i]` is the order of
/// registration, which a person does not see), its path written once. An
/// input or output schema that is not an object is said as what to write:
/// the type must be a struct.
pub(crate) fn definition_problems(
    tools: &[Arc<dyn ErasedTool>],
    problems: &[toolrunner_protocol::tooldef::ToolProblem],
) -> String {
    let said: Vec<String> = problems
        .iter()
        .map(|p| {
            let tool = p
                .param
                .strip_prefix("tools[")
                .and_then(|rest| rest.split_once(']'))
                .and_then(|(i, field)| Some((tools.get(i.parse::<usize>().ok()?)?, field)));
            let Some((tool, field)) = tool else {
                return p.message.clone();
            };
            let (input, output) = tool.type_names();
            let (schema, what, ty, why) = match field {
                ".input_schema" => (
                    tool.input_schema(),
                    "input",
                    input,
                    "a tool's arguments are a JSON object",
                ),
                ".output_schema" => (
                    tool.output_schema(),
                    "output",
                    output,
                    "a tool's result is a JSON object",
                ),
                _ => return format!("tool `{}`: {}", tool.name(), p.message),
            };
            if schema.get("type").and_then(Value::as_str) == Some("object") {
                return format!("tool `{}`: {}", tool.name(), p.message);
            }
            format!(
                "tool `{}`: its {what} must be a struct (an object with named fields, marked #[toolrunner::schema]), not `{}`: {why}",
                tool.name(),
                short_type_name(ty)
            )
        })
        .collect();
    said.join("; ")
}

/// `alloc::vec::Vec<my_crate::Order>` as `Vec<Order>`: each path reduced
/// to its last segment.
fn short_type_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut word = String::new();
    for c in name.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
        } else {
            out.push_str(word.rsplit("::").next().unwrap_or(&word));
            word.clear();
            out.push(c);
        }
    }
    out.push_str(word.rsplit("::").next().unwrap_or(&word));
    out
}

/// A type a tool takes or returns: one with a JSON Schema, which the
/// executor publishes as the tool's `input_schema` or `output_schema`.
/// Implemented for every type that implements `schemars::JsonSchema`;
/// put `#[toolrunner::schema]` on a type of your own to derive it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no JSON Schema, so it cannot be a tool's input or output",
    label = "no JSON Schema",
    note = "add #[toolrunner::schema] to the type `{Self}` (with #[derive(serde::Deserialize)] for an input, #[derive(serde::Serialize)] for an output): the platform publishes its schema and checks every call against it"
)]
pub trait ToolSchema: JsonSchema {}

impl<T: JsonSchema + ?Sized> ToolSchema for T {}

#[cfg(test)]
mod tests {
    use super::short_type_name;

    #[test]
    fn type_names_are_shortened_to_their_last_segments() {
        assert_eq!(short_type_name("i64"), "i64");
        assert_eq!(short_type_name("alloc::string::String"), "String");
        assert_eq!(
            short_type_name("core::option::Option<alloc::vec::Vec<my_crate::orders::Order>>"),
            "Option<Vec<Order>>"
        );
        assert_eq!(short_type_name("(u8, a::B)"), "(u8, B)");
    }
}

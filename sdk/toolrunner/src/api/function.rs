//! Function tools: a tool is an `async fn`.
//!
//! ```rust
//! use toolrunner::{CallContext, Reconciled, ToolError};
//!
//! /// What to charge.
//! #[toolrunner::schema]
//! #[derive(serde::Deserialize)]
//! struct Charge {
//!     /// Amount in minor units.
//!     amount: u64,
//! }
//!
//! /// The charge made.
//! #[toolrunner::schema]
//! #[derive(serde::Serialize)]
//! struct Charged {
//!     /// The provider's id.
//!     charge_id: String,
//! }
//!
//! async fn charge(ctx: CallContext, input: Charge) -> Result<Charged, ToolError> {
//!     ctx.commit_point().await?; // right before the irreversible step
//!     Ok(Charged { charge_id: format!("ch_{}_{}", ctx.operation_key(), input.amount) })
//! }
//!
//! async fn find_charge(ctx: CallContext) -> Reconciled<Charged> {
//!     let _ = ctx.operation_key(); // look it up in the business system
//!     Reconciled::Unknown
//! }
//!
//! let tool = toolrunner::tool::write("payments.charge", charge)
//!     .describe("Charges the customer's card")
//!     .reconcile(find_charge);
//! # let _ = toolrunner::Executor::builder().tool(tool);
//! ```
//!
//! With the attribute macro the same tool is `#[toolrunner::tool(name =
//! "payments.charge", effect = write, reconcile = find_charge)]` on
//! `charge`, its doc comment the description.
//!
//! Shared state is handed in the way axum does it: give it once with
//! [`ExecutorBuilder::state`](crate::ExecutorBuilder::state), and take it
//! as the first argument, `State(db): State<Db>`.
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::api::context::CallContext;
use crate::api::handler::{Effect, ErasedTool, Reconciled, Tool, ToolError, ToolSchema};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Shared state a handler takes as its first argument, given once with
/// [`ExecutorBuilder::state`](crate::ExecutorBuilder::state).
///
/// ```rust
/// # use toolrunner::{CallContext, State, ToolError};
/// #[derive(Clone)]
/// struct Db;
/// # #[toolrunner::schema] #[derive(serde::Deserialize)] struct In {}
/// # #[toolrunner::schema] #[derive(serde::Serialize)] struct Out {}
/// async fn lookup(State(db): State<Db>, ctx: CallContext, input: In) -> Result<Out, ToolError> {
///     let _ = (db, ctx, input);
///     Ok(Out {})
/// }
/// # let _ = toolrunner::Executor::builder().state(Db).tool(toolrunner::tool::read("db.lookup", lookup).describe("Looks up"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct State<T>(pub T);

/// The shared states by type (the executor's business; it appears only in
/// the sealed handler traits' hidden methods).
#[derive(Clone, Default)]
pub struct States(HashMap<TypeId, Arc<dyn Any + Send + Sync>>);

impl States {
    pub(crate) fn insert<T: Clone + Send + Sync + 'static>(&mut self, value: T) {
        self.0.insert(TypeId::of::<T>(), Arc::new(value));
    }

    fn get<T: Clone + Send + Sync + 'static>(&self) -> Option<T> {
        self.0
            .get(&TypeId::of::<T>())
            .and_then(|v| v.downcast_ref::<T>())
            .cloned()
    }

    pub(crate) fn has(&self, need: &StateNeed) -> bool {
        self.0.contains_key(&need.id)
    }
}

/// A state type a handler takes (the executor's business, as `States`).
#[derive(Debug, Clone, Copy)]
pub struct StateNeed {
    id: TypeId,
    pub(crate) name: &'static str,
}

impl StateNeed {
    fn of<T: 'static>() -> StateNeed {
        StateNeed {
            id: TypeId::of::<T>(),
            name: std::any::type_name::<T>(),
        }
    }
}

fn missing<T>() -> ToolError {
    ToolError::unknown(format!(
        "no State<{}> was given to the executor",
        std::any::type_name::<T>()
    ))
}

/// An `async fn` that handles a tool's calls: `async fn(ctx: CallContext,
/// input: Input) -> Result<Output, ToolError>`, optionally with
/// `State<T>` first. Implemented for such functions; you do not implement
/// it yourself.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tool handler",
    label = "expected `async fn(ctx: CallContext, input: Input) -> Result<Output, ToolError>`",
    note = "a tool handler is `async fn(ctx: CallContext, input: Input) -> Result<Output, ToolError>`, with `Input: Deserialize + JsonSchema` and `Output: Serialize + JsonSchema` (derive them, or put #[toolrunner::schema] on the types)",
    note = "shared state comes first: `async fn(State(db): State<Db>, ctx: CallContext, input: Input) -> Result<Output, ToolError>`"
)]
pub trait Handler<Args, I, O>:
    sealed::SealedHandler<Args, I, O> + Clone + Send + Sync + 'static
{
    #[doc(hidden)]
    fn call(&self, states: &States, ctx: CallContext, input: I) -> BoxFuture<Result<O, ToolError>>;
    #[doc(hidden)]
    fn needs() -> Vec<StateNeed>;
}

impl<F, Fut, I, O> Handler<(CallContext, I), I, O> for F
where
    F: Fn(CallContext, I) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<O, ToolError>> + Send + 'static,
{
    fn call(&self, _: &States, ctx: CallContext, input: I) -> BoxFuture<Result<O, ToolError>> {
        Box::pin(self(ctx, input))
    }

    fn needs() -> Vec<StateNeed> {
        Vec::new()
    }
}

impl<F, Fut, S, I, O> Handler<(State<S>, CallContext, I), I, O> for F
where
    F: Fn(State<S>, CallContext, I) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<O, ToolError>> + Send + 'static,
    S: Clone + Send + Sync + 'static,
    I: Send + 'static,
    O: 'static,
{
    fn call(&self, states: &States, ctx: CallContext, input: I) -> BoxFuture<Result<O, ToolError>> {
        match states.get::<S>() {
            Some(s) => Box::pin(self(State(s), ctx, input)),
            None => Box::pin(async { Err(missing::<S>()) }),
        }
    }

    fn needs() -> Vec<StateNeed> {
        vec![StateNeed::of::<S>()]
    }
}

/// An `async fn` that looks an operation up to settle an unknown outcome:
/// `async fn(ctx: CallContext) -> Reconciled<Output>`, optionally with
/// `State<T>` first.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a reconcile hook for this tool",
    label = "expected `async fn(ctx: CallContext) -> Reconciled<Output>`",
    note = "a reconcile hook is `async fn(ctx: CallContext) -> Reconciled<Output>` with the tool's own Output type; it looks ctx.operation_key() up in the business system",
    note = "shared state comes first: `async fn(State(db): State<Db>, ctx: CallContext) -> Reconciled<Output>`"
)]
pub trait ReconcileHandler<Args, O>:
    sealed::SealedReconcileHandler<Args, O> + Clone + Send + Sync + 'static
{
    #[doc(hidden)]
    fn call(&self, states: &States, ctx: CallContext) -> BoxFuture<Reconciled<O>>;
    #[doc(hidden)]
    fn needs() -> Vec<StateNeed>;
}

impl<F, Fut, O> ReconcileHandler<(CallContext,), O> for F
where
    F: Fn(CallContext) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reconciled<O>> + Send + 'static,
{
    fn call(&self, _: &States, ctx: CallContext) -> BoxFuture<Reconciled<O>> {
        Box::pin(self(ctx))
    }

    fn needs() -> Vec<StateNeed> {
        Vec::new()
    }
}

impl<F, Fut, S, O> ReconcileHandler<(State<S>, CallContext), O> for F
where
    F: Fn(State<S>, CallContext) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reconciled<O>> + Send + 'static,
    S: Clone + Send + Sync + 'static,
    O: 'static,
{
    fn call(&self, states: &States, ctx: CallContext) -> BoxFuture<Reconciled<O>> {
        match states.get::<S>() {
            Some(s) => Box::pin(self(State(s), ctx)),
            None => Box::pin(async { Reconciled::Unknown }),
        }
    }

    fn needs() -> Vec<StateNeed> {
        vec![StateNeed::of::<S>()]
    }
}

type CallFn =
    Arc<dyn Fn(&States, CallContext, Value) -> BoxFuture<Result<Value, ToolError>> + Send + Sync>;
type HookFn = Arc<dyn Fn(&States, CallContext) -> BoxFuture<Reconciled<Value>> + Send + Sync>;
/// A concurrency key from a call's arguments (an error: they do not read
/// as the type the key function takes).
pub(crate) type KeyFn = Arc<dyn Fn(&Value) -> Result<String, String> + Send + Sync>;

/// A tool made of functions (see [`tool::write`](crate::tool::write)).
#[must_use = "a tool does nothing until it is given to `ExecutorBuilder::tool`"]
pub struct FnTool<O> {
    name: String,
    description: String,
    effect: Effect,
    input_schema: Value,
    output_schema: Value,
    /// The input and output types' names.
    type_names: (&'static str, &'static str),
    check_input: fn(&Value) -> Result<(), String>,
    call: CallFn,
    reconcile: Option<HookFn>,
    rerun: bool,
    commit_window: std::time::Duration,
    limits: crate::Limits,
    /// The concurrency key's function, and the type it reads.
    key: Option<(KeyFn, &'static str)>,
    needs: Vec<StateNeed>,
    _output: PhantomData<fn() -> O>,
}

impl<O> std::fmt::Debug for FnTool<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnTool")
            .field("name", &self.name)
            .field("effect", &self.effect)
            .field("reconcile", &self.reconcile.is_some())
            .finish_non_exhaustive()
    }
}

fn check_input<I: DeserializeOwned>(arguments: &Value) -> Result<(), String> {
    I::deserialize(arguments)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn new<H, A, I, O>(name: &str, effect: Effect, handler: H) -> FnTool<O>
where
    H: Handler<A, I, O>,
    I: DeserializeOwned + ToolSchema + Send + 'static,
    O: Serialize + ToolSchema + Send + 'static,
{
    let call: CallFn = Arc::new(move |states, ctx, arguments| {
        let input = match I::deserialize(arguments) {
            Ok(i) => i,
            Err(e) => {
                let e = ToolError::unknown(format!("arguments changed shape: {e}"));
                return Box::pin(async move { Err(e) });
            }
        };
        let fut = handler.call(states, ctx, input);
        Box::pin(async move {
            let output = fut.await?;
            serde_json::to_value(output)
                .map_err(|e| ToolError::unknown(format!("the output does not serialize: {e}")))
        })
    });
    FnTool {
        name: name.to_owned(),
        description: String::new(),
        effect,
        input_schema: super::handler::input_schema_of::<I>(),
        output_schema: super::handler::output_schema_of::<O>(),
        type_names: (std::any::type_name::<I>(), std::any::type_name::<O>()),
        check_input: check_input::<I>,
        call,
        reconcile: None,
        rerun: false,
        commit_window: crate::api::handler::DEFAULT_COMMIT_WINDOW,
        limits: crate::Limits::none(),
        key: None,
        needs: H::needs(),
        _output: PhantomData,
    }
}

/// A tool with side effects (runs at most once per call; an unknown
/// outcome goes to `reconciliation_required`) made of an `async fn`.
/// Add a description with [`FnTool::describe`] before registering it.
pub fn write<H, A, I, O>(name: &str, handler: H) -> FnTool<O>
where
    H: Handler<A, I, O>,
    I: DeserializeOwned + ToolSchema + Send + 'static,
    O: Serialize + ToolSchema + Send + 'static,
{
    new(name, Effect::Write, handler)
}

/// A tool whose only side effects are its writes in the store's database,
/// made in [`CallContext::transaction`](crate::CallContext::transaction)
/// and committed with its `completed` receipt in one transaction (see
/// [`Effect::Transactional`]), made of an `async fn`.
pub fn transactional<H, A, I, O>(name: &str, handler: H) -> FnTool<O>
where
    H: Handler<A, I, O>,
    I: DeserializeOwned + ToolSchema + Send + 'static,
    O: Serialize + ToolSchema + Send + 'static,
{
    new(name, Effect::Transactional, handler)
}

/// A tool free of side effects (may run again after a crash) made of an
/// `async fn`.
pub fn read<H, A, I, O>(name: &str, handler: H) -> FnTool<O>
where
    H: Handler<A, I, O>,
    I: DeserializeOwned + ToolSchema + Send + 'static,
    O: Serialize + ToolSchema + Send + 'static,
{
    new(name, Effect::Read, handler)
}

impl<O: Serialize + Send + 'static> FnTool<O> {
    /// What the model reads about the tool (required).
    pub fn describe(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }

    /// The hook that looks an unknown outcome up by
    /// [`CallContext::operation_key`].
    pub fn reconcile<H, A>(mut self, hook: H) -> Self
    where
        H: ReconcileHandler<A, O>,
    {
        self.needs.extend(H::needs());
        self.reconcile = Some(Arc::new(move |states, ctx| {
            let fut = hook.call(states, ctx);
            Box::pin(async move {
                match fut.await {
                    Reconciled::Happened(output) => match serde_json::to_value(output) {
                        Ok(v) => Reconciled::Happened(v),
                        Err(_) => Reconciled::Unknown,
                    },
                    Reconciled::DidNotHappen => Reconciled::DidNotHappen,
                    Reconciled::Unknown => Reconciled::Unknown,
                }
            })
        }));
        self
    }

    /// A [`DidNotHappen`](Reconciled::DidNotHappen) from the hook may run
    /// the tool again (same operation key) instead of settling `failed`
    /// with code `not_performed`.
    pub fn rerun_when_not_performed(mut self) -> Self {
        self.rerun = true;
        self
    }

    /// How long the handler may take from
    /// [`commit_point()`](crate::CallContext::commit_point), or from its
    /// start when it has none, to its effect (default 30 s; see
    /// [`Tool::commit_window`](crate::Tool::commit_window)).
    pub fn commit_window(mut self, window: std::time::Duration) -> Self {
        self.commit_window = window;
        self
    }

    /// At most `n` calls of this tool held at once by this process, from
    /// the claim to the final receipt (see [`Limits`](crate::Limits)); a
    /// call of the tool is claimed only when a slot is free. Zero is
    /// refused at [`build`](crate::ExecutorBuilder::build).
    pub fn concurrency(mut self, n: u32) -> Self {
        self.limits = self.limits.concurrency(n);
        self
    }

    /// At most `n` first `accepted` sends of this tool in any sliding
    /// second, by this process (see [`Limits`](crate::Limits)); a call of
    /// the tool is claimed only when a token is free. Zero is refused at
    /// [`build`](crate::ExecutorBuilder::build).
    pub fn rate(mut self, n: u32) -> Self {
        self.limits = self.limits.rate(n);
        self
    }

    /// At most `per_key` calls with one concurrency key held at once,
    /// the key computed from the call's arguments by `key` (for example
    /// the merchant account: `.concurrency_key(2, |a: &Charge|
    /// a.merchant_id.clone())`). Decided after the claim, before
    /// `accepted`: a call whose key is at its limit is given back at once
    /// (nothing ran) and claimed again after a back-off; the other keys'
    /// calls go on (see [`Limits`](crate::Limits)).
    /// [`build`](crate::ExecutorBuilder::build) refuses a key function
    /// that reads another type than the tool's arguments, a tool without
    /// arguments, and zero.
    pub fn concurrency_key<I, K, F>(mut self, per_key: u32, key: F) -> Self
    where
        I: DeserializeOwned + 'static,
        K: std::fmt::Display,
        F: Fn(&I) -> K + Send + Sync + 'static,
    {
        self.limits = self.limits.per_key(per_key);
        let key: KeyFn = Arc::new(move |arguments| {
            I::deserialize(arguments)
                .map(|input| key(&input).to_string())
                .map_err(|e| e.to_string())
        });
        self.key = Some((key, std::any::type_name::<I>()));
        self
    }
}

/// Something [`ExecutorBuilder::tool`](crate::ExecutorBuilder::tool)
/// takes: a [`Tool`] implementation, a [`FnTool`], or a function marked
/// `#[toolrunner::tool]`. Sealed: only the SDK implements it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tool",
    label = "not a tool",
    note = "give `.tool(..)` a function marked #[toolrunner::tool(name = \"…\", effect = write)], a `toolrunner::tool::write(\"name\", handler)`, or a type that implements `toolrunner::Tool`"
)]
pub trait IntoTool: sealed::SealedTool {
    /// Registers it (the executor's business).
    #[doc(hidden)]
    fn into_tool(self) -> Registered;
}

/// A tool as registered, before the executor binds its state (named only
/// by the `#[toolrunner::tool]` expansion, through `__private`).
pub struct Registered(pub(crate) Kind);

/// What a `#[toolrunner::tool]` expansion declares: how to make its
/// tool. The expansion implements it for a marker type of its own and
/// hands [`ExecutorBuilder::tool`](crate::ExecutorBuilder::tool) a
/// [`Declared`] of that marker (through `toolrunner::__private`). It grants
/// nothing that [`tool::write`](crate::tool::write) does not: a
/// [`Registered`] comes only from a real [`IntoTool`].
pub trait Declaration {
    /// The tool, registered.
    fn declare() -> Registered;
}

/// The value a `#[toolrunner::tool]` function becomes: the tool its
/// marker `D` declares.
pub struct Declared<D>(PhantomData<fn() -> D>);

impl<D> Declared<D> {
    /// The tool `D` declares.
    #[allow(clippy::new_without_default)] // built in a `const` by the expansion
    pub const fn new() -> Declared<D> {
        Declared(PhantomData)
    }
}

impl<D> Clone for Declared<D> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D> Copy for Declared<D> {}

impl<D> std::fmt::Debug for Declared<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Declared")
    }
}

impl<D: Declaration> IntoTool for Declared<D> {
    fn into_tool(self) -> Registered {
        D::declare()
    }
}

/// The seals of the handler traits: implemented here for the function
/// shapes, and nameable nowhere else.
mod sealed {
    use super::{CallContext, Declared, FnTool, Reconciled, State, Tool, ToolError};
    use std::future::Future;

    /// The seal of [`IntoTool`](super::IntoTool): a [`Tool`], an
    /// [`FnTool`], or what `#[toolrunner::tool]` declares, and nothing
    /// else.
    #[allow(unreachable_pub)]
    pub trait SealedTool {}
    impl<T: Tool> SealedTool for T {}
    impl<O> SealedTool for FnTool<O> {}
    impl<D> SealedTool for Declared<D> {}

    #[allow(unreachable_pub)]
    pub trait SealedHandler<Args, I, O> {}
    impl<F, Fut, I, O> SealedHandler<(CallContext, I), I, O> for F
    where
        F: Fn(CallContext, I) -> Fut,
        Fut: Future<Output = Result<O, ToolError>>,
    {
    }
    impl<F, Fut, S, I, O> SealedHandler<(State<S>, CallContext, I), I, O> for F
    where
        F: Fn(State<S>, CallContext, I) -> Fut,
        Fut: Future<Output = Result<O, ToolError>>,
    {
    }

    #[allow(unreachable_pub)]
    pub trait SealedReconcileHandler<Args, O> {}
    impl<F, Fut, O> SealedReconcileHandler<(CallContext,), O> for F
    where
        F: Fn(CallContext) -> Fut,
        Fut: Future<Output = Reconciled<O>>,
    {
    }
    impl<F, Fut, S, O> SealedReconcileHandler<(State<S>, CallContext), O> for F
    where
        F: Fn(State<S>, CallContext) -> Fut,
        Fut: Future<Output = Reconciled<O>>,
    {
    }
}

pub(crate) enum Kind {
    Trait(Arc<dyn ErasedTool>),
    Function(Box<FnTool<()>>),
}

impl<T: Tool> IntoTool for T {
    fn into_tool(self) -> Registered {
        Registered(Kind::Trait(Arc::new(crate::api::handler::Erased(self))))
    }
}

impl<O> IntoTool for FnTool<O> {
    fn into_tool(self) -> Registered {
        Registered(Kind::Function(Box::new(FnTool {
            name: self.name,
            description: self.description,
            effect: self.effect,
            input_schema: self.input_schema,
            output_schema: self.output_schema,
            type_names: self.type_names,
            check_input: self.check_input,
            call: self.call,
            reconcile: self.reconcile,
            rerun: self.rerun,
            commit_window: self.commit_window,
            limits: self.limits,
            key: self.key,
            needs: self.needs,
            _output: PhantomData,
        })))
    }
}

impl Registered {
    /// The state types it takes.
    pub(crate) fn needs(&self) -> &[StateNeed] {
        match &self.0 {
            Kind::Trait(_) => &[],
            Kind::Function(f) => &f.needs,
        }
    }

    /// The tool's name.
    pub(crate) fn name(&self) -> &str {
        match &self.0 {
            Kind::Trait(t) => t.name(),
            Kind::Function(f) => &f.name,
        }
    }

    /// The tool as the runner holds it, with the executor's states.
    pub(crate) fn bind(self, states: &Arc<States>) -> Arc<dyn ErasedTool> {
        match self.0 {
            Kind::Trait(t) => t,
            Kind::Function(f) => Arc::new(Bound {
                tool: *f,
                states: states.clone(),
            }),
        }
    }
}

/// A function tool with the executor's states.
struct Bound {
    tool: FnTool<()>,
    states: Arc<States>,
}

#[async_trait::async_trait]
impl ErasedTool for Bound {
    fn name(&self) -> &str {
        &self.tool.name
    }

    fn description(&self) -> &str {
        &self.tool.description
    }

    fn effect(&self) -> Effect {
        self.tool.effect
    }

    fn input_schema(&self) -> Value {
        self.tool.input_schema.clone()
    }

    fn output_schema(&self) -> Value {
        self.tool.output_schema.clone()
    }

    fn type_names(&self) -> (&'static str, &'static str) {
        self.tool.type_names
    }

    fn check_input(&self, arguments: &Value) -> Result<(), String> {
        (self.tool.check_input)(arguments)
    }

    async fn call(&self, ctx: &CallContext, arguments: Value) -> Result<Value, ToolError> {
        (self.tool.call)(&self.states, ctx.clone(), arguments).await
    }

    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Value> {
        match &self.tool.reconcile {
            Some(hook) => hook(&self.states, ctx.clone()).await,
            None => Reconciled::Unknown,
        }
    }

    fn rerun_when_not_performed(&self) -> bool {
        self.tool.rerun
    }

    fn commit_window(&self) -> std::time::Duration {
        self.tool.commit_window
    }

    fn limits(&self) -> crate::Limits {
        self.tool.limits
    }

    fn concurrency_key(&self, arguments: &Value) -> Option<Result<String, String>> {
        self.tool.key.as_ref().map(|(key, _)| key(arguments))
    }

    fn key_reads(&self) -> Option<&'static str> {
        self.tool.key.as_ref().map(|(_, reads)| *reads)
    }
}

//! What a person must hear even when the program installed no `tracing`
//! subscriber (a first program rarely does): that the executor serves,
//! and that a call needs reconciliation. Each is a `tracing` event; with
//! no global subscriber set, the same line goes to standard error too.

/// Whether no global `tracing` subscriber is set, so that nobody would see
/// the event.
fn unheard() -> bool {
    !tracing::dispatcher::has_been_set()
}

/// The executor connected and serves these tools for this binding. With
/// no subscriber, said on standard error at the first connect only
/// (`first`), not at each reconnect.
pub(crate) fn serving<'a>(
    executor_id: &str,
    binding_id: &str,
    tools: impl Iterator<Item = &'a str>,
    first: bool,
) {
    let tools = tools.collect::<Vec<_>>().join(", ");
    tracing::info!(executor_id, binding_id, tools = %tools, "connected; serving {tools} for binding {binding_id}");
    if first && unheard() {
        eprintln!(
            "toolrunner: executor {executor_id} connected; serving {tools} for binding {binding_id}"
        );
    }
}

/// A call's outcome is unknown: it waits for the tool's reconcile hook or
/// for an operator, who reads the call with `toolrunner calls show`.
pub(crate) fn needs_reconciliation(
    executor_id: &str,
    run_id: &str,
    call_id: &str,
    tool: &str,
    why: &str,
) {
    tracing::warn!(
        executor_id,
        run_id,
        call_id,
        tool,
        why,
        "call needs reconciliation: its outcome is unknown"
    );
    if unheard() {
        eprintln!(
            "toolrunner: call {call_id} of run {run_id} ({tool}) needs reconciliation: its outcome is unknown ({why}); its reconcile hook or an operator settles it (toolrunner calls show {run_id}/{call_id})"
        );
    }
}

/// At the first connect: how many calls of this store wait in
/// `reconciliation_required` from before (nothing is said for none).
pub(crate) fn waiting(executor_id: &str, calls: u64) {
    if calls == 0 {
        return;
    }
    tracing::warn!(executor_id, calls, "calls wait in reconciliation_required");
    if unheard() {
        eprintln!(
            "toolrunner: {calls} call(s) of executor {executor_id} wait in reconciliation_required: their reconcile hook or an operator settles them (toolrunner calls list --state reconciliation_required)"
        );
    }
}

//! The console's actions: resolve, compensated, close, redeliver, and the
//! bulk redeliver. Each POST first answers with a preview that says what
//! will be sent (or that nothing will); the same form confirmed does it,
//! through the [`Reconciler`](crate::Reconciler), which writes the
//! operator's evidence into the call's timeline.
use std::sync::Arc;

use axum::Extension;
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};
use serde::Deserialize;
use toolrunner_protocol::wire::ReceiptKind;

use super::Inner;
use super::html::{self, call_path, pretty};
use super::pages::{Identity, find};
use super::security::Visitor;
use super::sources::Source;
use crate::reconciler::{Evidence, Outcome, ReceiptView};
use crate::store::{CallFilter, ReceiptStatus};

/// The fields every action's form carries, besides its own.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Given {
    #[serde(default)]
    who: String,
    #[serde(default)]
    evidence: String,
    #[serde(default)]
    reference: String,
    /// `yes` once the operator confirmed the preview.
    #[serde(default)]
    confirm: String,
}

impl Given {
    /// The signed-in operator, if the request has one, in place of the
    /// name typed into the form.
    fn sign(&mut self, v: &Visitor) {
        if let Some(name) = &v.operator {
            self.who.clone_from(name);
        }
    }

    fn evidence(&self) -> Evidence {
        let e = Evidence::new(self.who.trim(), self.evidence.trim());
        match self.reference.trim() {
            "" => e,
            r => e.with_reference(r),
        }
    }

    fn confirmed(&self) -> bool {
        self.confirm == "yes"
    }

    /// The evidence as hidden fields of the confirmation.
    fn hidden(&self) -> Markup {
        html! {
            input type="hidden" name="who" value=(self.who);
            input type="hidden" name="evidence" value=(self.evidence);
            input type="hidden" name="reference" value=(self.reference);
            input type="hidden" name="confirm" value="yes";
        }
    }

    /// The evidence as the timeline will hold it.
    fn shown(&self) -> Markup {
        html! {
            p { "Recorded in the call's timeline with the operator " strong { (self.who.trim()) } ", the evidence:" }
            pre { (self.evidence.trim()) }
            @if !self.reference.trim().is_empty() { p { "and the reference " code { (self.reference.trim()) } } }
        }
    }
}

/// The resolve form.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ResolveForm {
    #[serde(default)]
    outcome: String,
    #[serde(default)]
    result: String,
    #[serde(default)]
    code: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    reason: String,
    #[serde(flatten)]
    given: Given,
}

/// The page for an error: 422 for a refusal (nothing changed), 503
/// otherwise.
fn failed(v: &Visitor, e: &crate::Error, back: Option<String>) -> Response {
    let status = if e.is_refused() {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let why = if e.is_refused() {
        format!("refused, nothing changed: {e}")
    } else {
        format!("not done: {e}")
    };
    html::error(v, status, &why, back.map(|b| ("back to the call", b)))
}

/// A refusal of the form itself (422), with a way back.
fn refused(v: &Visitor, why: &str, back: String) -> Response {
    html::error(
        v,
        StatusCode::UNPROCESSABLE_ENTITY,
        &format!("refused, nothing changed: {why}"),
        Some(("back to the call", back)),
    )
}

/// The preview page: what will happen, and the form that confirms it.
fn preview(
    v: &Visitor,
    title: &str,
    what: Markup,
    action: &str,
    hidden: Markup,
    back: &str,
) -> Response {
    let body = html! {
        h1 { (title) }
        div #preview .banner.info { (what) }
        form #confirm-form .action method="post" action=(v.link(action)) {
            input type="hidden" name="csrf" value=(v.csrf);
            (hidden)
            button #confirm type="submit" { "Confirm and do it" }
            " "
            a href=(v.link(back)) { "cancel" }
        }
    };
    html::page(v, title, false, body)
}

/// The page after an action.
fn done(v: &Visitor, title: &str, what: Markup, back: &str) -> Response {
    let body = html! {
        h1 { (title) }
        div #done .done { (what) }
        p { a #back href=(v.link(back)) { "back to the call" } }
    };
    html::page(v, title, false, body)
}

/// `POST /calls/RUN_ID/CALL_ID/resolve`: settle a call with an outcome.
pub(super) async fn resolve(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Path((run_id, call_id)): Path<(String, String)>,
    Query(identity): Query<Identity>,
    Form(mut form): Form<ResolveForm>,
) -> Response {
    form.given.sign(&v);
    let (source, t) = match find(&state, &v, (&run_id, &call_id), identity.label()).await {
        Ok(found) => found,
        Err(page) => return page,
    };
    let back = call_path(&run_id, &call_id, &source.label);
    let outcome = match form.outcome.as_str() {
        "completed" => match toolrunner_protocol::json::parse_strict(form.result.trim().as_bytes())
        {
            Ok(result) => Outcome::Completed(result),
            Err(e) => {
                return refused(
                    &v,
                    &format!("the result is not acceptable JSON: {e}"),
                    v.link(&back),
                );
            }
        },
        "failed" if !form.code.trim().is_empty() => Outcome::Failed {
            code: form.code.trim().to_owned(),
            message: form.message.trim().to_owned(),
        },
        "failed" => return refused(&v, "a failure needs its code", v.link(&back)),
        "cancelled" if !form.reason.trim().is_empty() => Outcome::Cancelled {
            reason: form.reason.trim().to_owned(),
        },
        "cancelled" => return refused(&v, "a cancellation needs its reason", v.link(&back)),
        _ => {
            return refused(
                &v,
                "choose an outcome: completed, failed or cancelled",
                v.link(&back),
            );
        }
    };
    let evidence = form.given.evidence();
    let r = &source.reconciler;
    if !form.given.confirmed() {
        if let Err(e) = r
            .check_resolve(&run_id, &call_id, outcome.clone(), &evidence)
            .await
        {
            return failed(&v, &e, Some(v.link(&back)));
        }
        let c = t.call();
        let what = html! {
            @if r.delivers() {
                p { "This sends the platform a final " strong { (form.outcome) } " receipt for the call " code { (run_id) "/" (call_id) } " (assignment " code { (c.assignment_id().unwrap_or("-")) } "), and the platform ends the call with it. It cannot be taken back." }
            } @else {
                p { "This saves a final " strong { (form.outcome) } " receipt for the call " code { (run_id) "/" (call_id) } " in the outbox of the store " code { (source.label) } "; the running executor sends it to the platform, which ends the call with it (this console has no platform). It cannot be taken back." }
            }
            @match &outcome {
                Outcome::Completed(result) => { p { "The result the model will read:" } pre #preview-result { (pretty(result)) } },
                Outcome::Failed { code, message } => { p { "The error: code " code { (code) } ", message for the model: " (message) } },
                Outcome::Cancelled { reason } => { p { "The reason: " (reason) } },
            }
            (form.given.shown())
        };
        let hidden = html! {
            input type="hidden" name="outcome" value=(form.outcome);
            input type="hidden" name="result" value=(form.result);
            input type="hidden" name="code" value=(form.code);
            input type="hidden" name="message" value=(form.message);
            input type="hidden" name="reason" value=(form.reason);
            (form.given.hidden())
        };
        let action = html::with_query(
            &format!(
                "/calls/{}/{}/resolve",
                html::encode(&run_id),
                html::encode(&call_id)
            ),
            &[("identity", &source.label)],
        );
        return preview(&v, "Resolve: preview", what, &action, hidden, &back);
    }
    match r.resolve(&run_id, &call_id, outcome, &evidence).await {
        Ok(resolved) => done(
            &v,
            "Resolved",
            html! {
                p {
                    "Resolved " code { (run_id) "/" (call_id) } ": receipt " code { (resolved.receipt_id()) } " "
                    @if resolved.delivered() { "delivered to the platform" } @else { "saved; the running executor's outbox delivers it" }
                    ". The call is now " (html::state(resolved.state().as_str())) "."
                }
            },
            &back,
        ),
        Err(e) => failed(&v, &e, Some(v.link(&back))),
    }
}

/// `POST /calls/RUN_ID/CALL_ID/compensated`: a rejected call's effect was
/// undone.
pub(super) async fn compensated(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Path((run_id, call_id)): Path<(String, String)>,
    Query(identity): Query<Identity>,
    Form(given): Form<Given>,
) -> Response {
    local_action(
        &state,
        &v,
        (&run_id, &call_id),
        identity.label(),
        given,
        Local::Compensated,
    )
    .await
}

/// `POST /calls/RUN_ID/CALL_ID/close`: an orphaned call whose outcome was
/// unknown is closed here.
pub(super) async fn close(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Path((run_id, call_id)): Path<(String, String)>,
    Query(identity): Query<Identity>,
    Form(given): Form<Given>,
) -> Response {
    local_action(
        &state,
        &v,
        (&run_id, &call_id),
        identity.label(),
        given,
        Local::Close,
    )
    .await
}

/// An action that sends nothing to the platform.
#[derive(Clone, Copy)]
enum Local {
    Compensated,
    Close,
}

async fn local_action(
    state: &Inner,
    v: &Visitor,
    (run_id, call_id): (&str, &str),
    identity: &str,
    mut given: Given,
    action: Local,
) -> Response {
    given.sign(v);
    let (source, _) = match find(state, v, (run_id, call_id), identity).await {
        Ok(found) => found,
        Err(page) => return page,
    };
    let back = call_path(run_id, call_id, &source.label);
    let evidence = given.evidence();
    let (name, title, what) = match action {
        Local::Compensated => (
            "compensated",
            "Record a compensation",
            "records that this rejected call's effect was compensated",
        ),
        Local::Close => (
            "close",
            "Close",
            "closes this orphaned call, whose outcome stays unknown to the platform",
        ),
    };
    if !given.confirmed() {
        let r = &source.reconciler;
        let checked = match action {
            Local::Compensated => r.check_compensated(run_id, call_id, &evidence).await,
            Local::Close => r.check_close(run_id, call_id, &evidence).await,
        };
        if let Err(e) = checked {
            return failed(v, &e, Some(v.link(&back)));
        }
        let body = html! {
            p { "This " (what) ". " strong { "Nothing is sent to the platform" } ": it is written to the store " code { (source.label) } " only." }
            (given.shown())
        };
        let path = html::with_query(
            &format!(
                "/calls/{}/{}/{name}",
                html::encode(run_id),
                html::encode(call_id)
            ),
            &[("identity", &source.label)],
        );
        return preview(
            v,
            &format!("{title}: preview"),
            body,
            &path,
            given.hidden(),
            &back,
        );
    }
    let r = &source.reconciler;
    let outcome = match action {
        Local::Compensated => r.compensated(run_id, call_id, &evidence).await,
        Local::Close => r.close(run_id, call_id, &evidence).await,
    };
    match outcome {
        Ok(()) => done(
            v,
            title,
            html! { p { "Done: the call " code { (run_id) "/" (call_id) } " " (what) "." } },
            &back,
        ),
        Err(e) => failed(v, &e, Some(v.link(&back))),
    }
}

/// The redeliver form: the receipts its preview listed (comma-separated
/// ids), which the confirmation sends and no other.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RedeliverForm {
    #[serde(default)]
    receipts: String,
    #[serde(flatten)]
    given: Given,
}

/// `POST /calls/RUN_ID/CALL_ID/redeliver`: send the call's waiting
/// receipts now.
pub(super) async fn redeliver(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Path((run_id, call_id)): Path<(String, String)>,
    Query(identity): Query<Identity>,
    Form(mut form): Form<RedeliverForm>,
) -> Response {
    form.given.sign(&v);
    let (source, t) = match find(&state, &v, (&run_id, &call_id), identity.label()).await {
        Ok(found) => found,
        Err(page) => return page,
    };
    let back = call_path(&run_id, &call_id, &source.label);
    let given = &form.given;
    let evidence = given.evidence();
    if !given.confirmed() {
        if let Err(e) = evidence.check() {
            return failed(&v, &e, Some(v.link(&back)));
        }
        let waiting: Vec<&ReceiptView> = t.receipts().iter().filter(|r| sendable(r)).collect();
        if waiting.is_empty() {
            return refused(
                &v,
                "no receipt of this call waits to be sent",
                v.link(&back),
            );
        }
        if !source.reconciler.delivers() {
            return refused(
                &v,
                "this console has no platform to send to (start it with --base-url and TOOLRUNNER_TOKEN)",
                v.link(&back),
            );
        }
        let body = html! {
            p { "This sends the platform these " (waiting.len()) " receipt(s) of the call " code { (run_id) "/" (call_id) } ", byte for byte as stored:" }
            @for r in &waiting {
                p { strong { (r.kind().as_str()) } " " code { (r.receipt_id()) } " (" (r.attempts()) " attempts so far)" }
                pre { (r.body()) }
            }
            (given.shown())
        };
        let path = html::with_query(
            &format!(
                "/calls/{}/{}/redeliver",
                html::encode(&run_id),
                html::encode(&call_id)
            ),
            &[("identity", &source.label)],
        );
        let ids: Vec<&str> = waiting.iter().map(|r| r.receipt_id()).collect();
        let hidden = html! {
            input type="hidden" name="receipts" value=(ids.join(","));
            (given.hidden())
        };
        return preview(&v, "Redeliver: preview", body, &path, hidden, &back);
    }
    let ids = split_ids(&form.receipts);
    match source
        .reconciler
        .redeliver_call(&run_id, &call_id, &ids, &evidence)
        .await
    {
        Ok(sent) => done(&v, sent_title(&sent), statuses(&sent), &back),
        Err(e) => failed(&v, &e, Some(v.link(&back))),
    }
}

/// Comma-separated ids.
fn split_ids(ids: &str) -> Vec<String> {
    ids.split(',')
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether the console may send a receipt: waiting, and not an
/// `accepted` (only the executor's accept step sends those).
fn sendable(r: &ReceiptView) -> bool {
    r.status() == ReceiptStatus::Pending && r.kind() != ReceiptKind::Accepted
}

/// The title of a page after receipts were sent: whether all arrived.
fn sent_title(sent: &[(String, ReceiptStatus)]) -> &'static str {
    if sent.iter().all(|(_, s)| *s == ReceiptStatus::Delivered) {
        "Redelivered"
    } else {
        "Sent, not all delivered"
    }
}

/// Each receipt named and where it stands now.
fn statuses(sent: &[(String, ReceiptStatus)]) -> Markup {
    let delivered = sent
        .iter()
        .filter(|(_, s)| *s == ReceiptStatus::Delivered)
        .count();
    html! {
        p {
            (sent.len()) " receipt(s): " (delivered) " delivered, " (sent.len() - delivered) " not"
            @if delivered < sent.len() { " (one not delivered keeps waiting: its call's timeline shows the last error, and the executor's outbox retries it)" }
            "."
        }
        ul { @for (id, s) in sent { li { code { (id) } ": " (s.as_str()) } } }
    }
}

/// The bulk redeliver's filter and evidence, and at confirmation the
/// receipts its preview counted.
#[derive(Debug, Default, Deserialize)]
pub(super) struct BulkForm {
    #[serde(default)]
    identity: String,
    #[serde(default)]
    tool: String,
    /// What the preview counted, one `LABEL RUN CALL RECEIPT,…` per line
    /// (each part percent-encoded): the confirmation sends those only.
    #[serde(default)]
    previewed: String,
    #[serde(flatten)]
    given: Given,
}

/// The calls whose waiting receipts a bulk redeliver sends, in one store:
/// each call with the ids of its receipts.
struct Matched {
    source: Source,
    calls: Vec<(String, String, Vec<String>)>,
}

/// The waiting receipts of the calls that match, store by store; a store
/// that cannot be read is a problem, left out.
async fn matching(state: &Inner, form: &BulkForm) -> (Vec<Matched>, Vec<String>) {
    let view = state.sources.only(&form.identity).await;
    let mut problems = view.problems;
    let mut out = Vec::new();
    for source in view.sources {
        match matching_in(&source, form.tool.trim()).await {
            Ok(calls) => out.push(Matched { source, calls }),
            Err(e) => problems.push(format!("the store of {} cannot be read: {e}", source.label)),
        }
    }
    (out, problems)
}

async fn matching_in(
    source: &Source,
    tool: &str,
) -> crate::Result<Vec<(String, String, Vec<String>)>> {
    let of_tool: Option<Vec<(String, String)>> = if tool.is_empty() {
        None
    } else {
        Some(
            source
                .reconciler
                .list(&CallFilter::new().tool_name(tool))
                .await?
                .into_iter()
                .map(|c| (c.run_id().to_owned(), c.call_id().to_owned()))
                .collect(),
        )
    };
    let mut calls: Vec<(String, String, Vec<String>)> = Vec::new();
    for r in source
        .reconciler
        .outbox()
        .await?
        .pending()
        .iter()
        .filter(|r| sendable(r))
    {
        let key = (r.run_id().to_owned(), r.call_id().to_owned());
        if of_tool.as_ref().is_some_and(|calls| !calls.contains(&key)) {
            continue;
        }
        let id = r.receipt_id().to_owned();
        match calls
            .iter_mut()
            .find(|(run, call, _)| (run, call) == (&key.0, &key.1))
        {
            Some(entry) => entry.2.push(id),
            None => calls.push((key.0, key.1, vec![id])),
        }
    }
    Ok(calls)
}

/// What a preview counted, as the confirmation carries it.
fn previewed(matched: &[&Matched]) -> String {
    matched
        .iter()
        .flat_map(|m| {
            m.calls.iter().map(|(run, call, ids)| {
                format!(
                    "{} {} {} {}",
                    html::encode(&m.source.label),
                    html::encode(run),
                    html::encode(call),
                    ids.iter()
                        .map(|id| html::encode(id))
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The calls a confirmation carries: `(label, run, call, receipts)`.
fn read_previewed(text: &str) -> Vec<(String, String, String, Vec<String>)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split(' ').map(html::decode);
            Some((
                parts.next()?,
                parts.next()?,
                parts.next()?,
                split_ids(&parts.next()?),
            ))
        })
        .collect()
}

/// `POST /outbox/redeliver`: send every waiting receipt of the calls that
/// match, after a preview of how many; the confirmation sends what the
/// preview counted, nothing that began to wait since.
pub(super) async fn bulk_redeliver(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Form(mut form): Form<BulkForm>,
) -> Response {
    form.given.sign(&v);
    let back = html::with_query("/outbox", &[("identity", &form.identity)]);
    let evidence = form.given.evidence();
    if let Err(e) = evidence.check() {
        return failed(&v, &e, None);
    }
    if form.given.confirmed() {
        return bulk_send(&state, &v, &form, &evidence, &back).await;
    }
    let (matched, problems) = matching(&state, &form).await;
    let (sendable, unsendable): (Vec<&Matched>, Vec<&Matched>) =
        matched.iter().partition(|m| m.source.reconciler.delivers());
    let count: usize = sendable
        .iter()
        .flat_map(|m| &m.calls)
        .map(|c| c.2.len())
        .sum();
    let held: usize = unsendable
        .iter()
        .flat_map(|m| &m.calls)
        .map(|c| c.2.len())
        .sum();
    let calls: usize = sendable.iter().map(|m| m.calls.len()).sum();
    let body = html! {
        h1 { "Redeliver by filter: preview" }
        (html::problems(&problems))
        div #preview .banner.info {
            p { "This sends the platform " span #bulk-count { (count) } " waiting receipt(s) of " (calls) " call(s), byte for byte as stored, and writes the evidence into each call's timeline. Receipts that begin to wait after this preview are not sent." }
            @if held > 0 { p { (held) " more wait in stores this console has no platform for; their executors' outboxes retry them." } }
            ul {
                @for m in &sendable { @for (run, call, ids) in &m.calls {
                    li { a href=(v.link(&call_path(run, call, &m.source.label))) { (run) "/" (call) } " (" (m.source.label) "): " (ids.len()) " receipt(s)" }
                } }
            }
            (form.given.shown())
        }
        @if count > 0 {
            form #confirm-form .action method="post" action=(v.link("/outbox/redeliver")) {
                input type="hidden" name="csrf" value=(v.csrf);
                input type="hidden" name="identity" value=(form.identity);
                input type="hidden" name="tool" value=(form.tool);
                input type="hidden" name="previewed" value=(previewed(&sendable));
                (form.given.hidden())
                button #confirm type="submit" { "Confirm and send" }
                " "
                a href=(v.link(&back)) { "cancel" }
            }
        } @else {
            p { "Nothing to send. " a href=(v.link(&back)) { "Back to the outbox" } }
        }
    };
    html::page(&v, "Redeliver: preview", false, body)
}

/// The confirmed bulk redeliver: each previewed call's receipts, through
/// its store's reconciler.
async fn bulk_send(
    state: &Inner,
    v: &Visitor,
    form: &BulkForm,
    evidence: &crate::reconciler::Evidence,
    back: &str,
) -> Response {
    let view = state.sources.in_view().await;
    let mut sent = Vec::new();
    let mut refusals = view.problems;
    for (label, run, call, ids) in read_previewed(&form.previewed) {
        let Some(source) = view.sources.iter().find(|s| s.label == label) else {
            refusals.push(format!("{run}/{call}: the store {label} is not in view"));
            continue;
        };
        match source
            .reconciler
            .redeliver_call(&run, &call, &ids, evidence)
            .await
        {
            Ok(s) => sent.extend(s),
            Err(e) => refusals.push(format!("{run}/{call}: {e}")),
        }
    }
    let body = html! {
        h1 { (sent_title(&sent)) }
        div #done .done {
            (statuses(&sent))
            @if !refusals.is_empty() {
                p { "Not sent:" }
                ul { @for r in &refusals { li { (r) } } }
            }
        }
        p { a href=(v.link(back)) { "back to the outbox" } }
    };
    html::page(v, sent_title(&sent), false, body)
}

//! The approvals page: the calls that wait for a person's yes, with their
//! arguments, subject, reason and expiry, each with a form to approve or
//! deny it (the approver's name and a note recorded), and the decisions
//! made. A decision goes through [`Approvals`](crate::Approvals): made
//! once, bound to the arguments' digest the page showed, refused when the
//! console's approver check refuses the approver.
use std::collections::HashSet;
use std::sync::Arc;

use axum::Extension;
use axum::Form;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};
use serde::Deserialize;

use super::Inner;
use super::html::{self, age, pretty, stamp};
use super::security::Visitor;
use super::sources::Book;
use crate::approvals::{ApprovalRequest, ApprovalState, Decision};
use crate::store::approvals::Verdict;

/// How many decided requests the page lists under the waiting ones.
const DECIDED_SHOWN: usize = 50;

/// A request as the page lists it: the book it is in, and itself.
type Listed = (String, ApprovalRequest);

/// Every request of every book, each once (the identities of one
/// PostgreSQL database share a book): the waiting ones oldest first, then
/// the others newest first.
async fn listed(state: &Inner) -> (Vec<Listed>, Vec<Listed>, Vec<String>) {
    let (books, mut problems) = state.sources.books(state.approver_check.as_ref()).await;
    let mut seen = HashSet::new();
    let (mut waiting, mut decided) = (Vec::new(), Vec::new());
    for book in &books {
        match tokio::time::timeout(super::sources::READ_TIMEOUT, book.approvals.list()).await {
            Ok(Ok(requests)) => {
                for r in requests {
                    let key = (
                        r.run_id().to_owned(),
                        r.call_id().to_owned(),
                        r.digest().to_owned(),
                    );
                    if !seen.insert(key) {
                        continue;
                    }
                    if r.state() == ApprovalState::Waiting {
                        waiting.push((book.name.clone(), r));
                    } else {
                        decided.push((book.name.clone(), r));
                    }
                }
            }
            Ok(Err(e)) => problems.push(format!(
                "the approval requests of {} cannot be read: {e}",
                book.name
            )),
            Err(_) => problems.push(format!(
                "the approval requests of {} did not answer",
                book.name
            )),
        }
    }
    waiting.sort_by_key(|(_, r)| r.asked_at());
    decided.sort_by_key(|(_, r)| std::cmp::Reverse(r.decided_at().unwrap_or(r.asked_at())));
    decided.truncate(DECIDED_SHOWN);
    (waiting, decided, problems)
}

/// The path a request's decision is posted to.
fn decide_path(r: &ApprovalRequest) -> String {
    format!(
        "/approvals/{}/{}",
        html::encode(r.run_id()),
        html::encode(r.call_id())
    )
}

/// One waiting request, with its form.
fn waiting_request(v: &Visitor, book: &str, r: &ApprovalRequest) -> Markup {
    html! {
        section .approval data-run-id=(r.run_id()) data-call-id=(r.call_id()) data-store=(book) {
            h2 { code { (r.tool()) } " · " code { (r.run_id()) "/" (r.call_id()) } }
            table .facts {
                tr { th { "reason" } td .reason { (r.reason()) } }
                tr { th { "subject" } td .subject { (r.subject()) } }
                tr { th { "agent" } td { (r.agent_id()) " " (r.agent_version()) } }
                tr { th { "asked" } td title=(stamp(&r.asked_at())) { (age(&r.asked_at())) " ago" } }
                tr { th { "expires" } td .expires { (stamp(&r.expires_at())) } }
                tr { th { "arguments' digest" } td { code { (r.digest()) } } }
                tr { th { "store" } td { (book) } }
            }
            h3 { "Arguments" }
            pre .arguments { (pretty(r.arguments())) }
            @if !v.read_only {
                form .decide method="post" action=(v.link(&decide_path(r))) {
                    input type="hidden" name="csrf" value=(v.csrf);
                    input type="hidden" name="store" value=(book);
                    input type="hidden" name="digest" value=(r.digest());
                    (html::operator_field(v, "Approver"))
                    label { "Note " textarea name="note" {} }
                    button .approve type="submit" name="decision" value="approve" { "Approve" }
                    " "
                    button .deny type="submit" name="decision" value="deny" { "Deny" }
                }
            }
        }
    }
}

/// `GET /approvals`: the requests waiting, and the decisions made.
pub(super) async fn page(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
) -> Response {
    let (waiting, decided, problems) = listed(&state).await;
    let body = html! {
        h1 { "Approvals" }
        (html::problems(&problems))
        p .muted {
            (waiting.len()) " calls wait for a person's yes. Nothing of theirs ran: an approved call is claimed again and runs once, within the executor's poll interval; a denied or expired one is settled "
            code { "forbidden" } "."
        }
        @for (book, r) in &waiting { (waiting_request(&v, book, r)) }
        h2 { "Decided" }
        table #decided {
            tr { th { "call" } th { "tool" } th { "state" } th { "by" } th { "when" } th { "note" } }
            @for (_, r) in &decided {
                tr .decided data-run-id=(r.run_id()) data-call-id=(r.call_id()) data-state=(r.state().as_str()) {
                    td { code { (r.run_id()) "/" (r.call_id()) } }
                    td { (r.tool()) }
                    td { (html::state(r.state().as_str())) }
                    td { (r.decided_by().unwrap_or("")) }
                    td { (r.decided_at().map(|t| stamp(&t)).unwrap_or_default()) }
                    td { (r.note().or(r.closed_why()).unwrap_or("")) }
                }
            }
        }
    };
    // A page with forms to fill in does not reload itself.
    html::page(&v, "Approvals", v.read_only || waiting.is_empty(), body)
}

/// The decision form.
#[derive(Debug, Default, Deserialize)]
pub(super) struct DecideForm {
    /// The book the request was shown from.
    #[serde(default)]
    store: String,
    /// The arguments' digest the page showed.
    #[serde(default)]
    digest: String,
    /// `approve` or `deny`.
    #[serde(default)]
    decision: String,
    #[serde(default)]
    who: String,
    #[serde(default)]
    note: String,
}

/// `POST /approvals/RUN_ID/CALL_ID`: approve or deny the request shown.
pub(super) async fn decide(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Path((run_id, call_id)): Path<(String, String)>,
    Form(form): Form<DecideForm>,
) -> Response {
    let back = Some(("back to the approvals", v.link("/approvals")));
    let refused = |why: String| {
        html::error(
            &v,
            StatusCode::UNPROCESSABLE_ENTITY,
            &format!("refused, nothing changed: {why}"),
            back.clone(),
        )
    };
    let verdict = match form.decision.as_str() {
        "approve" => Verdict::Approve,
        "deny" => Verdict::Deny,
        other => return refused(format!("no such decision {other:?}: approve or deny")),
    };
    let (books, _) = state.sources.books(state.approver_check.as_ref()).await;
    let Some(Book { approvals, .. }) = books.into_iter().find(|b| b.name == form.store) else {
        return refused(format!(
            "no store {:?} holds approval requests in this console",
            form.store
        ));
    };
    let note = Some(form.note.trim()).filter(|n| !n.is_empty());
    let who = v.operator.as_deref().unwrap_or(form.who.trim()).to_owned();
    let decided = approvals
        .decide_shown((&run_id, &call_id, &form.digest), verdict, &who, note)
        .await;
    let word = match verdict {
        Verdict::Approve => "approved",
        Verdict::Deny => "denied",
    };
    let what = match decided {
        Ok(Decision::Recorded) => html! {
            p { "The call " code { (run_id) "/" (call_id) } " is " strong { (word) } " by " strong { (who) } "." }
            @if matches!(verdict, Verdict::Approve) {
                p { "An executor claims it again and runs it once, within its poll interval." }
            } @else {
                p { "An executor settles it " code { "forbidden" } " (\"denied by an approver\"), within its poll interval." }
            }
        },
        Ok(_) => html! {
            p { "The call " code { (run_id) "/" (call_id) } " was " (word) " before: nothing changed." }
        },
        Err(e) if e.is_refused() => return refused(e.to_string()),
        Err(e) => {
            return html::error(
                &v,
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("not done: {e}"),
                back,
            );
        }
    };
    let body = html! {
        h1 { "Decided" }
        div #done .done { (what) }
        p { a #back href=(v.link("/approvals")) { "back to the approvals" } }
    };
    html::page(&v, "Decided", false, body)
}

//! The console's pages: the overview, the calls, one call, the outbox.
//! Each reads the stores through their [`Reconciler`](crate::Reconciler)s
//! and renders HTML; none changes anything.
use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};
use serde::Deserialize;
use toolrunner_protocol::wire::ReceiptKind;

use super::Inner;
use super::html::{self, age, call_path, pretty, pretty_text, stamp, with_query};
use super::security::Visitor;
use super::sources::{self, Source};
use crate::reconciler::{CallSummary, ReceiptView, Timeline};
use crate::store::{Attempt, CallFilter, Event, LocalState, ReceiptStatus, Timestamp};

/// Rows on one page of the calls.
const PAGE_SIZE: usize = 50;

/// The states that need a person: an operator settles them.
const NEEDS_A_PERSON: [LocalState; 2] = [LocalState::ReconciliationRequired, LocalState::Rejected];

/// `?identity=LABEL`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Identity {
    #[serde(default)]
    identity: String,
}

impl Identity {
    /// The label, `""` for any store.
    pub(super) fn label(&self) -> &str {
        &self.identity
    }
}

/// What one store holds, for the overview.
struct Counts {
    label: String,
    by_state: BTreeMap<&'static str, usize>,
    by_tool: BTreeMap<String, usize>,
    waiting: usize,
    oldest_waiting: Option<Timestamp>,
    needs_person: usize,
    oldest_needing: Option<Timestamp>,
}

/// Whether a call needs a person: its outcome is unknown
/// (`reconciliation_required`), the platform refused it after its effect
/// may have happened (`rejected`), or the platform forgot it while its
/// outcome was unknown and nobody closed it yet (`orphaned`).
async fn needs_a_person(source: &Source, c: &CallSummary) -> crate::Result<bool> {
    Ok(match c.state() {
        s if NEEDS_A_PERSON.contains(&s) => true,
        LocalState::Orphaned => source
            .reconciler
            .show(c.run_id(), c.call_id())
            .await?
            .closable(),
        _ => false,
    })
}

/// `GET /`: calls by state and by tool, receipts waiting and calls needing
/// a person, per identity; every number links to its list.
pub(super) async fn overview(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
) -> Response {
    let view = state.sources.in_view().await;
    let mut problems = view.problems;
    let (counted, unread) = sources::each(&view.sources, |s| async move { counts(&s).await }).await;
    problems.extend(unread);
    let (flow, unread) = state.sources.flow().await;
    problems.extend(unread);
    let all: Vec<Counts> = counted.into_iter().map(|(_, c)| c).collect();
    let total = |s: LocalState| all.iter().map(|c| c.by_state[s.as_str()]).sum::<usize>();
    let waiting: usize = all.iter().map(|c| c.waiting).sum();
    let needing: usize = all.iter().map(|c| c.needs_person).sum();
    let oldest_needing = all.iter().filter_map(|c| c.oldest_needing).min();
    let oldest_waiting = all.iter().filter_map(|c| c.oldest_waiting).min();
    let body = html! {
        h1 { "Overview" }
        (html::problems(&problems))
        div .grid {
            table #totals {
                tr { th { "state" } th { "calls" } }
                @for s in LocalState::ALL {
                    tr {
                        td { (html::state(s.as_str())) }
                        td { a id={ "total-" (s.as_str()) } href=(v.link(&with_query("/calls", &[("state", s.as_str())]))) { (total(*s)) } }
                    }
                }
            }
            table {
                tr { th { "needs a person" } td { a #total-needs-person href=(v.link("/calls?needs=person")) { (needing) } } }
                tr { th { "oldest of them" } td { (oldest_needing.as_ref().map_or_else(|| "-".to_owned(), age)) } }
                tr { th { "receipts waiting" } td { a #total-waiting href=(v.link("/outbox")) { (waiting) } } }
                tr { th { "oldest of them" } td { (oldest_waiting.as_ref().map_or_else(|| "-".to_owned(), age)) } }
                tr { th { "identities" } td { (all.len()) } }
            }
        }
        @for f in &flow {
            @if !f.tools.is_empty() {
                section .flow data-database=(f.database) {
                    h2 { "Flow limits on " code { (f.database) } }
                    p { "Limits set in the store (" code { "toolrunner limits set" } "), over each replica's own; \"-\": the replicas' own apply. Slots and tokens: every replica's now." }
                    table .flow-limits {
                        tr { th { "tool" } th { "concurrency" } th { "rate" } th { "slots in use" } th { "tokens in use" } }
                        @for t in &f.tools {
                            tr .flow data-flow-tool=(t.tool()) {
                                td { code { (t.tool()) } }
                                td .concurrency { (limit(t.stored().max_concurrency())) }
                                td .rate { (limit(t.stored().max_rate())) }
                                td .slots { (t.slots_in_use()) }
                                td .tokens { (t.tokens_in_use()) }
                            }
                        }
                    }
                }
            }
        }
        @for c in &all {
            section .identity data-identity=(c.label) {
                h2 { "Identity " code { (c.label) } }
                div .grid {
                    table {
                        tr { th { "state" } th { "calls" } }
                        @for (s, n) in &c.by_state {
                            @if *n > 0 {
                                tr {
                                    td { (html::state(s)) }
                                    td { a .count data-state=(s) href=(v.link(&with_query("/calls", &[("state", s), ("identity", &c.label)]))) { (n) } }
                                }
                            }
                        }
                    }
                    table {
                        tr { th { "tool" } th { "calls" } }
                        @for (tool, n) in &c.by_tool {
                            tr {
                                td { code { (tool) } }
                                td { a .count data-tool=(tool) href=(v.link(&with_query("/calls", &[("tool", tool), ("identity", &c.label)]))) { (n) } }
                            }
                        }
                    }
                    table {
                        tr { th { "needs a person" } td { a .needs-person href=(v.link(&with_query("/calls", &[("needs", "person"), ("identity", &c.label)]))) { (c.needs_person) } } }
                        tr { th { "oldest of them" } td { (c.oldest_needing.as_ref().map_or_else(|| "-".to_owned(), age)) } }
                        tr { th { "receipts waiting" } td { a .waiting href=(v.link(&with_query("/outbox", &[("identity", &c.label)]))) { (c.waiting) } } }
                        tr { th { "oldest of them" } td { (c.oldest_waiting.as_ref().map_or_else(|| "-".to_owned(), age)) } }
                    }
                }
            }
        }
    };
    html::page(&v, "Overview", true, body)
}

/// A stored limit, or `-` for none.
fn limit(n: Option<u32>) -> String {
    n.map_or_else(|| "-".to_owned(), |n| n.to_string())
}

/// One store's counts.
async fn counts(source: &Source) -> crate::Result<Counts> {
    let calls = source.reconciler.list(&CallFilter::new()).await?;
    let outbox = source.reconciler.outbox().await?;
    let mut by_state: BTreeMap<&'static str, usize> =
        LocalState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
    let mut by_tool = BTreeMap::new();
    for c in &calls {
        *by_state.entry(c.state().as_str()).or_default() += 1;
        *by_tool.entry(c.tool_name().to_owned()).or_default() += 1;
    }
    let mut needing: Vec<&CallSummary> = Vec::new();
    for c in &calls {
        if needs_a_person(source, c).await? {
            needing.push(c);
        }
    }
    Ok(Counts {
        label: source.label.clone(),
        by_state,
        by_tool,
        waiting: outbox.pending().len(),
        oldest_waiting: outbox.oldest_pending_at(),
        needs_person: needing.len(),
        oldest_needing: needing.iter().map(|c| c.updated_at()).min(),
    })
}

/// The calls page's filters (every one optional).
#[derive(Debug, Default, Deserialize)]
pub(super) struct CallsQuery {
    #[serde(default)]
    state: String,
    #[serde(default)]
    needs: String,
    #[serde(default)]
    tool: String,
    #[serde(default)]
    identity: String,
    #[serde(default)]
    run: String,
    #[serde(default)]
    older_than: String,
    #[serde(default)]
    q: String,
    #[serde(default)]
    sort: String,
    #[serde(default)]
    page: Option<usize>,
}

impl CallsQuery {
    /// This query's link, with `page`.
    fn link(&self, page: usize) -> String {
        let page = page.to_string();
        with_query(
            "/calls",
            &[
                ("state", &self.state),
                ("needs", &self.needs),
                ("tool", &self.tool),
                ("identity", &self.identity),
                ("run", &self.run),
                ("older_than", &self.older_than),
                ("q", &self.q),
                ("sort", &self.sort),
                ("page", &page),
            ],
        )
    }
}

/// The calls of one store the calls page shows: the store's filter, then
/// the run, the search (a call id, a run id, or an operation key: the
/// current one, else, when no call's matches, any earlier one), and
/// `needs=person`.
async fn matching_calls(
    source: &Source,
    filter: &CallFilter,
    query: &CallsQuery,
    q: &str,
) -> crate::Result<Vec<CallSummary>> {
    let listed: Vec<CallSummary> = source
        .reconciler
        .list(filter)
        .await?
        .into_iter()
        .filter(|c| query.run.is_empty() || c.run_id() == query.run.trim())
        .collect();
    let mut found: Vec<CallSummary> = listed
        .iter()
        .filter(|c| {
            q.is_empty()
                || c.call_id().contains(q)
                || c.operation_key().contains(q)
                || c.run_id() == q
        })
        .cloned()
        .collect();
    if found.is_empty() && !q.is_empty() {
        for c in &listed {
            let t = source.reconciler.show(c.run_id(), c.call_id()).await?;
            if t.attempts().iter().any(|a| a.operation_key().contains(q)) {
                found.push(c.clone());
            }
        }
    }
    if query.needs == "person" {
        let mut kept = Vec::new();
        for c in found {
            if needs_a_person(source, &c).await? {
                kept.push(c);
            }
        }
        found = kept;
    }
    Ok(found)
}

/// `10s`, `5m`, `2h`, `3d` as seconds.
fn parse_age(s: &str) -> Option<i64> {
    let s = s.trim();
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: i64 = n.parse().ok()?;
    let per = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    n.checked_mul(per)
}

/// `GET /calls`: the calls that match the filters, oldest change first
/// (or newest, `sort=newest`), a page at a time.
pub(super) async fn calls(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Query(query): Query<CallsQuery>,
) -> Response {
    let mut filter = CallFilter::new();
    if !query.state.is_empty() {
        let Some(s) = LocalState::parse(&query.state) else {
            let names: Vec<&str> = LocalState::ALL.iter().map(|s| s.as_str()).collect();
            return html::error(
                &v,
                StatusCode::BAD_REQUEST,
                &format!(
                    "unknown state {:?}: one of {}",
                    query.state,
                    names.join(", ")
                ),
                Some(("all calls", v.link("/calls"))),
            );
        };
        filter = filter.state(s);
    } else if query.needs == "person" {
        filter = filter.states(NEEDS_A_PERSON.into_iter().chain([LocalState::Orphaned]));
    }
    if !query.tool.is_empty() {
        filter = filter.tool_name(query.tool.clone());
    }
    if !query.older_than.is_empty() {
        let Some(secs) = parse_age(&query.older_than) else {
            return html::error(
                &v,
                StatusCode::BAD_REQUEST,
                &format!(
                    "{:?} is not an age: a number and s, m, h or d (10m, 2h)",
                    query.older_than
                ),
                Some(("all calls", v.link("/calls"))),
            );
        };
        let before = chrono::Utc::now()
            .checked_sub_signed(chrono::TimeDelta::seconds(secs))
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        filter = filter.updated_before(before);
    }
    let view = state.sources.only(&query.identity).await;
    let mut problems = view.problems;
    let all_labels = state.sources.labels().await;
    let q = query.q.trim();
    let (found, unread) = sources::each(&view.sources, |source| {
        let filter = filter.clone();
        let query = &query;
        async move { matching_calls(&source, &filter, query, q).await }
    })
    .await;
    problems.extend(unread);
    let mut rows: Vec<(String, CallSummary)> = found
        .into_iter()
        .flat_map(|(source, calls)| calls.into_iter().map(move |c| (source.label.clone(), c)))
        .collect();
    let newest = query.sort == "newest";
    rows.sort_by(|a, b| {
        let order = a.1.updated_at().cmp(&b.1.updated_at());
        if newest { order.reverse() } else { order }
    });
    let pages = rows.len().div_ceil(PAGE_SIZE).max(1);
    let page = query.page.unwrap_or(1).clamp(1, pages);
    let shown = rows.iter().skip((page - 1) * PAGE_SIZE).take(PAGE_SIZE);
    let title = if !query.state.is_empty() {
        format!("Calls {}", query.state)
    } else if query.needs == "person" {
        "Calls needing a person".to_owned()
    } else {
        "Calls".to_owned()
    };
    let body = html! {
        h1 { (title) }
        (html::problems(&problems))
        form #filters method="get" action=(v.link("/calls")) {
            label { "state " select name="state" {
                option value="" { "any" }
                @for s in LocalState::ALL {
                    option value=(s.as_str()) selected[query.state == s.as_str()] { (s.as_str()) }
                }
            } }
            " "
            label { "identity " select name="identity" {
                option value="" { "all" }
                @for l in &all_labels { option value=(l) selected[&query.identity == l] { (l) } }
            } }
            " "
            label { "tool " input type="text" name="tool" value=(query.tool) size="14"; }
            " "
            label { "run " input type="text" name="run" value=(query.run) size="14"; }
            " "
            label { "unchanged for " input type="text" name="older_than" value=(query.older_than) size="5" placeholder="10m"; }
            " "
            label { "call id or operation key " input type="text" name="q" value=(query.q) size="18"; }
            " "
            label { "sort " select name="sort" {
                option value="oldest" selected[!newest] { "oldest first" }
                option value="newest" selected[newest] { "newest first" }
            } }
            @if query.needs == "person" { input type="hidden" name="needs" value="person"; }
            " "
            button type="submit" { "Filter" }
        }
        p .muted { (rows.len()) " calls · page " (page) " of " (pages) }
        table #calls {
            tr { th { "call" } th { "identity" } th { "tool" } th { "state" } th { "unchanged for" } th { "operation key" } th { "reason" } }
            @for (label, c) in shown {
                tr .call data-call-id=(c.call_id()) data-run-id=(c.run_id()) data-state=(c.state().as_str()) data-identity=(label) {
                    td { a .call-link href=(v.link(&call_path(c.run_id(), c.call_id(), label))) { (c.run_id()) "/" (c.call_id()) } }
                    td { (label) }
                    td { code { (c.tool_name()) } }
                    td { (html::state(c.state().as_str())) }
                    td title=(stamp(&c.updated_at())) { (age(&c.updated_at())) }
                    td { code { (c.operation_key()) } }
                    td { (c.reason().unwrap_or("")) }
                }
            }
        }
        p {
            @if page > 1 { a #prev rel="prev" href=(v.link(&query.link(page - 1))) { "← previous" } " " }
            @if page < pages { a #next rel="next" href=(v.link(&query.link(page + 1))) { "next →" } }
        }
    };
    html::page(&v, &title, false, body)
}

/// One entry of a call's timeline, in time order; an event repeated
/// with the same detail one after another (an automatic check that keeps
/// answering `unknown`) is one entry with its count and last time.
enum Entry<'a> {
    Event(&'a Event, Option<(usize, Timestamp)>),
    Attempt(&'a Attempt),
    Receipt(&'a ReceiptView),
}

impl Entry<'_> {
    fn at(&self) -> Timestamp {
        match self {
            Entry::Event(e, _) => e.at(),
            Entry::Attempt(a) => a.created_at(),
            Entry::Receipt(r) => r.created_at(),
        }
    }
}

/// Folds each run of one event repeated with the same detail into its
/// first entry, with the count and the last time.
fn collapse(entries: Vec<Entry<'_>>) -> Vec<Entry<'_>> {
    let mut out: Vec<Entry> = Vec::with_capacity(entries.len());
    for e in entries {
        if let (Some(Entry::Event(first, repeats)), Entry::Event(next, None)) = (out.last_mut(), &e)
            && first.what() == next.what()
            && first.detail() == next.detail()
        {
            let n = repeats.map_or(2, |(n, _)| n + 1);
            *repeats = Some((n, next.at()));
            continue;
        }
        out.push(e);
    }
    out
}

/// The action a timeline entry records, as `data-what` names it: the
/// stored name, with an operator's resolve and compensation named as
/// actions.
fn action_name(what: &str) -> &str {
    match what {
        "resolved by operator" => "operator_resolved",
        "compensated" => "operator_compensated",
        other => other,
    }
}

/// The call, in the store `identity` names (or the first that holds it):
/// a 404 page when no store does, a 503 page naming the stores that could
/// not be read when the call may be in one of them.
pub(super) async fn find(
    state: &Inner,
    v: &Visitor,
    (run_id, call_id): (&str, &str),
    identity: &str,
) -> Result<(Source, Timeline), Response> {
    let view = state.sources.only(identity).await;
    let mut problems = view.problems;
    for source in view.sources {
        match source.reconciler.show(run_id, call_id).await {
            Ok(t) => return Ok((source, t)),
            Err(e) if e.is_refused() => {}
            Err(e) => problems.push(format!("the store of {} cannot be read: {e}", source.label)),
        }
    }
    if problems.is_empty() {
        return Err(html::error(
            v,
            StatusCode::NOT_FOUND,
            &format!("no store of this console holds the call {run_id}/{call_id}"),
            Some(("all calls", v.link("/calls"))),
        ));
    }
    Err(html::error(
        v,
        StatusCode::SERVICE_UNAVAILABLE,
        &format!(
            "the call {run_id}/{call_id} is in no store that could be read; {}",
            problems.join("; ")
        ),
        Some(("all calls", v.link("/calls"))),
    ))
}

/// `GET /calls/RUN_ID/CALL_ID`: the call's timeline, its arguments and
/// result, what to look up downstream, and the actions its state allows.
pub(super) async fn call(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Path((run_id, call_id)): Path<(String, String)>,
    Query(identity): Query<Identity>,
) -> Response {
    let (source, t) = match find(&state, &v, (&run_id, &call_id), identity.label()).await {
        Ok(found) => found,
        Err(page) => return page,
    };
    html::page(
        &v,
        &format!("{run_id}/{call_id}"),
        false,
        call_body(&v, &source, &t),
    )
}

fn call_body(v: &Visitor, source: &Source, t: &Timeline) -> Markup {
    let c = t.call();
    let mut entries: Vec<Entry> = t
        .events()
        .iter()
        .map(|e| Entry::Event(e, None))
        .chain(t.attempts().iter().map(Entry::Attempt))
        .chain(t.receipts().iter().map(Entry::Receipt))
        .collect();
    entries.sort_by_key(Entry::at);
    let entries = collapse(entries);
    let result = t.result();
    let mut keys: Vec<&str> = Vec::new();
    for a in t.attempts() {
        if !keys.contains(&a.operation_key()) {
            keys.push(a.operation_key());
        }
    }
    let waiting: Vec<&ReceiptView> = t
        .receipts()
        .iter()
        .filter(|r| r.status() == ReceiptStatus::Pending && r.kind() != ReceiptKind::Accepted)
        .collect();
    let closable = t.closable();
    let here = |action: &str| {
        v.link(&html::with_query(
            &format!(
                "/calls/{}/{}/{action}",
                html::encode(c.run_id()),
                html::encode(c.call_id())
            ),
            &[("identity", &source.label)],
        ))
    };
    html! {
        h1 #call-title { "Call " code { (c.run_id()) "/" (c.call_id()) } }
        table {
            tr { th { "state" } td { span #call-state class={ "state state-" (c.state().as_str()) } { (c.state().as_str()) } } }
            tr { th { "tool" } td { code { (c.tool_name()) } } }
            tr { th { "identity" } td #call-identity { (source.label) } }
            tr { th { "reason" } td { (c.reason().unwrap_or("-")) } }
            tr { th { "subject" } td { (c.subject().unwrap_or("-")) } }
            tr { th { "assignment" } td { code { (c.assignment_id().unwrap_or("-")) } } }
            tr { th { "first seen" } td { (stamp(&c.created_at())) } }
            tr { th { "last change" } td { (stamp(&c.updated_at())) " (" (age(&c.updated_at())) " ago)" } }
        }
        h2 { "Look up downstream" }
        p { "The operation key this call's handler passed downstream (the idempotency key): look it up in the business system to learn whether the effect happened." }
        p { input #operation-key .key type="text" readonly size="60" value=(c.operation_key()) aria-label="operation key"; }
        @if keys.len() > 1 {
            p .muted { "Every operation key this call had, oldest first (each claim had its own):" }
            ul #operation-keys { @for k in &keys { li { code { (k) } } } }
        }
        h2 { "Arguments" }
        @match t.arguments() {
            Some(args) => pre #arguments { (pretty(args)) },
            None => p .muted { "Not assigned yet: no arguments in this store." },
        }
        @if let Some(r) = &result {
            h2 { "Result" }
            pre #result { (pretty(r)) }
        }
        h2 { "Timeline" }
        ol #timeline {
            @for e in &entries {
                @match e {
                    Entry::Event(ev, repeats) => li .event data-what=(action_name(ev.what())) {
                        (stamp(&ev.at())) " · " strong { (ev.what()) }
                        @if let Some((n, last)) = repeats { " " span .muted { "× " (n) ", the last at " (stamp(last)) } }
                        @if let Some(d) = ev.detail() {
                            @if d.len() <= 120 && !d.contains('\n') && !d.starts_with('{') {
                                " — " (d)
                            } @else {
                                pre { (pretty_text(d)) }
                            }
                        }
                    },
                    Entry::Attempt(a) => li .attempt {
                        (stamp(&a.created_at())) " · " strong { "attempt" } " operation key " code { (a.operation_key()) }
                        " · executor " code { (a.executor_id().unwrap_or("?")) }
                        " · assignment " code { (a.assignment_id().unwrap_or("none yet")) }
                    },
                    Entry::Receipt(r) => li .receipt data-receipt-id=(r.receipt_id()) data-kind=(r.kind().as_str()) {
                        (stamp(&r.created_at())) " · " strong { "receipt " (r.kind().as_str()) } " #" (r.sequence())
                        " · " code { (r.receipt_id()) } " · " (r.status().as_str())
                        " · " (r.attempts()) " delivery attempts"
                        @if let Some(at) = r.delivered_at() { " · delivered " (stamp(&at)) }
                        @if let Some(e) = r.last_error() { " · last error: " (e) }
                        details { summary { "the bytes sent" } pre { (r.body()) } }
                    },
                }
            }
        }
        @if !v.read_only {
            (actions(v, source, t, &here, &waiting, closable))
        }
    }
}

/// The forms of the actions the call's state allows.
fn actions(
    v: &Visitor,
    source: &Source,
    t: &Timeline,
    here: &dyn Fn(&str) -> String,
    waiting: &[&ReceiptView],
    closable: bool,
) -> Markup {
    let c = t.call();
    let resolvable = NEEDS_A_PERSON.contains(&c.state());
    let delivers = source.reconciler.delivers();
    html! {
        @if resolvable || c.state() == LocalState::Rejected || closable || !waiting.is_empty() {
            h2 { "Actions" }
        }
        @if resolvable {
            form #resolve-form .action method="post" action=(here("resolve")) {
                h3 { "Resolve" }
                p .muted {
                    "Settles the call with a new final receipt. "
                    @if delivers { "The console sends it to the platform at once, which ends the call with it." }
                    @else { "It is saved in this store's outbox; the running executor sends it (this console has no platform)." }
                    " You see exactly what goes out before it is sent."
                }
                label { input type="radio" name="outcome" value="completed" checked; " completed, with this result (checked against the tool's output schema):" }
                textarea name="result" placeholder="{\"charge_id\": \"ch_…\"}" {}
                label { input type="radio" name="outcome" value="failed"; " failed, with code " input type="text" name="code" placeholder="declined"; }
                label { "and message for the model " input type="text" name="message"; }
                label { input type="radio" name="outcome" value="cancelled"; " cancelled, because " input type="text" name="reason"; }
                (evidence_fields(v))
                button #resolve-preview type="submit" { "Preview what will be sent" }
            }
        }
        @if c.state() == LocalState::Rejected {
            form #compensated-form .action method="post" action=(here("compensated")) {
                h3 { "Record a compensation" }
                p .muted { "The platform refused this call's receipt after its effect may have happened: record that the effect was undone. Nothing is sent to the platform." }
                (evidence_fields(v))
                button #compensated-preview type="submit" { "Preview" }
            }
        }
        @if closable {
            form #close-form .action method="post" action=(here("close")) {
                h3 { "Close" }
                p .muted { "The platform forgot this call while its outcome was unknown: close it here with evidence. Nothing is sent to the platform." }
                (evidence_fields(v))
                button #close-preview type="submit" { "Preview" }
            }
        }
        @if !waiting.is_empty() {
            @if delivers {
                form #redeliver-form .action method="post" action=(here("redeliver")) {
                    h3 { "Redeliver" }
                    p .muted { (waiting.len()) " receipt(s) of this call wait to be sent; a running executor's outbox retries them by itself. Send them now:" }
                    (evidence_fields(v))
                    button #redeliver-preview type="submit" { "Preview" }
                }
            } @else {
                p .muted { (waiting.len()) " receipt(s) wait; this console has no platform to send them (start it with --base-url and TOOLRUNNER_TOKEN), and a running executor's outbox retries them by itself." }
            }
        }
    }
}

/// Who decides, why, and where the proof is; and the CSRF token.
pub(super) fn evidence_fields(v: &Visitor) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(v.csrf);
        (html::operator_field(v, "Operator"))
        label { "Evidence (what you checked, where) " textarea name="evidence" required {} }
        label { "Reference (ticket, provider transaction id) " input type="text" name="reference"; }
    }
}

/// `GET /outbox`: the receipts waiting, why, since when, how many attempts,
/// the last error; and the bulk redeliver.
pub(super) async fn outbox(
    State(state): State<Arc<Inner>>,
    Extension(v): Extension<Visitor>,
    Query(identity): Query<Identity>,
) -> Response {
    let view = state.sources.only(identity.label()).await;
    let mut problems = view.problems;
    let labels = state.sources.labels().await;
    let (read, unread) = sources::each(&view.sources, |source| async move {
        source.reconciler.outbox().await
    })
    .await;
    problems.extend(unread);
    let mut rows: Vec<(String, ReceiptView)> = read
        .into_iter()
        .flat_map(|(source, status)| {
            status
                .pending()
                .iter()
                .map(|r| (source.label.clone(), r.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    rows.sort_by_key(|(_, r)| r.created_at());
    let body = html! {
        h1 { "Outbox" }
        (html::problems(&problems))
        p .muted { (rows.len()) " receipts wait to be sent. A running executor's outbox retries each by itself, with backoff." }
        table #outbox {
            tr { th { "receipt" } th { "call" } th { "identity" } th { "kind" } th { "waiting since" } th { "attempts" } th { "why it waits" } }
            @for (label, r) in &rows {
                tr .receipt data-receipt-id=(r.receipt_id()) data-identity=(label) {
                    td { code { (r.receipt_id()) } }
                    td { a href=(v.link(&call_path(r.run_id(), r.call_id(), label))) { (r.run_id()) "/" (r.call_id()) } }
                    td { (label) }
                    td { (r.kind().as_str()) }
                    td title=(stamp(&r.created_at())) { (age(&r.created_at())) }
                    td { (r.attempts()) }
                    td { (why_waiting(r)) }
                }
            }
        }
        @if !v.read_only {
            form #bulk-redeliver-form .action method="post" action=(v.link("/outbox/redeliver")) {
                h2 { "Redeliver by filter" }
                p .muted { "Sends every waiting receipt (but `accepted` ones, which only the executor's accept step sends) of the calls that match. You see how many before anything is sent." }
                label { "identity " select name="identity" {
                    option value="" { "all" }
                    @for l in &labels { option value=(l) selected[&identity.identity == l] { (l) } }
                } }
                label { "tool (empty: any) " input type="text" name="tool"; }
                (evidence_fields(&v))
                button #bulk-preview type="submit" { "Preview the count" }
            }
        }
    };
    // A page with a form to fill in does not reload itself.
    html::page(&v, "Outbox", v.read_only, body)
}

/// Why a receipt still waits, in words.
fn why_waiting(r: &ReceiptView) -> String {
    if r.kind() == ReceiptKind::Accepted {
        return "an accepted: only the executor's accept step sends it (start the executor)"
            .to_owned();
    }
    match (r.attempts(), r.last_error()) {
        (0, _) => "not tried yet: the executor's outbox sends it".to_owned(),
        (_, Some(e)) => format!("the last attempt failed: {e}"),
        (n, None) => format!("{n} attempts, no answer recorded"),
    }
}

/// Any other path: 404.
pub(super) async fn not_found() -> Response {
    html::refusal(StatusCode::NOT_FOUND, "no such page in this console")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_seconds() {
        assert_eq!(parse_age("10m"), Some(600));
        assert_eq!(parse_age("2h"), Some(7200));
        assert_eq!(parse_age("3d"), Some(259_200));
        assert_eq!(parse_age("45s"), Some(45));
        assert_eq!(parse_age("m"), None);
        assert_eq!(parse_age("10"), None);
        assert_eq!(parse_age("10y"), None);
    }
}

//! Integration tests of the `toolrunner` executor against the development
//! platform: each test starts its own platform on `127.0.0.1:0`, creates an
//! agent, a binding and a version from the executor's own tool definitions,
//! starts runs through the admin API and checks what the platform stored,
//! what the handlers did and what the local store holds.

#![allow(missing_docs, unreachable_pub)]

mod approvals;
mod error_messages;
mod failures;
mod fixture;
mod flat_cost;
mod flow;
mod flow_keys;
mod function_tools;
mod group_commit;
mod happy;
mod lifecycle;
mod migration;
mod read_failures;
mod review_accept_missing_scope;
mod review_commit_point_cancel;
mod review_report_poison;
mod review_stuck_running;
mod review_unknown_fields;
mod rows;
mod secrets;
#[path = "../store_contract/mod.rs"]
mod store_contract;
mod store_rules;
mod tools;

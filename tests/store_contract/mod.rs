//! The store contract: what every backend of `toolrunner::testing::store::Store`
//! must do, written once against `&dyn Store`. The SQLite tests
//! (`tests/executor`) and the PostgreSQL suite (`tests/postgres.rs`) run
//! the same bodies, each on a fresh store of its own.

pub(crate) mod cost;
pub(crate) mod rows;
pub(crate) mod rules;

pub(crate) use cost::{
    an_operator_closes_an_unknown_outcome_orphaned_call, older_migrations, older_orphans,
    outcomes_and_executor_ids_are_read_as_stored, prune_keeps_what_needs_a_person,
    prune_takes_only_calls_settled_for_good_before_the_cut_off,
    retention_keeps_the_unknown_outcome_orphans_an_older_version_wrote,
    the_outbox_summary_lists_what_waits_without_reading_bodies,
};
pub(crate) use rules::{
    a_change_decided_on_an_old_version_is_refused, impossible_receipts_are_refused,
    text_with_nul_characters_is_stored,
};

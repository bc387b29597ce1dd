//! The PostgreSQL suite: the store contract (`tests/store_contract`) and
//! the executor, on a real server. Run it with
//!
//! ```text
//! TOOLRUNNER_TEST_PG_URL=postgres://postgres@127.0.0.1:5432/test cargo test --features postgres --test postgres
//! ```
//!
//! Each test works in a schema of its own (created, then dropped), so the
//! tests run in parallel on one database. Without the `postgres` feature,
//! or without `TOOLRUNNER_TEST_PG_URL`, the suite runs nothing and says so;
//! with the URL given, a server that does not answer fails every test.

use std::process::ExitCode;

use libtest_mimic::{Arguments, Trial};

#[cfg(feature = "postgres")]
#[path = "store_contract/mod.rs"]
mod store_contract;

#[cfg(feature = "postgres")]
#[path = "transactional/mod.rs"]
mod transactional;

#[cfg(feature = "postgres")]
#[path = "replicas/mod.rs"]
mod replicas;

fn main() -> ExitCode {
    let args = Arguments::from_args();
    // `RUST_LOG=toolrunner=debug` shows the executors' own logs.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let url = std::env::var("TOOLRUNNER_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty());
    let trials = match url {
        #[cfg(feature = "postgres")]
        Some(url) => suite::trials(&url),
        #[cfg(not(feature = "postgres"))]
        Some(_) => {
            eprintln!(
                "the PostgreSQL suite was not run: TOOLRUNNER_TEST_PG_URL is set but the `postgres` feature is off (add --features postgres)"
            );
            return ExitCode::FAILURE;
        }
        None => {
            println!(
                "the PostgreSQL suite was not run: set TOOLRUNNER_TEST_PG_URL (for example postgres://postgres@127.0.0.1:5432/test) and pass --features postgres"
            );
            Vec::<Trial>::new()
        }
    };
    libtest_mimic::run(&args, trials).exit_code()
}

#[cfg(feature = "postgres")]
mod suite {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use anyhow::{Context, Result, bail, ensure};
    use libtest_mimic::{Failed, Trial};
    use serde::{Deserialize, Serialize};
    use serde_json::json;
    use toolrunner::platform::{NewToolCall, Platform};
    use toolrunner::testing::store::{LocalState, PgStore, Store};
    use toolrunner::{CallContext, Executor, Shutdown, ToolError};

    use super::store_contract;

    /// A test body on a fresh store in its own schema.
    type Body = fn(Arc<dyn Store>, String) -> Pin<Box<dyn Future<Output = Result<()>> + Send>>;

    /// Every test of the suite.
    pub(super) fn trials(url: &str) -> Vec<Trial> {
        let mut tests: Vec<(&str, Body)> = vec![
            (
                "store_contract::a_change_decided_on_an_old_version_is_refused",
                |s, _| {
                    Box::pin(async move {
                        store_contract::a_change_decided_on_an_old_version_is_refused(s.as_ref())
                            .await
                    })
                },
            ),
            (
                "store_contract::an_operator_closes_an_unknown_outcome_orphaned_call",
                |s, _| {
                    Box::pin(async move {
                        store_contract::an_operator_closes_an_unknown_outcome_orphaned_call(s).await
                    })
                },
            ),
            (
                "store_contract::outcomes_and_executor_ids_are_read_as_stored",
                |s, _| {
                    Box::pin(async move {
                        store_contract::outcomes_and_executor_ids_are_read_as_stored(s.as_ref())
                            .await
                    })
                },
            ),
            ("store_contract::prune_keeps_what_needs_a_person", |s, _| {
                Box::pin(async move {
                    store_contract::prune_keeps_what_needs_a_person(s.as_ref()).await
                })
            }),
            (
                "store_contract::text_with_nul_characters_is_stored",
                |s, _| {
                    Box::pin(async move {
                        store_contract::text_with_nul_characters_is_stored(s.as_ref()).await
                    })
                },
            ),
            ("store_contract::impossible_receipts_are_refused", |s, _| {
                Box::pin(async move {
                    store_contract::impossible_receipts_are_refused(s.as_ref()).await
                })
            }),
            (
                "store_contract::prune_takes_only_calls_settled_for_good_before_the_cut_off",
                |s, _| {
                    Box::pin(async move {
                        store_contract::prune_takes_only_calls_settled_for_good_before_the_cut_off(
                            s.as_ref(),
                        )
                        .await
                    })
                },
            ),
            (
                "store_contract::the_outbox_summary_lists_what_waits_without_reading_bodies",
                |s, _| {
                    Box::pin(async move {
                        store_contract::the_outbox_summary_lists_what_waits_without_reading_bodies(
                            s.as_ref(),
                        )
                        .await
                    })
                },
            ),
            (
                "store_contract::prune_deletes_a_batch_in_a_few_round_trips",
                |s, u| Box::pin(prune_deletes_a_batch_in_a_few_round_trips(s, u)),
            ),
            (
                "writer::a_job_whose_caller_is_gone_is_not_written",
                |_, u| {
                    Box::pin(
                        async move { writer::a_job_whose_caller_is_gone_is_not_written(&u).await },
                    )
                },
            ),
            (
                "writer::a_failed_group_commit_is_heard_by_every_job_of_the_group",
                |_, u| {
                    Box::pin(async move {
                        writer::a_failed_group_commit_is_heard_by_every_job_of_the_group(&u).await
                    })
                },
            ),
            (
                "writer::a_writer_task_that_died_is_started_again",
                |_, u| {
                    Box::pin(
                        async move { writer::a_writer_task_that_died_is_started_again(&u).await },
                    )
                },
            ),
            (
                "executor::calls_run_once_and_are_delivered_with_a_postgres_store_url",
                |s, u| Box::pin(calls_run_once_and_are_delivered(s, u)),
            ),
            (
                "transactional::business_row_and_receipt_are_both_or_neither_at_every_step",
                |_, u| {
                    Box::pin(async move {
                        let open = || async {
                            let store: Arc<dyn Store> = Arc::new(PgStore::connect(&u).await?);
                            Ok(store)
                        };
                        super::transactional::both_or_neither_at_every_step(&u, open).await
                    })
                },
            ),
            (
                "replicas::a_write_with_an_older_fencing_token_is_refused",
                |_, u| {
                    Box::pin(async move {
                        super::replicas::a_write_with_an_older_token_is_refused(&u).await
                    })
                },
            ),
            (
                "replicas::a_running_executor_whose_lease_moved_on_stops",
                |_, u| {
                    Box::pin(async move {
                        super::replicas::a_running_executor_whose_lease_moved_on_stops(&u).await
                    })
                },
            ),
            (
                "transactional::a_nested_transaction_is_refused_at_once",
                |_, u| {
                    Box::pin(async move {
                        super::transactional::a_nested_transaction_is_refused_at_once(&u).await
                    })
                },
            ),
            (
                "transactional::a_closure_still_running_when_the_handler_returns_is_cut_off",
                |_, u| {
                    Box::pin(async move {
                        super::transactional::a_closure_still_running_when_the_handler_returns_is_cut_off(&u).await
                    })
                },
            ),
            (
                "transactional::an_executor_stopped_mid_transaction_holds_nothing",
                |_, u| {
                    Box::pin(async move {
                        super::transactional::an_executor_stopped_mid_transaction_holds_nothing(&u)
                            .await
                    })
                },
            ),
            ("transactional::a_kept_transaction_is_harmless", |_, u| {
                Box::pin(
                    async move { super::transactional::a_kept_transaction_is_harmless(&u).await },
                )
            }),
            (
                "transactional::an_interrupted_transaction_is_rolled_back",
                |_, u| {
                    Box::pin(async move {
                        super::transactional::an_interrupted_transaction_is_rolled_back(&u).await
                    })
                },
            ),
            (
                "transactional::a_run_cancelled_while_down_is_not_run_again",
                |_, u| {
                    Box::pin(async move {
                        let open = || async {
                            let store: Arc<dyn Store> = Arc::new(PgStore::connect(&u).await?);
                            Ok(store)
                        };
                        super::transactional::a_run_cancelled_while_down_is_not_run_again(&u, open)
                            .await
                    })
                },
            ),
            (
                "transactional::progress_before_the_transaction_completes_once",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::progress_before_the_transaction_completes_once(&u, s)
                            .await
                    })
                },
            ),
            (
                "transactional::a_closure_that_fails_leaves_none_of_its_writes",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_closure_that_fails_leaves_none_of_its_writes(&u, s)
                            .await
                    })
                },
            ),
            (
                "transactional::a_closure_that_ends_the_transaction_is_an_unknown_outcome",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_closure_that_ends_the_transaction_is_an_unknown_outcome(&u, s)
                            .await
                    })
                },
            ),
            (
                "transactional::a_closure_that_ends_the_transaction_and_stops_is_an_unknown_outcome",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_closure_that_ends_the_transaction_and_stops_is_an_unknown_outcome(&u, s)
                            .await
                    })
                },
            ),
            (
                "transactional::a_temporary_table_takes_none_of_the_store_s_writes",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_temporary_table_takes_none_of_the_store_s_writes(
                            &u, s,
                        )
                        .await
                    })
                },
            ),
            (
                "transactional::a_handler_cannot_change_the_store_s_session",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_handler_cannot_change_the_store_s_session(&u, s)
                            .await
                    })
                },
            ),
            (
                "transactional::slow_handlers_at_capacity_leave_the_store_writable",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::slow_handlers_at_capacity_leave_the_store_writable(
                            &u, s,
                        )
                        .await
                    })
                },
            ),
            (
                "transactional::a_resumed_call_whose_run_ended_unseen_is_not_run_again",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_resumed_call_whose_run_ended_unseen_is_not_run_again(&u, s)
                            .await
                    })
                },
            ),
            (
                "transactional::a_resumed_call_whose_run_was_forgotten_is_orphaned",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::a_resumed_call_whose_run_was_forgotten_is_orphaned(
                            &u, s,
                        )
                        .await
                    })
                },
            ),
            (
                "transactional::a_handler_cut_off_while_its_closure_is_released_rolls_back",
                |_, u| {
                    Box::pin(async move {
                        let proxy = super::replicas::pause::Proxy::start(
                            super::replicas::pause::address_of(&u),
                        )
                        .await?;
                        let through = proxy.url(&u);
                        super::transactional::a_handler_cut_off_while_its_closure_is_released_rolls_back(
                            &u,
                            &through,
                            || proxy.pause_behind(b"RELEASE SAVEPOINT toolrunner_closure"),
                            || proxy.is_paused(),
                            || proxy.resume(),
                        )
                        .await
                    })
                },
            ),
            (
                "transactional::an_error_rolls_the_business_write_back",
                |s, u| {
                    Box::pin(async move {
                        super::transactional::an_error_rolls_the_business_write_back(&u, s).await
                    })
                },
            ),
            (
                "counts::a_transaction_cut_off_at_its_begin_leaves_no_connection_inside_it",
                |s, u| {
                    Box::pin(
                        a_transaction_cut_off_at_its_begin_leaves_no_connection_inside_it(s, u),
                    )
                },
            ),
        ];
        tests.push(("counts::a_fold_beside_another_is_not_refused", |s, u| {
            Box::pin(a_fold_beside_another_is_not_refused(s, u))
        }));
        tests.push((
            "counts::the_call_counts_agree_with_the_calls_when_reads_are_cut_off",
            |s, u| {
                Box::pin(the_call_counts_agree_with_the_calls_when_reads_are_cut_off(
                    s, u,
                ))
            },
        ));
        let mut trials: Vec<Trial> = tests
            .into_iter()
            .map(|(name, body)| {
                let url = url.to_owned();
                Trial::test(name, move || in_schema(&url, name, body))
            })
            .collect();
        // Replicas on the shared database itself (their lease rows live
        // in `toolrunner_leases`; each test uses identities of its own).
        type Shared = fn(String) -> Pin<Box<dyn Future<Output = Result<()>> + Send>>;
        let shared: Vec<(&str, Shared)> = vec![
            (
                "replicas::chaos::three_replicas_killed_and_paused_at_random_no_effect_twice_or_failed_every_restart_serves",
                |u| {
                    Box::pin(async move {
                        super::replicas::chaos::three_replicas_killed_and_paused(&u).await
                    })
                },
            ),
            (
                "replicas::flow::three_replicas_hold_one_concurrency_and_rate_limit_and_no_claim_waits",
                |u| {
                    Box::pin(async move {
                        super::replicas::flow::three_replicas_hold_one_limit(&u).await
                    })
                },
            ),
            (
                "replicas::flow::killed_and_paused_replicas_give_their_slots_back_within_a_lease",
                |u| {
                    Box::pin(async move {
                        super::replicas::flow::killed_and_paused_replicas_give_their_slots_back(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::flow::a_limit_set_in_the_store_applies_without_a_restart",
                |u| {
                    Box::pin(async move {
                        super::replicas::flow::a_limit_set_in_the_store_applies_without_a_restart(
                            &u,
                        )
                        .await
                    })
                },
            ),
            (
                "replicas::rolling::three_executors_restarted_in_turn_on_postgres_hand_every_call_over",
                |u| {
                    Box::pin(async move {
                        super::replicas::rolling::three_executors_restarted_in_turn_on_postgres(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::approvals::a_request_whose_asker_died_untold_is_told_by_another_replica",
                |u| {
                    Box::pin(async move {
                        super::replicas::approvals::a_request_whose_asker_died_untold_is_told_by_another_replica(&u).await
                    })
                },
            ),
            (
                "replicas::approvals::an_undecided_request_keeps_its_identity_from_counting_as_idle",
                |u| {
                    Box::pin(async move {
                        super::replicas::approvals::an_undecided_request_keeps_its_identity_from_counting_as_idle(&u).await
                    })
                },
            ),
            (
                "replicas::approvals::an_approval_is_acted_on_once_when_its_replica_dies_before_accepted",
                |u| {
                    Box::pin(async move {
                        super::replicas::approvals::an_approval_is_acted_on_once_when_its_replica_dies_before_accepted(&u).await
                    })
                },
            ),
            (
                "replicas::takeover::a_paused_handler_without_commit_point_has_its_effect_found_by_the_adopter",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_paused_handler_has_its_effect_found_by_the_adopter(&u).await
                    })
                },
            ),
            (
                "replicas::takeover::a_paused_replica_never_connects_over_its_adopter",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_paused_replica_never_connects_over_its_adopter(
                            &u,
                        )
                        .await
                    })
                },
            ),
            (
                "replicas::a_fresh_schema_before_a_migrated_one_is_migrated",
                |u| {
                    Box::pin(async move {
                        super::replicas::a_fresh_schema_before_a_migrated_one_is_migrated(&u).await
                    })
                },
            ),
            ("replicas::a_frozen_migration_holds_no_store_back", |u| {
                Box::pin(async move {
                    super::replicas::a_frozen_migration_holds_no_store_back(&u).await
                })
            }),
            (
                "replicas::takeover::a_start_frozen_while_it_takes_the_lease_holds_no_other_back",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_start_frozen_while_it_takes_the_lease_holds_no_other_back(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::takeover::a_replica_paused_inside_a_write_is_adopted",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_replica_paused_inside_a_write_is_adopted(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::takeover::a_transaction_longer_than_the_grace_keeps_its_identity",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_long_transaction_keeps_its_identity(&u).await
                    })
                },
            ),
            (
                "replicas::takeover::an_adopted_identity_that_stops_serving_is_let_go",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::an_adopted_identity_that_stops_serving_is_let_go(
                            &u,
                        )
                        .await
                    })
                },
            ),
            (
                "replicas::takeover::a_broken_lapsed_identity_blocks_no_other",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_broken_lapsed_identity_blocks_no_other(&u)
                            .await
                    })
                },
            ),
            ("replicas::takeover::a_clean_drain_is_never_adopted", |u| {
                Box::pin(async move {
                    super::replicas::takeover::a_clean_drain_is_never_adopted(&u).await
                })
            }),
            (
                "replicas::takeover::a_slow_adoption_is_not_adopted_again_at_once",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_slow_adoption_is_not_adopted_again_at_once(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::takeover::an_adopted_replica_restarted_with_its_id_serves_again",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::an_adopted_replica_restarted_serves_again(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::takeover::a_second_live_process_of_one_id_fails_fast_and_the_first_serves_on",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::a_second_live_process_of_one_id_fails_fast(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::console::three_identities_show_each_their_calls",
                |u| {
                    Box::pin(async move {
                        super::replicas::console::three_identities_show_each_their_calls(&u).await
                    })
                },
            ),
            (
                "replicas::health::the_lease_shows_in_health_and_metrics_and_readiness_follows_the_database",
                |u| {
                    Box::pin(async move {
                        super::replicas::health::the_lease_shows_in_health_and_metrics_and_readiness_follows_the_database(&u).await
                    })
                },
            ),
            (
                "replicas::unlike::a_release_carries_the_wait_owed_to_a_frozen_holder",
                |u| {
                    Box::pin(async move {
                        super::replicas::unlike::a_release_carries_the_wait_owed_to_a_frozen_holder(
                            &u,
                        )
                        .await
                    })
                },
            ),
            (
                "replicas::unlike::a_take_back_keeps_what_a_shorter_lease_owed",
                |u| {
                    Box::pin(async move {
                        super::replicas::unlike::a_take_back_keeps_what_a_shorter_lease_owed(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::unlike::a_step_of_the_database_clock_takes_no_live_identity",
                |u| {
                    Box::pin(async move {
                        super::replicas::unlike::a_step_of_the_database_clock_takes_no_live_identity(&u).await
                    })
                },
            ),
            (
                "replicas::unlike::twins_on_two_databases_leave_the_later_one_serving",
                |u| {
                    Box::pin(async move {
                        super::replicas::unlike::twins_on_two_databases_leave_the_later_one_serving(
                            &u,
                        )
                        .await
                    })
                },
            ),
            (
                "replicas::unlike::an_upgrade_refuses_to_run_beside_an_older_version",
                |u| {
                    Box::pin(async move {
                        super::replicas::unlike::an_upgrade_refuses_to_run_beside_an_older_version(
                            &u,
                        )
                        .await
                    })
                },
            ),
            (
                "replicas::unlike::a_pooler_that_drops_startup_options_is_named",
                |u| {
                    Box::pin(async move {
                        super::replicas::unlike::a_pooler_that_drops_startup_options_is_named(&u)
                            .await
                    })
                },
            ),
            (
                "replicas::takeover::an_adopter_superseded_by_a_process_without_the_lease_connects_again",
                |u| {
                    Box::pin(async move {
                        super::replicas::takeover::an_adopter_superseded_by_a_process_without_the_lease_connects_again(&u).await
                    })
                },
            ),
            (
                "store_contract::retention_keeps_the_unknown_outcome_orphans_an_older_version_wrote",
                |u| Box::pin(async move { older_orphans_are_kept_after_the_migration(&u).await }),
            ),
        ];
        for (name, body) in shared {
            let url = url.to_owned();
            trials.push(Trial::test(name, move || on_runtime(body(url))));
        }
        trials
    }

    /// Runs `body` on a store in a new schema named after the test, which
    /// is dropped afterwards (kept if the test failed, to look at).
    /// Runs `body` on a runtime of its own.
    fn on_runtime(body: impl Future<Output = Result<()>>) -> Result<(), Failed> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Failed::from(e.to_string()))?;
        runtime
            .block_on(body)
            .map_err(|e| Failed::from(format!("{e:#}")))
    }

    fn in_schema(url: &str, name: &str, body: Body) -> Result<(), Failed> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Failed::from(e.to_string()))?;
        let schema = schema_name(name);
        let outcome: Result<()> =
            runtime.block_on(async {
                let store = PgStore::connect_in_schema(url, &schema).await.with_context(|| {
                format!(
                    "the PostgreSQL server at {} does not answer or refuses the test schema",
                    without_password(url)
                )
            })?;
                let outcome = body(Arc::new(store), schema_url(url, &schema)).await;
                // Dropped whether the test passed or not.
                let dropped = drop_schema(url, &schema).await;
                outcome.and(dropped)
            });
        outcome.map_err(|e| Failed::from(format!("{e:#}")))
    }

    /// `t_` and the test's name, shortened, with a random suffix: unique
    /// per run, at most 63 characters.
    fn schema_name(test: &str) -> String {
        let base: String = test
            .rsplit("::")
            .next()
            .unwrap_or(test)
            .chars()
            .take(40)
            .collect();
        format!("t_{base}_{:08x}", rand::random::<u32>())
    }

    /// `url` with the connection's `search_path` set to `schema`.
    fn schema_url(url: &str, schema: &str) -> String {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}options=-c%20search_path%3D{schema}")
    }

    /// The URL without a password, for messages.
    fn without_password(url: &str) -> String {
        match (url.find("://"), url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                let userinfo = &url[scheme + 3..at];
                let user = userinfo.split(':').next().unwrap_or("");
                format!("{}{user}{}", &url[..scheme + 3], &url[at..])
            }
            _ => url.to_owned(),
        }
    }

    async fn drop_schema(url: &str, schema: &str) -> Result<()> {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(url).await?;
        // The name is ours (`schema_name`: letters, digits, `_`).
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        Ok(())
    }

    /// The call counts (`call_counts` and its deltas, kept by triggers and
    /// folded by every count and prune) agree with the calls themselves
    /// while writers commit, and counts and prunes are cut off at any
    /// point (as a gauge round's bounded reads are). Seed 215's
    /// reproduction (docs/simulation.md): before folds ran one at a time
    /// it failed on a loaded machine with folds refused by
    /// `call_counts_n_check` while the counts plus the deltas still equaled
    /// the calls.
    async fn the_call_counts_agree_with_the_calls_when_reads_are_cut_off(
        store: Arc<dyn Store>,
        url: String,
    ) -> Result<()> {
        use rand::Rng;
        use toolrunner::testing::store::{Change, Timestamp};
        let long_ago: Timestamp = "2026-01-01T00:00:00.000Z".parse()?;
        let end = std::time::Instant::now() + Duration::from_secs(8);
        let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let mut tasks = Vec::new();
        for w in 0..6 {
            let store = store.clone();
            let failures = failures.clone();
            tasks.push(tokio::spawn(async move {
                let mut i = 0;
                while std::time::Instant::now() < end {
                    i += 1;
                    let id = format!("call_{w}_{i}");
                    let mut c = toolrunner::testing::store::LocalCall {
                        updated_at: long_ago,
                        ..store_contract::rows::call(&id, LocalState::Claiming, 0)
                    };
                    let mut steps = vec![Change::InsertCall(c.clone())];
                    for (v, state) in [
                        (1, LocalState::Assigned),
                        (2, LocalState::Running),
                        (3, LocalState::Delivered),
                    ] {
                        let prev = c.version;
                        c.state = state;
                        c.version = v;
                        steps.push(Change::UpdateCall {
                            expect_version: prev,
                            call: c.clone(),
                        });
                    }
                    for step in steps {
                        if let Err(e) = store.commit(vec![step]).await {
                            failures.lock().unwrap().push(format!("commit: {e}"));
                            return;
                        }
                    }
                }
            }));
        }
        // Two readers and a pruner cut off at random, and three readers
        // never cut off: a fold refused while its cut-off caller no longer
        // waits for it (the server still runs it) would go unseen, so
        // these wait for theirs.
        for r in 0..6 {
            let store = store.clone();
            let failures = failures.clone();
            tasks.push(tokio::spawn(async move {
                while std::time::Instant::now() < end {
                    let within = if r >= 3 {
                        Duration::from_secs(3600)
                    } else {
                        Duration::from_micros(rand::rng().random_range(0..4000))
                    };
                    let outcome = if r == 0 {
                        tokio::time::timeout(within, async {
                            store
                                .prune(Timestamp::from(std::time::SystemTime::now()), 20)
                                .await
                                .map(|_| ())
                        })
                        .await
                    } else {
                        tokio::time::timeout(within, async {
                            store.count_by_state().await.map(|_| ())
                        })
                        .await
                    };
                    if let Ok(Err(e)) = outcome {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("count or prune: {e}"));
                    }
                }
            }));
        }
        for t in tasks {
            t.await?;
        }
        let failures = failures.lock().unwrap().clone();
        // The pool's connections whose caller was cut off settle (a
        // `COMMIT` cut off in flight is flushed when one is given back).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let counted = store.count_by_state().await;
        // Every state, zeros included, in one statement: `call_counts` plus
        // the deltas no fold took, against the calls.
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        let wrong = miscounted(&mut conn).await?;
        if !failures.is_empty() || !wrong.is_empty() {
            bail!(
                "{} failures (the counts that are not the calls' (state, counted, calls): {wrong:?}), the first: {:?}",
                failures.len(),
                &failures[..failures.len().min(3)]
            );
        }
        let counted: std::collections::BTreeMap<String, u64> = counted?
            .into_iter()
            .map(|(s, n)| (s.as_str().to_owned(), n))
            .collect();
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT state, COUNT(*) FROM calls GROUP BY state ORDER BY state")
                .fetch_all(&mut conn)
                .await?;
        let truth: std::collections::BTreeMap<String, u64> =
            rows.into_iter().map(|(s, n)| (s, n as u64)).collect();
        if truth != counted {
            bail!("the counts {counted:?} are not the calls' {truth:?}");
        }
        Ok(())
    }

    /// The states whose count (`call_counts` plus the deltas no fold
    /// took) is not the number of calls in them, every state with zeros
    /// included, read in one statement: (state, counted, calls).
    async fn miscounted(conn: &mut sqlx::PgConnection) -> Result<Vec<(String, i64, i64)>> {
        Ok(sqlx::query_as(
            "SELECT c.state, c.n + COALESCE(d.n, 0), COALESCE(t.n, 0)
             FROM call_counts c
             LEFT JOIN (SELECT state, SUM(n)::BIGINT AS n FROM call_count_deltas GROUP BY state) d
               ON d.state = c.state
             LEFT JOIN (SELECT state, COUNT(*)::BIGINT AS n FROM calls GROUP BY state) t
               ON t.state = c.state
             WHERE c.n + COALESCE(d.n, 0) <> COALESCE(t.n, 0)
             ORDER BY c.state",
        )
        .fetch_all(conn)
        .await?)
    }

    /// A fold of the call counts while another is under way (here one
    /// held open by a session of the test: it took a call's `+1`
    /// `delivered` and has not committed) is not refused, and the counts
    /// stay the calls'. Before folds ran one at a time, the store's fold
    /// after a prune waited for the other's rows, skipped the `+1` once it
    /// committed, summed the prune's `-1` against the count its snapshot
    /// held (0) and was refused by `call_counts_n_check` (seed 215).
    async fn a_fold_beside_another_is_not_refused(
        store: Arc<dyn Store>,
        url: String,
    ) -> Result<()> {
        use toolrunner::testing::store::{Change, Timestamp};
        let long_ago: Timestamp = "2026-01-01T00:00:00.000Z".parse()?;
        let mut c = toolrunner::testing::store::LocalCall {
            updated_at: long_ago,
            ..store_contract::rows::call("call_folded", LocalState::Claiming, 0)
        };
        store.commit(vec![Change::InsertCall(c.clone())]).await?;
        c.state = LocalState::Delivered;
        c.version = 1;
        store
            .commit(vec![Change::UpdateCall {
                expect_version: 0,
                call: c.clone(),
            }])
            .await?;
        // Another fold, as the store makes it (the lock it takes, then its
        // statement), held open.
        use sqlx::Connection;
        let mut other = sqlx::PgConnection::connect(&url).await?;
        sqlx::query("BEGIN").execute(&mut other).await?;
        sqlx::query(
            "SELECT pg_advisory_xact_lock(1953460076, ('call_counts'::regclass)::oid::integer)",
        )
        .execute(&mut other)
        .await?;
        let taken = sqlx::query(
            "WITH moved AS (DELETE FROM call_count_deltas RETURNING state, n),
                  sums AS (SELECT state, SUM(n)::BIGINT AS n FROM moved GROUP BY state)
             UPDATE call_counts c SET n = c.n + sums.n FROM sums WHERE c.state = sums.state",
        )
        .execute(&mut other)
        .await?
        .rows_affected();
        ensure!(taken > 0, "the other fold took no delta");
        // It commits a second from now, whether or not the store waits.
        let committed = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            sqlx::query("COMMIT").execute(&mut other).await.map(|_| ())
        });
        // The prune deletes the call (its `-1 delivered`), then folds.
        let pruned = tokio::time::timeout(
            Duration::from_secs(20),
            store.prune(Timestamp::from(std::time::SystemTime::now()), 20),
        )
        .await
        .context("the prune did not return within 20 s")?
        .context("the prune (and its fold) beside another fold")?;
        ensure!(pruned == 1, "the prune took {pruned} calls, not the 1");
        let counted = store
            .count_by_state()
            .await
            .context("a count beside another fold")?;
        ensure!(
            counted.is_empty(),
            "no call is left, but counted {counted:?}"
        );
        committed.await??;
        let counted = store.count_by_state().await.context("a count after it")?;
        ensure!(
            counted.is_empty(),
            "no call is left, but counted {counted:?}"
        );
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        let wrong = miscounted(&mut conn).await?;
        ensure!(wrong.is_empty(), "(state, counted, calls) {wrong:?}");
        Ok(())
    }

    /// A store transaction cut off at its `BEGIN` (a bounded gauge read
    /// that gave up, a task aborted) leaves no connection of the store's
    /// pool inside a transaction: the next request on it would run in that
    /// transaction (an autocommit write not committed, locks held) until
    /// the server ends the session.
    async fn a_transaction_cut_off_at_its_begin_leaves_no_connection_inside_it(
        _seed: Arc<dyn Store>,
        url: String,
    ) -> Result<()> {
        use rand::Rng;
        let application = format!("cut_begin_{:08x}", rand::random::<u32>());
        let store = PgStore::connect(&format!("{url}&application_name={application}")).await?;
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        let mut cut = 0;
        for _ in 0..400 {
            let within = Duration::from_micros(rand::rng().random_range(0..1500));
            if tokio::time::timeout(within, store.count_by_state())
                .await
                .is_ok()
            {
                continue;
            }
            cut += 1;
            // The pool takes a connection back (and sends the `ROLLBACK`
            // its transaction queued) in a task of its own: a moment
            // later none may be left inside a transaction (the server
            // would end such a session only after 5 s idle).
            let given = std::time::Instant::now() + Duration::from_millis(1500);
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let inside: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM pg_stat_activity
                      WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
                )
                .bind(&application)
                .fetch_one(&mut conn)
                .await?;
                if inside == 0 {
                    break;
                }
                if std::time::Instant::now() > given {
                    bail!(
                        "{inside} connections of the store's pool are idle inside a transaction 1.5 s after read {cut} was cut off"
                    );
                }
            }
        }
        if cut == 0 {
            bail!("no read was cut off: the test shows nothing");
        }
        Ok(())
    }

    /// Retention deletes a batch of 200 settled calls (each with its
    /// receipts, attempt and timeline) in a few round trips to the server,
    /// not four or more per call: counted as the chunks the store's
    /// connections send through a proxy while it prunes.
    async fn prune_deletes_a_batch_in_a_few_round_trips(
        seed: Arc<dyn Store>,
        url: String,
    ) -> Result<()> {
        use toolrunner::protocol::wire::ReceiptKind;
        use toolrunner::testing::store::{
            Attempt, Change, LocalCall, OutboxReceipt, ReceiptStatus, Timestamp,
        };
        const CALLS: usize = 200;
        let long_ago: Timestamp = "2026-01-01T00:00:00.000Z".parse()?;
        let mut changes = Vec::new();
        for i in 0..CALLS {
            let id = format!("call_{i}");
            changes.push(Change::InsertCall(LocalCall {
                next_sequence: 2,
                created_at: long_ago,
                updated_at: long_ago,
                ..store_contract::rows::call(&id, LocalState::Delivered, 0)
            }));
            for (sequence, kind) in [(0, ReceiptKind::Accepted), (1, ReceiptKind::Completed)] {
                changes.push(Change::AddReceipt(OutboxReceipt {
                    receipt_id: format!("rcp_{i}_{sequence}"),
                    run_id: "run_1".into(),
                    call_id: id.clone(),
                    assignment_id: format!("asg_{i}"),
                    kind,
                    sequence,
                    body: "{}".into(),
                    status: ReceiptStatus::Delivered,
                    attempts: 1,
                    last_error: None,
                    created_at: long_ago,
                    delivered_at: Some(long_ago),
                }));
            }
            changes.push(Change::AddAttempt(Attempt::seed(
                "run_1",
                &id,
                &format!("op_{i}"),
                Some("exe"),
                Some(&format!("asg_{i}")),
                long_ago,
            )));
        }
        seed.commit(changes).await?;
        let proxy =
            super::replicas::pause::Proxy::start(super::replicas::pause::address_of(&url)).await?;
        let store = PgStore::connect(&proxy.url(&url)).await?;
        // Its pool's connections are open and its statements known.
        store.count_by_state().await?;
        let before = proxy.client_chunks();
        let cut: Timestamp = "2026-06-01T00:00:00.000Z".parse()?;
        let pruned = store.prune(cut, CALLS as u32).await?;
        let round_trips = proxy.client_chunks() - before;
        if pruned != CALLS as u64 {
            bail!("pruned {pruned} calls of {CALLS}");
        }
        for i in [0, CALLS - 1] {
            let id = format!("call_{i}");
            if seed.call("run_1", &id).await?.is_some()
                || !seed.receipts("run_1", &id).await?.is_empty()
                || !seed.attempts("run_1", &id).await?.is_empty()
                || !seed.events("run_1", &id).await?.is_empty()
            {
                bail!("{id} left rows behind");
            }
        }
        if round_trips > 20 {
            bail!(
                "pruning a batch of {CALLS} calls took {round_trips} round trips to the server (at most 20 wanted: a few statements a batch)"
            );
        }
        Ok(())
    }

    /// A schema an older version migrated and wrote orphaned calls into
    /// (`store_contract::older_orphans`), opened by this version: the
    /// migration marks the unknown-outcome ones, and retention keeps them.
    async fn older_orphans_are_kept_after_the_migration(url: &str) -> Result<()> {
        use sqlx::Connection;
        let schema = schema_name("older_orphans");
        let mut conn = sqlx::PgConnection::connect(url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        let outcome = async {
            let older = store_contract::older_migrations("postgres")?;
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&schema_url(url, &schema))
                .await?;
            sqlx::migrate::Migrator::new(older.path())
                .await?
                .run(&pool)
                .await?;
            for sql in store_contract::older_orphans() {
                sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
            }
            pool.close().await;
            let store = PgStore::connect_in_schema(url, &schema).await?;
            store_contract::retention_keeps_the_unknown_outcome_orphans_an_older_version_wrote(
                &store,
            )
            .await
        }
        .await;
        let dropped = drop_schema(url, &schema).await;
        outcome.and(dropped)
    }

    /// The fault paths of the store's group-commit writer
    /// (`store/postgres/writer.rs`), each driven by the store's own
    /// `WriterFaults` (the suite's tests run side by side: a process-wide
    /// fail point would reach the others' writers).
    mod writer {
        use std::time::Duration;

        use anyhow::{Result, bail, ensure};
        use toolrunner::testing::store::{
            Change, LocalState, PgStore, Store, StoreError, WriterFaults,
        };

        use super::store_contract::rows;

        /// A new call `id`.
        fn insert(id: &str) -> Vec<Change> {
            vec![Change::InsertCall(rows::call(id, LocalState::Claiming, 0))]
        }

        /// Waits (up to 10 s) until the writer, held, has `behind` jobs
        /// waiting behind the one it holds.
        async fn until_held_with(faults: &WriterFaults, behind: usize) -> Result<()> {
            for _ in 0..2000 {
                if faults.held_behind() == Some(behind) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            bail!(
                "the writer is not held with {behind} jobs behind it: {:?}",
                faults.held_behind()
            )
        }

        /// Commits `id` on a task of its own.
        fn commit_aside(
            store: &PgStore,
            id: &str,
        ) -> tokio::task::JoinHandle<Result<(), StoreError>> {
            let store = store.clone();
            let changes = insert(id);
            tokio::spawn(async move { store.commit(changes).await })
        }

        async fn stored(store: &PgStore, id: &str) -> Result<bool> {
            Ok(store.call("run_1", id).await?.is_some())
        }

        /// A commit whose caller stopped waiting (its task dropped, as an
        /// executor stopped or lost) before the writer took it into a
        /// group is not written: nothing lands after the one who asked is
        /// gone, as its own transaction would not have. The writer goes on.
        pub(crate) async fn a_job_whose_caller_is_gone_is_not_written(url: &str) -> Result<()> {
            let store = PgStore::connect(url).await?;
            let faults = store.writer_faults();
            faults.hold();
            let gone = commit_aside(&store, "call_gone");
            until_held_with(&faults, 0).await?;
            gone.abort();
            ensure!(
                gone.await.is_err_and(|e| e.is_cancelled()),
                "the caller's task was not dropped"
            );
            faults.release();
            store.commit(insert("call_after")).await?;
            ensure!(
                !stored(&store, "call_gone").await?,
                "the commit of a caller that was gone landed"
            );
            ensure!(stored(&store, "call_after").await?, "the writer stopped");
            Ok(())
        }

        /// When the `COMMIT` of a group fails, every job of the group hears
        /// that it failed and may have happened (carried out or not), but
        /// a job whose own change failed, which hears its own error (it
        /// wrote nothing either way). A `COMMIT` that did not happen
        /// stored none of them; one whose answer was lost stored them all.
        /// The writer goes on.
        pub(crate) async fn a_failed_group_commit_is_heard_by_every_job_of_the_group(
            url: &str,
        ) -> Result<()> {
            let store = PgStore::connect(url).await?;
            store.commit(insert("call_taken")).await?;
            let faults = store.writer_faults();
            for happened in [false, true] {
                let (a, c) = (format!("call_a_{happened}"), format!("call_c_{happened}"));
                faults.hold();
                let first = commit_aside(&store, &a);
                until_held_with(&faults, 0).await?;
                let taken = commit_aside(&store, "call_taken");
                until_held_with(&faults, 1).await?;
                let third = commit_aside(&store, &c);
                until_held_with(&faults, 2).await?;
                faults.fail_next_group_commit(happened);
                faults.release();
                for (id, outcome) in [(&a, first.await?), (&c, third.await?)] {
                    match outcome {
                        Err(e) if e.to_string().contains("may have happened") => {}
                        other => bail!(
                            "{id} (happened: {happened}) heard {other:?}, not that the group's COMMIT failed"
                        ),
                    }
                    ensure!(
                        stored(&store, id).await? == happened,
                        "{id}: stored is not {happened}"
                    );
                }
                match taken.await? {
                    Err(StoreError::Conflict(..)) => {}
                    other => bail!("the job whose own change failed heard {other:?}"),
                }
            }
            store.commit(insert("call_after")).await?;
            ensure!(stored(&store, "call_after").await?, "the writer stopped");
            Ok(())
        }

        /// A writer task that died (it panicked) takes the job it held with
        /// it: its caller hears that the store's writer stopped, and
        /// nothing of it is written. The next commit starts a new writer.
        pub(crate) async fn a_writer_task_that_died_is_started_again(url: &str) -> Result<()> {
            let store = PgStore::connect(url).await?;
            store.commit(insert("call_before")).await?;
            let faults = store.writer_faults();
            faults.kill_writer();
            match store.commit(insert("call_lost")).await {
                Err(StoreError::Closed) => {}
                other => bail!("the job of a writer that died heard {other:?}"),
            }
            ensure!(
                !stored(&store, "call_lost").await?,
                "the job of a writer that died was written"
            );
            store.commit(insert("call_after")).await?;
            ensure!(
                stored(&store, "call_after").await?,
                "no new writer after the old one died"
            );
            Ok(())
        }
    }

    /// A number to echo.    /// A number to echo.
    #[toolrunner::schema]
    #[derive(Deserialize)]
    struct In {
        /// The number.
        n: u64,
    }

    /// The number echoed.
    #[toolrunner::schema]
    #[derive(Serialize)]
    struct Out {
        /// The number.
        n: u64,
    }

    /// Handler runs, by this suite's one executor test.
    static RUNS: AtomicUsize = AtomicUsize::new(0);

    /// Echoes a number, counting its runs.
    #[toolrunner::tool(name = "pg.echo", effect = write)]
    async fn echo(_ctx: CallContext, input: In) -> Result<Out, ToolError> {
        RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(Out { n: input.n })
    }

    /// An executor whose store URL is `postgres://…` serves 20 write calls
    /// on the development platform: each handler runs once, each call is
    /// `completed` on the platform with its number, and each row in the
    /// database ends `delivered`.
    async fn calls_run_once_and_are_delivered(store: Arc<dyn Store>, url: String) -> Result<()> {
        const CALLS: u64 = 20;
        let server = toolrunner_devserver::DevServer::builder()
            .listen("127.0.0.1:0".parse()?)
            .start()
            .await?;
        let admin = Platform::new(&server.base_url(), "dev-admin")?;
        let agent = admin.create_agent("pg").await?;
        let binding = admin
            .create_binding(&agent.agent_id, "pg", &["pg.echo"])
            .await?;
        let executor = Executor::builder()
            .base_url(server.base_url())
            .token("dev-executor")
            .executor_id(format!("pg-exe-{:08x}", rand::random::<u32>()))
            .binding_id(&binding.binding_id)
            .store_url(&url)
            .allow_all()
            .tool(echo)
            .build()?;
        let version = admin
            .publish(&agent.agent_id, executor.tool_definitions())
            .await?;
        let calls = (0..CALLS)
            .map(|n| NewToolCall::new("pg.echo", json!({ "n": n })))
            .collect();
        let run = admin
            .create_run(&version.agent_version, "pg", calls)
            .await?;
        let running = executor.start().await?;
        let done = admin
            .wait_settled(&run.run_id, Duration::from_secs(60))
            .await?;
        running
            .shutdown(Shutdown::Drain {
                deadline: Duration::from_secs(10),
            })
            .await?;
        for call in &done.tool_calls {
            if call.state.as_str() != "completed" {
                bail!("call {} ended {}", call.call_id, call.state.as_str());
            }
        }
        let runs = RUNS.load(Ordering::SeqCst);
        if runs != CALLS as usize {
            bail!("{runs} handler runs for {CALLS} calls");
        }
        let delivered = store.count_by_state().await?;
        if delivered.get(&LocalState::Delivered).copied() != Some(CALLS) {
            bail!("the database's counts: {delivered:?}");
        }
        for call in &done.tool_calls {
            let row = store
                .call(&run.run_id, &call.call_id)
                .await?
                .context("the call's row")?;
            if row.state != LocalState::Delivered {
                bail!("row {} is {}", call.call_id, row.state);
            }
        }
        // The operator's API opens the same database by its URL.
        let operator = toolrunner::Reconciler::open(&url).await?;
        let listed = operator
            .list(&toolrunner::testing::store::CallFilter::default())
            .await?;
        if listed.len() != CALLS as usize {
            bail!("the Reconciler lists {} calls of {CALLS}", listed.len());
        }
        server.shutdown().await;
        Ok(())
    }
}

//! The shared holds against a store that fails on demand (in memory).
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use super::*;
use crate::store::StoreError;
use crate::store::flow::{Counted, ToolRow};

/// A store whose answers the test sets.
#[derive(Default)]
struct Fake {
    /// Releases to fail before they succeed.
    release_failures: AtomicU32,
    /// The holds given back, by id.
    released: Mutex<Vec<i64>>,
    /// Every take asked, with what.
    takes: Mutex<Vec<(HoldAtSeen, Take)>>,
    /// Whether takes fail.
    takes_fail: AtomicBool,
    /// Whether a send-now take finds the rate full.
    rate_full: AtomicBool,
    /// Whether a reservation turns into a send.
    reservation_lapsed: AtomicBool,
    /// Whether the store's limits cannot be read.
    limits_fail: AtomicBool,
}

type HoldAtSeen = (String, i64);

fn failed() -> StoreError {
    StoreError::Refused("the database is away".into())
}

#[async_trait::async_trait]
impl SharedFlow for Fake {
    async fn stored_limits(&self) -> Result<BTreeMap<String, Caps>, StoreError> {
        if self.limits_fail.load(Ordering::SeqCst) {
            return Err(failed());
        }
        Ok(BTreeMap::new())
    }

    async fn take(
        &self,
        at: &crate::store::flow::HoldAt,
        limits: Caps,
        take: Take,
        _assignment_id: &str,
    ) -> Result<Counted, StoreError> {
        self.takes
            .lock()
            .unwrap()
            .push(((at.call_id.clone(), at.hold_id), take));
        if self.takes_fail.load(Ordering::SeqCst) {
            return Err(failed());
        }
        let taken = !(take == Take::SendNow && self.rate_full.load(Ordering::SeqCst));
        Ok(Counted {
            taken,
            slots: 0,
            tokens: 0,
            limits,
        })
    }

    async fn start_send(
        &self,
        _at: &crate::store::flow::HoldAt,
        _assignment_id: &str,
    ) -> Result<bool, StoreError> {
        Ok(!self.reservation_lapsed.load(Ordering::SeqCst))
    }

    async fn answered(
        &self,
        _at: &crate::store::flow::HoldAt,
        _assignment_id: &str,
    ) -> Result<(), StoreError> {
        Ok(())
    }

    async fn release(
        &self,
        at: &crate::store::flow::HoldAt,
        _slot: bool,
    ) -> Result<bool, StoreError> {
        let left = self.release_failures.load(Ordering::SeqCst);
        if left > 0 {
            self.release_failures.store(left - 1, Ordering::SeqCst);
            return Err(failed());
        }
        self.released.lock().unwrap().push(at.hold_id);
        Ok(true)
    }

    async fn set_limits(&self, _tool: &str, _limits: Caps, _clear: bool) -> Result<(), StoreError> {
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ToolRow>, StoreError> {
        Ok(Vec::new())
    }
}

fn shared(limits: Limits) -> (Flow, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let f = Flow::new(&BTreeMap::from([("t".to_owned(), limits)]));
    f.share(fake.clone());
    (f, fake)
}

fn key(n: u32) -> CallKey {
    CallKey {
        run_id: "run_1".into(),
        call_id: format!("call_{n}"),
    }
}

fn holder() -> Holder {
    Holder {
        executor_id: "ex".into(),
        lease_token: 1,
    }
}

#[tokio::test(start_paused = true)]
async fn a_hold_dropped_while_the_database_is_away_is_given_back_once_it_answers() {
    let (f, fake) = shared(Limits::none().concurrency(2));
    let hold = f
        .take_for_claim(Some(&holder()), &key(1), "t")
        .await
        .expect("taken");
    // Away for longer than any fixed number of tries would cover.
    fake.release_failures.store(40, Ordering::SeqCst);
    drop(hold);
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(
        fake.released.lock().unwrap().len(),
        1,
        "given back once the database answered again"
    );
}

#[tokio::test]
async fn a_call_this_identity_owns_without_the_database_still_needs_a_token_to_send() {
    let (f, fake) = shared(Limits::none().concurrency(2).rate(1));
    fake.takes_fail.store(true, Ordering::SeqCst);
    let hold = f
        .take_for_resume(Some(&holder()), &key(1), "t", true)
        .await
        .expect("its own work is never refused");
    fake.takes_fail.store(false, Ordering::SeqCst);
    fake.rate_full.store(true, Ordering::SeqCst);
    assert_eq!(
        hold.take_token("asg_1").await,
        Err(NoToken::Full),
        "no accepted without a token, even without a row"
    );
    fake.rate_full.store(false, Ordering::SeqCst);
    assert_eq!(hold.take_token("asg_1").await, Ok(()));
}

#[tokio::test]
async fn a_lapsed_reservation_is_spent_and_the_next_send_takes_a_token_of_its_own() {
    let (f, fake) = shared(Limits::none().rate(5));
    let hold = f
        .take_for_claim(Some(&holder()), &key(1), "t")
        .await
        .expect("taken");
    fake.reservation_lapsed.store(true, Ordering::SeqCst);
    assert_eq!(hold.take_token("asg_1").await, Err(NoToken::Lapsed));
    assert_eq!(
        hold.take_token("asg_1").await,
        Ok(()),
        "the second try takes a token below the limit, not the lapsed reservation again"
    );
    let send_now = fake
        .takes
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, t)| *t == Take::SendNow)
        .count();
    assert_eq!(send_now, 1);
}

#[tokio::test]
async fn a_parked_hold_taken_back_asserts_its_slot_again() {
    let (f, fake) = shared(Limits::none().concurrency(2));
    let hold = f
        .take_for_claim(Some(&holder()), &key(1), "t")
        .await
        .expect("taken");
    let first_id = fake.takes.lock().unwrap()[0].0.1;
    f.park("ex", key(1), hold);
    let again = f
        .take_for_resume(Some(&holder()), &key(1), "t", true)
        .await
        .expect("its parked hold");
    let takes = fake.takes.lock().unwrap().clone();
    assert_eq!(
        takes.last(),
        Some(&(("call_1".to_owned(), first_id), Take::Owed)),
        "the same hold's slot asserted again: {takes:?}"
    );
    drop(again);
}

#[tokio::test]
async fn nothing_new_is_claimed_before_the_stores_limits_were_read() {
    let (f, fake) = shared(Limits::none());
    fake.limits_fail.store(true, Ordering::SeqCst);
    assert!(
        f.take_for_claim(Some(&holder()), &key(1), "t")
            .await
            .is_none(),
        "a tool limited only in the store is not taken as unlimited"
    );
    fake.limits_fail.store(false, Ordering::SeqCst);
    tokio::time::sleep(shared::REFRESH + Duration::from_millis(20)).await;
    assert!(
        f.take_for_claim(Some(&holder()), &key(1), "t")
            .await
            .is_some()
    );
}

#[tokio::test]
async fn a_key_the_database_cannot_count_holds_its_call_back_never() {
    let (f, fake) = shared(Limits::none().per_key(1));
    fake.takes_fail.store(true, Ordering::SeqCst);
    let hold = ToolHold::default();
    assert!(
        f.take_key(Some(&holder()), &key(1), "t", "0123abcd", &hold)
            .await,
        "it runs without its key's slot rather than being given back for ever"
    );
}

#[tokio::test]
async fn a_keys_holds_are_no_tool_of_the_gauges() {
    let (f, _fake) = shared(Limits::none().concurrency(3).per_key(1));
    let tool = f
        .take_for_claim(Some(&holder()), &key(1), "t")
        .await
        .expect("taken");
    assert!(
        f.take_key(Some(&holder()), &key(1), "t", "0123abcd", &tool)
            .await
    );
    let shown: Vec<String> = f.in_use().into_iter().map(|u| u.tool).collect();
    assert_eq!(shown, vec!["t".to_owned()], "one tool, no key: {shown:?}");
}

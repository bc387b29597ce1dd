use std::collections::BTreeMap;
use std::time::Duration;

use super::rate::WINDOW;
use super::*;

fn flow(limits: Limits) -> Flow {
    Flow::new(&BTreeMap::from([("t".to_owned(), limits)]))
}

fn key(n: u32) -> CallKey {
    CallKey {
        run_id: "run_1".into(),
        call_id: format!("call_{n}"),
    }
}

fn slots(f: &Flow) -> Option<(u32, u32)> {
    f.in_use()[0].slots
}

/// Runs a test's steps on a runtime of their own (the key's slots are
/// taken in async code).
fn block_on<T>(steps: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime")
        .block_on(steps)
}

/// `call` of tool `t` is claimed, finds `key` at its limit and is given
/// back.
async fn given_back(f: &Flow, call: &CallKey, key: &str) {
    assert!(
        !f.take_key(None, call, "t", key, &ToolHold::default()).await,
        "{key} is at its limit"
    );
    f.key_limited("ex", call, "t", key);
}

#[test]
fn a_new_claim_takes_a_slot_only_below_the_limit_and_a_dropped_slot_comes_back() {
    let f = flow(Limits::none().concurrency(2));
    let a = f.try_take(&key(1), "t");
    let b = f.try_take(&key(2), "t");
    assert!(a.is_some() && b.is_some());
    assert!(f.try_take(&key(3), "t").is_none());
    drop(a);
    assert!(f.try_take(&key(3), "t").is_some());
    assert_eq!(slots(&f), Some((2, 1)), "the slot just taken was dropped");
}

#[test]
fn a_tool_without_a_limit_is_never_full() {
    let f = flow(Limits::none().concurrency(1));
    let _held = f.try_take(&key(1), "t");
    assert!(f.try_take(&key(2), "other").is_some());
    let resumed = f.resume(&key(3), "other", true).expect("never full");
    assert!(!resumed.has_slot());
}

#[test]
fn a_call_whose_claim_the_platform_holds_takes_its_slot_over_the_limit() {
    let f = flow(Limits::none().concurrency(1));
    let first = f.try_take(&key(1), "t");
    let owed = f.resume(&key(2), "t", true).expect("its own work");
    assert!(owed.has_slot());
    assert_eq!(slots(&f), Some((1, 2)));
    drop(first);
    assert!(
        f.try_take(&key(3), "t").is_none(),
        "still at the limit with the resumed call"
    );
    drop(owed);
    assert!(f.try_take(&key(3), "t").is_some());
}

#[test]
fn a_call_still_to_be_claimed_waits_for_a_slot_when_picked_up_again() {
    let f = flow(Limits::none().concurrency(1));
    let _first = f.try_take(&key(1), "t");
    assert!(
        f.resume(&key(2), "t", false).is_none(),
        "not claimed there: it waits like a new claim"
    );
}

#[test]
fn a_paused_call_keeps_its_slot_until_picked_up_again_or_swept() {
    let f = flow(Limits::none().concurrency(1));
    let a = f.try_take(&key(1), "t").expect("a slot");
    f.park("ex", key(1), a);
    assert!(
        f.try_take(&key(2), "t").is_none(),
        "the parked call keeps its slot"
    );
    let again = f.resume(&key(1), "t", true).expect("its parked hold");
    assert!(again.has_slot());
    assert_eq!(slots(&f), Some((1, 1)), "the same slot, not a second one");
    f.park("ex", key(1), again);
    f.sweep("ex", &[key(1)], |_| false);
    assert_eq!(slots(&f), Some((1, 1)), "still waiting in the store: kept");
    f.sweep("ex", &[], |_| false);
    assert_eq!(slots(&f), Some((1, 0)), "gone from the store: given back");
}

#[test]
fn a_rate_counts_reservations_and_sends_and_frees_a_reservation_dropped_unsent() {
    let f = flow(Limits::none().rate(2));
    let a = f.try_take(&key(1), "t").expect("a token");
    let b = f.try_take(&key(2), "t").expect("a token");
    assert!(
        f.try_take(&key(3), "t").is_none(),
        "two reserved: none left"
    );
    drop(b);
    let c = f
        .try_take(&key(3), "t")
        .expect("the reservation dropped unsent came back");
    assert_eq!(a.sending("asg_a"), Ok(()));
    a.answered();
    drop(a);
    assert!(
        f.try_take(&key(4), "t").is_none(),
        "a send counts for a window after its answer, even once its call is done"
    );
    drop(c);
}

#[test]
fn a_send_frees_its_token_a_window_after_its_answer() {
    let f = flow(Limits::none().rate(1));
    let a = f.try_take(&key(1), "t").expect("a token");
    assert_eq!(a.sending("asg_a"), Ok(()));
    std::thread::sleep(WINDOW + Duration::from_millis(50));
    assert!(
        f.try_take(&key(2), "t").is_none(),
        "still sending (no answer yet): it counts however long it takes"
    );
    a.answered();
    assert!(f.try_take(&key(2), "t").is_none());
    assert!(f.next_token_in().is_some_and(|d| d <= WINDOW));
    std::thread::sleep(WINDOW + Duration::from_millis(50));
    assert!(
        f.try_take(&key(2), "t").is_some(),
        "a window after the answer"
    );
}

#[test]
fn a_reservation_older_than_the_window_lapses_and_its_token_is_free() {
    let f = flow(Limits::none().rate(1));
    let a = f.try_take(&key(1), "t").expect("a token");
    std::thread::sleep(WINDOW + Duration::from_millis(50));
    assert_eq!(a.sending("asg_a"), Err(NoToken::Lapsed));
    let b = f.try_take(&key(2), "t").expect("the lapsed token is free");
    assert_eq!(b.sending("asg_b"), Ok(()));
}

#[test]
fn a_call_picked_up_again_sends_only_with_a_free_token() {
    let f = flow(Limits::none().rate(1));
    let a = f.try_take(&key(1), "t").expect("a token");
    let resumed = f.resume(&key(2), "t", true).expect("its own work");
    assert_eq!(
        resumed.sending("asg_r"),
        Err(NoToken::Full),
        "no second accepted in the window"
    );
    drop(a);
    assert_eq!(
        resumed.sending("asg_r"),
        Ok(()),
        "the reservation gave it back"
    );
    assert_eq!(
        resumed.sending("asg_r"),
        Ok(()),
        "a send again takes nothing more"
    );
}

#[test]
fn a_new_assignment_needs_a_token_of_its_own() {
    let f = flow(Limits::none().rate(1));
    let a = f.try_take(&key(1), "t").expect("a token");
    assert_eq!(a.sending("asg_1"), Ok(()));
    a.answered();
    assert_eq!(
        a.sending("asg_2"),
        Err(NoToken::Full),
        "the first assignment's accepted still counts"
    );
}

#[test]
fn a_call_whose_token_lapsed_is_not_claimed_again_for_a_while() {
    let f = flow(Limits::none().rate(5));
    f.lapsed("ex", &key(1), "t");
    assert!(f.try_take(&key(1), "t").is_none(), "it backs off");
    assert!(f.try_take(&key(2), "t").is_some(), "the others do not");
}

#[test]
fn one_identitys_sweep_keeps_the_parked_holds_of_another() {
    let f = flow(Limits::none().concurrency(1));
    let a = f.try_take(&key(1), "t").expect("a slot");
    f.park("adopted", key(1), a);
    f.sweep("own", &[], |_| false);
    assert_eq!(
        slots(&f),
        Some((1, 1)),
        "the adopted identity's call still waits in its own store"
    );
    f.sweep("adopted", &[], |_| false);
    assert_eq!(slots(&f), Some((1, 0)), "its own sweep gives it back");
}

#[test]
fn a_call_whose_key_is_at_its_limit_waits_until_a_slot_of_its_key_comes_back() {
    let f = flow(Limits::none().per_key(1));
    block_on(async {
        let first = ToolHold::default();
        assert!(f.take_key(None, &key(1), "t", "m1", &first).await);
        given_back(&f, &key(2), "m1").await;
        assert!(f.try_take(&key(2), "t").is_none(), "it backs off");
        let other = ToolHold::default();
        assert!(
            f.take_key(None, &key(3), "t", "m2", &other).await,
            "another key is free"
        );
        assert_eq!(f.keys.held("t", "m1"), 1);
        drop(first);
        assert_eq!(f.keys.held("t", "m1"), 0);
        assert!(
            f.try_take(&key(2), "t").is_some(),
            "woken when its key's slot came back, before its back-off is over"
        );
    });
}

/// A key-limited call whose back-off is over while its key is still full
/// in this process is not claimed again (it would only be given back):
/// it waits to be woken, or for its key to have a slot free. A hot key's
/// backlog claimed again and again filled the capacity the other keys
/// needed (the others took 45 s behind 300 older hot calls).
#[test]
fn a_call_whose_back_off_is_over_waits_while_its_key_is_still_full_here() {
    let f = flow(Limits::none().per_key(1));
    block_on(async {
        let first = ToolHold::default();
        assert!(f.take_key(None, &key(1), "t", "m1", &first).await);
        for n in [2, 3] {
            given_back(&f, &key(n), "m1").await;
        }
        // Their back-offs are over.
        for b in lock(&f.lapsed).values_mut() {
            b.until = Instant::now();
        }
        assert!(f.backs_off(&key(2)), "its key is still full here");
        assert!(
            f.try_take(&key(2), "t").is_none(),
            "not claimed to be given back"
        );
        assert_eq!(
            f.backing_off_now(),
            2,
            "both still count as backing off (the page grows)"
        );
        f.sweep("ex", &[], |_| false);
        assert!(f.try_take(&key(3), "t").is_none(), "a sweep keeps its wait");
        drop(first);
        assert!(f.try_take(&key(2), "t").is_some(), "the oldest, woken");
        assert!(
            f.try_take(&key(3), "t").is_some(),
            "the next one too: its key has a slot free and its back-off is over (the woken one may never come)"
        );
    });
}

/// A call woken while it was being claimed (claimed without a wake: its
/// back-off over and its key not full), that finds its key full again and
/// is given back once more, carries no stale wake: it backs off like any
/// call given back, instead of being claimed and given back at once.
#[test]
fn a_call_given_back_again_after_a_wake_backs_off_again() {
    let f = flow(Limits::none().per_key(2));
    block_on(async {
        let (x, w) = (key(10), key(11));
        let a = ToolHold::default();
        assert!(f.take_key(None, &key(1), "t", "m1", &a).await);
        let filler = ToolHold::default();
        assert!(f.take_key(None, &key(2), "t", "m1", &filler).await);
        for c in [&x, &w] {
            given_back(&f, c, "m1").await;
        }
        // The filler's slot back wakes X; W's back-off is over and its key
        // has a slot free: W is claimed, without a wake, still waiting.
        drop(filler);
        for b in lock(&f.lapsed).values_mut() {
            b.until = Instant::now();
        }
        assert!(f.try_take(&w, "t").is_some(), "W is claimed");
        // While W's claim is in flight, B takes the free slot, A gives its
        // own back (waking W) and C takes it: W's claim finds the key full.
        let b = ToolHold::default();
        assert!(f.take_key(None, &key(3), "t", "m1", &b).await);
        drop(a);
        let c = ToolHold::default();
        assert!(f.take_key(None, &key(4), "t", "m1", &c).await);
        given_back(&f, &w, "m1").await;
        assert!(
            f.try_take(&w, "t").is_none(),
            "the wake that came before it was given back again is spent: it backs off"
        );
        drop(b);
        assert!(f.try_take(&w, "t").is_some(), "woken by the next slot back");
        drop(c);
    });
}

#[test]
fn a_call_that_took_its_keys_slot_waits_no_more_so_the_next_wake_finds_the_one_still_waiting() {
    let f = flow(Limits::none().per_key(2));
    block_on(async {
        let (x, y) = (key(10), key(11));
        let a = ToolHold::default();
        let b = ToolHold::default();
        assert!(f.take_key(None, &key(1), "t", "m1", &a).await);
        assert!(f.take_key(None, &key(2), "t", "m1", &b).await);
        for c in [&x, &y] {
            given_back(&f, c, "m1").await;
        }
        drop(a);
        // Y comes first after its back-off, and takes the slot; X, woken,
        // finds the key full again and waits once more.
        let y_hold = ToolHold::default();
        assert!(f.take_key(None, &y, "t", "m1", &y_hold).await);
        assert!(f.try_take(&x, "t").is_some(), "X was woken");
        given_back(&f, &x, "m1").await;
        drop(b);
        assert!(
            f.try_take(&x, "t").is_some(),
            "the slot B gave back wakes X, not Y, which holds a slot already"
        );
    });
}

#[test]
fn a_key_is_held_by_its_digest_never_as_the_arguments_data() {
    let digest = key_digest("merchant-42\u{0}");
    assert_eq!(digest.len(), 32);
    assert!(digest.chars().all(|c| c.is_ascii_hexdigit()), "{digest}");
    assert_eq!(
        digest,
        key_digest("merchant-42\u{0}"),
        "the same on every replica"
    );
    assert_ne!(digest, key_digest("merchant-43\u{0}"));
}

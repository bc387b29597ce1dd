//! A tool's rate in this process: a sliding [`WINDOW`] that holds at most
//! its limit of tokens, each one call's first `accepted`.
//!
//! A token is reserved before the claim ([`RateWindow::reserve`]) and
//! lapses after [`WINDOW`]; it becomes a send when `accepted` is due
//! ([`Token::start_send`], checked and changed under one lock), counts
//! for as long as the send is unanswered, and for [`WINDOW`] after its
//! answer ([`Token::answered`], or its drop).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The sliding window of a rate limit, and the longest a reservation
/// lasts.
pub(crate) const WINDOW: Duration = Duration::from_secs(1);

/// Where a token is.
#[derive(Debug, Clone, Copy)]
enum Stage {
    /// Reserved at this instant: lapses after [`WINDOW`].
    Reserved(Instant),
    /// Its `accepted` is being saved and sent: counts until the answer.
    Sending,
    /// Answered at this instant: counts for [`WINDOW`] more.
    Sent(Instant),
}

/// One tool's rate: its limit and the tokens that count now.
#[derive(Debug)]
pub(super) struct RateWindow {
    pub(super) limit: u32,
    next_id: AtomicU64,
    tokens: Mutex<Vec<(u64, Stage)>>,
}

/// One call's token, given back when dropped while reserved; while
/// sending, it counts for [`WINDOW`] from its drop.
#[derive(Debug)]
pub(super) struct Token {
    window: Arc<RateWindow>,
    id: u64,
}

impl RateWindow {
    pub(super) fn new(limit: u32) -> Arc<RateWindow> {
        Arc::new(RateWindow {
            limit,
            next_id: AtomicU64::new(0),
            tokens: Mutex::new(Vec::new()),
        })
    }

    fn tokens(&self) -> MutexGuard<'_, Vec<(u64, Stage)>> {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the tokens that no longer count at `now`; how many do.
    fn counting(tokens: &mut Vec<(u64, Stage)>, now: Instant) -> usize {
        tokens.retain(|(_, stage)| match stage {
            Stage::Reserved(at) | Stage::Sent(at) => now.saturating_duration_since(*at) < WINDOW,
            Stage::Sending => true,
        });
        tokens.len()
    }

    /// A token in `stage`, only below the limit.
    fn take(self: &Arc<Self>, stage: Stage) -> Option<Token> {
        let mut tokens = self.tokens();
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        if Self::counting(&mut tokens, Instant::now()) >= limit {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        tokens.push((id, stage));
        Some(Token {
            window: self.clone(),
            id,
        })
    }

    /// A token reserved for a new claim, only below the limit.
    pub(super) fn reserve(self: &Arc<Self>) -> Option<Token> {
        self.take(Stage::Reserved(Instant::now()))
    }

    /// A token for an `accepted` due now with no reservation (a call
    /// picked up again), only below the limit.
    pub(super) fn send_now(self: &Arc<Self>) -> Option<Token> {
        self.take(Stage::Sending)
    }

    /// At the limit, how long until a token stops counting by time alone
    /// (`None`: below the limit, or every token waits for an answer).
    pub(super) fn frees_in(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut tokens = self.tokens();
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        if Self::counting(&mut tokens, now) < limit {
            return None;
        }
        tokens
            .iter()
            .filter_map(|(_, stage)| match stage {
                Stage::Reserved(at) | Stage::Sent(at) => {
                    Some(WINDOW.saturating_sub(now.saturating_duration_since(*at)))
                }
                Stage::Sending => None,
            })
            .min()
    }

    /// How many tokens count now.
    pub(super) fn in_use(&self) -> u32 {
        let mut tokens = self.tokens();
        u32::try_from(Self::counting(&mut tokens, Instant::now())).unwrap_or(u32::MAX)
    }
}

impl Token {
    /// A reservation younger than [`WINDOW`] becomes a send (`true`); a
    /// lapsed one (perhaps already dropped from the window) does not.
    pub(super) fn start_send(&self) -> bool {
        let mut tokens = self.window.tokens();
        let Some((_, stage)) = tokens.iter_mut().find(|(id, _)| *id == self.id) else {
            return false;
        };
        match *stage {
            Stage::Reserved(at) if at.elapsed() < WINDOW => {
                *stage = Stage::Sending;
                true
            }
            Stage::Reserved(_) => false,
            Stage::Sending | Stage::Sent(_) => true,
        }
    }

    /// The send was answered: it counts for [`WINDOW`] from now.
    pub(super) fn answered(&self) {
        let mut tokens = self.window.tokens();
        if let Some((_, stage @ Stage::Sending)) = tokens.iter_mut().find(|(id, _)| *id == self.id)
        {
            *stage = Stage::Sent(Instant::now());
        }
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        let mut tokens = self.window.tokens();
        let Some(i) = tokens.iter().position(|(id, _)| *id == self.id) else {
            return;
        };
        match tokens[i].1 {
            Stage::Reserved(_) => {
                tokens.swap_remove(i);
            }
            Stage::Sending => tokens[i].1 = Stage::Sent(Instant::now()),
            Stage::Sent(_) => {}
        }
    }
}

//! A tool's flow-control limits: how many of its calls may be held at once
//! by this executor, and how many may start a second, decided before a
//! call is claimed.

/// A tool's limits, set on the tool ([`Tool::limits`](crate::Tool::limits),
/// [`FnTool::concurrency`](crate::FnTool::concurrency),
/// `#[toolrunner::tool(concurrency = 4)]`) and overridden by configuration
/// ([`ExecutorBuilder::limit`](crate::ExecutorBuilder::limit)).
///
/// **Concurrency** is how many calls of the tool this process holds at
/// once: from the claim until the task driving the call is done with it
/// (its final receipt delivered, or, the platform not answering, left to
/// the outbox's redelivery; or the call waiting in
/// `reconciliation_required`: a call waiting for a person holds no slot).
/// A call that pauses on the way (the platform unreachable, a lapsed
/// lease) keeps its slot until it is picked up again. The claimer claims
/// a call of the tool only when a slot is free; it never claims a call to
/// make it wait. The executor's capacity stays the total over every tool.
/// A call the platform already holds as this executor's, picked up again
/// without its slot (after a restart), takes one even when the tool is at
/// its limit: it is its own work, and is never refused; new claims wait
/// until the count is below the limit again.
///
/// **Rate** is how many first `accepted` sends of the tool this process
/// makes in any sliding second. A token is reserved when the call is
/// claimed, for at most a second, and becomes the send when `accepted` is
/// due; a reservation that lapsed (a slow authorizer) gives the claim back
/// (`released`: nothing ran, the call is claimed again after a back-off).
/// A send counts from then until a second after the platform's answer. An
/// `accepted` saved before a restart or a pause waits, when sent again,
/// for a free token.
///
/// **Per key** is how many calls with one concurrency key (computed from
/// the arguments by the tool's key function,
/// [`FnTool::concurrency_key`](crate::FnTool::concurrency_key)) are held
/// at once. The arguments come with the claim, so it is decided after the
/// claim and before `accepted`: a call whose key is at its limit is given
/// back at once (`released`: nothing ran) and not claimed again until a
/// slot of its key comes back in this process (the oldest waiting call of
/// the key first), or after a back-off (1 s, doubling to 10 s: a slot held
/// by another replica), while the calls of other keys are claimed in the
/// platform's order: one hot key takes at most its limit and never starves
/// the others.
///
/// On a PostgreSQL store every limit counts every replica of the database
/// (`docs/operations.md`, "Flow control"), and the store may hold limits
/// of its own over these ([`StoredLimits`](crate::StoredLimits)).
///
/// ```
/// use toolrunner::Limits;
///
/// let limits = Limits::none().concurrency(4).rate(100);
/// assert_eq!(limits.max_concurrency(), Some(4));
/// assert_eq!(limits.max_rate(), Some(100));
/// assert_eq!(Limits::none().max_concurrency(), None);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    concurrency: Option<u32>,
    rate: Option<u32>,
    per_key: Option<u32>,
}

impl Limits {
    /// No limit: only the executor's capacity bounds the tool.
    pub const fn none() -> Limits {
        Limits {
            concurrency: None,
            rate: None,
            per_key: None,
        }
    }

    /// At most `n` calls of the tool held at once by this process. Zero is
    /// refused at [`build`](crate::ExecutorBuilder::build).
    #[must_use]
    pub const fn concurrency(mut self, n: u32) -> Limits {
        self.concurrency = Some(n);
        self
    }

    /// The concurrency limit, if one is set.
    pub const fn max_concurrency(&self) -> Option<u32> {
        self.concurrency
    }

    /// At most `n` first `accepted` sends of the tool in any sliding
    /// second, by this process. Zero is refused at
    /// [`build`](crate::ExecutorBuilder::build).
    #[must_use]
    pub const fn rate(mut self, n: u32) -> Limits {
        self.rate = Some(n);
        self
    }

    /// At most `n` calls with one concurrency key held at once (the tool
    /// needs a key function). Zero is refused at
    /// [`build`](crate::ExecutorBuilder::build).
    #[must_use]
    pub const fn per_key(mut self, n: u32) -> Limits {
        self.per_key = Some(n);
        self
    }

    /// The per-key concurrency limit, if one is set.
    pub const fn max_per_key(&self) -> Option<u32> {
        self.per_key
    }

    /// The rate limit (first `accepted` sends a second), if one is set.
    pub const fn max_rate(&self) -> Option<u32> {
        self.rate
    }

    /// These limits with the given ones set (`None`: left as they are).
    pub(crate) const fn with(mut self, concurrency: Option<u32>, rate: Option<u32>) -> Limits {
        if concurrency.is_some() {
            self.concurrency = concurrency;
        }
        if rate.is_some() {
            self.rate = rate;
        }
        self
    }

    /// These limits, with each limit `over` sets taking the place of this
    /// one's (configuration over code).
    pub(crate) fn overridden_by(self, over: Limits) -> Limits {
        Limits {
            concurrency: over.concurrency.or(self.concurrency),
            rate: over.rate.or(self.rate),
            per_key: over.per_key.or(self.per_key),
        }
    }

    /// What is wrong with these limits, said as what to set instead.
    pub(crate) fn problem(&self) -> Option<&'static str> {
        if self.concurrency == Some(0) {
            return Some("a concurrency limit of 0 would never run the tool: set at least 1");
        }
        if self.per_key == Some(0) {
            return Some("a per-key limit of 0 would never run the tool: set at least 1");
        }
        (self.rate == Some(0)).then_some(
            "a rate limit of 0 would never start the tool: set at least 1 (first `accepted` sends a second)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Limits;

    #[test]
    fn configuration_overrides_code_limit_by_limit() {
        let code = Limits::none().concurrency(4);
        assert_eq!(code.overridden_by(Limits::none()), code);
        let both = code.overridden_by(Limits::none().rate(9));
        assert_eq!(
            (both.max_concurrency(), both.max_rate()),
            (Some(4), Some(9))
        );
        assert_eq!(
            code.overridden_by(Limits::none().concurrency(2))
                .max_concurrency(),
            Some(2)
        );
        assert_eq!(
            Limits::none()
                .overridden_by(Limits::none().concurrency(7))
                .max_concurrency(),
            Some(7)
        );
    }

    #[test]
    fn zero_is_a_problem_that_says_what_to_set() {
        let why = Limits::none().concurrency(0).problem().unwrap();
        assert!(why.contains("at least 1"), "{why}");
        let why = Limits::none().rate(0).problem().unwrap();
        assert!(why.contains("rate") && why.contains("at least 1"), "{why}");
        assert_eq!(Limits::none().concurrency(1).problem(), None);
        assert_eq!(Limits::none().problem(), None);
    }
}

-- Approval requests: a call whose product asked for a person's yes first
-- (its authorizer, or its tool's policy) is given back to the platform
-- and waits here, keyed by run, call and the arguments' digest (a decision
-- is valid only for the digest it was asked for). `state` is `waiting`
-- until a person decides it once (`approved`, `denied`; a compare-and-set
-- on `waiting`), or the call ends otherwise (`closed`). An expired request
-- is a `waiting` one whose `expires_at` has passed: nothing rewrites it,
-- and no decision is taken after it. Times are RFC 3339 UTC with
-- milliseconds, as every time of the store.
CREATE TABLE approvals (
    run_id TEXT NOT NULL CHECK (run_id <> ''),
    call_id TEXT NOT NULL CHECK (call_id <> ''),
    digest TEXT NOT NULL CHECK (digest <> ''),
    tool TEXT NOT NULL CHECK (tool <> ''),
    subject TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    agent_version TEXT NOT NULL,
    arguments TEXT NOT NULL,
    reason TEXT NOT NULL,
    executor_id TEXT NOT NULL CHECK (executor_id <> ''),
    asked_at TEXT NOT NULL,
    expires_at TEXT NOT NULL CHECK (expires_at > asked_at),
    state TEXT NOT NULL CHECK (state IN ('waiting', 'approved', 'denied', 'closed')),
    decided_by TEXT,
    note TEXT,
    decided_at TEXT,
    -- Why the request was closed (the decision before it, if any, stays).
    closed_why TEXT,
    PRIMARY KEY (run_id, call_id, digest),
    -- A decision names who made it and when; a waiting request has none.
    CHECK ((state = 'waiting') = (decided_at IS NULL)),
    CHECK (state = 'waiting' OR decided_by IS NOT NULL),
    CHECK ((state = 'closed') = (closed_why IS NOT NULL))
);

CREATE INDEX approvals_waiting ON approvals (state, expires_at);

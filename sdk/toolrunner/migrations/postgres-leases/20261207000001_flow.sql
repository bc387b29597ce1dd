-- Flow control shared by every replica and identity of this database: each
-- limited tool's slots (concurrency) and rate tokens, held as rows.
--
-- `flow_tools`: a row per tool that a process limited here, with the
-- limits an operator set in the store (`toolrunner limits set`; NULL: the
-- process's own, from its code or configuration). A taker locks its tool's
-- row (`FOR UPDATE`) before it counts and takes, so two replicas never
-- both take the last slot.
--
-- `flow_holds`: a slot or a token held for one call (run, call), by an
-- identity (`executor_id`) under its fencing token (`lease_token`), for
-- one hold of the process (`hold_id`: a hold gives back only its own rows,
-- never a newer hold's of the same call). The key makes racing replicas
-- reserve one call once. A hold counts while
-- its identity's lease row still has that token and is not seen lapsed
-- (judged by the taker's monotonic clock, as adoptions are); a token
-- counts for a second after `at` (the database's clock) once it is no
-- longer being sent. Rows that no longer count are deleted by the next
-- taker of the tool.
CREATE TABLE flow_tools (
    tool TEXT PRIMARY KEY CHECK (tool <> ''),
    concurrency INTEGER CHECK (concurrency IS NULL OR concurrency > 0),
    rate INTEGER CHECK (rate IS NULL OR rate > 0),
    set_at TIMESTAMPTZ
);

CREATE TABLE flow_holds (
    tool TEXT NOT NULL REFERENCES flow_tools (tool),
    kind TEXT NOT NULL CHECK (kind IN ('slot', 'token')),
    run_id TEXT NOT NULL CHECK (run_id <> ''),
    call_id TEXT NOT NULL CHECK (call_id <> ''),
    -- A token's assignment once its `accepted` is sent ('' while it is a
    -- reservation; always '' for a slot).
    assignment_id TEXT NOT NULL DEFAULT '',
    executor_id TEXT NOT NULL CHECK (executor_id <> ''),
    lease_token BIGINT NOT NULL CHECK (lease_token > 0),
    hold_id BIGINT NOT NULL,
    stage TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tool, kind, run_id, call_id, assignment_id),
    CONSTRAINT flow_holds_stage_of_kind CHECK (
        (kind = 'slot' AND stage = 'held' AND assignment_id = '')
        OR (kind = 'token' AND stage = 'reserved' AND assignment_id = '')
        OR (kind = 'token' AND stage IN ('sending', 'sent') AND assignment_id <> '')
    )
);

-- The executor's durable store: one row per call attempt, the receipt
-- outbox, and a timeline of every change for operators.
CREATE TABLE calls (
    run_id         TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    tool_name      TEXT NOT NULL,
    operation_key  TEXT NOT NULL,
    state          TEXT NOT NULL,
    assignment     TEXT,            -- the claim answer's assignment (JSON, grant included)
    next_sequence  INTEGER NOT NULL DEFAULT 0,
    reason         TEXT,
    report         TEXT,            -- a state still to report to the platform
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    PRIMARY KEY (run_id, call_id)
);
CREATE INDEX calls_by_state ON calls (state, updated_at);

CREATE TABLE receipts (
    receipt_id     TEXT PRIMARY KEY NOT NULL,
    run_id         TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    assignment_id  TEXT NOT NULL,
    kind           TEXT NOT NULL,
    sequence       INTEGER NOT NULL,
    body           TEXT NOT NULL,   -- the exact bytes sent, every time
    status         TEXT NOT NULL,   -- pending | delivered | rejected | superseded | orphaned
    attempts       INTEGER NOT NULL DEFAULT 0,
    last_error     TEXT,
    created_at     TEXT NOT NULL,
    delivered_at   TEXT
);
CREATE INDEX receipts_by_call ON receipts (run_id, call_id, sequence);
CREATE INDEX receipts_by_status ON receipts (status, created_at);

CREATE TABLE events (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id    TEXT NOT NULL,
    call_id   TEXT NOT NULL,
    at        TEXT NOT NULL,
    what      TEXT NOT NULL,
    detail    TEXT
);
CREATE INDEX events_by_call ON events (run_id, call_id, id);

-- The executor's durable store on PostgreSQL: the final schema of the
-- SQLite store (migrations/sdk, all three migrations) in one migration.
--
-- Table names are unqualified: the connection's `search_path` decides the
-- schema. Times are TEXT in the fixed form the SDK writes (RFC 3339 UTC with
-- milliseconds), so they order as strings; every text column that is
-- compared or ordered uses the "C" collation, so it orders byte by byte as
-- SQLite's BINARY collation does whatever the database's default is.

CREATE TABLE calls (
    run_id         TEXT COLLATE "C" NOT NULL,
    call_id        TEXT COLLATE "C" NOT NULL,
    tool_name      TEXT COLLATE "C" NOT NULL,
    operation_key  TEXT NOT NULL,   -- the current attempt's key ('' for a call known only from the platform)
    state          TEXT COLLATE "C" NOT NULL CHECK (state IN (
                       'claiming', 'assigned', 'running', 'settled', 'delivered', 'abandoned',
                       'released', 'rejected', 'reconciliation_required', 'orphaned', 'compensated')),
    assignment     TEXT,            -- the current assignment (JSON, grant included)
    next_sequence  BIGINT NOT NULL DEFAULT 0 CHECK (next_sequence >= 0),
    reason         TEXT,
    report         TEXT COLLATE "C" CHECK (report IS NULL OR report IN (
                       'reconciliation_required', 'pending_delivery', 'released')),
    version        BIGINT NOT NULL DEFAULT 0 CHECK (version >= 0),
    created_at     TEXT COLLATE "C" NOT NULL,
    updated_at     TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (run_id, call_id)
);
CREATE INDEX calls_by_state ON calls (state, updated_at);
-- The calls with a state still to report (a handful among many).
CREATE INDEX calls_to_report ON calls (updated_at, run_id, call_id) WHERE report IS NOT NULL;

CREATE TABLE receipts (
    receipt_id     TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    run_id         TEXT COLLATE "C" NOT NULL,
    call_id        TEXT COLLATE "C" NOT NULL,
    assignment_id  TEXT COLLATE "C" NOT NULL,
    kind           TEXT COLLATE "C" NOT NULL CHECK (kind IN ('accepted', 'progress', 'completed', 'failed', 'cancelled')),
    sequence       BIGINT NOT NULL CHECK (sequence >= 0),
    body           TEXT NOT NULL,   -- the exact bytes sent, every time
    status         TEXT COLLATE "C" NOT NULL CHECK (status IN ('pending', 'delivered', 'rejected', 'superseded', 'orphaned')),
    attempts       BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error     TEXT,
    created_at     TEXT COLLATE "C" NOT NULL,
    delivered_at   TEXT COLLATE "C",
    UNIQUE (assignment_id, sequence),
    FOREIGN KEY (run_id, call_id) REFERENCES calls (run_id, call_id)
);
CREATE INDEX receipts_by_call ON receipts (run_id, call_id, sequence);
CREATE INDEX receipts_by_status ON receipts (status, created_at);
-- At most one `accepted` per assignment.
CREATE UNIQUE INDEX receipts_one_accepted ON receipts (assignment_id) WHERE kind = 'accepted';
-- At most one live (pending or delivered) final receipt per call.
CREATE UNIQUE INDEX receipts_one_live_final ON receipts (run_id, call_id)
    WHERE kind IN ('completed', 'failed', 'cancelled') AND status IN ('pending', 'delivered');
-- The outbox's periodic look-ups read only what is still to send.
CREATE INDEX receipts_pending ON receipts (created_at, run_id, call_id) WHERE status = 'pending';

-- Receipts an older SQLite store held twice under one (assignment_id,
-- sequence), set aside by its lifecycle migration. A PostgreSQL store never
-- had such rows; the table is kept so both schemas hold the same tables.
CREATE TABLE receipts_set_aside (
    receipt_id     TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    run_id         TEXT COLLATE "C" NOT NULL,
    call_id        TEXT COLLATE "C" NOT NULL,
    assignment_id  TEXT COLLATE "C" NOT NULL,
    kind           TEXT NOT NULL,
    sequence       BIGINT NOT NULL,
    body           TEXT NOT NULL,
    status         TEXT NOT NULL,
    attempts       BIGINT NOT NULL,
    last_error     TEXT,
    created_at     TEXT COLLATE "C" NOT NULL,
    delivered_at   TEXT COLLATE "C",
    why            TEXT NOT NULL
);

-- Every operation key and every assignment a call ever had.
CREATE TABLE attempts (
    id             BIGSERIAL PRIMARY KEY,
    run_id         TEXT COLLATE "C" NOT NULL,
    call_id        TEXT COLLATE "C" NOT NULL,
    operation_key  TEXT COLLATE "C" NOT NULL CHECK (operation_key <> ''),
    executor_id    TEXT,            -- NULL when unknown
    assignment_id  TEXT COLLATE "C", -- NULL: the claim with this key, before (or without) an answer
    created_at     TEXT COLLATE "C" NOT NULL,
    FOREIGN KEY (run_id, call_id) REFERENCES calls (run_id, call_id)
);
CREATE INDEX attempts_by_call ON attempts (run_id, call_id, id);
CREATE UNIQUE INDEX attempts_one_key ON attempts (operation_key) WHERE assignment_id IS NULL;
CREATE UNIQUE INDEX attempts_one_assignment ON attempts (assignment_id) WHERE assignment_id IS NOT NULL;

-- The timeline of every change, for operators.
CREATE TABLE events (
    id        BIGSERIAL PRIMARY KEY,
    run_id    TEXT COLLATE "C" NOT NULL,
    call_id   TEXT COLLATE "C" NOT NULL,
    at        TEXT COLLATE "C" NOT NULL,
    what      TEXT NOT NULL,
    detail    TEXT
);
CREATE INDEX events_by_call ON events (run_id, call_id, id);

-- The number of calls in each state, kept by triggers, so the gauges read
-- eleven rows instead of counting every call (SQLite: `call_counts`).
--
-- On SQLite the triggers update `call_counts` in place: its writes are
-- serialized anyway. Here concurrent transactions would all queue on (and
-- deadlock over) the eleven counter rows until they commit, so the triggers
-- only append +1/-1 rows to `call_count_deltas`, which no one updates; the
-- store folds them into `call_counts` in short transactions of their own
-- (each delta row is deleted by exactly one fold, in the transaction that
-- adds it), and a count is `call_counts.n` plus the deltas not yet folded.
CREATE TABLE call_counts (
    state  TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    n      BIGINT NOT NULL CHECK (n >= 0)
);
INSERT INTO call_counts (state, n) VALUES
    ('claiming', 0), ('assigned', 0), ('running', 0), ('settled', 0), ('delivered', 0),
    ('abandoned', 0), ('released', 0), ('rejected', 0), ('reconciliation_required', 0),
    ('orphaned', 0), ('compensated', 0);

CREATE TABLE call_count_deltas (
    state  TEXT COLLATE "C" NOT NULL,
    n      BIGINT NOT NULL CHECK (n IN (-1, 1))
);
CREATE INDEX call_count_deltas_by_state ON call_count_deltas (state);

CREATE FUNCTION call_counts_track() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO call_count_deltas (state, n) VALUES (NEW.state, 1);
        RETURN NEW;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO call_count_deltas (state, n) VALUES (OLD.state, -1);
        RETURN OLD;
    ELSE
        INSERT INTO call_count_deltas (state, n) VALUES (OLD.state, -1), (NEW.state, 1);
        RETURN NEW;
    END IF;
END;
$$;

CREATE TRIGGER call_counts_insert AFTER INSERT ON calls
    FOR EACH ROW EXECUTE FUNCTION call_counts_track();
CREATE TRIGGER call_counts_delete AFTER DELETE ON calls
    FOR EACH ROW EXECUTE FUNCTION call_counts_track();
CREATE TRIGGER call_counts_update AFTER UPDATE OF state ON calls
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION call_counts_track();

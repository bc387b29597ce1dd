-- The lifecycle schema: rows that must never exist are refused by the
-- database itself, every change of a call is a compare-and-set on its
-- `version`, and every operation key and assignment a call ever had is kept.
--
-- SQLite cannot add CHECKs, foreign keys or table constraints to a table in
-- place, so `calls` and `receipts` are rebuilt and their rows copied. Rows
-- written before this migration that break the new rules are mended first
-- (each mend is described where it happens); nothing is deleted: a receipt
-- that cannot stay in `receipts` moves to `receipts_set_aside`.

ALTER TABLE calls RENAME TO calls_v1;
ALTER TABLE receipts RENAME TO receipts_v1;
DROP INDEX calls_by_state;
DROP INDEX receipts_by_call;
DROP INDEX receipts_by_status;

CREATE TABLE calls (
    run_id         TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    tool_name      TEXT NOT NULL,
    operation_key  TEXT NOT NULL,   -- the current attempt's key ('' for a call known only from the platform)
    state          TEXT NOT NULL CHECK (state IN (
                       'claiming', 'assigned', 'running', 'settled', 'delivered', 'abandoned',
                       'released', 'rejected', 'reconciliation_required', 'orphaned', 'compensated')),
    assignment     TEXT,            -- the current assignment (JSON, grant included)
    next_sequence  INTEGER NOT NULL DEFAULT 0 CHECK (next_sequence >= 0),
    reason         TEXT,
    report         TEXT CHECK (report IS NULL OR report IN (
                       'reconciliation_required', 'pending_delivery', 'released')),
    version        INTEGER NOT NULL DEFAULT 0 CHECK (version >= 0),
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    PRIMARY KEY (run_id, call_id)
);
CREATE INDEX calls_by_state ON calls (state, updated_at);
-- The calls with a state still to report (a handful among many).
CREATE INDEX calls_to_report ON calls (updated_at, run_id, call_id) WHERE report IS NOT NULL;

CREATE TABLE receipts (
    receipt_id     TEXT PRIMARY KEY NOT NULL,
    run_id         TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    assignment_id  TEXT NOT NULL,
    kind           TEXT NOT NULL CHECK (kind IN ('accepted', 'progress', 'completed', 'failed', 'cancelled')),
    sequence       INTEGER NOT NULL CHECK (sequence >= 0),
    body           TEXT NOT NULL,   -- the exact bytes sent, every time
    status         TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'rejected', 'superseded', 'orphaned')),
    attempts       INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error     TEXT,
    created_at     TEXT NOT NULL,
    delivered_at   TEXT,
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

-- Receipts an older store held twice under one (assignment_id, sequence)
-- (a final that reused a progress receipt's sequence, refused by the
-- platform as `sequence_conflict`): kept here for the operator, byte for
-- byte, instead of in `receipts`.
CREATE TABLE receipts_set_aside (
    receipt_id     TEXT PRIMARY KEY NOT NULL,
    run_id         TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    assignment_id  TEXT NOT NULL,
    kind           TEXT NOT NULL,
    sequence       INTEGER NOT NULL,
    body           TEXT NOT NULL,
    status         TEXT NOT NULL,
    attempts       INTEGER NOT NULL,
    last_error     TEXT,
    created_at     TEXT NOT NULL,
    delivered_at   TEXT,
    why            TEXT NOT NULL
);

-- Every operation key and every assignment a call ever had.
CREATE TABLE attempts (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id         TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    operation_key  TEXT NOT NULL CHECK (operation_key <> ''),
    executor_id    TEXT,            -- NULL for attempts made before this migration without a receipt
    assignment_id  TEXT,            -- NULL: the claim with this key, before (or without) an answer
    created_at     TEXT NOT NULL,
    FOREIGN KEY (run_id, call_id) REFERENCES calls (run_id, call_id)
);
CREATE INDEX attempts_by_call ON attempts (run_id, call_id, id);
CREATE UNIQUE INDEX attempts_one_key ON attempts (operation_key) WHERE assignment_id IS NULL;
CREATE UNIQUE INDEX attempts_one_assignment ON attempts (assignment_id) WHERE assignment_id IS NOT NULL;

INSERT INTO calls (run_id, call_id, tool_name, operation_key, state, assignment, next_sequence,
                   reason, report, version, created_at, updated_at)
SELECT run_id, call_id, tool_name, operation_key, state, assignment, next_sequence,
       reason, report, 0, created_at, updated_at
FROM calls_v1;

-- Mend: a second receipt under one (assignment_id, sequence) is set aside,
-- and so is a receipt whose call row is missing.
INSERT INTO receipts_set_aside
SELECT r.receipt_id, r.run_id, r.call_id, r.assignment_id, r.kind, r.sequence, r.body, r.status,
       r.attempts, r.last_error, r.created_at, r.delivered_at,
       CASE
           WHEN NOT EXISTS (SELECT 1 FROM calls_v1 c WHERE c.run_id = r.run_id AND c.call_id = r.call_id)
               THEN 'its call is not in the store (set aside by the lifecycle migration)'
           ELSE 'a second receipt with this assignment and sequence (set aside by the lifecycle migration)'
       END
FROM receipts_v1 r
WHERE EXISTS (SELECT 1 FROM receipts_v1 o
              WHERE o.assignment_id = r.assignment_id AND o.sequence = r.sequence
                AND (o.created_at < r.created_at OR (o.created_at = r.created_at AND o.rowid < r.rowid)))
   OR NOT EXISTS (SELECT 1 FROM calls_v1 c WHERE c.run_id = r.run_id AND c.call_id = r.call_id);

INSERT INTO receipts (receipt_id, run_id, call_id, assignment_id, kind, sequence, body, status,
                      attempts, last_error, created_at, delivered_at)
SELECT r.receipt_id, r.run_id, r.call_id, r.assignment_id, r.kind, r.sequence, r.body,
       CASE
           -- Mend: an `accepted` is sent only while its call waits for the
           -- answer (`assigned`, or `claiming` again with the same key);
           -- left pending in any other state it is never to be sent.
           WHEN r.kind = 'accepted' AND r.status = 'pending'
                AND c.state NOT IN ('assigned', 'claiming') THEN 'superseded'
           -- Mend: of two live finals of one call, one stays live: the one
           -- the platform has (delivered), else the first.
           WHEN r.kind IN ('completed', 'failed', 'cancelled') AND r.status IN ('pending', 'delivered')
                AND EXISTS (SELECT 1 FROM receipts_v1 o
                            WHERE o.run_id = r.run_id AND o.call_id = r.call_id
                              AND o.receipt_id <> r.receipt_id
                              AND o.receipt_id NOT IN (SELECT receipt_id FROM receipts_set_aside)
                              AND o.kind IN ('completed', 'failed', 'cancelled')
                              AND o.status IN ('pending', 'delivered')
                              AND ((o.status = 'delivered') > (r.status = 'delivered')
                                   OR ((o.status = 'delivered') = (r.status = 'delivered')
                                       AND (o.created_at < r.created_at
                                            OR (o.created_at = r.created_at AND o.rowid < r.rowid)))))
                THEN 'rejected'
           ELSE r.status
       END,
       r.attempts,
       CASE
           WHEN r.kind = 'accepted' AND r.status = 'pending' AND c.state NOT IN ('assigned', 'claiming')
               THEN 'never sent: the claim had settled (lifecycle migration)'
           ELSE r.last_error
       END,
       r.created_at, r.delivered_at
FROM receipts_v1 r
JOIN calls_v1 c ON c.run_id = r.run_id AND c.call_id = r.call_id
WHERE r.receipt_id NOT IN (SELECT receipt_id FROM receipts_set_aside);

-- Mend the calls whose receipts were mended. A `settled` call whose live
-- final the platform has is `delivered`; one left without a pending final
-- (it was set aside or demoted above) no longer knows its outcome is
-- delivered: `reconciliation_required`, reported, for a new final.
INSERT INTO events (run_id, call_id, at, what, detail)
SELECT c.run_id, c.call_id, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), 'delivered',
       'its final receipt was delivered (lifecycle migration)'
FROM calls c
WHERE c.state = 'settled'
  AND EXISTS (SELECT 1 FROM receipts r WHERE r.run_id = c.run_id AND r.call_id = c.call_id
              AND r.kind IN ('completed', 'failed', 'cancelled') AND r.status = 'delivered');
UPDATE calls SET state = 'delivered', report = NULL
WHERE state = 'settled'
  AND EXISTS (SELECT 1 FROM receipts r WHERE r.run_id = calls.run_id AND r.call_id = calls.call_id
              AND r.kind IN ('completed', 'failed', 'cancelled') AND r.status = 'delivered');

INSERT INTO events (run_id, call_id, at, what, detail)
SELECT c.run_id, c.call_id, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), 'reconciliation_required',
       'its final receipt was set aside by the lifecycle migration: settle it again'
FROM calls c
WHERE c.state = 'settled'
  AND NOT EXISTS (SELECT 1 FROM receipts r WHERE r.run_id = c.run_id AND r.call_id = c.call_id
                  AND r.kind IN ('completed', 'failed', 'cancelled') AND r.status = 'pending');
UPDATE calls SET state = 'reconciliation_required', report = 'reconciliation_required',
                 reason = 'its final receipt was set aside by the lifecycle migration: settle it again'
WHERE state = 'settled'
  AND NOT EXISTS (SELECT 1 FROM receipts r WHERE r.run_id = calls.run_id AND r.call_id = calls.call_id
                  AND r.kind IN ('completed', 'failed', 'cancelled') AND r.status = 'pending');

-- Mend: the next receipt of the current assignment comes after every one
-- it already had.
UPDATE calls SET next_sequence = (
    SELECT MAX(s) + 1 FROM (
        SELECT sequence AS s FROM receipts
        WHERE assignment_id = json_extract(calls.assignment, '$.assignment_id')
        UNION ALL
        SELECT sequence FROM receipts_set_aside
        WHERE assignment_id = json_extract(calls.assignment, '$.assignment_id')))
WHERE assignment IS NOT NULL
  AND next_sequence <= (
    SELECT MAX(s) FROM (
        SELECT sequence AS s FROM receipts
        WHERE assignment_id = json_extract(calls.assignment, '$.assignment_id')
        UNION ALL
        SELECT sequence FROM receipts_set_aside
        WHERE assignment_id = json_extract(calls.assignment, '$.assignment_id')));

-- The attempts an older store knew of: the current key, and its assignment.
INSERT INTO attempts (run_id, call_id, operation_key, executor_id, assignment_id, created_at)
SELECT run_id, call_id, operation_key,
       (SELECT json_extract(r.body, '$.executor_id') FROM receipts_v1 r
        WHERE r.run_id = c.run_id AND r.call_id = c.call_id ORDER BY r.created_at LIMIT 1),
       NULL, created_at
FROM calls_v1 c
WHERE operation_key <> '';

INSERT INTO attempts (run_id, call_id, operation_key, executor_id, assignment_id, created_at)
SELECT run_id, call_id, operation_key,
       (SELECT json_extract(r.body, '$.executor_id') FROM receipts_v1 r
        WHERE r.run_id = c.run_id AND r.call_id = c.call_id ORDER BY r.created_at LIMIT 1),
       json_extract(assignment, '$.assignment_id'), updated_at
FROM calls_v1 c
WHERE operation_key <> '' AND assignment IS NOT NULL;

DROP TABLE receipts_v1;
DROP TABLE calls_v1;

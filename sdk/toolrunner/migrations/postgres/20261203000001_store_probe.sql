-- The store's health probe: one row, written once a second by a running
-- executor (`Change::Probe`) in a transaction that checks the identity's
-- fencing token, so that "the store takes writes" is shown by a real write.
CREATE TABLE store_probe (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    probed_at TEXT NOT NULL
);

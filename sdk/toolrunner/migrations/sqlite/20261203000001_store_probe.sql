-- The store's health probe: one row, written once a second by a running
-- executor (`Change::Probe`), so that "the store takes writes" is shown by
-- a real write (a WAL frame, a commit) and not inferred from a read.
CREATE TABLE store_probe (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    probed_at TEXT NOT NULL
);

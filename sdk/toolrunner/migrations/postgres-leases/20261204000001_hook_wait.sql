-- Takeovers that keep what they owe, lapses judged without the server's
-- clock, twins told apart, and no writer of an older version.
--
-- `hook_wait_ms`: the wait still owed, when the row was last written,
-- before any `reconcile` hook may be asked about a call of the identity (an
-- earlier holder may still be making an effect it passed its commit point
-- for). Milliseconds, not a timestamp of any clock: whoever reads the row
-- waits it from its own first (monotonic) read. Carried forward as the
-- maximum by every take, adoption and release, so that no sequence of
-- holders with other settings shortens it.
--
-- `commit_window_ms`: the longest commit window of the holder's tools (how
-- long after a commit point its handlers may still make their effect); a
-- taker waits two of the holder's leases plus this after it saw the lease
-- lapse. Rows written before this column: 30 s, the SDK's default.
--
-- `renewals`: counts the holder's renewals. A taker judges a lapse by its
-- own monotonic clock, watching the row unchanged (the same token and
-- renewals) for a whole `ttl_ms`, never by `renewed_at`, which the
-- database server's wall clock stamps (a step of that clock would make
-- every live holder look old).
--
-- `holders`: the instance ids of the latest holders of the identity on this
-- database, newest first (at most 16). A connection superseded by one of
-- them is a takeover of this database's own; one superseded by an instance
-- this database never recorded is a twin with the same executor id on
-- another database.
--
-- `format`: 2 for a row last written by this version; a trigger keeps it,
-- from the session setting `toolrunner.lease_format` that this version's
-- connections carry. A session without it is a process of an older
-- version, whose lease writes are refused from now on (docs/operations.md,
-- "Upgrading"): it could not keep what this version owes.
ALTER TABLE executor_leases
    ADD COLUMN hook_wait_ms BIGINT NOT NULL DEFAULT 0 CHECK (hook_wait_ms >= 0),
    ADD COLUMN commit_window_ms BIGINT NOT NULL DEFAULT 30000 CHECK (commit_window_ms >= 0),
    ADD COLUMN renewals BIGINT NOT NULL DEFAULT 0 CHECK (renewals >= 0),
    ADD COLUMN holders TEXT[] NOT NULL DEFAULT '{}'
        CHECK (cardinality(holders) <= 16),
    ADD COLUMN format INTEGER NOT NULL DEFAULT 1 CHECK (format IN (1, 2));

CREATE FUNCTION executor_leases_format() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('toolrunner.lease_format', true), '') <> '2' THEN
        RAISE EXCEPTION 'toolrunner: this database''s executor leases were upgraded by a newer toolrunner (lease format 2); a process of an older version cannot hold an executor identity here: stop every process of the older version and start the new one (docs/operations.md, "Upgrading")'
            USING ERRCODE = 'TR001';
    END IF;
    NEW.format := 2;
    RETURN NEW;
END
$$;

CREATE TRIGGER executor_leases_format BEFORE INSERT OR UPDATE ON executor_leases
    FOR EACH ROW EXECUTE FUNCTION executor_leases_format();

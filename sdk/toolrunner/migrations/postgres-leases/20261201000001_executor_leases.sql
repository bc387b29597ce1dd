-- The executor identities that share one PostgreSQL database, in a schema
-- of their own (`toolrunner_leases`) beside each identity's store schema.
--
-- A process holds its executor identity through its row: `token` is the
-- fencing token, bumped by every process start and by every adoption, and
-- every write of the identity's store first checks (FOR SHARE) that the
-- row still has the token its writer holds, so a process whose identity
-- moved on writes nothing. `renewed_at` is renewed by whoever holds the
-- identity; a replica with a takeover grace adopts an identity whose
-- `renewed_at` lies further back than the grace (SELECT … FOR UPDATE SKIP
-- LOCKED, so two replicas never adopt the same one) and records itself in
-- `adopted_by`. A process of an adopted identity refuses to start.
CREATE TABLE executor_leases (
    executor_id TEXT PRIMARY KEY CHECK (executor_id <> ''),
    token BIGINT NOT NULL CHECK (token > 0),
    -- The instance id of the process holding the identity.
    holder TEXT NOT NULL,
    -- The executor id of the replica that adopted it (NULL: its own).
    adopted_by TEXT CHECK (adopted_by IS NULL OR adopted_by <> executor_id),
    renewed_at TIMESTAMPTZ NOT NULL
);

-- The executor identity whose calls this schema holds: set by the first
-- executor that takes it (`PgStore::connect_as`), after which an executor
-- of another id is refused here. Recovery reads every call of its store,
-- so a second identity in the same schema would take the first one's
-- calls for its own.
CREATE TABLE store_identity (
    one BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    executor_id TEXT NOT NULL CHECK (executor_id <> '')
);

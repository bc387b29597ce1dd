-- The development platform keeps each record as one JSON document per row.
-- `seq` keeps insertion order so that a restart rebuilds the same state.
CREATE TABLE agents         (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE bindings       (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE agent_versions (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE runs           (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE calls          (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE executors      (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE connections    (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE assignments    (id TEXT PRIMARY KEY NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL);

-- Replicas adopt only each other: the identities that serve the same
-- executor binding (the same tools of the same agent). A lease row names
-- its binding; rows written before this column have none, and are never
-- adopted.
ALTER TABLE executor_leases ADD COLUMN binding_id TEXT NOT NULL DEFAULT '';
CREATE INDEX executor_leases_by_binding ON executor_leases (binding_id, renewed_at);

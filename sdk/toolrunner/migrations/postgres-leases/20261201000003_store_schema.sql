-- Where an identity's store lives (its schema), so that a replica that
-- adopts it opens that very store, whatever the URL of the process that
-- held it named. Empty for rows written before this column: the
-- identity's own schema (`toolrunner_<id>`).
ALTER TABLE executor_leases ADD COLUMN store_schema TEXT NOT NULL DEFAULT '';

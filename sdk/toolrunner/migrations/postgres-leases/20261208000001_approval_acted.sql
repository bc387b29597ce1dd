-- `acted_at`: when the executor saved what the request's decision made of
-- its call (its `accepted` after an approval, or its `failed` at sequence
-- 0 after a deny or an expiry); NULL until then. Retention deletes a
-- decided request only once it was acted on, longer ago than the
-- retention period: a decision not yet acted on (the executors down, the
-- call not yet claimed again) is never deleted, so that nobody is asked
-- again and a deny never turns into a new question.
--
-- `retold_at`: when a replica last took the request to tell the product
-- of it in place of an asker that stopped before telling (a compare-and-
-- set, so that one replica tells it, not every replica that finds it).
ALTER TABLE approvals ADD COLUMN acted_at TEXT CHECK (acted_at IS NULL OR state <> 'waiting');
ALTER TABLE approvals ADD COLUMN retold_at TEXT;

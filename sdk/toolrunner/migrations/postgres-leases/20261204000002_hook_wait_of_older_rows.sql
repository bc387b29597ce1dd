-- The rows an older version wrote (format 1) carry no wait before a
-- `reconcile` hook: that version kept it in its memory only, so a release
-- or a takeover it made may still owe one (a frozen holder's commit
-- window). Each such row now owes what a takeover of its last holder
-- would: two of its leases plus the longest commit window (30 s unless
-- recorded), counted by whoever reads it next from that read. Runs in the
-- session of this version's first start, which carries the lease format
-- the table's trigger asks for.
UPDATE executor_leases
   SET hook_wait_ms = GREATEST(hook_wait_ms, 2 * ttl_ms + commit_window_ms)
 WHERE format = 1;

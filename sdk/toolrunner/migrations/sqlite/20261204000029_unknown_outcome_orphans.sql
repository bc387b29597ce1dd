-- Orphaned calls whose outcome was unknown, as versions before 0.1.0 left
-- them. Retention keeps an `orphaned` call whose timeline holds
-- `orphaned_outcome_unknown` (written since 0.1.0 when a call goes
-- `orphaned` from `reconciliation_required`) until an operator closes it;
-- the earlier versions wrote no such entry, so retention would prune the
-- calls they orphaned while nobody knew whether the effect happened.
--
-- Every change of state has always added a timeline entry named after the
-- new state. This marks each `orphaned` call without the entry unless its
-- timeline shows it went `orphaned` from a state whose outcome was known
-- (`settled`: a final receipt was saved; `abandoned` or `released`: nothing
-- ran). A call whose timeline cannot tell (no `orphaned` entry, or no state
-- entry before it) is marked too: an unknown outcome is never guessed, and
-- an operator closes it with `toolrunner reconcile close`.
INSERT INTO events (run_id, call_id, at, what, detail)
SELECT c.run_id, c.call_id, COALESCE(o.at, c.updated_at), 'orphaned_outcome_unknown',
       'marked on upgrade: orphaned by an earlier version while its outcome was unknown'
           || COALESCE(' (' || o.detail || ')', '')
FROM calls c
LEFT JOIN events o ON o.id = (
    SELECT MAX(e.id) FROM events e
    WHERE e.run_id = c.run_id AND e.call_id = c.call_id AND e.what = 'orphaned')
WHERE c.state = 'orphaned'
  AND NOT EXISTS (
      SELECT 1 FROM events e
      WHERE e.run_id = c.run_id AND e.call_id = c.call_id AND e.what = 'orphaned_outcome_unknown')
  AND COALESCE((
      SELECT p.what FROM events p
      WHERE p.run_id = c.run_id AND p.call_id = c.call_id AND p.id < o.id
        AND p.what IN ('claiming', 'assigned', 'running', 'settled', 'delivered', 'abandoned',
                       'released', 'rejected', 'reconciliation_required', 'orphaned', 'compensated')
      ORDER BY p.id DESC LIMIT 1), '') NOT IN ('settled', 'abandoned', 'released')
ORDER BY c.run_id, c.call_id;

-- When the product was told that a request waits (its authorizer's
-- `on_approval_requested`, called after the request is stored): NULL until
-- then. An executor tells again each of its own waiting requests whose
-- telling is not recorded (a crash between the two), so the product hears
-- of each request at least once, possibly twice.
ALTER TABLE approvals ADD COLUMN notified_at TEXT;

-- A lease with a time to live, and a clean release.
--
-- `ttl_ms`: how long the holder's lease lasts after each renewal (the
-- holder renews well within it, and stops taking work once it has not
-- renewed for that long). An identity is lapsed once `renewed_at` is older
-- than `ttl_ms`; a replica adopts it `grace` later still. Rows written
-- before this column get 3 s, the SDK's default.
--
-- `released`: the last holder drained with nothing left and let the
-- identity go (bumping the token, so it writes nothing more): nobody holds
-- it, a start takes it at once, and no replica adopts it.
--
-- `renewed_at` leaves the index, so that a renewal (an UPDATE of that
-- column alone) is a HOT update that touches no index.
ALTER TABLE executor_leases
    ADD COLUMN ttl_ms BIGINT NOT NULL DEFAULT 3000 CHECK (ttl_ms > 0),
    ADD COLUMN released BOOLEAN NOT NULL DEFAULT FALSE,
    ADD CONSTRAINT executor_leases_released_is_held_by_nobody
        CHECK (NOT released OR (adopted_by IS NULL AND holder = ''));
DROP INDEX executor_leases_by_binding;
CREATE INDEX executor_leases_by_binding ON executor_leases (binding_id);

-- Allocation takes the uid released longest ago: read in that order, a
-- page at a time, instead of every released uid of the range each time.
CREATE INDEX sandbox_uid_released_order ON sandbox_uid_released (node, released_at_ms, uid);

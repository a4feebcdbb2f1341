-- When a node was asked to drain: it is drained only once it renewed its
-- lease after that with nothing running.
ALTER TABLE nodes ADD COLUMN drain_requested_at_ms BIGINT NOT NULL DEFAULT 0;

-- The fleet's queue: an accepted execution no node with room could take at
-- once waits here (its executions row is `pending`, of no node) until a
-- node claims it in a transaction (FOR UPDATE SKIP LOCKED) with the
-- fleet-wide quota counts. The row holds the command, task included, and
-- is deleted by the claim (or by a cancel before one).
CREATE TABLE queue (
    execution_id TEXT PRIMARY KEY,
    principal    TEXT NOT NULL,
    quota        BIGINT,
    needs        TEXT NOT NULL,
    work         TEXT NOT NULL,
    queued_at_ms BIGINT NOT NULL
);
CREATE INDEX queue_order ON queue (queued_at_ms, execution_id);
-- Sessions count toward their principal's fleet-wide quota.
ALTER TABLE sessions ADD COLUMN principal TEXT NOT NULL DEFAULT '';
CREATE INDEX executions_principal_state ON executions (principal, state);
CREATE INDEX sessions_principal_state ON sessions (principal, state);

-- Hub reports waiting for delivery: written in the same transaction as the
-- final execution record, delivered with backoff, kept across restarts.
CREATE TABLE hub_outbox (
    id              TEXT PRIMARY KEY,
    subject_id      TEXT NOT NULL,
    body            TEXT NOT NULL,
    state           TEXT NOT NULL,
    attempts        BIGINT NOT NULL,
    next_attempt_ms BIGINT NOT NULL,
    created_at_ms   BIGINT NOT NULL
);
CREATE INDEX hub_outbox_due ON hub_outbox (state, next_attempt_ms);

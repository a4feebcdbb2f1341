-- Which daemon owns a row, so that in a store shared by several daemons
-- each one recovers and reports only what it ran itself.
ALTER TABLE executions ADD COLUMN node TEXT;
ALTER TABLE sessions ADD COLUMN node TEXT;
ALTER TABLE sandboxes ADD COLUMN node TEXT;
ALTER TABLE hub_outbox ADD COLUMN node TEXT;

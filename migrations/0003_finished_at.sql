-- When an execution finished, so that event retention can compact it.
ALTER TABLE executions ADD COLUMN finished_at_ms BIGINT;

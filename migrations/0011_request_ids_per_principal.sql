-- A request id belongs to the principal that sent it: another principal
-- using the same id starts its own execution (and learns nothing of the
-- first). Rows from before this migration keep an empty principal: a retry
-- of such a request after the upgrade starts a new execution.
ALTER TABLE executions ADD COLUMN principal TEXT NOT NULL DEFAULT '';
DROP INDEX executions_request_id;
CREATE UNIQUE INDEX executions_principal_request_id ON executions (principal, request_id);

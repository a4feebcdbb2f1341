-- What a forwarded request carries beyond its subject (a turn's tool call,
-- as JSON), and what the owner hands back after answering (a forwarded
-- turn's raw result, for the caller on the node it was sent to).
ALTER TABLE node_requests ADD COLUMN payload TEXT NOT NULL DEFAULT '';
ALTER TABLE node_requests ADD COLUMN raw TEXT;

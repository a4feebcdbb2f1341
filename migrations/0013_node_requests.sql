-- Requests for another node of the fleet (a cancel sent to a node that
-- does not run the execution): the owner is woken by NOTIFY (or finds
-- them on its next look), acts, and writes its answer here.
CREATE TABLE node_requests (
    id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    state TEXT NOT NULL,
    answer TEXT,
    error TEXT,
    created_at_ms BIGINT NOT NULL
);
CREATE INDEX node_requests_pending ON node_requests (node, state);

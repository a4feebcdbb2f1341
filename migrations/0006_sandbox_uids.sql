-- The host uid each live sandbox runs as, per node (uids are per host).
-- A row is written before the sandbox is created and deleted only once
-- nothing of the sandbox is alive, so no two live sandboxes share a uid,
-- across restarts too.
CREATE TABLE sandbox_uids (
    node       TEXT NOT NULL,
    uid        BIGINT NOT NULL,
    sandbox_id TEXT NOT NULL,
    PRIMARY KEY (node, uid)
);
CREATE INDEX sandbox_uids_sandbox ON sandbox_uids (sandbox_id);

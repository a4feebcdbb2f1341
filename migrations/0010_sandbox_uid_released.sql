-- When each host uid was last given back, per node: allocation prefers
-- uids never used, then the one released longest ago, so a uid does not go
-- to the next sandbox the moment the last one let go of it.
CREATE TABLE sandbox_uid_released (
    node           TEXT NOT NULL,
    uid            BIGINT NOT NULL,
    released_at_ms BIGINT NOT NULL,
    PRIMARY KEY (node, uid)
);

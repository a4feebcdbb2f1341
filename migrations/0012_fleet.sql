-- The fleet: each daemon on a store is a node with a lease it renews; a
-- node whose lease ran out is marked lost by one survivor, which fails its
-- unfinished runs. Secrets every node shares (never a principal's).
CREATE TABLE nodes (
    name TEXT PRIMARY KEY,
    epoch TEXT NOT NULL,
    state TEXT NOT NULL,
    capacity BIGINT NOT NULL,
    labels TEXT NOT NULL,
    version TEXT NOT NULL,
    started_at_ms BIGINT NOT NULL,
    renewed_at_ms BIGINT NOT NULL,
    lease_until_ms BIGINT NOT NULL,
    running BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE fleet_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

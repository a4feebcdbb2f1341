-- SQLite only (PostgreSQL has no rowid): the events table is its primary
-- key's own b-tree, instead of a rowid table plus an index repeating
-- (subject_id, sequence) for every event. Versions here and in the shared
-- directory above are one sequence: the next shared migration is 0010.
CREATE TABLE events_by_key (
    subject_id TEXT NOT NULL,
    sequence   BIGINT NOT NULL,
    time_ms    BIGINT NOT NULL,
    kind       TEXT NOT NULL,
    body       TEXT NOT NULL,
    PRIMARY KEY (subject_id, sequence)
) WITHOUT ROWID;
INSERT INTO events_by_key (subject_id, sequence, time_ms, kind, body)
    SELECT subject_id, sequence, time_ms, kind, body FROM events;
DROP TABLE events;
ALTER TABLE events_by_key RENAME TO events;

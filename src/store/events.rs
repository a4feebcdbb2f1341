//! The store's lifecycle events: appended in batches, read after or between sequences, compacted, and each execution's raw result.

use super::*;

/// [`Store::append_events_adopting`] on SQLite, over (`$1` the sandbox, `$2`
/// the subject, `$3` now, `$4` the events' rows).
static ADOPTING_SQLITE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    sqlite_transaction(&[super::sandboxes::ADOPT, &INSERT_EVENTS_SQLITE.replace("$1", "$4")])
});

impl Store {
    /// Stores several events in one statement; on a shared store the same
    /// statement checks this node is not fenced (see [`FENCED_APPEND`]) and
    /// notifies their subjects' watchers: one statement.
    pub async fn append_events(&self, events: &[Event]) -> Result<(), StoreError> {
        if !self.shared || events.is_empty() {
            return self.insert_events(&self.pool, events, false).await;
        }
        self.fenced_write(sqlx::query(FENCED_APPEND).bind(events_rows_json(events, false)?)).await
    }

    /// Stores `events` and gives the sandbox `sandbox_id` to their subject,
    /// marked ready (see [`Store::adopt_sandbox`]), in one commit: a run
    /// names a warm sandbox it took, and marks a sandbox made for it ready,
    /// in the write that stores its `sandbox_ready`, not in a write of its
    /// own. On a shared store, one fenced statement.
    pub async fn append_events_adopting(&self, events: &[Event], sandbox_id: &str) -> Result<(), StoreError> {
        let Some(subject) = events.first().map(|e| e.subject_id.as_str()) else {
            return Ok(());
        };
        if self.shared {
            let statement = sqlx::query(FENCED_APPEND_ADOPTING)
                .bind(events_rows_json(events, false)?)
                .bind(sandbox_id)
                .bind(now_ms());
            return self.fenced_write(statement).await;
        }
        let batch = sqlx::query(&ADOPTING_SQLITE).bind(sandbox_id.to_string()).bind(subject.to_string());
        self.run_sqlite_transaction(batch.bind(now_ms()).bind(events_rows_json(events, false)?)).await
    }

    /// Inserts `events` with one statement on `conn` (the pool, or a
    /// transaction's connection); with `stub_finished`, a `finished` event
    /// is stored as its stub (only when its record is written in the same
    /// transaction).
    pub(super) async fn insert_events<'c, E>(
        &self,
        conn: E,
        events: &[Event],
        stub_finished: bool,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = sqlx::Any>,
    {
        if events.is_empty() {
            return Ok(());
        }
        let sql = if self.shared { INSERT_EVENTS_POSTGRES } else { INSERT_EVENTS_SQLITE };
        sqlx::query(sql).bind(events_rows_json(events, stub_finished)?).execute(conn).await?;
        Ok(())
    }

    /// What each stored event of a subject takes: (sequence, kind, bytes of
    /// its stored body). For diagnostics: a `finished` stored with its
    /// record is a stub of a few bytes.
    pub async fn stored_event_sizes(&self, subject: &str) -> Result<Vec<(u64, String, usize)>, StoreError> {
        let rows = sqlx::query("SELECT sequence, kind, body FROM events WHERE subject_id = $1 ORDER BY sequence")
            .bind(subject)
            .fetch_all(&self.reader)
            .await?;
        Ok(rows.iter().map(|r| (r.get::<i64, _>(0) as u64, r.get::<String, _>(1), r.get::<&str, _>(2).len())).collect())
    }

    /// The lowest and the highest sequence still stored for a subject
    /// (compaction keeps the last event), if it has any.
    pub async fn sequence_bounds(&self, subject: &str) -> Result<Option<(u64, u64)>, StoreError> {
        let row = sqlx::query("SELECT MIN(sequence), MAX(sequence) FROM events WHERE subject_id = $1")
            .bind(subject)
            .fetch_one(&self.reader)
            .await?;
        let bound = |i: usize| row.get::<Option<i64>, _>(i).map(|s| s as u64);
        Ok(bound(0).zip(bound(1)))
    }

    /// The raw output and error of a finished execution, if kept.
    pub async fn get_raw(&self, execution_id: &str) -> Result<Option<(String, String)>, StoreError> {
        let row = sqlx::query("SELECT output, error FROM execution_raw WHERE execution_id = $1")
            .bind(execution_id)
            .fetch_optional(&self.reader)
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// Deletes what finished executions older than `cutoff_ms` (Unix
    /// milliseconds, by their end) no longer need: their raw results and every
    /// event but the last. Returns how many events were deleted.
    pub async fn compact_events(&self, cutoff_ms: i64) -> Result<u64, StoreError> {
        sqlx::query(
            "DELETE FROM execution_raw WHERE execution_id IN (
                 SELECT execution_id FROM executions WHERE finished_at_ms IS NOT NULL AND finished_at_ms < $1)",
        )
        .bind(cutoff_ms)
        .execute(&self.pool)
        .await?;
        let result = sqlx::query(
            "DELETE FROM events WHERE subject_id IN (
                 SELECT execution_id FROM executions
                 WHERE finished_at_ms IS NOT NULL AND finished_at_ms < $1)
             AND sequence < (SELECT MAX(e2.sequence) FROM events e2 WHERE e2.subject_id = events.subject_id)",
        )
        .bind(cutoff_ms)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected())
    }

    /// The stored events of a subject with `after < sequence < before`.
    pub async fn events_between(&self, subject: &str, after: u64, before: u64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(
            "SELECT sequence, time_ms, kind, body FROM events
             WHERE subject_id = $1 AND sequence > $2 AND sequence < $3 ORDER BY sequence",
        )
        .bind(subject)
        .bind(sequence(after))
        .bind(sequence(before))
        .fetch_all(&self.reader)
        .await?;
        self.events_from_rows(subject, &rows).await
    }

    /// The stored events of a subject after `after`, in order.
    pub async fn events_after(&self, subject: &str, after: u64) -> Result<Vec<Event>, StoreError> {
        self.events_after_limited(subject, after, u64::MAX).await
    }

    /// At most `limit` stored events of a subject after `after`, in order:
    /// a follower reads a subject's backlog a page at a time.
    pub async fn events_after_limited(&self, subject: &str, after: u64, limit: u64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(
            "SELECT sequence, time_ms, kind, body FROM events WHERE subject_id = $1 AND sequence > $2
             ORDER BY sequence LIMIT $3",
        )
        .bind(subject)
        .bind(sequence(after))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.reader)
        .await?;
        self.events_from_rows(subject, &rows).await
    }

    /// Decodes stored events; a `finished` stored as its stub gets its
    /// subject's record back.
    async fn events_from_rows(&self, subject: &str, rows: &[sqlx::any::AnyRow]) -> Result<Vec<Event>, StoreError> {
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            let body = row.get::<&str, _>("body");
            let kind = match body {
                FINISHED_STUB => match self.get_execution(subject).await? {
                    Some(record) => EventKind::Finished { execution: Box::new(record) },
                    None => return Err(StoreError::Missing(format!("the record of execution {subject}"))),
                },
                SESSION_FINISHED_STUB => match self.get_session(subject).await? {
                    Some(record) => EventKind::SessionFinished { session: Box::new(record) },
                    None => return Err(StoreError::Missing(format!("the record of session {subject}"))),
                },
                body => stored::event_from_stored(subject, row.get::<&str, _>("kind"), body)?,
            };
            events.push(Event {
                subject_id: subject.to_string(),
                sequence: row.get::<i64, _>("sequence") as u64,
                time_ms: row.get("time_ms"),
                kind,
            });
        }
        Ok(events)
    }
}

//! The store's executions: insert under a request id, update, finish (with the finished event and the hub report, in one transaction), read, list, count.

use super::*;

/// An execution's row as it ends, over (`$1` state, `$2` profile, `$3`
/// finished at, `$4` the stored record, `$5` its id).
const FINISH_UPDATE: &str =
    "UPDATE executions SET state = $1, profile_ref = $2, finished_at_ms = $3, record = $4 WHERE execution_id = $5";

/// [`Store::finish_execution`] on SQLite with no raw result and no report:
/// [`FINISH_UPDATE`] and the events (`$6`: their rows, `[]` for none).
static FINISH_SQLITE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| sqlite_transaction(&[&INSERT_EVENTS_SQLITE.replace("$1", "$6"), FINISH_UPDATE]));

impl Store {
    /// Inserts a new execution with its request digest. A request id its
    /// principal already used is not inserted again: the execution that holds
    /// it comes back as [`Inserted::Existing`], for the caller to compare
    /// digests.
    pub async fn insert_execution(&self, record: &ExecutionRecord, digest: &str) -> Result<Inserted, StoreError> {
        if insert_execution_on(&self.pool, record, digest, record.state, Some(&self.node)).await? {
            return Ok(Inserted::Created);
        }
        let (record, digest) = self.execution_holding(record).await?;
        Ok(Inserted::Existing { record, digest })
    }

    /// The execution that holds `record`'s request id (its principal's),
    /// with the digest of the request that created it.
    pub(super) async fn execution_holding(
        &self,
        record: &ExecutionRecord,
    ) -> Result<(Box<ExecutionRecord>, String), StoreError> {
        self.execution_of_request(&record.consumer.principal, &record.request_id)
            .await?
            .ok_or_else(|| StoreError::Missing(format!("the execution that holds request_id {}", record.request_id)))
    }

    /// The execution of `principal` that holds `request_id`, if one does,
    /// with the digest of the request that created it.
    pub async fn execution_of_request(
        &self,
        principal: &str,
        request_id: &str,
    ) -> Result<Option<(Box<ExecutionRecord>, String)>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {EXECUTION}, request_digest FROM executions WHERE principal = $1 AND request_id = $2"
        ))
        .bind(principal)
        .bind(request_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some((Box::new(execution_from_row(&row)?), row.get("request_digest"))))
    }

    /// How many of `ids` name an execution or a session of `principal`:
    /// of a repository's `refs/corral/<id>` refs, those its runs made.
    pub async fn count_owned(&self, principal: &str, ids: &[String]) -> Result<u64, StoreError> {
        let mut owned = 0;
        for chunk in ids.chunks(500) {
            let list = (0..chunk.len()).map(|i| format!("${}", i + 2)).collect::<Vec<_>>().join(", ");
            let sql = format!(
                "SELECT (SELECT count(*) FROM executions WHERE principal = $1 AND execution_id IN ({list})) \
                 + (SELECT count(*) FROM sessions WHERE principal = $1 AND session_id IN ({list}))"
            );
            let mut query = sqlx::query(&sql).bind(principal);
            for id in chunk {
                query = query.bind(id);
            }
            owned += query.fetch_one(&self.pool).await?.get::<i64, _>(0).max(0) as u64;
        }
        Ok(owned)
    }

    /// Stores the record as it now is, with no report, raw result or event
    /// (on a shared store, while it runs, in one fenced statement).
    pub async fn update_execution(&self, record: &ExecutionRecord) -> Result<(), StoreError> {
        if !self.shared || record.state.is_terminal() {
            return self.finish_execution(record, None, None, &[]).await;
        }
        let update = sqlx::query(FENCED_UPDATE_EXECUTION)
            .bind(record.state.as_str())
            .bind(stored::profile_column(record))
            .bind(record.finished_at_ms)
            .bind(stored::execution_to_stored(record)?)
            .bind(&record.execution_id);
        self.fenced_write(update).await
    }

    /// The final record, its hub report and its raw result, in one
    /// transaction: a report is never lost nor sent for an unrecorded end.
    ///
    /// With `finished` (the execution's `finished` event), that event is
    /// stored in the same transaction, without the record it carries: the
    /// record is this row, and reading the event back joins it (see
    /// [`FINISHED_STUB`]).
    pub async fn finish_execution(
        &self,
        record: &ExecutionRecord,
        report: Option<&str>,
        raw: Option<(&str, &str)>,
        events: &[Event],
    ) -> Result<(), StoreError> {
        // Nothing to keep for a run that said nothing: no row (reading it
        // back gives the same empty output and error).
        let raw = raw.filter(|(output, error)| !output.is_empty() || !error.is_empty());
        if !self.shared && raw.is_none() && report.is_none() {
            let batch = sqlx::query(&FINISH_SQLITE)
                .bind(record.state.as_str())
                .bind(stored::profile_column(record).to_string())
                .bind(record.finished_at_ms)
                .bind(stored::execution_to_stored(record)?)
                .bind(record.execution_id.clone());
            return self.run_sqlite_transaction(batch.bind(events_rows_json(events, true)?)).await;
        }
        let mut tx = self.pool.begin().await?;
        self.check_fence(&mut tx).await?;
        if !events.is_empty() {
            self.insert_events(&mut *tx, events, true).await?;
            self.notify_events(&mut tx, events).await?;
        }
        if let Some((output, error)) = raw {
            sqlx::query("INSERT INTO execution_raw (execution_id, output, error) VALUES ($1, $2, $3)")
                .bind(&record.execution_id)
                .bind(output)
                .bind(error)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(FINISH_UPDATE)
            .bind(record.state.as_str())
            .bind(stored::profile_column(record))
            .bind(record.finished_at_ms)
            .bind(stored::execution_to_stored(record)?)
            .bind(&record.execution_id)
            .execute(&mut *tx)
            .await?;
        // A run that ends frees a place in its principal's quota (and
        // maybe its node's): every node looks at the queue again.
        if self.shared && record.state.is_terminal() {
            sqlx::query("SELECT pg_notify('corral_queue', '')").execute(&mut *tx).await?;
        }
        if let Some(body) = report {
            let now = now_ms();
            sqlx::query(
                "INSERT INTO hub_outbox (id, subject_id, body, state, attempts, next_attempt_ms, created_at_ms, node)
                 VALUES ($1, $2, $3, 'pending', 0, $4, $5, $6)",
            )
            .bind(uuid::Uuid::now_v7().to_string())
            .bind(&record.execution_id)
            .bind(body)
            .bind(now)
            .bind(now)
            .bind(&self.node)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The execution with this id, if there is one.
    pub async fn get_execution(&self, id: &str) -> Result<Option<ExecutionRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {EXECUTION} FROM executions WHERE execution_id = $1"))
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(execution_from_row).transpose()
    }

    /// Newest first. Ids are UUIDv7, so id order is creation order. A
    /// profile filter is a pinned reference, or a bare id that matches
    /// every version of it: compared exactly (not with `LIKE`, whose `_`
    /// is a wildcard and which ignores ASCII case on SQLite).
    pub async fn list_executions(&self, filter: &ExecutionFilter) -> Result<Vec<ExecutionRecord>, StoreError> {
        let visible = visible_projects(filter.projects.as_deref(), 7);
        let sql = format!(
            "SELECT {EXECUTION} FROM executions
             WHERE ($1 = '' OR state = $1)
               AND ($2 = '' OR profile_ref = $2 OR substr(profile_ref, 1, length($2) + 1) = $2 || '@')
               AND ($3 = '' OR actor = $3)
               AND ($4 = '' OR project = $4)
               AND ($5 = '' OR execution_id < $5){visible}
             ORDER BY execution_id DESC LIMIT $6"
        );
        let mut query = sqlx::query(&sql)
            .bind(filter.state.map(|s| s.as_str()).unwrap_or(""))
            .bind(&filter.profile)
            .bind(&filter.actor)
            .bind(&filter.project)
            .bind(&filter.before_id)
            .bind(filter.limit as i64);
        for project in filter.projects.iter().flatten() {
            query = query.bind(project);
        }
        let rows = query.fetch_all(&self.reader).await?;
        rows.iter().map(execution_from_row).collect()
    }

    /// When an execution of `profile_ref` (pinned `id@version`) last
    /// succeeded, in ms since the epoch (one index lookup).
    pub async fn last_success(&self, profile_ref: &str) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query("SELECT MAX(finished_at_ms) FROM executions WHERE profile_ref = $1 AND state = $2")
            .bind(profile_ref)
            .bind(ExecutionState::Succeeded.as_str())
            .fetch_one(&self.reader)
            .await?;
        Ok(row.get::<Option<i64>, _>(0))
    }

    /// How many executions the store holds, finished or not.
    pub async fn count_executions(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) FROM executions").fetch_one(&self.reader).await?.get(0))
    }

    /// This daemon's executions still pending or running, in id order: what
    /// a restart must recover. Of this node; on SQLite (a fleet of one)
    /// also of no node (from before nodes) and not queued, never on a
    /// shared store, where such a row may be a live daemon's (one not yet
    /// upgraded) or wait in the queue for whichever node claims it.
    pub async fn unfinished_executions(&self) -> Result<Vec<ExecutionRecord>, StoreError> {
        let owner = match self.shared {
            true => "node = $1",
            false => "(node = $1 OR (node IS NULL AND execution_id NOT IN (SELECT execution_id FROM queue)))",
        };
        self.unfinished_executions_where(owner, &self.node).await
    }

    /// Executions still pending or running whose `owner` condition (on
    /// `node`, bound as `$1`) holds, in id order.
    pub(super) async fn unfinished_executions_where(
        &self,
        owner: &'static str,
        node: &str,
    ) -> Result<Vec<ExecutionRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {EXECUTION} FROM executions WHERE {UNFINISHED_EXECUTION} AND {owner} ORDER BY execution_id"
        ))
        .bind(node)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(execution_from_row).collect()
    }
}

/// Inserts `record` as `state`, of `node` (`None`: of no node yet, queued);
/// `false` when its principal already used its request id.
pub(super) async fn insert_execution_on<'c, E>(
    conn: E,
    record: &ExecutionRecord,
    digest: &str,
    state: ExecutionState,
    node: Option<&str>,
) -> Result<bool, StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    let request_id = (!record.request_id.is_empty()).then_some(record.request_id.as_str());
    let inserted = sqlx::query(
        "INSERT INTO executions (execution_id, request_id, request_digest, state, profile_ref, actor, project, created_at_ms, record, node, principal)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
         ON CONFLICT (principal, request_id) DO NOTHING",
    )
    .bind(&record.execution_id)
    .bind(request_id)
    // Only a repeated request id compares digests.
    .bind(if request_id.is_some() { digest } else { "" })
    .bind(state.as_str())
    .bind(stored::profile_column(record))
    .bind(&record.consumer.actor)
    .bind(&record.consumer.project)
    .bind(record.created_at_ms)
    .bind(stored::execution_to_stored(record)?)
    .bind(node)
    // Request ids are unique per principal, not across the daemon.
    .bind(&record.consumer.principal)
    .execute(conn)
    .await?;
    Ok(inserted.rows_affected() == 1)
}

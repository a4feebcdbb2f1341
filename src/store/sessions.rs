//! The store's sessions: insert, update, finish, read, list.

use super::*;

impl Store {
    /// Inserts a new session; `false` when the id is taken. On a shared
    /// store only while this start holds its node (`Fenced` otherwise): a
    /// lost epoch's session would be failed by no sweep.
    pub async fn insert_session(&self, record: &SessionRecord) -> Result<bool, StoreError> {
        if !self.shared {
            return insert_session_on(&self.pool, record, &self.node).await;
        }
        let mut tx = self.pool.begin().await?;
        self.check_fence(&mut tx).await?;
        let inserted = insert_session_on(&mut *tx, record, &self.node).await?;
        if inserted {
            tx.commit().await?;
        }
        Ok(inserted)
    }

    /// Withdraws request `id` (one forwarded to another node, which gave
    /// no answer in time) while no node has taken it: `true` when it was still pending, so no
    /// node will ever act on it; `false` when a node took or answered it.
    pub async fn withdraw_request(&self, id: &str) -> Result<bool, StoreError> {
        let withdrawn = sqlx::query(
            "UPDATE node_requests SET state = 'done', error = 'withdrawn by its sender' WHERE id = $1 AND state = 'pending'",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(withdrawn.rows_affected() == 1)
    }

    /// Stores the session's record as it now is.
    pub async fn update_session(&self, record: &SessionRecord) -> Result<(), StoreError> {
        if !self.shared {
            return update_session_on(&self.pool, record).await;
        }
        let mut tx = self.pool.begin().await?;
        self.check_fence(&mut tx).await?;
        update_session_on(&mut *tx, record).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The session's final record and its `finished` event (stored as its
    /// stub, see [`FINISHED_STUB`]), in one transaction.
    pub async fn finish_session(&self, record: &SessionRecord, events: &[Event]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        self.check_fence(&mut tx).await?;
        self.insert_events(&mut *tx, events, true).await?;
        self.notify_events(&mut tx, events).await?;
        update_session_on(&mut *tx, record).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The session with this id, if there is one.
    pub async fn get_session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let row = sqlx::query("SELECT record FROM sessions WHERE session_id = $1")
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.map(|r| serde_json::from_str(r.get::<&str, _>("record")).map_err(Into::into)).transpose()
    }

    /// Sessions in id order after `after_id`, in `projects` only (`None`:
    /// every project). The filter is in the query, so a page holds only
    /// what the caller may see and its cursor is one of them.
    pub async fn list_sessions(
        &self,
        after_id: &str,
        limit: u32,
        projects: Option<&[String]>,
    ) -> Result<Vec<SessionRecord>, StoreError> {
        let visible = visible_projects(projects, 3);
        let sql = format!("SELECT record FROM sessions WHERE session_id > $1{visible} ORDER BY session_id LIMIT $2");
        let mut query = sqlx::query(&sql).bind(after_id).bind(limit as i64);
        for project in projects.into_iter().flatten() {
            query = query.bind(project);
        }
        let rows = query.fetch_all(&self.reader).await?;
        rows.iter().map(|r| serde_json::from_str(r.get::<&str, _>("record")).map_err(Into::into)).collect()
    }

    /// This daemon's sessions still starting or active, in id order: what a
    /// restart must recover. Of this node; on SQLite (a fleet of one) also
    /// of no node (from before nodes), never on a shared store, where such
    /// a row may be a live daemon's (one not yet upgraded).
    pub async fn unfinished_sessions(&self) -> Result<Vec<SessionRecord>, StoreError> {
        let owner = if self.shared { "node = $1" } else { "(node = $1 OR node IS NULL)" };
        self.unfinished_sessions_where(owner, &self.node).await
    }

    /// Sessions still starting or active whose `owner` condition (on
    /// `node`, bound as `$1`) holds, in id order.
    pub(super) async fn unfinished_sessions_where(
        &self,
        owner: &'static str,
        node: &str,
    ) -> Result<Vec<SessionRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT record FROM sessions WHERE {UNFINISHED_SESSION} AND {owner} ORDER BY session_id"
        ))
        .bind(node)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| serde_json::from_str(r.get::<&str, _>("record")).map_err(Into::into)).collect()
    }
}

/// Inserts `record` as a session of `node`; `false` when its id is taken.
pub(super) async fn insert_session_on<'c, E>(conn: E, record: &SessionRecord, node: &str) -> Result<bool, StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    let result = sqlx::query(
        "INSERT INTO sessions (session_id, state, profile_ref, actor, project, created_at_ms, record, node, principal)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&record.session_id)
    .bind(record.state.as_str())
    .bind(&record.profile_ref)
    .bind(&record.consumer.actor)
    .bind(&record.consumer.project)
    .bind(record.created_at_ms)
    .bind(stored::to_stored(record)?)
    .bind(node)
    .bind(&record.consumer.principal)
    .execute(conn)
    .await;
    match result {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

//! The record: executions, sessions, their events, the sandboxes the daemon
//! owns and the hub outbox. SQLite (WAL) in the data directory by default;
//! PostgreSQL when `store.url` says so, so that several daemons share one
//! record. The SQL is written once for both (`$N` placeholders, portable
//! types); migrations are versioned and run on start. Everything is written
//! here before it is announced.

use std::path::Path;

use sqlx::any::AnyPoolOptions;
use sqlx::migrate::Migrator;
use sqlx::AnyPool;
use sqlx::{Executor, Row};

use crate::records::{now_ms, ExecutionRecord, ExecutionState, SessionRecord};
use crate::records::{Event, EventKind};
use crate::sandbox::SandboxState;

mod stored;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Database(#[from] sqlx::Error),
    #[error("store migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("store encoding: {0}")]
    Encoding(#[from] serde_json::Error),
    #[error("store: {0} is missing")]
    Missing(String),
}

/// The result of inserting an execution under a request id.
#[derive(Debug)]
pub enum Inserted {
    Created,
    /// The request id was taken; here is the execution that holds it.
    Existing {
        record: Box<ExecutionRecord>,
        digest: String,
    },
}

#[derive(Clone, Debug, Default)]
pub struct ExecutionFilter {
    pub state: Option<ExecutionState>,
    pub profile: String,
    pub actor: String,
    pub project: String,
    /// Only executions whose id sorts before this one (the page token).
    pub before_id: String,
    /// Only these projects (the caller's); `None`: all.
    pub projects: Option<Vec<String>>,
    pub limit: u32,
}

/// A hub report waiting in the outbox.
#[derive(Clone, Debug)]
pub struct OutboxRow {
    pub id: String,
    pub subject_id: String,
    pub body: String,
    pub attempts: u32,
    pub created_at_ms: i64,
}

/// A sandbox as recorded before it was created.
#[derive(Clone, Debug)]
pub struct SandboxRow {
    pub sandbox_id: String,
    pub subject_id: String,
    pub backend: String,
    pub root_path: std::path::PathBuf,
    /// The host uid it held, if it had its own.
    pub uid: Option<u32>,
}

#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    /// Who this daemon is in a shared store: recovery only touches its own.
    node: String,
    shared: bool,
}

static SHARED_MIGRATIONS: Migrator = sqlx::migrate!("./migrations");
static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("./migrations/sqlite");

/// The shared migrations, plus SQLite's own on SQLite: one sequence of
/// versions, so each store's history is checked whole (a version this
/// binary does not know is an error).
fn migrator(sqlite: bool) -> Migrator {
    let mut migrations = SHARED_MIGRATIONS.migrations.to_vec();
    if sqlite {
        migrations.extend(SQLITE_MIGRATIONS.migrations.iter().cloned());
        migrations.sort_by_key(|m| m.version);
    }
    Migrator { migrations: migrations.into(), ..Migrator::DEFAULT }
}

impl Store {
    /// Opens the store: `url` (a `postgres://` URL) or, without one,
    /// `corral.db` in `data_dir`; then runs the migrations. `node` names
    /// this daemon in a shared store.
    pub async fn open(data_dir: &Path, url: Option<&str>, node: &str) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let sqlite = url.is_none();
        let url = match url {
            Some(url) => url.to_string(),
            None => format!("sqlite://{}?mode=rwc", data_dir.join("corral.db").display()),
        };
        let pool = AnyPoolOptions::new()
            .max_connections(if sqlite { 4 } else { 16 })
            // A SQLite connection is a file in this process: pinging it
            // before every use would be one more hand-off to its worker
            // thread per query, for nothing. A PostgreSQL one may have died.
            .test_before_acquire(!sqlite)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if sqlite {
                        // Under WAL, NORMAL is durable across process crashes;
                        // only an OS crash can lose the last commits.
                        conn.execute(
                            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 10000;",
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        migrator(sqlite).run(&pool).await?;
        Ok(Store { pool, node: node.to_string(), shared: !sqlite })
    }

    /// Whether other daemons may write to this store (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    pub async fn insert_execution(&self, record: &ExecutionRecord, digest: &str) -> Result<Inserted, StoreError> {
        let request_id = (!record.request_id.is_empty()).then_some(record.request_id.as_str());
        let result = sqlx::query(
            "INSERT INTO executions (execution_id, request_id, request_digest, state, profile_ref, actor, project, created_at_ms, record, node, principal)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(&record.execution_id)
        .bind(request_id)
        // Only a repeated request id compares digests.
        .bind(if request_id.is_some() { digest } else { "" })
        .bind(record.state.as_str())
        .bind(&record.harness_profile_ref)
        .bind(&record.consumer.actor)
        .bind(&record.consumer.project)
        .bind(record.created_at_ms)
        .bind(stored::execution_to_stored(record)?)
        .bind(&self.node)
        // Request ids are unique per principal, not across the daemon.
        .bind(&record.consumer.principal)
        .execute(&self.pool)
        .await;
        match result {
            Ok(_) => Ok(Inserted::Created),
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() && request_id.is_some() => {
                let row = sqlx::query(&format!(
                    "SELECT {EXECUTION}, request_digest FROM executions WHERE principal = $1 AND request_id = $2"
                ))
                .bind(&record.consumer.principal)
                .bind(request_id)
                .fetch_one(&self.pool)
                .await?;
                let record = execution_from_row(&row)?;
                Ok(Inserted::Existing { record: Box::new(record), digest: row.get("request_digest") })
            }
            Err(e) => Err(e.into()),
        }
    }

    pub async fn update_execution(&self, record: &ExecutionRecord) -> Result<(), StoreError> {
        self.finish_execution(record, None, None, None).await
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
        finished: Option<&Event>,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        if let Some(event) = finished {
            self.insert_events(&mut *tx, std::slice::from_ref(event), true).await?;
        }
        // Nothing to keep for a run that said nothing: no row (reading it
        // back gives the same empty output and error).
        if let Some((output, error)) = raw.filter(|(output, error)| !output.is_empty() || !error.is_empty()) {
            sqlx::query("INSERT INTO execution_raw (execution_id, output, error) VALUES ($1, $2, $3)")
                .bind(&record.execution_id)
                .bind(output)
                .bind(error)
                .execute(&mut *tx)
                .await?;
        }
        let profile = if record.evidence.profile_ref.is_empty() {
            &record.harness_profile_ref
        } else {
            &record.evidence.profile_ref
        };
        sqlx::query(
            "UPDATE executions SET state = $1, profile_ref = $2, finished_at_ms = $3, record = $4 WHERE execution_id = $5",
        )
        .bind(record.state.as_str())
        .bind(profile)
        .bind(record.finished_at_ms)
        .bind(stored::execution_to_stored(record)?)
        .bind(&record.execution_id)
        .execute(&mut *tx)
        .await?;
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

    pub async fn due_reports(&self, now: i64, limit: u32) -> Result<Vec<OutboxRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, subject_id, body, attempts, created_at_ms FROM hub_outbox
             WHERE state = 'pending' AND next_attempt_ms <= $1 AND (node = $3 OR node IS NULL)
             ORDER BY next_attempt_ms LIMIT $2",
        )
        .bind(now)
        .bind(limit as i64)
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| OutboxRow {
                id: r.get(0),
                subject_id: r.get(1),
                body: r.get(2),
                attempts: r.get::<i64, _>(3) as u32,
                created_at_ms: r.get(4),
            })
            .collect())
    }

    pub async fn retry_report(&self, id: &str, attempts: u32, next_attempt_ms: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE hub_outbox SET attempts = $1, next_attempt_ms = $2 WHERE id = $3")
            .bind(attempts as i64)
            .bind(next_attempt_ms)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Ends a report's life (accepted or given up) and records that on the
    /// execution, in one transaction.
    pub async fn settle_report(
        &self,
        id: &str,
        execution_id: &str,
        status: crate::types::evidence::HubReportStatus,
        attempts: u32,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let state = if status == crate::types::evidence::HubReportStatus::Accepted { "accepted" } else { "failed" };
        sqlx::query("UPDATE hub_outbox SET state = $1, attempts = $2 WHERE id = $3")
            .bind(state)
            .bind(attempts as i64)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(&format!("SELECT {EXECUTION} FROM executions WHERE execution_id = $1"))
            .bind(execution_id)
            .fetch_optional(&mut *tx)
            .await?;
        if let Some(row) = row {
            let mut record = execution_from_row(&row)?;
            record.evidence.hub_report_status = status;
            sqlx::query("UPDATE executions SET record = $1 WHERE execution_id = $2")
                .bind(stored::execution_to_stored(&record)?)
                .bind(execution_id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn get_execution(&self, id: &str) -> Result<Option<ExecutionRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {EXECUTION} FROM executions WHERE execution_id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(execution_from_row).transpose()
    }

    /// Newest first. Ids are UUIDv7, so id order is creation order.
    pub async fn list_executions(&self, filter: &ExecutionFilter) -> Result<Vec<ExecutionRecord>, StoreError> {
        let visible = visible_projects(filter.projects.as_deref(), 7);
        let sql = format!(
            "SELECT {EXECUTION} FROM executions
             WHERE ($1 = '' OR state = $1)
               AND ($2 = '' OR profile_ref = $2 OR profile_ref LIKE $2 || '@%')
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
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter().map(execution_from_row).collect()
    }

    /// When an execution of `profile_ref` (pinned `id@version`) last
    /// succeeded, in ms since the epoch (one index lookup).
    pub async fn last_success(&self, profile_ref: &str) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query("SELECT MAX(finished_at_ms) FROM executions WHERE profile_ref = $1 AND state = $2")
            .bind(profile_ref)
            .bind(ExecutionState::Succeeded.as_str())
            .fetch_one(&self.pool)
            .await?;
        Ok(row.get::<Option<i64>, _>(0))
    }

    pub async fn count_executions(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) FROM executions").fetch_one(&self.pool).await?.get(0))
    }

    /// Rows of every table a request can add to: executions, sessions,
    /// events, sandboxes, raw results, the hub outbox (for tests and
    /// diagnostics).
    pub async fn row_counts(&self) -> Result<[(&'static str, i64); 6], StoreError> {
        let mut counts = [
            ("executions", 0),
            ("sessions", 0),
            ("events", 0),
            ("sandboxes", 0),
            ("execution_raw", 0),
            ("hub_outbox", 0),
        ];
        for (table, count) in &mut counts {
            *count = sqlx::query(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&self.pool).await?.get(0);
        }
        Ok(counts)
    }

    /// Stores several events in one statement.
    pub async fn append_events(&self, events: &[Event]) -> Result<(), StoreError> {
        self.insert_events(&self.pool, events, false).await
    }

    /// Inserts `events` with one statement on `conn` (the pool, or a
    /// transaction's connection); with `stub_finished`, a `finished` event
    /// is stored as its stub (only when its record is written in the same
    /// transaction).
    async fn insert_events<'c, E>(&self, conn: E, events: &[Event], stub_finished: bool) -> Result<(), StoreError>
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
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get::<i64, _>(0) as u64, r.get::<String, _>(1), r.get::<&str, _>(2).len())).collect())
    }

    /// The lowest sequence still stored for a subject.
    pub async fn oldest_sequence(&self, subject: &str) -> Result<Option<u64>, StoreError> {
        let row = sqlx::query("SELECT MIN(sequence) FROM events WHERE subject_id = $1")
            .bind(subject)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.get::<Option<i64>, _>(0).map(|s| s as u64))
    }

    /// Compacts executions finished before `cutoff_ms` to their record: all
    /// their events but the last (`finished`, which carries the record and
    /// evidence) are deleted. Returns how many events went.
    /// The raw output and error of a finished execution, if kept.
    pub async fn get_raw(&self, execution_id: &str) -> Result<Option<(String, String)>, StoreError> {
        let row = sqlx::query("SELECT output, error FROM execution_raw WHERE execution_id = $1")
            .bind(execution_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

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
        .fetch_all(&self.pool)
        .await?;
        self.events_from_rows(subject, &rows).await
    }

    /// The stored events of a subject after `after`, in order.
    pub async fn events_after(&self, subject: &str, after: u64) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(
            "SELECT sequence, time_ms, kind, body FROM events WHERE subject_id = $1 AND sequence > $2 ORDER BY sequence",
        )
        .bind(subject)
        .bind(sequence(after))
        .fetch_all(&self.pool)
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

    /// Inserts a new session; `false` when the id is taken.
    pub async fn insert_session(&self, record: &SessionRecord) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO sessions (session_id, state, profile_ref, actor, project, created_at_ms, record, node)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&record.session_id)
        .bind(record.state.as_str())
        .bind(&record.profile_ref)
        .bind(&record.consumer.actor)
        .bind(&record.consumer.project)
        .bind(record.created_at_ms)
        .bind(stored::to_stored(record)?)
        .bind(&self.node)
        .execute(&self.pool)
        .await;
        match result {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn update_session(&self, record: &SessionRecord) -> Result<(), StoreError> {
        update_session_on(&self.pool, record).await
    }

    /// The session's final record and its `finished` event (stored as its
    /// stub, see [`FINISHED_STUB`]), in one transaction.
    pub async fn finish_session(&self, record: &SessionRecord, finished: &Event) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        self.insert_events(&mut *tx, std::slice::from_ref(finished), true).await?;
        update_session_on(&mut *tx, record).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn get_session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let row = sqlx::query("SELECT record FROM sessions WHERE session_id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
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
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter().map(|r| serde_json::from_str(r.get::<&str, _>("record")).map_err(Into::into)).collect()
    }

    /// Records the intent to create a sandbox, before the backend acts.
    pub async fn insert_sandbox(
        &self,
        sandbox_id: &str,
        subject_id: &str,
        backend: &str,
        root: &Path,
        epoch: &str,
    ) -> Result<(), StoreError> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO sandboxes (sandbox_id, subject_id, backend, state, root_path, instance_epoch, created_at_ms, updated_at_ms, node)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(sandbox_id)
        .bind(subject_id)
        .bind(backend)
        .bind(SandboxState::Creating.as_str())
        .bind(root.to_string_lossy().as_ref())
        .bind(epoch)
        .bind(now)
        .bind(now)
        .bind(&self.node)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records a sandbox's state. A destroyed sandbox (nothing of it
    /// alive) gives its uid back and needs no row any more (the record
    /// keeps its id). The uid goes first: a crash between the two leaves a
    /// row that the next start's recovery destroys again, which is a no-op.
    pub async fn set_sandbox_state(&self, sandbox_id: &str, state: SandboxState) -> Result<(), StoreError> {
        if state == SandboxState::Destroyed {
            // Remembered, so allocation hands it out again as late as it can.
            sqlx::query(
                "INSERT INTO sandbox_uid_released (node, uid, released_at_ms)
                 SELECT node, uid, $3 FROM sandbox_uids WHERE sandbox_id = $1 AND node = $2
                 ON CONFLICT (node, uid) DO UPDATE SET released_at_ms = excluded.released_at_ms",
            )
            .bind(sandbox_id)
            .bind(&self.node)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
            sqlx::query("DELETE FROM sandbox_uids WHERE sandbox_id = $1 AND node = $2")
                .bind(sandbox_id)
                .bind(&self.node)
                .execute(&self.pool)
                .await?;
            sqlx::query("DELETE FROM sandboxes WHERE sandbox_id = $1").bind(sandbox_id).execute(&self.pool).await?;
            return Ok(());
        }
        sqlx::query("UPDATE sandboxes SET state = $1, updated_at_ms = $2 WHERE sandbox_id = $3")
            .bind(state.as_str())
            .bind(now_ms())
            .bind(sandbox_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Reserves a host uid in `first..=last` for `sandbox_id` on this node,
    /// one no live sandbox holds and `usable` accepts (the daemon skips uids
    /// that have live processes): the lowest never used, else the one
    /// released longest ago. A uid thus goes around the whole range before
    /// it is used again, so what one tenant might have left under it (and
    /// teardown missed) is not the next tenant's. `None` when none is free.
    pub async fn allocate_uid(
        &self,
        first: u32,
        last: u32,
        sandbox_id: &str,
        usable: impl Fn(u32) -> bool,
    ) -> Result<Option<u32>, StoreError> {
        // A concurrent allocation may take a candidate first; the primary
        // key makes one of the two inserts a no-op, and the loser goes on
        // to the next free uid.
        let used: std::collections::BTreeSet<i64> =
            sqlx::query("SELECT uid FROM sandbox_uids WHERE node = $1 ORDER BY uid")
                .bind(&self.node)
                .fetch_all(&self.pool)
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
        let mut released: Vec<(i64, i64)> = sqlx::query(
            "SELECT uid, released_at_ms FROM sandbox_uid_released WHERE node = $1 AND uid >= $2 AND uid <= $3",
        )
        .bind(&self.node)
        .bind(first as i64)
        .bind(last as i64)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
        released.sort_by_key(|&(uid, at)| (at, uid));
        let once: std::collections::HashSet<i64> = released.iter().map(|&(uid, _)| uid).collect();
        let never = (first as i64..=last as i64).filter(|u| !once.contains(u));
        let candidates = never.chain(released.into_iter().map(|(uid, _)| uid));
        for uid in candidates.filter(|u| !used.contains(u)) {
            if !usable(uid as u32) {
                continue;
            }
            let inserted = sqlx::query(
                "INSERT INTO sandbox_uids (node, uid, sandbox_id) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            )
            .bind(&self.node)
            .bind(uid)
            .bind(sandbox_id)
            .execute(&self.pool)
            .await?;
            if inserted.rows_affected() == 1 {
                return Ok(Some(uid as u32));
            }
        }
        Ok(None)
    }

    /// The uid a sandbox holds, if any.
    pub async fn sandbox_uid(&self, sandbox_id: &str) -> Result<Option<u32>, StoreError> {
        let row = sqlx::query("SELECT uid FROM sandbox_uids WHERE sandbox_id = $1 AND node = $2")
            .bind(sandbox_id)
            .bind(&self.node)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.get::<i64, _>(0) as u32))
    }

    /// Sandboxes an earlier instance of this node did not finish
    /// destroying: rows of other nodes, or of no node, are never this
    /// daemon's to destroy (see [`Store::foreign_leftover_sandboxes`]).
    pub async fn leftover_sandboxes(&self, current_epoch: &str) -> Result<Vec<SandboxRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT s.sandbox_id, s.subject_id, s.backend, s.root_path, u.uid FROM sandboxes s
             LEFT JOIN sandbox_uids u ON u.sandbox_id = s.sandbox_id AND u.node = s.node
             WHERE s.state NOT IN ('destroyed') AND s.instance_epoch != $1 AND s.node = $2
             ORDER BY s.created_at_ms",
        )
        .bind(current_epoch)
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| SandboxRow {
                sandbox_id: r.get(0),
                subject_id: r.get(1),
                backend: r.get(2),
                root_path: r.get::<String, _>(3).into(),
                uid: r.get::<Option<i64>, _>(4).map(|u| u as u32),
            })
            .collect())
    }

    /// How many leftover sandbox rows belong to another node or to none:
    /// recovery leaves them alone and says so.
    pub async fn foreign_leftover_sandboxes(&self, current_epoch: &str) -> Result<i64, StoreError> {
        let row = sqlx::query(
            "SELECT COUNT(*) FROM sandboxes
             WHERE state NOT IN ('destroyed') AND instance_epoch != $1 AND (node IS NULL OR node != $2)",
        )
        .bind(current_epoch)
        .bind(&self.node)
        .fetch_one(&self.pool)
        .await?;
        Ok(row.get(0))
    }

    pub async fn unfinished_executions(&self) -> Result<Vec<ExecutionRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {EXECUTION} FROM executions WHERE state IN ('pending', 'running') AND (node = $1 OR node IS NULL)
             ORDER BY execution_id"
        ))
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(execution_from_row).collect()
    }

    pub async fn unfinished_sessions(&self) -> Result<Vec<SessionRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT record FROM sessions WHERE state IN ('starting', 'active') AND (node = $1 OR node IS NULL)
             ORDER BY session_id",
        )
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| serde_json::from_str(r.get::<&str, _>("record")).map_err(Into::into)).collect()
    }

    /// Sandbox rows by state, as `(sandbox_id, subject_id, state)`.
    pub async fn sandboxes(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        let rows = sqlx::query("SELECT sandbox_id, subject_id, state FROM sandboxes ORDER BY created_at_ms")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect())
    }
}

/// The stored body of a `finished` event written with its subject's final
/// record (one transaction): the record is not repeated in the event, and
/// reading the event back ([`Store::events_after`]) puts the subject's
/// record back in. A replayed `finished` therefore carries the record as it
/// is now (e.g. with the hub report's final status).
const FINISHED_STUB: &str = r#"{"kind":"finished"}"#;
const SESSION_FINISHED_STUB: &str = r#"{"kind":"session_finished"}"#;

/// Inserts a batch of events in one statement, whatever its size: the rows
/// travel as one JSON array parameter (`[[subject, sequence, time, kind,
/// body], ...]`), so a batch is one hand-off to the database (a statement
/// is atomic on its own: no BEGIN/COMMIT round trips) and one cached
/// prepared statement serves every batch size.
const INSERT_EVENTS_SQLITE: &str = "INSERT INTO events (subject_id, sequence, time_ms, kind, body)
     SELECT e.value ->> 0, e.value ->> 1, e.value ->> 2, e.value ->> 3, e.value ->> 4 FROM json_each($1) AS e";
const INSERT_EVENTS_POSTGRES: &str = "INSERT INTO events (subject_id, sequence, time_ms, kind, body)
     SELECT e ->> 0, (e ->> 1)::BIGINT, (e ->> 2)::BIGINT, e ->> 3, e ->> 4 FROM json_array_elements($1::json) AS e";

/// The rows of [`INSERT_EVENTS_SQLITE`] as its JSON parameter; with
/// `stub_finished`, `finished` events as their stubs.
fn events_rows_json(events: &[Event], stub_finished: bool) -> Result<String, StoreError> {
    let mut rows = Vec::with_capacity(events.len());
    for event in events {
        let body = match &event.kind {
            EventKind::Finished { .. } if stub_finished => FINISHED_STUB.to_string(),
            EventKind::SessionFinished { .. } if stub_finished => SESSION_FINISHED_STUB.to_string(),
            kind => stored::event_body(&event.subject_id, kind)?,
        };
        rows.push((event.subject_id.as_str(), sequence(event.sequence), event.time_ms, event.kind.name(), body));
    }
    Ok(serde_json::to_string(&rows)?)
}

/// The `AND project IN (...)` clause that keeps a listing to the caller's
/// `projects` (`None`: every project), the projects bound as parameters
/// from `$first` on, never as text.
fn visible_projects(projects: Option<&[String]>, first: usize) -> String {
    match projects {
        None => String::new(),
        Some([]) => " AND 1 = 0".to_string(),
        Some(projects) => {
            let marks: Vec<String> = (0..projects.len()).map(|i| format!("${}", first + i)).collect();
            format!(" AND project IN ({})", marks.join(", "))
        }
    }
}

/// Writes a session's record (and its state) on `conn`.
async fn update_session_on<'c, E>(conn: E, record: &SessionRecord) -> Result<(), StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    sqlx::query("UPDATE sessions SET state = $1, record = $2 WHERE session_id = $3")
        .bind(record.state.as_str())
        .bind(stored::to_stored(record)?)
        .bind(&record.session_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// The columns an execution is read from: its record, and the fields of
/// the record that have columns of their own (see
/// [`stored::execution_to_stored`]).
const EXECUTION: &str = "execution_id, state, created_at_ms, finished_at_ms, record";

/// An execution read back from [`EXECUTION`]'s columns. A record stored
/// by an older daemon repeats the columns (and from before
/// `finished_at_ms` had a column, holds it alone), so a missing column
/// value keeps the record's.
fn execution_from_row(row: &sqlx::any::AnyRow) -> Result<ExecutionRecord, StoreError> {
    let mut record: ExecutionRecord = serde_json::from_str(row.get::<&str, _>("record"))?;
    record.execution_id = row.get("execution_id");
    if let Some(state) = ExecutionState::parse(row.get::<&str, _>("state")) {
        record.state = state;
    }
    record.created_at_ms = row.get("created_at_ms");
    if let Some(ms) = row.get::<Option<i64>, _>("finished_at_ms") {
        record.finished_at_ms = Some(ms);
    }
    // An execution is its own run.
    if record.consumer.run_id.is_empty() {
        record.consumer.run_id = record.execution_id.clone();
    }
    Ok(record)
}

/// A sequence number as the store keeps it (BIGINT): one past `i64::MAX`
/// is no different from it, since no event has such a sequence.
fn sequence(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_travels_as_one_json_array_of_rows() {
        let event = |sequence, kind| Event { subject_id: "s1".into(), sequence, time_ms: 7, kind };
        let events = [
            event(1, EventKind::Dispatched { tool: "run_task".into() }),
            event(2, EventKind::Reaped { idle_seconds: 3 }),
        ];
        assert_eq!(
            events_rows_json(&events, true).unwrap(),
            r#"[["s1",1,7,"dispatched","{\"tool\":\"run_task\"}"],["s1",2,7,"reaped","{\"idle_seconds\":3}"]]"#
        );
    }

    /// A record's own columns are not repeated in its stored JSON; one
    /// stored with them (by an older daemon, `finished_at_ms` in the JSON
    /// alone) reads as it was.
    #[tokio::test]
    async fn a_record_is_read_from_its_columns_and_its_json_in_either_form() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let mut record = ExecutionRecord {
            execution_id: "e1".into(),
            consumer: crate::sandbox::Consumer { run_id: "e1".into(), ..Default::default() },
            state: ExecutionState::Succeeded,
            title: "t".into(),
            created_at_ms: 5,
            finished_at_ms: Some(9),
            ..Default::default()
        };
        assert!(matches!(store.insert_execution(&record, "d").await.unwrap(), Inserted::Created));
        store.update_execution(&record).await.unwrap();
        let json: String = sqlx::query("SELECT record FROM executions").fetch_one(&store.pool).await.unwrap().get(0);
        let stored: serde_json::Value = serde_json::from_str(&json).unwrap();
        for column in stored::EXECUTION_COLUMNS {
            assert!(stored.get(column).is_none(), "{column} repeated in {json}");
        }
        assert_eq!(stored["title"], "t");
        assert!(stored["consumer"].get("run_id").is_none(), "{json}");
        assert_eq!(store.get_execution("e1").await.unwrap().unwrap(), record);

        record.execution_id = "e2".into();
        record.consumer.run_id = "e2".into();
        let old = serde_json::to_string(&record).unwrap();
        sqlx::query(
            "INSERT INTO executions (execution_id, request_digest, state, profile_ref, actor, project, created_at_ms, record)
             VALUES ('e2', '', 'succeeded', '', '', '', 5, $1)",
        )
        .bind(old)
        .execute(&store.pool)
        .await
        .unwrap();
        assert_eq!(store.get_execution("e2").await.unwrap().unwrap(), record);
        store.close().await;
    }

    /// A store made before SQLite's own migrations keeps its events (in
    /// their old form) when the daemon that has them opens it.
    #[tokio::test]
    async fn an_older_sqlite_store_keeps_its_events_through_the_rowid_migration() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("corral.db").display());
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
        SHARED_MIGRATIONS.run(&pool).await.unwrap();
        sqlx::query(r#"INSERT INTO events VALUES ('s1', 1, 7, 'dispatched', '{"kind":"dispatched","tool":"t"}')"#)
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;

        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let events = store.events_after("s1", 0).await.unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, EventKind::Dispatched { tool: "t".into() });
        let schema: String = sqlx::query("SELECT sql FROM sqlite_schema WHERE name = 'events'")
            .fetch_one(&store.pool)
            .await
            .unwrap()
            .get(0);
        assert!(schema.contains("WITHOUT ROWID"), "{schema}");
        // And once more: nothing left to apply, nothing unknown.
        store.close().await;
        Store::open(dir.path(), None, "n").await.unwrap().close().await;
    }

    #[test]
    fn the_finished_stubs_are_what_the_events_serialise_to_without_their_record() {
        // A stub must never collide with a full body: a full `finished`
        // always has its record.
        assert_eq!(serde_json::from_str::<serde_json::Value>(FINISHED_STUB).unwrap()["kind"], "finished");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(SESSION_FINISHED_STUB).unwrap()["kind"],
            "session_finished"
        );
        assert!(serde_json::from_str::<EventKind>(FINISHED_STUB).is_err(), "a stub alone is not an event");
    }
}

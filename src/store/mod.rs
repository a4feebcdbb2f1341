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

mod events;
mod executions;
mod nodes;
mod outbox;
mod queue;
mod sandboxes;
mod sessions;
mod stored;

pub use nodes::{NodeRequest, NodeRow, NodeState, TakenOver};
pub use queue::{Admit, Claimed, Enqueued, QueuedWork, SessionInsert};
pub use sandboxes::NewSandbox;

/// Why a store operation failed. Every variant means the record could not be
/// read or written as asked; the operation did not take effect.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed the query, or could not be reached.
    #[error("store: {0}")]
    Database(#[from] sqlx::Error),
    /// The migrations could not run: a failed migration, or a store with a
    /// version this binary does not know.
    #[error("store migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A stored record or event could not be encoded or decoded.
    #[error("store encoding: {0}")]
    Encoding(#[from] serde_json::Error),
    /// A row the operation needs is not there (e.g. the record a stored
    /// `finished` event points to).
    #[error("store: {0} is missing")]
    Missing(String),
    /// This node was declared lost (or started again elsewhere): it owns
    /// no run any more and may not write to one.
    #[error("store: node {node} (epoch {epoch}) is fenced: it was declared lost")]
    Fenced {
        /// The node's name.
        node: String,
        /// The start that is fenced.
        epoch: String,
    },
}

/// The result of inserting an execution under a request id.
#[derive(Debug)]
pub enum Inserted {
    /// The execution was inserted.
    Created,
    /// The request id was taken; here is the execution that holds it.
    Existing {
        /// The execution that holds the request id.
        record: Box<ExecutionRecord>,
        /// The digest of the request that created it.
        digest: String,
    },
}

/// What to list: every empty or `None` field matches everything.
#[derive(Clone, Debug, Default)]
pub struct ExecutionFilter {
    /// Only executions in this state.
    pub state: Option<ExecutionState>,
    /// Only executions of this profile: `id@version`, or a bare `id` for any
    /// version.
    pub profile: String,
    /// Only executions of this actor.
    pub actor: String,
    /// Only executions of this project.
    pub project: String,
    /// Only executions whose id sorts before this one (the page token).
    pub before_id: String,
    /// Only these projects (the caller's); `None`: all.
    pub projects: Option<Vec<String>>,
    /// At most this many executions.
    pub limit: u32,
}

/// A hub report waiting in the outbox.
#[derive(Clone, Debug)]
pub struct OutboxRow {
    /// The report's id.
    pub id: String,
    /// The execution the report is about.
    pub subject_id: String,
    /// The report as it is POSTed (a CloudEvents JSON envelope).
    pub body: String,
    /// How many deliveries were tried so far.
    pub attempts: u32,
    /// When the report was stored, in Unix milliseconds; it is given up
    /// `max_age_seconds` later.
    pub created_at_ms: i64,
}

/// A sandbox as recorded before it was created.
#[derive(Clone, Debug)]
pub struct SandboxRow {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The execution or session it was created for.
    pub subject_id: String,
    /// The backend that creates it (`linux_bwrap`, `none`).
    pub backend: String,
    /// Its root directory on the host.
    pub root_path: std::path::PathBuf,
    /// The host uid it held, if it had its own.
    pub uid: Option<u32>,
    /// Its run had begun tearing it down (stored `destroying`, see
    /// `lifecycle::core`): the run got as far as its teardown.
    pub destroying: bool,
}

/// The daemon's record, behind one connection pool (SQLite or PostgreSQL).
/// Cheap to clone: clones share the pool.
#[derive(Clone)]
pub struct Store {
    /// Every write, and the reads a write depends on. On SQLite one
    /// connection: SQLite runs one write transaction at a time whatever
    /// the number of connections, and with several a writer that finds the
    /// lock taken sleeps in SQLite's busy handler (1, 2, 5 ms ...) and
    /// re-reads the pages another connection changed. With one, writes wait
    /// their turn in the pool's queue and its page cache stays warm.
    pool: AnyPool,
    /// Reads that stand alone (a record, a page of events, a listing): on
    /// SQLite connections of their own, which WAL lets read beside the
    /// writer; on PostgreSQL the same pool.
    reader: AnyPool,
    /// The connection the node's lease is renewed on (PostgreSQL: one of
    /// its own; SQLite: the pool).
    lease_pool: AnyPool,
    /// Who this daemon is in a shared store: recovery only touches its own.
    node: String,
    /// This start of the daemon: a new one per `open`. On a shared store
    /// every write of a run checks it (see `nodes.rs`), so a node that was
    /// declared lost cannot append to a run it no longer owns.
    epoch: String,
    shared: bool,
    /// The PostgreSQL URL (shared stores only), for `LISTEN`.
    url: Option<String>,
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

/// SQLite connections for standalone reads, beside its one writer.
const SQLITE_READERS: u32 = 3;

/// A pool of up to `max` connections; SQLite's in WAL mode.
fn pool_options(sqlite: bool, max: u32) -> AnyPoolOptions {
    AnyPoolOptions::new()
        .max_connections(max)
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
        let pool = pool_options(sqlite, if sqlite { 1 } else { 16 }).connect(&url).await?;
        migrator(sqlite).run(&pool).await?;
        let reader = match sqlite {
            true => pool_options(true, SQLITE_READERS).connect(&url).await?,
            false => pool.clone(),
        };
        // The lease's own connection: a pool busy with runs and watchers
        // must not make a healthy node miss its renewal and fence itself.
        let lease_pool = match sqlite {
            true => pool.clone(),
            false => AnyPoolOptions::new().max_connections(1).test_before_acquire(true).connect(&url).await?,
        };
        let listen_url = (!sqlite).then(|| url.clone());
        Ok(Store {
            pool,
            reader,
            lease_pool,
            node: node.to_string(),
            epoch: uuid::Uuid::now_v7().to_string(),
            shared: !sqlite,
            url: listen_url,
        })
    }

    /// This daemon's name in the store.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// This start's epoch (see the field).
    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    /// Whether other daemons may write to this store (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// Closes the connection pool, waiting for connections in use to be given
    /// back.
    pub async fn close(&self) {
        self.pool.close().await;
        self.reader.close().await;
        self.lease_pool.close().await;
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
            *count = sqlx::query(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&self.reader).await?.get(0);
        }
        Ok(counts)
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

/// [`INSERT_EVENTS_POSTGRES`] behind the fence, in one statement (its own
/// transaction): the share lock on the writer's node row that
/// [`Store::check_fence`] takes first is taken by `owner`, which the insert
/// waits for; when the node was declared lost nothing is inserted and
/// `owned` is 0. The subjects' watchers are notified at commit.
const FENCED_APPEND: &str = "WITH owner AS MATERIALIZED (
         SELECT 1 FROM nodes WHERE name = $2 AND epoch = $3 AND state <> 'lost' FOR SHARE
     ), stored AS (
         INSERT INTO events (subject_id, sequence, time_ms, kind, body)
         SELECT e ->> 0, (e ->> 1)::BIGINT, (e ->> 2)::BIGINT, e ->> 3, e ->> 4
         FROM json_array_elements($1::json) AS e WHERE EXISTS (SELECT 1 FROM owner)
         RETURNING subject_id
     )
     SELECT (SELECT count(*) FROM owner) AS owned,
            (SELECT count(pg_notify('corral_events', subject)) FROM (SELECT DISTINCT subject_id AS subject FROM stored) AS s)
                AS notified";

/// [`FENCED_APPEND`], and the sandbox `$2` given to the events' subject
/// and marked ready (`$3` is the time; see `sandboxes::adopt`), behind the
/// same fence.
const FENCED_APPEND_ADOPTING: &str = "WITH owner AS MATERIALIZED (
         SELECT 1 FROM nodes WHERE name = $4 AND epoch = $5 AND state <> 'lost' FOR SHARE
     ), stored AS (
         INSERT INTO events (subject_id, sequence, time_ms, kind, body)
         SELECT e ->> 0, (e ->> 1)::BIGINT, (e ->> 2)::BIGINT, e ->> 3, e ->> 4
         FROM json_array_elements($1::json) AS e WHERE EXISTS (SELECT 1 FROM owner)
         RETURNING subject_id
     ), adopted AS (
         UPDATE sandboxes SET subject_id = ($1::json -> 0 ->> 0), updated_at_ms = $3,
             state = CASE WHEN state = 'creating' THEN 'ready' ELSE state END
         WHERE sandbox_id = $2 AND EXISTS (SELECT 1 FROM owner)
     )
     SELECT (SELECT count(*) FROM owner) AS owned,
            (SELECT count(pg_notify('corral_events', subject)) FROM (SELECT DISTINCT subject_id AS subject FROM stored) AS s)
                AS notified";

/// An execution's record updated behind the fence, in one statement (see
/// [`FENCED_APPEND`]); `owned` is 0 when the writer was declared lost.
const FENCED_UPDATE_EXECUTION: &str = "WITH owner AS MATERIALIZED (
         SELECT 1 FROM nodes WHERE name = $6 AND epoch = $7 AND state <> 'lost' FOR SHARE
     ), updated AS (
         UPDATE executions SET state = $1, profile_ref = $2, finished_at_ms = $3, record = $4
         WHERE execution_id = $5 AND EXISTS (SELECT 1 FROM owner)
         RETURNING 1
     )
     SELECT (SELECT count(*) FROM owner) AS owned, (SELECT count(*) FROM updated) AS updated";

/// SQLite: `statements` as one transaction (`BEGIN IMMEDIATE; …; COMMIT;`)
/// sent to the connection's thread in one command. A transaction held over
/// one command per statement keeps the one writer for as many hand-offs
/// between that thread and the runtime, each waiting for a CPU on a busy
/// host: the writer was held about 6 ms per no-op execution for 1.2 ms of
/// SQLite work, and busy 80-97% of a throughput run.
fn sqlite_transaction(statements: &[&str]) -> String {
    format!("BEGIN IMMEDIATE; {}; COMMIT;", statements.join("; "))
}

impl Store {
    /// Runs `batch` (made by [`sqlite_transaction`]) on the SQLite writer
    /// to its end, in a task of its own: a caller that stops waiting cannot
    /// leave the writer inside the transaction. When a statement fails the
    /// rest is not run and the transaction is rolled back; a connection
    /// that cannot roll back is closed, never handed out again.
    async fn run_sqlite_transaction(
        &self,
        batch: sqlx::query::Query<'static, sqlx::Any, sqlx::any::AnyArguments<'static>>,
    ) -> Result<(), StoreError> {
        let pool = self.pool.clone();
        to_its_end(async move {
            let mut conn = pool.acquire().await?;
            let Err(error) = batch.execute(&mut *conn).await else { return Ok(()) };
            roll_back(conn).await;
            Err(StoreError::from(error))
        })
        .await
    }
}

/// Runs `work` on the SQLite writer to its end, in a task of its own: a
/// caller that stops waiting cannot leave the writer inside a transaction.
async fn to_its_end<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    // Only a panic or the runtime's shutdown ends the task early.
    tokio::spawn(work).await.map_err(|_| StoreError::Database(sqlx::Error::WorkerCrashed))?
}

/// Ends the SQLite writer's transaction after a failed statement; a
/// connection that cannot roll back is closed, never handed out again.
async fn roll_back(mut conn: sqlx::pool::PoolConnection<sqlx::Any>) {
    match sqlx::query("ROLLBACK").execute(&mut *conn).await {
        Ok(_) => {}
        Err(e) if e.to_string().contains("no transaction is active") => {}
        Err(_) => drop(conn.detach()),
    }
}

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

/// The condition on an execution's row that it has not finished: what a
/// restart recovers, a lost node's sweep fails, and keeps a node from
/// leaving the fleet as stopped.
const UNFINISHED_EXECUTION: &str = "state IN ('pending', 'running')";

/// The condition on a session's row that it has not ended (the same uses,
/// and a principal's count of what it runs).
const UNFINISHED_SESSION: &str = "state IN ('starting', 'active')";

/// The columns an execution is read from: its record, and the fields of
/// the record that have columns of their own (see
/// [`stored::execution_to_stored`]).
const EXECUTION: &str =
    "execution_id, state, created_at_ms, finished_at_ms, profile_ref, actor, project, principal, record";

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
    let consumer = &mut record.consumer;
    for (field, column) in [
        (&mut consumer.actor, "actor"),
        (&mut consumer.project, "project"),
        (&mut consumer.principal, "principal"),
        (&mut record.harness_profile_ref, "profile_ref"),
    ] {
        if field.is_empty() {
            *field = row.get(column);
        }
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

    /// On SQLite every write goes through one connection, so a writer waits
    /// its turn in the pool, never sleeping in SQLite's busy handler; reads
    /// run on connections beside it, see every write committed before they
    /// start, and an open read does not hold the writer up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_writes_take_turns_on_one_connection_and_reads_run_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        assert_eq!(store.pool.options().get_max_connections(), 1);
        assert_eq!(store.reader.options().get_max_connections(), SQLITE_READERS);
        // A read transaction held open the whole time (WAL: writers pass it).
        let mut held = store.reader.begin().await.unwrap();
        sqlx::query("SELECT COUNT(*) FROM events").fetch_one(&mut *held).await.unwrap();
        let mut writers = tokio::task::JoinSet::new();
        for w in 0..16 {
            let store = store.clone();
            writers.spawn(async move {
                let subject = format!("s{w}");
                for sequence in 1..=20u64 {
                    let kind = EventKind::Dispatched { tool: format!("t{sequence}") };
                    let event = Event { subject_id: subject.clone(), sequence, time_ms: 1, kind };
                    store.append_events(&[event]).await.unwrap();
                    // Read back on a reader connection, at once.
                    let seen = store.events_after(&subject, 0).await.unwrap();
                    assert_eq!(seen.len() as u64, sequence, "{subject} read back {} of {sequence}", seen.len());
                }
            });
        }
        while let Some(done) = writers.join_next().await {
            done.unwrap();
        }
        held.rollback().await.unwrap();
        let count: i64 = sqlx::query("SELECT COUNT(*) FROM events").fetch_one(&store.reader).await.unwrap().get(0);
        assert_eq!(count, 16 * 20);
    }

    /// A SQLite transaction sent as one command is all or nothing: when a
    /// statement in it fails, what ran before is rolled back and the one
    /// writer is out of the transaction, so the next write commits alone.
    #[tokio::test]
    async fn a_sqlite_transaction_that_fails_midway_leaves_nothing_and_the_writer_free() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let root = std::path::PathBuf::from("/nowhere/sb");
        let new =
            |id| sandboxes::NewSandbox { sandbox_id: id, subject_id: "", backend: "none", root: &root, epoch: "e" };
        store.insert_sandbox(new("sb")).await.unwrap();
        let event = |sequence| Event {
            subject_id: "run".into(),
            sequence,
            time_ms: 1,
            kind: EventKind::Dispatched { tool: "t".into() },
        };
        store.append_events(&[event(1)]).await.unwrap();
        // The adoption runs first, then the insert fails on sequence 1.
        let failed = store.append_events_adopting(&[event(2), event(1)], "sb").await;
        assert!(failed.is_err(), "a duplicate sequence is refused");
        assert_eq!(store.sandboxes().await.unwrap(), vec![("sb".into(), "".into(), "creating".into())]);
        assert_eq!(store.events_after("run", 0).await.unwrap().len(), 1);
        // Next: a transaction of its own, committed.
        store.append_events_adopting(&[event(2)], "sb").await.unwrap();
        assert_eq!(store.sandboxes().await.unwrap(), vec![("sb".into(), "run".into(), "ready".into())]);
        store.set_sandbox_state("sb", SandboxState::Destroyed).await.unwrap();
        assert!(store.sandboxes().await.unwrap().is_empty());
        assert_eq!(store.events_after("run", 0).await.unwrap().len(), 2);
    }

    /// Host uids go around the range: never used first, in order, then the
    /// one given back longest ago; never one a sandbox holds, nor one
    /// `usable` refuses; each node has its own.
    #[tokio::test]
    async fn uids_go_out_lowest_never_used_first_then_released_longest_ago() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let any = |_: u32| true;
        for (sandbox, uid) in [("s1", 10), ("s2", 11), ("s3", 12)] {
            assert_eq!(store.allocate_uid(10, 13, sandbox, any).await.unwrap(), Some(uid));
        }
        store.set_sandbox_state("s2", SandboxState::Destroyed).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        store.set_sandbox_state("s1", SandboxState::Destroyed).await.unwrap();
        assert_eq!(store.allocate_uid(10, 13, "s4", any).await.unwrap(), Some(13), "never used first");
        assert_eq!(store.allocate_uid(10, 13, "s5", any).await.unwrap(), Some(11), "then released longest ago");
        assert_eq!(store.allocate_uid(10, 13, "s6", any).await.unwrap(), Some(10));
        assert_eq!(store.allocate_uid(10, 13, "s7", any).await.unwrap(), None, "every uid is held");
        store.set_sandbox_state("s3", SandboxState::Destroyed).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        store.set_sandbox_state("s4", SandboxState::Destroyed).await.unwrap();
        let not_12 = |uid: u32| uid != 12;
        assert_eq!(store.allocate_uid(10, 13, "s8", not_12).await.unwrap(), Some(13), "an unusable one is passed over");
        assert_eq!(store.allocate_uid(10, 13, "s9", any).await.unwrap(), Some(12));
        // Another node's uids are its own.
        let other = Store::open(dir.path(), None, "m").await.unwrap();
        assert_eq!(other.allocate_uid(10, 13, "t1", any).await.unwrap(), Some(10));
    }

    /// A sandbox's intent row and its uid are stored together, or neither
    /// is: with no usable uid, no row is left behind.
    #[tokio::test]
    async fn a_sandbox_row_and_its_uid_are_stored_in_one_commit_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let root = Path::new("/var/lib/corral/sandboxes/s1");
        let insert = |id: &'static str, usable: fn(u32) -> bool| {
            let store = &store;
            let new = NewSandbox { sandbox_id: id, subject_id: "e1", backend: "linux_bwrap", root, epoch: "ep" };
            async move { store.insert_sandbox_with_uid(new, (10, 11), usable, &[]).await }
        };
        assert_eq!(insert("s1", |_| true).await.unwrap(), Some(10));
        assert_eq!(store.sandbox_uid("s1").await.unwrap(), Some(10));
        assert_eq!(store.sandboxes().await.unwrap(), [("s1".into(), "e1".into(), "creating".into())]);
        assert_eq!(insert("s2", |uid| uid != 11).await.unwrap(), None, "10 is held, 11 unusable");
        assert_eq!(store.sandboxes().await.unwrap().len(), 1, "no row of s2");
        assert_eq!(store.sandbox_uid("s2").await.unwrap(), None);
        assert_eq!(insert("s3", |_| true).await.unwrap(), Some(11));
        // Then the uids given back, the one released longest ago first,
        // unless it is unusable; the row and its uid still go together.
        store.set_sandbox_state("s1", SandboxState::Destroyed).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        store.set_sandbox_state("s3", SandboxState::Destroyed).await.unwrap();
        assert_eq!(insert("s4", |uid| uid != 10).await.unwrap(), Some(11), "10 went back first, but is unusable");
        assert_eq!(insert("s5", |_| true).await.unwrap(), Some(10));
        assert_eq!(insert("s6", |_| true).await.unwrap(), None, "both held again");
        let rows: Vec<String> = store.sandboxes().await.unwrap().into_iter().map(|(id, ..)| id).collect();
        assert_eq!(rows, ["s4", "s5"]);
        assert_eq!(
            (store.sandbox_uid("s4").await.unwrap(), store.sandbox_uid("s5").await.unwrap()),
            (Some(11), Some(10))
        );
    }

    /// The events a sandbox's intent row carries are stored in its commit,
    /// with its uid, or not at all: none when no uid is usable, none when
    /// one of them is refused (and the one writer is free afterwards); a
    /// row with no uid range carries them the same way.
    #[tokio::test]
    async fn the_events_an_intent_row_carries_are_stored_with_it_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let root = Path::new("/var/lib/corral/sandboxes/s");
        let new = |id| NewSandbox { sandbox_id: id, subject_id: "run", backend: "linux_bwrap", root, epoch: "ep" };
        let event = |sequence| Event {
            subject_id: "run".into(),
            sequence,
            time_ms: 1,
            kind: EventKind::Dispatched { tool: "t".into() },
        };
        let sequences = |store: &Store| {
            let store = store.clone();
            async move { store.events_after("run", 0).await.unwrap().iter().map(|e| e.sequence).collect::<Vec<_>>() }
        };
        let no_uid = store.insert_sandbox_with_uid(new("s1"), (10, 10), |_| false, &[event(1), event(2)]).await;
        assert_eq!(no_uid.unwrap(), None);
        assert_eq!((sequences(&store).await, store.sandboxes().await.unwrap().len()), (vec![], 0), "nothing stored");
        let uid = store.insert_sandbox_with_uid(new("s1"), (10, 11), |uid| uid == 11, &[event(1), event(2)]).await;
        assert_eq!(uid.unwrap(), Some(11), "10 unusable: the search goes on in the same transaction");
        assert_eq!((sequences(&store).await, store.sandbox_uid("s1").await.unwrap()), (vec![1, 2], Some(11)));
        // Sequence 2 is taken: the row and its uid are rolled back too.
        let refused = store.insert_sandbox_with_uid(new("s2"), (10, 12), |_| true, &[event(2), event(3)]).await;
        assert!(refused.is_err(), "a duplicate sequence is refused");
        assert_eq!((sequences(&store).await, store.sandbox_uid("s2").await.unwrap()), (vec![1, 2], None));
        assert_eq!(store.sandboxes().await.unwrap().len(), 1, "no row of s2");
        // The writer is out of that transaction: the next commits alone.
        assert_eq!(store.insert_sandbox_with_uid(new("s2"), (10, 12), |_| true, &[event(3)]).await.unwrap(), Some(12));
        store.insert_sandbox_carrying(new("s3"), &[event(4)]).await.unwrap();
        assert!(store.insert_sandbox_carrying(new("s4"), &[event(4)]).await.is_err());
        assert_eq!(sequences(&store).await, [1, 2, 3, 4]);
        let rows: Vec<String> = store.sandboxes().await.unwrap().into_iter().map(|(id, ..)| id).collect();
        assert_eq!(rows, ["s1", "s2", "s3"]);
    }

    /// A record's own columns are not repeated in its stored JSON; one
    /// stored with them (by an older daemon, `finished_at_ms` in the JSON
    /// alone) reads as it was.
    #[tokio::test]
    async fn a_record_is_read_from_its_columns_and_its_json_in_either_form() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let consumer = crate::sandbox::Consumer {
            run_id: "e1".into(),
            actor: "agt".into(),
            project: "p".into(),
            principal: "alice".into(),
            ..Default::default()
        };
        let mut record = ExecutionRecord {
            execution_id: "e1".into(),
            consumer,
            state: ExecutionState::Succeeded,
            title: "t".into(),
            harness_profile_ref: "builtin.noop@1.0.0".into(),
            created_at_ms: 5,
            finished_at_ms: Some(9),
            ..Default::default()
        };
        record.evidence.profile_ref = "builtin.noop@1.0.0".into();
        assert!(matches!(store.insert_execution(&record, "d").await.unwrap(), Inserted::Created));
        store.update_execution(&record).await.unwrap();
        let stored_json = async || -> String {
            sqlx::query("SELECT record FROM executions WHERE execution_id = 'e1'")
                .fetch_one(&store.pool)
                .await
                .unwrap()
                .get(0)
        };
        let json = stored_json().await;
        let stored: serde_json::Value = serde_json::from_str(&json).unwrap();
        for column in stored::EXECUTION_COLUMNS {
            assert!(stored.get(column).is_none(), "{column} repeated in {json}");
        }
        assert_eq!(stored["title"], "t");
        // The consumer is all columns and its run id, the profile asked
        // for is the resolved one: neither is stored twice.
        assert!(stored.get("consumer").is_none(), "{json}");
        assert!(stored.get("harness_profile_ref").is_none(), "{json}");
        assert_eq!(stored["evidence"]["profile_ref"], "builtin.noop@1.0.0");
        assert_eq!(store.get_execution("e1").await.unwrap().unwrap(), record);
        let listed = store.list_executions(&ExecutionFilter { limit: 10, ..Default::default() }).await.unwrap();
        assert_eq!(listed, [record.clone()]);

        // Asked for without a version: what was asked is kept beside what
        // it resolved to.
        record.harness_profile_ref = "builtin.noop".into();
        store.update_execution(&record).await.unwrap();
        assert!(stored_json().await.contains(r#""harness_profile_ref":"builtin.noop""#));
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

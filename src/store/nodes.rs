//! The store's nodes: each daemon on a store is a row with its epoch, a
//! lease it renews, its state (`active`, `draining`, `lost`, `stopped`)
//! and what it runs; and the fleet's shared secrets. A node whose lease ran
//! out is marked lost by exactly one survivor (a conditional update), and
//! from then on [`Store::check_fence`] refuses every write of a run by that
//! node's epoch. A node that shut down cleanly, leaving no run unfinished,
//! marks itself stopped: nobody declares it lost.

use super::*;

/// A node's state in the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Takes work.
    Active,
    /// Takes no new work; finishes what it runs.
    Draining,
    /// Its lease ran out: a survivor failed its runs; its epoch is fenced.
    Lost,
    /// It shut down cleanly with no run left unfinished; nothing to fail.
    Stopped,
}

impl NodeState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Lost => "lost",
            NodeState::Stopped => "stopped",
        }
    }

    /// The state a stored name means (an unknown one reads as lost: it
    /// takes no work).
    pub fn parse(text: &str) -> NodeState {
        match text {
            "active" => NodeState::Active,
            "draining" => NodeState::Draining,
            "stopped" => NodeState::Stopped,
            _ => NodeState::Lost,
        }
    }
}

/// A node as the store has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRow {
    /// `[fleet] node`: unique in the store.
    pub name: String,
    /// The node's current start.
    pub epoch: String,
    /// Active, draining, lost or stopped.
    pub state: NodeState,
    /// Executions it may run at once (its admission limit).
    pub capacity: u64,
    /// What it can run (e.g. `linux_bwrap`, `claude`, `codex`).
    pub labels: Vec<String>,
    /// The daemon's version.
    pub version: String,
    /// When this epoch joined (ms since the epoch).
    pub started_at_ms: i64,
    /// When the lease was last renewed.
    pub renewed_at_ms: i64,
    /// When the lease runs out unless renewed.
    pub lease_until_ms: i64,
    /// Executions and sessions it ran at its last renewal.
    pub running: u64,
    /// When it was last asked to drain (0: never).
    pub drain_requested_at_ms: i64,
}

impl NodeRow {
    /// Draining, and it renewed its lease since it was asked to, with
    /// nothing running: a rolling restart may stop it now.
    pub fn drained(&self) -> bool {
        self.state == NodeState::Draining && self.running == 0 && self.renewed_at_ms > self.drain_requested_at_ms
    }
}

const NODE: &str =
    "name, epoch, state, capacity, labels, version, started_at_ms, renewed_at_ms, lease_until_ms, running, drain_requested_at_ms";

fn node_from_row(row: &sqlx::any::AnyRow) -> NodeRow {
    NodeRow {
        name: row.get("name"),
        epoch: row.get("epoch"),
        state: NodeState::parse(row.get::<&str, _>("state")),
        capacity: row.get::<i64, _>("capacity").max(0) as u64,
        labels: serde_json::from_str(row.get::<&str, _>("labels")).unwrap_or_default(),
        version: row.get("version"),
        started_at_ms: row.get("started_at_ms"),
        renewed_at_ms: row.get("renewed_at_ms"),
        lease_until_ms: row.get("lease_until_ms"),
        running: row.get::<i64, _>("running").max(0) as u64,
        drain_requested_at_ms: row.get("drain_requested_at_ms"),
    }
}

/// A request another node filed for this one (see [`Store::ask_node`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRequest {
    /// Its id.
    pub id: String,
    /// `cancel`, `end_session`, `cancel_turn` or `send_turn`.
    pub kind: String,
    /// The execution or session it is about.
    pub subject: String,
    /// What else it carries (JSON), or empty.
    pub payload: String,
}

/// What [`Store::take_over_other_names`] made this node's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TakenOver {
    /// The other names whose runs or sandboxes it took (`""`: rows of no
    /// node).
    pub names: Vec<String>,
    /// Unfinished executions.
    pub executions: u64,
    /// Unfinished sessions.
    pub sessions: u64,
    /// Sandbox rows.
    pub sandboxes: u64,
}

/// A lost node taken by this start for failing its runs (see
/// [`Store::claim_lost_node`]); the lock is held until it is released or
/// dropped.
pub struct LostNodeClaim {
    tx: sqlx::Transaction<'static, sqlx::Any>,
}

impl LostNodeClaim {
    /// Lets another survivor take the node again (it finds nothing left
    /// to fail once this one failed everything).
    pub async fn release(self) -> Result<(), StoreError> {
        self.tx.commit().await?;
        Ok(())
    }
}

impl Store {
    /// On SQLite only, at start, before recovery: makes this node the owner
    /// of what other node names left in the store (their unfinished
    /// executions and sessions, their sandbox rows and host uids, the uids
    /// they gave back, their pending hub reports) and marks their node rows
    /// lost. A SQLite store is its data directory's, which one daemon holds
    /// at a time (`daemon::DataDirLock`): a fleet of one, whose other names
    /// are this daemon under an earlier name (the host renamed, the data
    /// directory spelled otherwise, `[fleet] node` changed). On a shared
    /// store another name may be a live node: nothing is taken.
    pub async fn take_over_other_names(&self) -> Result<TakenOver, StoreError> {
        if self.shared {
            return Ok(TakenOver::default());
        }
        let mut tx = self.pool.begin().await?;
        let names = sqlx::query(&format!(
            "SELECT COALESCE(node, '') FROM sandboxes WHERE node IS NULL OR node <> $1
             UNION SELECT node FROM executions WHERE node <> $1 AND {UNFINISHED_EXECUTION}
             UNION SELECT node FROM sessions WHERE node <> $1 AND {UNFINISHED_SESSION}
             ORDER BY 1"
        ))
        .bind(&self.node)
        .fetch_all(&mut *tx)
        .await?;
        let mut taken = TakenOver { names: names.iter().map(|r| r.get(0)).collect(), ..TakenOver::default() };
        taken.executions =
            sqlx::query(&format!("UPDATE executions SET node = $1 WHERE node <> $1 AND {UNFINISHED_EXECUTION}"))
                .bind(&self.node)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        taken.sessions =
            sqlx::query(&format!("UPDATE sessions SET node = $1 WHERE node <> $1 AND {UNFINISHED_SESSION}"))
                .bind(&self.node)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        taken.sandboxes = sqlx::query("UPDATE sandboxes SET node = $1 WHERE node IS NULL OR node <> $1")
            .bind(&self.node)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        for statement in [
            // A uid held under both names (two leftovers, one of each) stays
            // this name's row: its sandbox is destroyed with that uid (every
            // process of it killed); the other is found by its id.
            "UPDATE OR IGNORE sandbox_uids SET node = $1 WHERE node <> $1",
            "DELETE FROM sandbox_uids WHERE node <> $1",
            // Given back under another name is given back: still handed out
            // as late as can be.
            "INSERT INTO sandbox_uid_released (node, uid, released_at_ms)
             SELECT $1, uid, MAX(released_at_ms) FROM sandbox_uid_released WHERE node <> $1 GROUP BY uid
             ON CONFLICT (node, uid) DO UPDATE SET released_at_ms = MAX(released_at_ms, excluded.released_at_ms)",
            "DELETE FROM sandbox_uid_released WHERE node <> $1",
            "UPDATE hub_outbox SET node = $1 WHERE node <> $1 AND state = 'pending'",
            "UPDATE nodes SET state = 'lost' WHERE name <> $1 AND state <> 'stopped'",
        ] {
            sqlx::query(statement).bind(&self.node).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(taken)
    }

    /// Joins the fleet as this start (a new epoch, `active`), replacing
    /// whatever an earlier start of this node left in the row.
    pub async fn join_fleet(&self, capacity: u64, labels: &[String], lease_ms: i64) -> Result<(), StoreError> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO nodes (name, epoch, state, capacity, labels, version, started_at_ms, renewed_at_ms, lease_until_ms, running)
             VALUES ($1, $2, 'active', $3, $4, $5, $6, $6, $7, 0)
             ON CONFLICT (name) DO UPDATE SET epoch = excluded.epoch, state = 'active', capacity = excluded.capacity,
                 labels = excluded.labels, version = excluded.version, started_at_ms = excluded.started_at_ms,
                 renewed_at_ms = excluded.renewed_at_ms, lease_until_ms = excluded.lease_until_ms, running = 0",
        )
        .bind(&self.node)
        .bind(&self.epoch)
        .bind(capacity.min(i64::MAX as u64) as i64)
        .bind(serde_json::to_string(labels)?)
        .bind(env!("CARGO_PKG_VERSION"))
        .bind(now)
        .bind(now + lease_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Renews this start's lease for `lease_ms` from now, noting what it
    /// runs; returns the node's state, or [`StoreError::Fenced`] when the
    /// row is no longer this start's or was declared lost.
    pub async fn renew_lease(&self, lease_ms: i64, running: u64) -> Result<NodeState, StoreError> {
        let now = now_ms();
        let renewed = sqlx::query(
            "UPDATE nodes SET renewed_at_ms = $3, lease_until_ms = $4, running = $5
             WHERE name = $1 AND epoch = $2 AND state <> 'lost'",
        )
        .bind(&self.node)
        .bind(&self.epoch)
        .bind(now)
        .bind(now + lease_ms)
        .bind(running.min(i64::MAX as u64) as i64)
        .execute(&self.lease_pool)
        .await?;
        if renewed.rows_affected() == 0 {
            return Err(self.fenced());
        }
        let row =
            sqlx::query("SELECT state FROM nodes WHERE name = $1").bind(&self.node).fetch_one(&self.lease_pool).await?;
        Ok(NodeState::parse(row.get::<&str, _>(0)))
    }

    /// Whether the store was closed ([`Store::close`], the end of a
    /// shutdown): the lease loop then has nothing left to renew.
    pub fn is_closed(&self) -> bool {
        self.lease_pool.is_closed()
    }

    pub(super) fn fenced(&self) -> StoreError {
        StoreError::Fenced { node: self.node.clone(), epoch: self.epoch.clone() }
    }

    /// Marks this start `stopped` after a clean shutdown, so that no
    /// survivor declares it lost when its lease runs out; only while the
    /// row is still this start's and the store holds no unfinished
    /// execution or session of this node (a run whose last write did not
    /// reach the store is left for a survivor to fail). Returns whether it
    /// did.
    pub async fn leave_fleet(&self) -> Result<bool, StoreError> {
        let left = sqlx::query(&format!(
            "UPDATE nodes SET state = 'stopped', running = 0 WHERE name = $1 AND epoch = $2 AND state <> 'lost'
               AND NOT EXISTS (SELECT 1 FROM executions WHERE node = $1 AND {UNFINISHED_EXECUTION})
               AND NOT EXISTS (SELECT 1 FROM sessions WHERE node = $1 AND {UNFINISHED_SESSION})"
        ))
        .bind(&self.node)
        .bind(&self.epoch)
        .execute(&self.pool)
        .await?;
        Ok(left.rows_affected() == 1)
    }

    /// Every node the store knows, by name.
    pub async fn list_nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {NODE} FROM nodes ORDER BY name")).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(node_from_row).collect())
    }

    /// Asks node `name` to drain (from `active`); returns its row, `None`
    /// when there is no such node. A lost node stays lost.
    pub async fn drain_node(&self, name: &str) -> Result<Option<NodeRow>, StoreError> {
        sqlx::query(
            "UPDATE nodes SET state = 'draining', drain_requested_at_ms = $2 WHERE name = $1 AND state = 'active'",
        )
        .bind(name)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        let row = sqlx::query(&format!("SELECT {NODE} FROM nodes WHERE name = $1"))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(node_from_row))
    }

    /// Marks lost every other node whose lease ran out before `now_ms`,
    /// and returns them. A node is returned to exactly one caller however
    /// many sweep at once: the update's condition no longer holds for the
    /// second.
    pub async fn claim_lost_nodes(&self, now_ms: i64) -> Result<Vec<NodeRow>, StoreError> {
        let candidates = sqlx::query(&format!(
            "SELECT {NODE} FROM nodes WHERE lease_until_ms < $1 AND state NOT IN ('lost', 'stopped') AND name <> $2 ORDER BY name"
        ))
        .bind(now_ms)
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        let mut claimed = Vec::new();
        for candidate in candidates.iter().map(node_from_row) {
            let marked = sqlx::query(
                "UPDATE nodes SET state = 'lost' WHERE name = $1 AND epoch = $2 AND state NOT IN ('lost', 'stopped') AND lease_until_ms < $3",
            )
            .bind(&candidate.name)
            .bind(&candidate.epoch)
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
            if marked.rows_affected() == 1 {
                claimed.push(NodeRow { state: NodeState::Lost, ..candidate });
            }
        }
        Ok(claimed)
    }

    /// The other nodes declared lost that the store still holds unfinished
    /// runs of: their runs are to be failed, whoever declared them lost
    /// (that survivor may have died, or failed to, on the way).
    pub async fn lost_nodes_with_unfinished_runs(&self) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT name FROM nodes WHERE state = 'lost' AND name <> $1
               AND (EXISTS (SELECT 1 FROM executions WHERE node = nodes.name AND {UNFINISHED_EXECUTION})
                 OR EXISTS (SELECT 1 FROM sessions WHERE node = nodes.name AND {UNFINISHED_SESSION}))
             ORDER BY name"
        ))
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Takes lost node `name` for failing its unfinished runs (see
    /// [`Store::lost_nodes_with_unfinished_runs`]): its row stays locked
    /// until the [`LostNodeClaim`] is released or dropped, so one survivor
    /// at a time fails them, and one that dies on the way lets the next
    /// take over (its connection closes, and the lock goes with it).
    /// `None` when another survivor holds it, or the node is no longer
    /// lost (it started again, and recovers its runs itself).
    pub async fn claim_lost_node(&self, name: &str) -> Result<Option<LostNodeClaim>, StoreError> {
        if !self.shared || name == self.node {
            return Ok(None);
        }
        let mut tx = self.pool.begin().await?;
        let locked = sqlx::query("SELECT 1 FROM nodes WHERE name = $1 AND state = 'lost' FOR UPDATE SKIP LOCKED")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
        Ok(locked.map(|_| LostNodeClaim { tx }))
    }

    /// On a shared store: fails unless this start still owns its node row
    /// and was not declared lost. Run inside the transaction of a write to
    /// a run, with a share lock on the row, so a survivor marking this node
    /// lost waits for writes already under way and every later one fails.
    pub(super) async fn check_fence(&self, conn: &mut sqlx::AnyConnection) -> Result<(), StoreError> {
        if !self.shared {
            return Ok(());
        }
        let owned = sqlx::query("SELECT 1 FROM nodes WHERE name = $1 AND epoch = $2 AND state <> 'lost' FOR SHARE")
            .bind(&self.node)
            .bind(&self.epoch)
            .fetch_optional(&mut *conn)
            .await?;
        match owned {
            Some(_) => Ok(()),
            None => Err(self.fenced()),
        }
    }

    /// Runs one of the fenced single statements ([`FENCED_APPEND`] and its
    /// kind), binding this start's node and epoch as its last two
    /// parameters: `Fenced` when the statement found this start declared
    /// lost (its first column, `owned`, is 0) and so wrote nothing.
    pub(super) async fn fenced_write<'q>(
        &self,
        statement: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<(), StoreError> {
        self.fenced_write_on(&self.pool, statement).await
    }

    /// [`Store::fenced_write`] on `conn` (the pool, or a transaction's
    /// connection).
    async fn fenced_write_on<'c, 'q, E>(
        &self,
        conn: E,
        statement: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = sqlx::Any>,
    {
        let row = statement.bind(self.node.clone()).bind(self.epoch.clone()).fetch_one(conn).await?;
        match row.get::<i64, _>(0) {
            0 => Err(self.fenced()),
            _ => Ok(()),
        }
    }

    /// [`FENCED_APPEND`] of `events` inside the transaction `tx` (nothing
    /// when there are none).
    pub(super) async fn fenced_append_on(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        events: &[Event],
    ) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let statement = sqlx::query(FENCED_APPEND).bind(events_rows_json(events, false)?);
        self.fenced_write_on(&mut **tx, statement).await
    }

    /// The fleet's secret `name`: the one stored, or `make()`'s, stored now
    /// (the first node to ask decides it for every node).
    pub async fn fleet_secret(&self, name: &str, make: impl FnOnce() -> String) -> Result<String, StoreError> {
        sqlx::query("INSERT INTO fleet_secrets (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
            .bind(name)
            .bind(make())
            .execute(&self.pool)
            .await?;
        let row =
            sqlx::query("SELECT value FROM fleet_secrets WHERE name = $1").bind(name).fetch_one(&self.pool).await?;
        Ok(row.get(0))
    }

    /// The unfinished executions of node `node` (a lost one's, for the
    /// survivor that fails them).
    pub async fn unfinished_executions_of(&self, node: &str) -> Result<Vec<ExecutionRecord>, StoreError> {
        self.unfinished_executions_where("node = $1", node).await
    }

    /// The unfinished sessions of node `node`.
    pub async fn unfinished_sessions_of(&self, node: &str) -> Result<Vec<SessionRecord>, StoreError> {
        self.unfinished_sessions_where("node = $1", node).await
    }

    /// The node that runs (or ran) execution `id`.
    pub async fn node_of_execution(&self, id: &str) -> Result<Option<String>, StoreError> {
        self.node_of("SELECT node FROM executions WHERE execution_id = $1", id).await
    }

    /// The node that runs (or ran) session `id`.
    pub async fn node_of_session(&self, id: &str) -> Result<Option<String>, StoreError> {
        self.node_of("SELECT node FROM sessions WHERE session_id = $1", id).await
    }

    async fn node_of(&self, query: &'static str, id: &str) -> Result<Option<String>, StoreError> {
        let row = sqlx::query(query).bind(id).fetch_optional(&self.pool).await?;
        Ok(row.and_then(|r| r.get::<Option<String>, _>(0)))
    }

    /// Files a request of `kind` about `subject` (with `payload`, JSON or
    /// empty) for node `node`, and wakes it (`NOTIFY corral_requests`).
    /// Returns the request's id.
    pub async fn ask_node(&self, node: &str, kind: &str, subject: &str, payload: &str) -> Result<String, StoreError> {
        let id = uuid::Uuid::now_v7().to_string();
        sqlx::query(
            "INSERT INTO node_requests (id, node, kind, subject, state, created_at_ms, payload)
             VALUES ($1, $2, $3, $4, 'pending', $5, $6)",
        )
        .bind(&id)
        .bind(node)
        .bind(kind)
        .bind(subject)
        .bind(now_ms())
        .bind(payload)
        .execute(&self.pool)
        .await?;
        if self.shared {
            sqlx::query("SELECT pg_notify('corral_requests', $1)").bind(node).execute(&self.pool).await?;
        }
        Ok(id)
    }

    /// The requests waiting for this node, oldest first.
    pub async fn pending_requests(&self) -> Result<Vec<NodeRequest>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, kind, subject, payload FROM node_requests WHERE node = $1 AND state = 'pending' ORDER BY id LIMIT 100",
        )
        .bind(&self.node)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| NodeRequest { id: r.get(0), kind: r.get(1), subject: r.get(2), payload: r.get(3) })
            .collect())
    }

    /// Takes request `id` before acting on it: it is no longer pending, so
    /// it is acted on once, and its sender can no longer withdraw it.
    /// False when it was taken already, or withdrawn.
    pub async fn take_request(&self, id: &str) -> Result<bool, StoreError> {
        let taken = sqlx::query("UPDATE node_requests SET state = 'taken' WHERE id = $1 AND state = 'pending'")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(taken.rows_affected() == 1)
    }

    /// Hands the caller of answered request `id` what came after the
    /// answer (a forwarded turn's raw result, as JSON).
    pub async fn set_request_raw(&self, id: &str, raw: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE node_requests SET raw = $2 WHERE id = $1").bind(id).bind(raw).execute(&self.pool).await?;
        Ok(())
    }

    /// What [`Store::set_request_raw`] left for request `id`, once it did.
    pub async fn request_raw(&self, id: &str) -> Result<Option<String>, StoreError> {
        let row =
            sqlx::query("SELECT raw FROM node_requests WHERE id = $1").bind(id).fetch_optional(&self.pool).await?;
        Ok(row.and_then(|r| r.get::<Option<String>, _>(0)))
    }

    /// Answers request `id`: a JSON answer, or an error sentence.
    pub async fn answer_request(&self, id: &str, answer: Result<String, String>) -> Result<(), StoreError> {
        let (answer, error) = match answer {
            Ok(answer) => (Some(answer), None),
            Err(error) => (None, Some(error)),
        };
        sqlx::query("UPDATE node_requests SET state = 'done', answer = $2, error = $3 WHERE id = $1")
            .bind(id)
            .bind(answer)
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Request `id`'s answer, once it has one.
    pub async fn request_answer(&self, id: &str) -> Result<Option<Result<String, String>>, StoreError> {
        let row = sqlx::query("SELECT state, answer, error FROM node_requests WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        if row.get::<&str, _>(0) != "done" {
            return Ok(None);
        }
        Ok(Some(match row.get::<Option<String>, _>(2) {
            Some(error) => Err(error),
            None => Ok(row.get::<Option<String>, _>(1).unwrap_or_default()),
        }))
    }

    /// A listener on `channels` (shared stores only): `corral_requests`
    /// carries the name of the node a new request is for, `corral_events`
    /// the subject that has new events.
    pub async fn listen(&self, channels: &[&str]) -> Result<Option<sqlx::postgres::PgListener>, StoreError> {
        let Some(url) = &self.url else { return Ok(None) };
        let mut listener = sqlx::postgres::PgListener::connect(url).await?;
        listener.listen_all(channels.iter().copied()).await?;
        Ok(Some(listener))
    }

    /// Within a write's transaction on a shared store: tells every node
    /// that `events`' subjects have new events (`NOTIFY corral_events`,
    /// delivered at commit), so their watchers read them at once.
    pub(super) async fn notify_events(
        &self,
        conn: &mut sqlx::AnyConnection,
        events: &[Event],
    ) -> Result<(), StoreError> {
        if !self.shared {
            return Ok(());
        }
        let mut subjects: Vec<&str> = events.iter().map(|e| e.subject_id.as_str()).collect();
        subjects.dedup();
        for subject in subjects {
            sqlx::query("SELECT pg_notify('corral_events', $1)").bind(subject).execute(&mut *conn).await?;
        }
        Ok(())
    }
}

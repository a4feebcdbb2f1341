//! The store's the sandboxes the daemon owns and their host uids: intent before creation, state, uid allocation, and what recovery finds left over.

use super::*;

/// A sandbox about to be made: what its intent row records.
#[derive(Clone, Copy, Debug)]
pub struct NewSandbox<'a> {
    /// The sandbox's id.
    pub sandbox_id: &'a str,
    /// The run it is made for; empty for a warm sandbox.
    pub subject_id: &'a str,
    /// The backend that makes it (`linux_bwrap`, ...).
    pub backend: &'a str,
    /// The sandbox's directory on the host.
    pub root: &'a Path,
    /// The daemon instance that makes it.
    pub epoch: &'a str,
}

impl Store {
    /// Records the intent to create a sandbox, before the backend acts.
    pub async fn insert_sandbox(&self, new: NewSandbox<'_>) -> Result<(), StoreError> {
        self.insert_sandbox_on(&self.pool, new).await
    }

    async fn insert_sandbox_on<'c, E>(&self, conn: E, new: NewSandbox<'_>) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = sqlx::Any>,
    {
        bind_sandbox(sqlx::query(INSERT_SANDBOX), new, now_ms(), &self.node).execute(conn).await?;
        Ok(())
    }

    /// [`Store::insert_sandbox`], and `events` stored in the same commit:
    /// a run's first events (`accepted`, `resolved`, `gated`) travel with
    /// the intent row of the sandbox made for it. On SQLite one command; on
    /// a shared store the events go behind the fence, in the same
    /// transaction.
    pub async fn insert_sandbox_carrying(&self, new: NewSandbox<'_>, events: &[Event]) -> Result<(), StoreError> {
        if events.is_empty() {
            return self.insert_sandbox(new).await;
        }
        if !self.shared {
            let batch = bind_sandbox(sqlx::query(&INTENT_SQLITE), new, now_ms(), &self.node);
            return self.run_sqlite_transaction(batch.bind(events_rows_json(events, false)?)).await;
        }
        let mut tx = self.pool.begin().await?;
        self.fenced_append_on(&mut tx, events).await?;
        self.insert_sandbox_on(&mut *tx, new).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Gives a warm sandbox (made with no subject) to the run that took it
    /// (see [`adopt`]).
    pub async fn adopt_sandbox(&self, sandbox_id: &str, subject_id: &str) -> Result<(), StoreError> {
        adopt(&self.pool, sandbox_id, subject_id).await
    }

    /// Records a sandbox's state. A destroyed sandbox (nothing of it
    /// alive) gives its uid back and needs no row any more (the record
    /// keeps its id). The uid goes first: a crash between the two leaves a
    /// row that the next start's recovery destroys again, which is a no-op.
    pub async fn set_sandbox_state(&self, sandbox_id: &str, state: SandboxState) -> Result<(), StoreError> {
        if state == SandboxState::Destroyed {
            // One transaction (one commit, where these were three); on
            // SQLite one command.
            if !self.shared {
                let batch = sqlx::query(&DESTROYED_SQLITE).bind(sandbox_id.to_string()).bind(self.node.clone());
                return self.run_sqlite_transaction(batch.bind(now_ms())).await;
            }
            let [released, uid, row] = DESTROYED;
            let mut tx = self.pool.begin().await?;
            sqlx::query(released).bind(sandbox_id).bind(&self.node).bind(now_ms()).execute(&mut *tx).await?;
            sqlx::query(uid).bind(sandbox_id).bind(&self.node).execute(&mut *tx).await?;
            sqlx::query(row).bind(sandbox_id).execute(&mut *tx).await?;
            tx.commit().await?;
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
    /// that have live processes): the lowest never used (never-used uids go
    /// out in order, so those above every uid handed out so far; one skipped
    /// as unusable, so below that mark, is not offered again),
    /// else the one released longest ago. Each allocation reads a page of
    /// candidates, not the whole range. A uid thus goes around the whole range before
    /// it is used again, so what one tenant might have left under it (and
    /// teardown missed) is not the next tenant's. `None` when none is free.
    pub async fn allocate_uid(
        &self,
        first: u32,
        last: u32,
        sandbox_id: &str,
        usable: impl Fn(u32) -> bool,
    ) -> Result<Option<u32>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        allocate_uid_on(&mut conn, &self.node, first, last, sandbox_id, usable).await
    }

    /// [`Store::insert_sandbox_carrying`] and [`Store::allocate_uid`] in
    /// one commit: the intent row, its uid and the events that travel with
    /// it, for a sandbox about to be made. `None` when no uid is `usable`:
    /// then nothing is stored, the events neither.
    pub async fn insert_sandbox_with_uid(
        &self,
        new: NewSandbox<'_>,
        (first, last): (u32, u32),
        usable: impl Fn(u32) -> bool + Send + 'static,
        events: &[Event],
    ) -> Result<Option<u32>, StoreError> {
        if !self.shared {
            let opening = bind_sandbox(sqlx::query(&OPEN_WITH_UID_SQLITE), new, now_ms(), &self.node)
                .bind(events_rows_json(events, false)?)
                .bind(first as i64)
                .bind(last as i64);
            let (node, sandbox_id) = (self.node.clone(), new.sandbox_id.to_string());
            let pool = self.pool.clone();
            return to_its_end(open_with_uid_sqlite(pool, opening, (node, sandbox_id), (first, last), usable)).await;
        }
        let mut tx = self.pool.begin().await?;
        self.fenced_append_on(&mut tx, events).await?;
        self.insert_sandbox_on(&mut *tx, new).await?;
        match allocate_uid_on(&mut tx, &self.node, first, last, new.sandbox_id, usable).await? {
            Some(uid) => {
                tx.commit().await?;
                Ok(Some(uid))
            }
            None => {
                tx.rollback().await?;
                Ok(None)
            }
        }
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
    /// daemon's to destroy (see [`Store::foreign_leftover_sandboxes`]; on
    /// SQLite [`Store::take_over_other_names`] made them this node's first).
    pub async fn leftover_sandboxes(&self, current_epoch: &str) -> Result<Vec<SandboxRow>, StoreError> {
        self.undestroyed_sandboxes("s.instance_epoch != $1", current_epoch).await
    }

    /// This node's sandboxes of `subject` not yet destroyed.
    pub async fn undestroyed_sandboxes_of(&self, subject: &str) -> Result<Vec<SandboxRow>, StoreError> {
        self.undestroyed_sandboxes("s.subject_id = $1", subject).await
    }

    /// This node's sandbox `sandbox_id`, unless destroyed.
    pub async fn undestroyed_sandbox(&self, sandbox_id: &str) -> Result<Option<SandboxRow>, StoreError> {
        Ok(self.undestroyed_sandboxes("s.sandbox_id = $1", sandbox_id).await?.pop())
    }

    /// This node's sandboxes not yet destroyed for which `filter` (on `$1`,
    /// bound to `value`) holds.
    async fn undestroyed_sandboxes(&self, filter: &'static str, value: &str) -> Result<Vec<SandboxRow>, StoreError> {
        let sql = format!(
            "SELECT s.sandbox_id, s.subject_id, s.backend, s.root_path, u.uid, s.state FROM sandboxes s
             LEFT JOIN sandbox_uids u ON u.sandbox_id = s.sandbox_id AND u.node = s.node
             WHERE s.state NOT IN ('destroyed') AND {filter} AND s.node = $2
             ORDER BY s.created_at_ms"
        );
        let rows = sqlx::query(&sql).bind(value).bind(&self.node).fetch_all(&self.pool).await?;
        Ok(rows
            .iter()
            .map(|r| SandboxRow {
                sandbox_id: r.get(0),
                subject_id: r.get(1),
                backend: r.get(2),
                root_path: r.get::<String, _>(3).into(),
                uid: r.get::<Option<i64>, _>(4).map(|u| u as u32),
                destroying: r.get::<&str, _>(5) == SandboxState::Destroying.as_str(),
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

    /// Sandbox rows by state, as `(sandbox_id, subject_id, state)`.
    pub async fn sandboxes(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        let rows = sqlx::query("SELECT sandbox_id, subject_id, state FROM sandboxes ORDER BY created_at_ms")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect())
    }
}

/// [`Store::allocate_uid`] on `conn`: the pool's connection (each
/// statement its own commit) or a transaction's.
async fn allocate_uid_on(
    conn: &mut sqlx::AnyConnection,
    node: &str,
    first: u32,
    last: u32,
    sandbox_id: &str,
    usable: impl Fn(u32) -> bool,
) -> Result<Option<u32>, StoreError> {
    // A concurrent allocation may take a candidate first; the primary
    // key makes one of the two inserts a no-op, and the loser goes on
    // to the next candidate. Never-used uids go out lowest first, so
    // they are the ones above every uid handed out so far.
    let (low, high) = (first as i64, last as i64);
    // Two index lookups (each table's primary key), not a scan.
    let row = sqlx::query(&HANDED).bind(node).bind(low).bind(high).fetch_one(&mut *conn).await?;
    let handed = row.get::<Option<i64>, _>(0).max(row.get::<Option<i64>, _>(1));
    for uid in handed.map_or(low, |h| h + 1)..=high {
        if usable(uid as u32) && take_uid(&mut *conn, node, uid, sandbox_id).await? {
            return Ok(Some(uid as u32));
        }
    }
    // Then the released ones no sandbox holds, longest ago first, a page
    // at a time (in the order of `sandbox_uid_released_order`).
    let mut after = (i64::MIN, i64::MIN);
    loop {
        let page: Vec<(i64, i64)> = sqlx::query(
            "SELECT r.released_at_ms, r.uid FROM sandbox_uid_released r
             WHERE r.node = $1 AND r.uid >= $2 AND r.uid <= $3
               AND (r.released_at_ms > $4 OR (r.released_at_ms = $4 AND r.uid > $5))
               AND NOT EXISTS (SELECT 1 FROM sandbox_uids u WHERE u.node = r.node AND u.uid = r.uid)
             ORDER BY r.released_at_ms, r.uid LIMIT 64",
        )
        .bind(node)
        .bind(low)
        .bind(high)
        .bind(after.0)
        .bind(after.1)
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
        let Some(&last_of_page) = page.last() else { return Ok(None) };
        for &(_, uid) in &page {
            if usable(uid as u32) && take_uid(&mut *conn, node, uid, sandbox_id).await? {
                return Ok(Some(uid as u32));
            }
        }
        after = last_of_page;
    }
}

/// [`Store::insert_sandbox_with_uid`] on SQLite's one writer (run to its
/// end by [`to_its_end`]):
/// `opening` ([`OPEN_WITH_UID_SQLITE`]) stores the events and the row and
/// reads the highest uid handed out so far in one command; then, in the
/// common case, that uid + 1 and the commit go in a second. When that uid
/// is not `usable` (or the range's never-used uids are all out), the same
/// transaction goes on with [`allocate_uid_on`]'s search.
async fn open_with_uid_sqlite(
    pool: sqlx::AnyPool,
    opening: sqlx::query::Query<'static, sqlx::Any, sqlx::any::AnyArguments<'static>>,
    (node, sandbox_id): (String, String),
    (first, last): (u32, u32),
    usable: impl Fn(u32) -> bool,
) -> Result<Option<u32>, StoreError> {
    let (low, high) = (first as i64, last as i64);
    let mut conn = pool.acquire().await?;
    let allocated = async {
        let row = opening.fetch_all(&mut *conn).await?.into_iter().next().ok_or(sqlx::Error::RowNotFound)?;
        let handed = row.get::<Option<i64>, _>(0).max(row.get::<Option<i64>, _>(1));
        let next = handed.map_or(low, |h| h + 1);
        if next <= high && usable(next as u32) {
            // Above every uid handed out on this node: no row holds it, and
            // a conflict would fail the command before its commit.
            sqlx::query("INSERT INTO sandbox_uids (node, uid, sandbox_id) VALUES ($1, $2, $3); COMMIT;")
                .bind(&node)
                .bind(next)
                .bind(&sandbox_id)
                .execute(&mut *conn)
                .await?;
            return Ok(Some(next as u32));
        }
        let uid = allocate_uid_on(&mut conn, &node, first, last, &sandbox_id, usable).await?;
        let end = if uid.is_some() { "COMMIT" } else { "ROLLBACK" };
        sqlx::query(end).execute(&mut *conn).await?;
        Ok(uid)
    }
    .await;
    if allocated.is_err() {
        roll_back(conn).await;
    }
    allocated
}

/// Reserves `uid` for `sandbox_id` on `node`; false when another sandbox
/// took it first.
async fn take_uid(conn: &mut sqlx::AnyConnection, node: &str, uid: i64, sandbox_id: &str) -> Result<bool, StoreError> {
    let inserted =
        sqlx::query("INSERT INTO sandbox_uids (node, uid, sandbox_id) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
            .bind(node)
            .bind(uid)
            .bind(sandbox_id)
            .execute(conn)
            .await?;
    Ok(inserted.rows_affected() == 1)
}

/// A sandbox's intent row, over (`$1` its id, `$2` its subject, `$3` the
/// backend, `$4` the state, `$5` its root, `$6` the epoch, `$7` now, `$8`
/// the node): see [`bind_sandbox`].
const INSERT_SANDBOX: &str = "INSERT INTO sandboxes
         (sandbox_id, subject_id, backend, state, root_path, instance_epoch, created_at_ms, updated_at_ms, node)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8)";

/// The highest uid in a range handed out on a node (held, or given back),
/// over (node, low, high) as the placeholders named: two index lookups
/// (each table's primary key), not a scan.
fn handed(node: &str, low: &str, high: &str) -> String {
    format!(
        "SELECT (SELECT MAX(uid) FROM sandbox_uids WHERE node = {node} AND uid >= {low} AND uid <= {high}),
                (SELECT MAX(uid) FROM sandbox_uid_released WHERE node = {node} AND uid >= {low} AND uid <= {high})"
    )
}
static HANDED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| handed("$1", "$2", "$3"));

/// [`Store::insert_sandbox_carrying`] on SQLite: [`INSERT_SANDBOX`]'s
/// parameters, then `$9` the events' rows.
static INTENT_SQLITE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    sqlite_transaction(&[&super::INSERT_EVENTS_SQLITE.replace("$1", "$9"), INSERT_SANDBOX])
});

/// The opening command of [`Store::insert_sandbox_with_uid`] on SQLite,
/// its transaction left open: [`INSERT_SANDBOX`]'s parameters, `$9` the
/// events' rows, `$10` and `$11` the uid range; its one row is [`HANDED`]'s.
static OPEN_WITH_UID_SQLITE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "BEGIN IMMEDIATE; {}; {INSERT_SANDBOX}; {}",
        super::INSERT_EVENTS_SQLITE.replace("$1", "$9"),
        handed("$8", "$10", "$11")
    )
});

/// [`INSERT_SANDBOX`] bound for `new`, made `now` on `node`.
fn bind_sandbox<'q>(
    query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    new: NewSandbox<'_>,
    now: i64,
    node: &str,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>> {
    query
        .bind(new.sandbox_id.to_string())
        .bind(new.subject_id.to_string())
        .bind(new.backend.to_string())
        .bind(SandboxState::Creating.as_str())
        .bind(new.root.to_string_lossy().into_owned())
        .bind(new.epoch.to_string())
        .bind(now)
        .bind(node.to_string())
}

/// A destroyed sandbox's rows, over (`$1` its id, `$2` this node, `$3`
/// now): its uid remembered as released (so allocation hands it out again
/// as late as it can) and given back, and its row gone.
const DESTROYED: [&str; 3] = [
    "INSERT INTO sandbox_uid_released (node, uid, released_at_ms)
     SELECT node, uid, $3 FROM sandbox_uids WHERE sandbox_id = $1 AND node = $2
     ON CONFLICT (node, uid) DO UPDATE SET released_at_ms = excluded.released_at_ms",
    "DELETE FROM sandbox_uids WHERE sandbox_id = $1 AND node = $2",
    "DELETE FROM sandboxes WHERE sandbox_id = $1",
];
static DESTROYED_SQLITE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| sqlite_transaction(&DESTROYED));

/// [`adopt`]'s statement, over (`$1` the sandbox, `$2` the subject, `$3` now).
pub(super) const ADOPT: &str = "UPDATE sandboxes SET subject_id = $2, updated_at_ms = $3,
         state = CASE WHEN state = 'creating' THEN 'ready' ELSE state END
     WHERE sandbox_id = $1";

/// The row of sandbox `sandbox_id` names `subject_id` from now on (a warm
/// one was made for no run), and one still `creating` is `ready`: a run's
/// sandbox is marked ready by the write that stores its `sandbox_ready`.
pub(super) async fn adopt<'c, E>(conn: E, sandbox_id: &str, subject_id: &str) -> Result<(), StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    sqlx::query(ADOPT).bind(sandbox_id).bind(subject_id).bind(now_ms()).execute(conn).await?;
    Ok(())
}

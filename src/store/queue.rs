//! The fleet's queue (shared stores): an accepted execution is taken at
//! once by the node that accepted it when it has room, or waits in `queue`
//! for a node that has, which claims it in a transaction. Every place that
//! starts work — the accepting node taking it, a node claiming it, a
//! session opening — counts its principal's running work across the whole
//! fleet inside that transaction, under the principal's advisory lock, so
//! a burst on many nodes at once never admits more than `max_running`.
//!
//! Locks, always taken in this order within one transaction: queue rows
//! (`FOR UPDATE SKIP LOCKED`: claimers never wait on each other's rows),
//! principals' locks (sorted by name), the queue's length lock, and last
//! the share lock on the writer's node row (`check_fence`): a transaction
//! holding it then waits for nothing, so the node's lease renewal (which
//! updates that row) is never held up behind a queue of waiting writes.

use serde::{Deserialize, Serialize};

use super::*;
use crate::records::ExecuteCommand;

/// The first key of the fleet's advisory locks (the second names what).
const LOCK_SPACE: i32 = 7031;

/// What the accepting node did with a new execution.
#[derive(Debug)]
pub enum Enqueued {
    /// This node took it: stored `running`, on this node.
    Taken,
    /// Stored `pending`; it waits in the queue for a node with room.
    Queued,
    /// The request id was taken (see [`Inserted::Existing`]).
    Existing {
        /// The execution that holds the request id.
        record: Box<ExecutionRecord>,
        /// The digest of the request that created it.
        digest: String,
    },
    /// The queue already holds this many executions, its limit.
    Full(u64),
    /// The queue already holds this many of the principal's executions,
    /// its share.
    PrincipalFull(u64),
}

/// What a queued execution needs to run, as the accepting node stored it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QueuedWork {
    /// The command, with its task (deleted from the store once claimed).
    pub command: ExecuteCommand,
    /// The caller's `traceparent`, to join its trace where it runs.
    pub traceparent: Option<String>,
    /// The principal's `max_running` when it was accepted.
    pub quota: Option<usize>,
}

/// How the accepting node asks for a new execution to be stored.
pub struct Admit<'a> {
    /// Take it here (this node has room and can run it) if the
    /// principal's quota allows; otherwise queue it.
    pub take_here: bool,
    /// The labels a node needs to run it.
    pub needs: &'a [String],
    /// The most executions the queue may hold.
    pub max_queued: u64,
    /// The most of one principal's executions the queue may hold.
    pub max_queued_per_principal: u64,
}

/// The id PostgreSQL gave `tx`, to ask after its commit (see
/// [`Store::committed`]).
async fn transaction_id(tx: &mut sqlx::Transaction<'_, sqlx::Any>) -> Result<i64, StoreError> {
    Ok(sqlx::query("SELECT txid_current()").fetch_one(&mut **tx).await?.get::<i64, _>(0))
}

/// A claimed execution: its record (now `running` here) and its command.
pub struct Claimed {
    /// The record, as stored when it was accepted.
    pub record: ExecutionRecord,
    /// What to run.
    pub work: QueuedWork,
}

impl Store {
    /// Stores a new execution of a fleet (see the module): taken here, or
    /// queued. `record` is stored with the state and node that says.
    pub async fn enqueue_execution(
        &self,
        record: &ExecutionRecord,
        digest: &str,
        work: &QueuedWork,
        admit: Admit<'_>,
    ) -> Result<Enqueued, StoreError> {
        let mut tx = self.pool.begin().await?;
        let principal = &record.consumer.principal;
        let take = admit.take_here
            && match work.quota {
                Some(quota) => {
                    lock_principals(&mut tx, &[principal.as_str()]).await?;
                    running_of(&mut tx, principal).await? < quota as i64
                }
                None => true,
            };
        if !take {
            // The principal's lock first, then the queue's (the order the
            // take above holds them in).
            lock_principals(&mut tx, &[principal.as_str()]).await?;
            sqlx::query("SELECT pg_advisory_xact_lock($1, 0)").bind(LOCK_SPACE).execute(&mut *tx).await?;
            let queued: i64 = sqlx::query("SELECT COUNT(*) FROM queue").fetch_one(&mut *tx).await?.get(0);
            if queued >= admit.max_queued.min(i64::MAX as u64) as i64 {
                return Ok(Enqueued::Full(queued as u64));
            }
            let mine: i64 = sqlx::query("SELECT COUNT(*) FROM queue WHERE principal = $1")
                .bind(principal)
                .fetch_one(&mut *tx)
                .await?
                .get(0);
            if mine >= admit.max_queued_per_principal.min(i64::MAX as u64) as i64 {
                return Ok(Enqueued::PrincipalFull(mine as u64));
            }
        }
        // Last: a share lock on this node's row held while waiting for
        // another lock would hold up its lease renewal behind that wait.
        self.check_fence(&mut tx).await?;
        let state = if take { ExecutionState::Running } else { ExecutionState::Pending };
        let node = take.then_some(self.node.as_str());
        if !super::executions::insert_execution_on(&mut *tx, record, digest, state, node).await? {
            drop(tx);
            let (record, digest) = self.execution_holding(record).await?;
            return Ok(Enqueued::Existing { record, digest });
        }
        if !take {
            sqlx::query(
                "INSERT INTO queue (execution_id, principal, quota, needs, work, queued_at_ms) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(&record.execution_id)
            .bind(principal)
            .bind(work.quota.map(|q| q.min(i64::MAX as usize) as i64))
            .bind(serde_json::to_string(admit.needs)?)
            .bind(serde_json::to_string(work)?)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
            sqlx::query("SELECT pg_notify('corral_queue', '')").execute(&mut *tx).await?;
        }
        // Taken, an execution whose commit landed unanswered would be
        // `running` here with nothing running it; queued, it would run
        // while its caller, told it failed, starts it again.
        self.commit_landed(tx, "a submit's").await?;
        Ok(if take { Enqueued::Taken } else { Enqueued::Queued })
    }

    /// Claims up to `room` queued executions this node can run (its
    /// `labels` cover what each needs) and whose principal's fleet-wide
    /// quota allows one more, oldest first: each is `running` on this node
    /// and out of the queue when this returns.
    pub async fn claim_queued(&self, room: usize, labels: &[String]) -> Result<Vec<Claimed>, StoreError> {
        if room == 0 || !self.shared {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        // Only rows this node can run and whose principal has room (as
        // counted before its lock, checked again under it below) are read:
        // a queue headed by work this node may not run hides nothing from
        // it. The window (larger than the room: a count may have changed by
        // the lock) is taken past the rows another claimer holds, as LIMIT
        // counts only rows this one locks.
        let window = (room * 4).clamp(16, 256) as i64;
        let rows = sqlx::query(&format!(
            "WITH busy AS (
                 SELECT p.principal,
                     (SELECT COUNT(*) FROM executions e WHERE e.principal = p.principal AND e.state = 'running')
                   + (SELECT COUNT(*) FROM sessions s WHERE s.principal = p.principal AND s.{UNFINISHED_SESSION}) AS running
                 FROM (SELECT DISTINCT principal FROM queue WHERE quota IS NOT NULL) p
             ), ranked AS (
                 SELECT q.execution_id, q.queued_at_ms, q.quota, COALESCE(b.running, 0) AS running,
                     ROW_NUMBER() OVER (PARTITION BY q.principal ORDER BY q.queued_at_ms, q.execution_id) AS nth
                 FROM queue q LEFT JOIN busy b ON b.principal = q.principal
                 WHERE q.needs::jsonb <@ $2::jsonb
             )
             SELECT execution_id, principal, quota FROM queue
             WHERE execution_id IN (SELECT execution_id FROM ranked WHERE quota IS NULL OR running + nth <= quota)
             ORDER BY queued_at_ms, execution_id LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .bind(window)
        .bind(serde_json::to_string(labels)?)
        .fetch_all(&mut *tx)
        .await?;
        let candidates: Vec<(String, String, Option<i64>)> =
            rows.iter().map(|row| (row.get("execution_id"), row.get("principal"), row.get("quota"))).collect();
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let mut limited: Vec<&str> =
            candidates.iter().filter(|(_, _, quota)| quota.is_some()).map(|(_, p, _)| p.as_str()).collect();
        limited.sort_unstable();
        limited.dedup();
        lock_principals(&mut tx, &limited).await?;
        let mut running = std::collections::HashMap::new();
        for principal in limited {
            running.insert(principal.to_string(), running_of(&mut tx, principal).await?);
        }
        // After the principals' locks (see `enqueue_execution`).
        self.check_fence(&mut tx).await?;
        let mut claimed = Vec::new();
        for (id, principal, quota) in candidates {
            if claimed.len() == room {
                break;
            }
            if let Some(quota) = quota {
                let count = running.entry(principal).or_insert(0);
                if *count >= quota {
                    continue;
                }
                *count += 1;
            }
            let work = sqlx::query("DELETE FROM queue WHERE execution_id = $1 RETURNING work")
                .bind(&id)
                .fetch_one(&mut *tx)
                .await?;
            let work: QueuedWork = serde_json::from_str(work.get::<&str, _>(0))?;
            let row = sqlx::query(&format!(
                "UPDATE executions SET state = 'running', node = $2 WHERE execution_id = $1 RETURNING {EXECUTION}"
            ))
            .bind(&id)
            .bind(&self.node)
            .fetch_one(&mut *tx)
            .await?;
            claimed.push(Claimed { record: execution_from_row(&row)?, work });
        }
        // A claim whose commit landed unanswered would leave its executions
        // `running` here with nothing running them, and their queued work
        // deleted.
        self.commit_landed(tx, "a claim's").await?;
        Ok(claimed)
    }

    /// Commits `tx` (`whose`: what it does, for the log), or learns that its
    /// commit landed although it answered an error (see [`Store::committed`]).
    async fn commit_landed(&self, mut tx: sqlx::Transaction<'_, sqlx::Any>, whose: &str) -> Result<(), StoreError> {
        let xid = transaction_id(&mut tx).await?;
        if let Err(error) = tx.commit().await {
            if !self.committed(xid).await {
                return Err(error.into());
            }
            tracing::warn!(%error, "fleet: {whose} commit answered an error but landed");
        }
        Ok(())
    }

    /// Whether transaction `xid` committed, asked on a fresh connection
    /// after its commit answered an error: a PostgreSQL commit whose answer
    /// was lost to a reset connection or a failover may have landed all the
    /// same. Asked again while the server still says it is in progress (the
    /// commit may not have been read yet), up to 5 s; a transaction whose
    /// fate is still unknown then is taken as not committed, and logged.
    async fn committed(&self, xid: i64) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let status = sqlx::query("SELECT txid_status($1)").bind(xid).fetch_one(&self.pool).await;
            match status.map(|row| row.get::<Option<String>, _>(0)) {
                Ok(Some(status)) if status == "committed" => return true,
                Ok(Some(status)) if status == "aborted" => return false,
                Ok(status) => tracing::debug!(xid, ?status, "fleet: a commit's fate is not known yet"),
                Err(error) => tracing::warn!(xid, %error, "fleet: cannot read whether a commit landed"),
            }
            if std::time::Instant::now() >= deadline {
                tracing::error!(
                    xid,
                    "fleet: whether a commit landed is unknown; taken as not (recovery finds what it left)"
                );
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// How many executions wait in the queue (at most `usize::MAX`).
    pub async fn queued_count(&self) -> Result<usize, StoreError> {
        let row = sqlx::query("SELECT COUNT(*) FROM queue").fetch_one(&self.pool).await?;
        Ok(row.get::<i64, _>(0).max(0) as usize)
    }

    /// Takes a queued execution out of the queue before any node claimed
    /// it, making it this node's to finish; `false` when it is not queued
    /// (a node claimed it, or it never was).
    pub async fn cancel_queued(&self, execution_id: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        self.check_fence(&mut tx).await?;
        let deleted =
            sqlx::query("DELETE FROM queue WHERE execution_id = $1").bind(execution_id).execute(&mut *tx).await?;
        if deleted.rows_affected() == 0 {
            return Ok(false);
        }
        sqlx::query("UPDATE executions SET node = $2 WHERE execution_id = $1")
            .bind(execution_id)
            .bind(&self.node)
            .execute(&mut *tx)
            .await?;
        // Landed unanswered, it would leave the run `pending` in no queue:
        // never claimed, never finished.
        self.commit_landed(tx, "a cancel's").await?;
        Ok(true)
    }

    /// Inserts a new session; on a shared store with `quota`, only if its
    /// principal runs fewer than `quota` executions and sessions across the
    /// fleet. `Ok(None)`: the id is taken; `Err(Quota)` is
    /// [`SessionInsert::AtQuota`].
    pub async fn insert_session_admitted(
        &self,
        record: &SessionRecord,
        quota: Option<usize>,
    ) -> Result<SessionInsert, StoreError> {
        let Some(quota) = quota.filter(|_| self.shared) else {
            return Ok(match self.insert_session(record).await? {
                true => SessionInsert::Created,
                false => SessionInsert::Taken,
            });
        };
        let mut tx = self.pool.begin().await?;
        let principal = record.consumer.principal.as_str();
        lock_principals(&mut tx, &[principal]).await?;
        let running = running_of(&mut tx, principal).await?;
        if running >= quota as i64 {
            return Ok(SessionInsert::AtQuota(running as u64));
        }
        // After the principal's lock (see `enqueue_execution`): a lost
        // epoch stores no session.
        self.check_fence(&mut tx).await?;
        let inserted = super::sessions::insert_session_on(&mut *tx, record, &self.node).await?;
        if inserted {
            tx.commit().await?;
        }
        Ok(if inserted { SessionInsert::Created } else { SessionInsert::Taken })
    }
}

/// What [`Store::insert_session_admitted`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionInsert {
    /// Stored.
    Created,
    /// The session id is taken.
    Taken,
    /// Its principal runs this many executions and sessions: its quota.
    AtQuota(u64),
}

/// Takes the advisory lock of each principal, in the order given (sorted,
/// so two transactions never wait on each other in a circle), until the
/// transaction ends.
async fn lock_principals(conn: &mut sqlx::AnyConnection, principals: &[&str]) -> Result<(), StoreError> {
    for principal in principals {
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .bind(LOCK_SPACE)
            .bind(principal)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// What `principal` runs across the fleet: executions taken by a node and
/// not finished, and sessions not ended.
async fn running_of(conn: &mut sqlx::AnyConnection, principal: &str) -> Result<i64, StoreError> {
    let row = sqlx::query(&format!(
        "SELECT (SELECT COUNT(*) FROM executions WHERE principal = $1 AND state = 'running')
              + (SELECT COUNT(*) FROM sessions WHERE principal = $1 AND {UNFINISHED_SESSION})"
    ))
    .bind(principal)
    .fetch_one(&mut *conn)
    .await?;
    Ok(row.get::<i64, _>(0))
}

//! The store's the hub outbox: reports due, retried with backoff, settled.

use super::*;

impl Store {
    /// Up to `limit` pending reports of this node (or of no node) whose next
    /// attempt is due at `now` (Unix milliseconds), the most overdue first.
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

    /// On a shared store: makes this node the one to deliver the pending
    /// reports of nodes that never will (declared lost, or stopped with
    /// reports left undelivered), keeping their attempts and when each is
    /// due. A report goes to one node however many adopt at once (the
    /// update's condition no longer holds for the second). Returns how
    /// many it took.
    pub async fn adopt_reports(&self) -> Result<u64, StoreError> {
        if !self.shared {
            return Ok(0);
        }
        let adopted = sqlx::query(
            "UPDATE hub_outbox SET node = $1 WHERE state = 'pending'
               AND node IN (SELECT name FROM nodes WHERE state IN ('lost', 'stopped') AND name <> $1)",
        )
        .bind(&self.node)
        .execute(&self.pool)
        .await?;
        Ok(adopted.rows_affected())
    }

    /// Records a failed delivery: the attempts so far and when to try again
    /// (Unix milliseconds).
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
}

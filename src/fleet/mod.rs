//! The fleet (configured by `[fleet]`, `config::FleetConfig`): every daemon on a store is a node (`nodes` in the store).
//! Each node renews a lease; one that cannot fences itself (kills its
//! sandboxes and exits, to start again with a new epoch) before the lease
//! runs out; a survivor marks a node whose lease ran out lost — exactly
//! once, by a conditional update — and fails its unfinished runs; from then
//! on every write of a run by the lost epoch is refused by the store. No
//! node talks to another: the store is the only thing they share.
//!
//! On SQLite (one node) the same loop runs: the node's row is renewed and
//! listed, and nothing else can be lost.

pub mod lease;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::lifecycle::Engine;
use crate::store::{NodeState, StoreError};
use lease::{Renewal, Step};

/// A node's labels: what it can run (its sandbox backend and the agent
/// CLIs on its PATH), then the `[fleet] labels` its config adds.
pub fn labels(bwrap: bool, configured: &[String]) -> Vec<String> {
    let mut labels = Vec::new();
    if bwrap {
        labels.push("linux_bwrap".to_string());
    }
    for cli in ["claude", "codex"] {
        if crate::sandbox::find_on_path(cli).is_some() {
            labels.push(cli.to_string());
        }
    }
    for label in configured {
        if !labels.contains(label) {
            labels.push(label.clone());
        }
    }
    labels
}

/// Runs the lease loop and the sweep for lost nodes. It goes on through a
/// shutdown (`shutdown` cancelled: SIGTERM), while the node's runs end in
/// their grace, until the node has left the fleet or `left` is cancelled
/// (after [`Engine::shutdown`]): a lease that lapsed during the grace would
/// have a survivor declare the node lost and fail the runs it finishes. On
/// a fence it kills every sandbox, cancels `fenced` and `shutdown` (the
/// daemon then exits with an error, to start again with a new epoch).
pub fn spawn(
    engine: Arc<Engine>,
    lease: Duration,
    shutdown: CancellationToken,
    left: CancellationToken,
    fenced: CancellationToken,
) {
    tokio::spawn(async move {
        let lease_ms = lease.as_millis() as i64;
        // The loop starts after recovery, some time after the join: it
        // renews at once, and counts the lease from no later than that.
        let start = Instant::now();
        let mut clock = lease::Clock::new(lease, Duration::ZERO);
        // The sweep runs beside the loop, one at a time, and is aborted
        // with it: a sweep waiting on the store (its pool full, a query
        // cut off mid-way, a lost node's final write retried) must hold up
        // neither the next renewal nor the fence when renewals fail.
        let mut sweeping: Option<AbortOnDropHandle<()>> = None;
        loop {
            tokio::select! {
                _ = left.cancelled() => return,
                _ = tokio::time::sleep(clock.wait(start.elapsed())) => {}
            }
            // The store closes at the end of a shutdown, after the node
            // left the fleet (or could not: a survivor fails what is left).
            if shutdown.is_cancelled() && engine.store.is_closed() {
                return;
            }
            // Bounded, up to the moment to fence: a store out of reach must
            // not stall the loop past it. The lease runs from the moment
            // the renewal was sent: the store counts it from no earlier.
            let sent = start.elapsed();
            clock.sent(sent);
            let limit = clock.limit(sent);
            let running = engine.running() as u64;
            let renewal = match tokio::time::timeout(limit, engine.store.renew_lease(lease_ms, running)).await {
                Ok(Ok(state)) => Renewal::Renewed(state),
                Ok(Err(StoreError::Fenced { .. })) => Renewal::Fenced,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "fleet: lease not renewed");
                    Renewal::Failed
                }
                Err(_) => {
                    tracing::warn!(timeout_ms = limit.as_millis() as u64, "fleet: lease renewal timed out");
                    Renewal::Failed
                }
            };
            clock.answered(&renewal);
            if let Renewal::Renewed(NodeState::Active | NodeState::Draining) = renewal {
                engine.lease_holds_until(start + sent + lease::takes_work_for(lease));
            }
            let since_renewed = clock.since_renewed(start.elapsed());
            let stopping = shutdown.is_cancelled();
            // One store: nothing else can be lost, and its errors are the
            // node's own (a fence would only kill healthy work).
            let step = match (engine.store.is_shared(), lease::after(&renewal, since_renewed, lease, stopping)) {
                (false, Step::Fence(_)) => Step::Continue,
                (_, step) => step,
            };
            match step {
                Step::Continue => {}
                Step::Left => return,
                Step::Drain => {
                    if engine.start_draining() {
                        tracing::warn!(running, "fleet: draining as asked; no new work is taken");
                    }
                }
                Step::Fence(reason) => {
                    // No sweep of this start's writes goes on while it fences.
                    drop(sweeping.take());
                    tracing::error!(%reason, "fleet: this node fences itself: killing every sandbox, then exiting");
                    let killed = engine.fence().await;
                    tracing::error!(processes_killed = killed, "fleet: fenced");
                    fenced.cancel();
                    shutdown.cancel();
                    return;
                }
            }
            if matches!(renewal, Renewal::Renewed(NodeState::Active | NodeState::Draining))
                && engine.store.is_shared()
                && sweeping.as_ref().is_none_or(|sweep| sweep.is_finished())
            {
                let engine = engine.clone();
                sweeping = Some(AbortOnDropHandle::new(tokio::spawn(async move { sweep(&engine).await })));
            }
        }
    });
}

/// Listens, on one connection, for what other nodes tell this one (shared
/// stores only): `corral_requests` naming this node wakes its request
/// answering, `corral_events` naming a subject wakes this node's watchers
/// of that run, `corral_queue` wakes its claimer. Requests are read every second besides (a notification is
/// missed while the listener reconnects); watchers read the store every
/// 100 ms without a wakeup.
pub fn serve_notifications(engine: Arc<Engine>, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut listener = match engine.store.listen(&["corral_requests", "corral_events", "corral_queue"]).await {
            Ok(Some(listener)) => Some(listener),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "fleet: no LISTEN connection; requests are read every second, watchers poll");
                None
            }
        };
        // An interval, not a sleep per turn: a stream of notifications must
        // not keep postponing the look.
        let mut every_second = tokio::time::interval(Duration::from_secs(1));
        loop {
            let notified = async {
                match listener.as_mut() {
                    Some(listener) => listener.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every_second.tick() => engine.answer_requests().await,
                notified = notified => match notified {
                    Ok(n) if n.channel() == "corral_events" => engine.wake_watchers(n.payload()),
                    Ok(n) if n.channel() == "corral_queue" => engine.wake_claims(),
                    Ok(n) if n.payload() == engine.store.node() => engine.answer_requests().await,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "fleet: LISTEN failed; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                },
            }
        }
    });
}

/// Claims queued work whenever this node may have room for it: woken by
/// `NOTIFY corral_queue` (new work, or a run ended somewhere and freed a
/// place in a quota) and by its own runs ending, and once a second
/// besides (a notification missed while the listener reconnects).
pub fn spawn_claimer(engine: Arc<Engine>, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut every_second = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every_second.tick() => {}
                _ = engine.claims_wanted() => {}
            }
            engine.claim_work().await;
        }
    });
}

/// Marks lost every node whose lease ran out (each claimed by one sweeper
/// only), then fails the unfinished runs of every lost node, one survivor
/// at a time per node: those just marked, and those a survivor marked but
/// did not finish failing (it died, or a write failed), tried again at
/// every sweep until none is left. A node with a hub also takes the
/// pending hub reports of lost and stopped nodes, to deliver them.
async fn sweep(engine: &Engine) {
    match engine.store.claim_lost_nodes(crate::records::now_ms()).await {
        Ok(claimed) => {
            for node in claimed {
                tracing::error!(node = %node.name, epoch = %node.epoch, "fleet: node lost (its lease ran out); failing its runs");
            }
        }
        Err(e) => tracing::warn!(error = %e, "fleet: cannot look for lost nodes"),
    }
    let lost = match engine.store.lost_nodes_with_unfinished_runs().await {
        Ok(lost) => lost,
        Err(e) => return tracing::warn!(error = %e, "fleet: cannot look for the unfinished runs of lost nodes"),
    };
    for name in lost {
        let claim = match engine.store.claim_lost_node(&name).await {
            Ok(Some(claim)) => claim,
            // Another survivor fails them now, or the node started again.
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(node = %name, error = %e, "fleet: cannot take a lost node's runs");
                continue;
            }
        };
        match engine.fail_lost_node(&name).await {
            Ok((executions, sessions)) => {
                tracing::warn!(node = %name, executions, sessions, "fleet: a lost node's runs failed")
            }
            Err(e) => {
                tracing::error!(node = %name, error = %e, "fleet: a lost node's runs not failed; tried again at the next sweep")
            }
        }
        if let Err(e) = claim.release().await {
            tracing::warn!(node = %name, error = %e, "fleet: a lost node's lock not released; it goes with the connection");
        }
    }
    // After the runs above were failed: their reports are this node's
    // already. Only a node that reports to a hub takes them.
    if let Some(hub) = &engine.hub {
        match engine.store.adopt_reports().await {
            Ok(0) => {}
            Ok(reports) => {
                tracing::warn!(reports, "fleet: delivering the pending hub reports of lost or stopped nodes");
                hub.notify();
            }
            Err(e) => tracing::warn!(error = %e, "fleet: cannot take the hub reports of lost or stopped nodes"),
        }
    }
}

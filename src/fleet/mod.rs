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

use crate::lifecycle::Engine;
use crate::store::{NodeState, StoreError};
use lease::{Renewal, Step};

/// What a node can run, for `ListNodes`: its sandbox backend and the agent
/// CLIs on its PATH.
pub fn labels(bwrap: bool) -> Vec<String> {
    let mut labels = Vec::new();
    if bwrap {
        labels.push("linux_bwrap".to_string());
    }
    for cli in ["claude", "codex"] {
        if crate::sandbox::find_on_path(cli).is_some() {
            labels.push(cli.to_string());
        }
    }
    labels
}

/// Runs the lease loop and the sweep for lost nodes until `shutdown`. On
/// a fence it kills every sandbox, cancels `fenced` and `shutdown` (the
/// daemon then exits with an error, to start again with a new epoch).
pub fn spawn(engine: Arc<Engine>, lease: Duration, shutdown: CancellationToken, fenced: CancellationToken) {
    tokio::spawn(async move {
        let every = lease::renew_every(lease);
        let lease_ms = lease.as_millis() as i64;
        let mut renewed = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            // Bounded: a store out of reach must not stall the loop past
            // the point where the node has to fence itself.
            let running = engine.running() as u64;
            let renewal = match tokio::time::timeout(every, engine.store.renew_lease(lease_ms, running)).await {
                Ok(Ok(state)) => Renewal::Renewed(state),
                Ok(Err(StoreError::Fenced { .. })) => Renewal::Fenced,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "fleet: lease not renewed");
                    Renewal::Failed
                }
                Err(_) => {
                    tracing::warn!(timeout_ms = every.as_millis() as u64, "fleet: lease renewal timed out");
                    Renewal::Failed
                }
            };
            if let Renewal::Renewed(_) = renewal {
                renewed = Instant::now();
            }
            // One store: nothing else can be lost, and its errors are the
            // node's own (a fence would only kill healthy work).
            let step = match (engine.store.is_shared(), lease::after(&renewal, renewed.elapsed(), lease)) {
                (false, Step::Fence(_)) => Step::Continue,
                (_, step) => step,
            };
            match step {
                Step::Continue => {}
                Step::Drain => {
                    if engine.start_draining() {
                        tracing::warn!(running, "fleet: draining as asked; no new work is taken");
                    }
                }
                Step::Fence(reason) => {
                    tracing::error!(%reason, "fleet: this node fences itself: killing every sandbox, then exiting");
                    let killed = engine.fence().await;
                    tracing::error!(processes_killed = killed, "fleet: fenced");
                    fenced.cancel();
                    shutdown.cancel();
                    return;
                }
            }
            if matches!(renewal, Renewal::Renewed(NodeState::Active | NodeState::Draining)) && engine.store.is_shared()
            {
                sweep(&engine).await;
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

/// Fails the runs of every node whose lease ran out (each claimed by one
/// sweeper only).
async fn sweep(engine: &Engine) {
    let claimed = match engine.store.claim_lost_nodes(crate::records::now_ms()).await {
        Ok(claimed) => claimed,
        Err(e) => return tracing::warn!(error = %e, "fleet: cannot look for lost nodes"),
    };
    for node in claimed {
        tracing::error!(node = %node.name, epoch = %node.epoch, "fleet: node lost (its lease ran out); failing its runs");
        match engine.fail_lost_node(&node.name).await {
            Ok((executions, sessions)) => {
                tracing::warn!(node = %node.name, executions, sessions, "fleet: a lost node's runs failed")
            }
            Err(e) => tracing::error!(node = %node.name, error = %e, "fleet: a lost node's runs not failed"),
        }
    }
}

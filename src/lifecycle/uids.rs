//! Which host uid a new sandbox runs as: reserved in the store (so two
//! daemons on one store never hand out the same uid) before anything runs
//! as it.

/// What was stored when making a sandbox's row and uid failed.
pub(super) enum Stored {
    /// Nothing: the caller has nothing to undo.
    Nothing(crate::store::StoreError),
    /// The intent row: the caller marks it destroyed.
    Intent(crate::store::StoreError),
}

/// The intent row of sandbox `new` and its own host uid in `range`:
/// in one commit, with the first uid the kernel knows no task of (one
/// system call each), the common case. When there is none: the row, then
/// a uid whose tasks are all zombies (a /proc scan each: an init that reaps
/// slowly leaves the sandboxes' orphaned zombies around for a while).
/// `Ok(None)` (the row stored) when no uid is free. `events` are stored
/// in the row's commit: unless the answer is `Stored::Nothing`, they are.
pub(super) async fn insert_with_own_uid(
    store: &crate::store::Store,
    range: crate::sandbox::UidRange,
    new: crate::store::NewSandbox<'_>,
    events: &[crate::records::Event],
) -> Result<Option<u32>, Stored> {
    use crate::sandbox::host::{processes_of_uid, uid_may_have_processes};
    let bounds = (range.first, range.last);
    match store.insert_sandbox_with_uid(new, bounds, |uid| !uid_may_have_processes(uid), events).await {
        Ok(Some(uid)) => return Ok(Some(uid)),
        Ok(None) => {}
        Err(e) => return Err(Stored::Nothing(e)),
    }
    store.insert_sandbox_carrying(new, events).await.map_err(Stored::Nothing)?;
    // A /proc that cannot be read shows no uid free of tasks.
    let no_live_task = |uid| processes_of_uid(uid).is_ok_and(|pids| pids.is_empty());
    store.allocate_uid(range.first, range.last, new.sandbox_id, no_live_task).await.map_err(Stored::Intent)
}

//! Which host uid a new sandbox runs as: reserved in the store (so two
//! daemons on one store never hand out the same uid) before anything runs
//! as it.

/// A host uid in `range` for `sandbox_id`: first one the kernel knows no
/// task of (one system call each); only when there is none, one whose tasks
/// are all zombies (a /proc scan each: an init that reaps slowly leaves the
/// sandboxes' orphaned zombies around for a while).
pub(super) async fn allocate_own_uid(
    store: &crate::store::Store,
    range: crate::sandbox::UidRange,
    sandbox_id: &str,
) -> Result<Option<u32>, crate::store::StoreError> {
    use crate::sandbox::host::{processes_of_uid, uid_may_have_processes};
    match store.allocate_uid(range.first, range.last, sandbox_id, |uid| !uid_may_have_processes(uid)).await? {
        Some(uid) => Ok(Some(uid)),
        None => store.allocate_uid(range.first, range.last, sandbox_id, |uid| processes_of_uid(uid).is_empty()).await,
    }
}

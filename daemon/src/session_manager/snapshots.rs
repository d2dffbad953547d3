//! Snapshots of sessions' sandboxes, kept by the daemon. A snapshot is its sandbox's file
//! system (and its memory, where the provider keeps that: the microVM provider) apart from
//! the sandbox: it outlives the sandbox and its session, belongs to the session's owner,
//! and sandboxes are created from it (E2B's snapshot templates) or forks made through it.
//!
//! Each snapshot is one file, `<state_dir>/snapshots/<id>.json`, written aside, synced and
//! renamed into place, so a crash leaves it whole or absent; all are read back at start.
//! The provider keeps the snapshot's bytes; the record says which provider and which of
//! its snapshots. Taking one is recorded in the session's log too (`sandbox/snapshot`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use tether_protocol::events::{EventBody, Expiry};
use tether_provider::{CallCtx, Clock, ProviderError};

use super::{Scope, Session, SessionManager};
use crate::error::{DaemonError, Result};
use crate::leases::now_ms;
use crate::ops::SandboxOp;

/// One snapshot, as kept on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRecord {
    /// The daemon's id of the snapshot (`s` and 19 lowercase hex digits).
    pub id: String,
    /// The name its owner gave it, unique per owner: a later snapshot under the same
    /// name takes the name over (as E2B assigns a new build to a named snapshot).
    pub name: Option<String>,
    /// The tenant owning it: the owner of the session it was taken of.
    pub owner: Option<String>,
    /// The configured provider name that holds it.
    pub provider: String,
    /// The provider's id of it.
    pub provider_snapshot: String,
    /// The session it was taken of.
    pub session: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// That session's template.
    pub template: Option<String>,
    /// When it was taken, ms since the epoch.
    pub created_ms: i64,
}

/// The longest snapshot name.
pub const MAX_NAME: usize = 128;

/// The tag every snapshot has (E2B names a snapshot `<name>:<tag>`; tether keeps one
/// build per name, tagged `default`).
pub const TAG: &str = "default";

/// Whether `name` can name a snapshot: 1 to [`MAX_NAME`] letters, digits, `_`, `-` and
/// `.`, starting with a letter or digit.
pub fn valid_name(name: &str) -> bool {
    name.len() <= MAX_NAME
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// `reference` without its tag; `None` for a tag other than [`TAG`].
fn untagged(reference: &str) -> Option<&str> {
    match reference.split_once(':') {
        Some((r, tag)) if tag == TAG => Some(r),
        Some(_) => None,
        None => Some(reference),
    }
}

/// The snapshots, in memory and on disk.
#[derive(Debug)]
pub struct Snapshots {
    dir: PathBuf,
    by_id: RwLock<BTreeMap<String, SnapshotRecord>>,
    /// Taken while a record is written or removed, so two snapshots under one name never
    /// both keep it.
    change: tokio::sync::Mutex<()>,
}

impl Snapshots {
    /// Read every record under `dir` (created if missing). A file that is not a record is
    /// left where it is and said at start; a half-written one (`*.tmp`) is removed.
    pub async fn open(dir: PathBuf) -> Result<Self> {
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|e| DaemonError::internal(format!("cannot create {}: {e}", dir.display())))?;
        let mut by_id = BTreeMap::new();
        let mut rd = tokio::fs::read_dir(&dir)
            .await
            .map_err(|e| DaemonError::internal(format!("cannot read {}: {e}", dir.display())))?;
        while let Ok(Some(entry)) = rd.next_entry().await {
            let path = entry.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("json") => {}
                Some("tmp") => {
                    let _ = tokio::fs::remove_file(&path).await;
                    continue;
                }
                _ => continue,
            }
            let parsed = tokio::fs::read(&path)
                .await
                .map_err(|e| e.to_string())
                .and_then(|b| {
                    serde_json::from_slice::<SnapshotRecord>(&b).map_err(|e| e.to_string())
                });
            match parsed {
                Ok(r) if path.file_stem().and_then(|s| s.to_str()) == Some(r.id.as_str()) => {
                    by_id.insert(r.id.clone(), r);
                }
                Ok(r) => {
                    tracing::error!(path = %path.display(), id = %r.id, "A snapshot record is not in its own file; leaving it alone");
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "Cannot read a snapshot record; leaving it alone");
                }
            }
        }
        Ok(Self {
            dir,
            by_id: RwLock::new(by_id),
            change: tokio::sync::Mutex::new(()),
        })
    }

    /// The snapshot `reference` names in `scope`: its id or its name, with or without
    /// the `:default` tag (what E2B's `snapshotID` carries). An id wins over a name.
    pub fn find(&self, reference: &str, scope: Scope<'_>) -> Option<SnapshotRecord> {
        let m = self.by_id.read().ok()?;
        let seen = |s: &&SnapshotRecord| scope.sees_owner(s.owner.as_deref());
        let r = untagged(reference)?;
        m.get(r)
            .filter(seen)
            .or_else(|| {
                m.values()
                    .filter(seen)
                    .find(|s| s.name.as_deref() == Some(r))
            })
            .cloned()
    }

    /// The snapshots `scope` sees, oldest first, of one session (`session`) or named by
    /// `name` (its name or id, tagged or not, as [`Snapshots::find`]) when given.
    pub fn list(
        &self,
        scope: Scope<'_>,
        session: Option<&str>,
        name: Option<&str>,
    ) -> Vec<SnapshotRecord> {
        let Ok(m) = self.by_id.read() else {
            return Vec::new();
        };
        let mut v: Vec<SnapshotRecord> = m
            .values()
            .filter(|s| scope.sees_owner(s.owner.as_deref()))
            .filter(|s| session.is_none_or(|x| s.session == x))
            .filter(|s| {
                name.is_none_or(|x| {
                    untagged(x).is_some_and(|x| s.id == x || s.name.as_deref() == Some(x))
                })
            })
            .cloned()
            .collect();
        v.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        v
    }

    /// The provider snapshots that records keep (whichever provider's).
    pub fn provider_snapshots(&self) -> std::collections::HashSet<String> {
        self.by_id
            .read()
            .map(|m| m.values().map(|s| s.provider_snapshot.clone()).collect())
            .unwrap_or_default()
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Keep `rec`: durable on return. Returns the record it took the name from, now
    /// forgotten (its provider's snapshot is the caller's to delete).
    async fn put(&self, rec: &SnapshotRecord) -> Result<Option<SnapshotRecord>> {
        let _one = self.change.lock().await;
        let body = serde_json::to_vec_pretty(rec)
            .map_err(|e| DaemonError::internal(format!("cannot encode a snapshot: {e}")))?;
        write_whole(&self.dir, &self.path(&rec.id), body)
            .await
            .map_err(|e| DaemonError::internal(format!("cannot keep the snapshot: {e}")))?;
        let replaced = rec.name.as_deref().and_then(|n| {
            let m = self.by_id.read().ok()?;
            m.values()
                .find(|s| s.owner == rec.owner && s.name.as_deref() == Some(n))
                .cloned()
        });
        if let Some(old) = &replaced {
            self.forget(&old.id).await?;
        }
        if let Ok(mut m) = self.by_id.write() {
            m.insert(rec.id.clone(), rec.clone());
        }
        Ok(replaced)
    }

    /// Forget `id`: its file is gone on return (the record first, so nothing refers to
    /// the provider's snapshot when that is deleted).
    async fn forget(&self, id: &str) -> Result<()> {
        match tokio::fs::remove_file(self.path(id)).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(DaemonError::internal(format!(
                    "cannot remove the snapshot record: {e}"
                )));
            }
        }
        let _ = sync_dir(&self.dir).await;
        if let Ok(mut m) = self.by_id.write() {
            m.remove(id);
        }
        Ok(())
    }

    /// Remove the record `id` under the change lock.
    async fn remove(&self, id: &str) -> Result<()> {
        let _one = self.change.lock().await;
        self.forget(id).await
    }
}

/// Write `body` to `path` whole or not at all: aside, synced, renamed, the directory
/// synced.
async fn write_whole(dir: &Path, path: &Path, body: Vec<u8>) -> std::io::Result<()> {
    let (dir, path) = (dir.to_owned(), path.to_owned());
    tokio::task::spawn_blocking(move || {
        use std::io::Write as _;
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(&dir)?.sync_all()
    })
    .await
    .map_err(std::io::Error::other)?
}

async fn sync_dir(dir: &Path) -> std::io::Result<()> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || std::fs::File::open(&dir)?.sync_all())
        .await
        .map_err(std::io::Error::other)?
}

fn new_snapshot_id() -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("s{}", &u[..19])
}

/// How many forks one request may make.
pub const MAX_FORKS: usize = 20;

impl SessionManager {
    /// The snapshots.
    pub fn snapshots(&self) -> &Snapshots {
        &self.snapshots
    }

    /// Take a snapshot of session `id`'s sandbox, named `name` when given (a name its
    /// owner used before moves to the new one, the old snapshot deleted). Runs on a
    /// tracked task to its end even when the caller leaves: a snapshot taken is always
    /// recorded, or deleted. `CONFLICT` for a paused sandbox, `UNSUPPORTED` where the
    /// provider cannot take one.
    pub async fn snapshot(
        self: &Arc<Self>,
        ctx: &CallCtx,
        id: &str,
        name: Option<String>,
        scope: Scope<'_>,
    ) -> Result<SnapshotRecord> {
        if self.shutdown.is_cancelled() {
            return Err(DaemonError::ShuttingDown);
        }
        if let Some(n) = &name
            && !valid_name(n)
        {
            return Err(DaemonError::invalid(format!(
                "snapshot name {n:?}: 1 to {MAX_NAME} letters, digits, '_', '-' or '.', starting with a letter or digit"
            )));
        }
        let session = self.get(id, scope)?;
        let me = Arc::clone(self);
        let ctx = ctx.clone();
        self.tasks
            .spawn(async move { me.snapshot_now(&ctx, &session, name).await })
            .await
            .map_err(|e| DaemonError::internal(format!("the snapshot task failed: {e}")))?
    }

    async fn snapshot_now(
        &self,
        ctx: &CallCtx,
        session: &Arc<Session>,
        name: Option<String>,
    ) -> Result<SnapshotRecord> {
        let (sandbox_id, provider_snapshot) = self.take(ctx, session).await?;
        let rec = SnapshotRecord {
            id: new_snapshot_id(),
            name,
            owner: session.owner.clone(),
            provider: session.provider_name.clone(),
            provider_snapshot,
            session: session.id.clone(),
            sandbox_id: sandbox_id.clone(),
            template: session.params.template.clone(),
            created_ms: now_ms(),
        };
        let replaced = match self.snapshots.put(&rec).await {
            Ok(r) => r,
            Err(e) => {
                self.drop_provider_snapshot(&rec.provider, &rec.provider_snapshot)
                    .await;
                return Err(e);
            }
        };
        let logged = session
            .log
            .append(EventBody::SandboxSnapshot {
                sandbox_id,
                snapshot_id: rec.id.clone(),
            })
            .await;
        if let Err(e) = logged {
            // The snapshot is kept (its record is durable); the session's history lacks
            // the line, which is loud here.
            tracing::error!(session.id = %session.id, snapshot.id = %rec.id, error = %e, "Could not log a snapshot");
        }
        if let Some(old) = replaced {
            self.drop_provider_snapshot(&old.provider, &old.provider_snapshot)
                .await;
        }
        Ok(rec)
    }

    /// Take a provider snapshot of `session`'s running sandbox, under the operation
    /// layer's deadline, span and metric. Returns the sandbox id and the provider's
    /// snapshot id.
    async fn take(&self, ctx: &CallCtx, session: &Session) -> Result<(String, String)> {
        session.sandbox()?;
        let sandbox_id = session.sandbox_id().ok_or_else(|| DaemonError::Detached {
            id: session.id.clone(),
            why: "no sandbox was leased".into(),
        })?;
        let provider = session.provider();
        let snap = crate::ops::sandbox(session, ctx, SandboxOp::Snapshot, &sandbox_id, |c| {
            let id = sandbox_id.clone();
            async move { provider.snapshot(&c, &id).await }
        })
        .await?;
        Ok((sandbox_id, snap))
    }

    /// Delete the snapshot `reference` names in `scope` (its record first, then the
    /// provider's bytes). `SNAPSHOT_NOT_FOUND` when there is none.
    pub async fn delete_snapshot(
        &self,
        reference: &str,
        scope: Scope<'_>,
    ) -> Result<SnapshotRecord> {
        let rec =
            self.snapshots
                .find(reference, scope)
                .ok_or_else(|| DaemonError::SnapshotNotFound {
                    id: reference.to_owned(),
                })?;
        self.snapshots.remove(&rec.id).await?;
        self.drop_provider_snapshot(&rec.provider, &rec.provider_snapshot)
            .await;
        Ok(rec)
    }

    /// Delete a provider's snapshot under the configured deadline; a failure is logged
    /// (nothing refers to it any more).
    pub(super) async fn drop_provider_snapshot(&self, provider: &str, snap: &str) {
        let Some(p) = self.providers.get(provider) else {
            return;
        };
        let ctx = CallCtx::new(format!("snapshot-delete-{snap}"))
            .with_timeout(self.deadlines.sandbox_op, Clock::Total);
        if let Err(e) = p.delete_snapshot(&ctx, snap).await {
            tracing::warn!(provider = %provider, snapshot = %snap, error = %e, "Could not delete a provider's snapshot");
        }
    }

    /// At start, before any request: delete the snapshots providers keep of their own
    /// that no record names (a crash between a snapshot and its record, or during a
    /// fork, whose snapshot never outlives its daemon). Returns `provider/snapshot` of
    /// each deleted.
    pub(super) async fn sweep_snapshots(&self) -> Vec<String> {
        let kept = self.snapshots.provider_snapshots();
        let mut deleted = Vec::new();
        for (name, p) in self.providers.iter() {
            let ctx = CallCtx::new("snapshot-sweep")
                .with_timeout(self.deadlines.sandbox_op, Clock::Total);
            let ids = match p.list_snapshots(&ctx).await {
                Ok(ids) => ids,
                Err(ProviderError::Unsupported { .. }) => continue,
                Err(e) => {
                    tracing::warn!(provider = %name, error = %e, "Could not list a provider's snapshots");
                    continue;
                }
            };
            for id in ids.into_iter().filter(|id| !kept.contains(id)) {
                tracing::info!(provider = %name, snapshot = %id, "Deleting a snapshot no record names");
                self.drop_provider_snapshot(name, &id).await;
                deleted.push(format!("{name}/{id}"));
            }
        }
        deleted
    }

    /// The provider snapshot a fork of `parent` starts from: `None` where there is
    /// nothing to copy (no sandbox) or the provider cannot take snapshots and `required`
    /// is false (the fork gets a fresh sandbox).
    pub(super) async fn fork_source(
        &self,
        ctx: &CallCtx,
        parent: &Session,
        required: bool,
    ) -> Result<Option<String>> {
        if parent.sandbox_id().is_none() || parent.state() != super::SessionState::Active {
            return if required {
                Err(DaemonError::SessionNotFound {
                    id: parent.id.clone(),
                })
            } else {
                Ok(None)
            };
        }
        match self.take(ctx, parent).await {
            Ok((_, snap)) => Ok(Some(snap)),
            Err(DaemonError::Provider(ProviderError::Unsupported { .. })) if !required => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Fork session `id` `count` times (1 to [`MAX_FORKS`]): one snapshot of its sandbox,
    /// then each fork a new session with the parent's log and parameters (`expiry`
    /// instead of the parent's), whose sandbox starts from that snapshot. Each fork
    /// succeeds or fails on its own; the snapshot is deleted after. Runs on a tracked
    /// task to its end. `UNSUPPORTED` where the provider cannot take snapshots.
    pub async fn fork_many(
        self: &Arc<Self>,
        ctx: &CallCtx,
        id: &str,
        count: usize,
        expiry: Expiry,
        scope: Scope<'_>,
    ) -> Result<Vec<Result<Arc<Session>>>> {
        if self.shutdown.is_cancelled() {
            return Err(DaemonError::ShuttingDown);
        }
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(DaemonError::invalid(format!(
                "count must be between 1 and {MAX_FORKS}"
            )));
        }
        let parent = self.get(id, scope)?;
        let me = Arc::clone(self);
        let ctx = ctx.clone();
        self.tasks
            .spawn(async move {
                let Some(snap) = me.fork_source(&ctx, &parent, true).await? else {
                    return Err(DaemonError::SessionNotFound {
                        id: parent.id.clone(),
                    });
                };
                let forks =
                    (0..count).map(|_| me.fork_one(&ctx, &parent, None, expiry, Some(&snap)));
                let made = futures_util::future::join_all(forks).await;
                me.drop_provider_snapshot(&parent.provider_name, &snap)
                    .await;
                Ok(made)
            })
            .await
            .map_err(|e| DaemonError::internal(format!("the fork task failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rec(id: &str, name: Option<&str>, owner: Option<&str>, at: i64) -> SnapshotRecord {
        SnapshotRecord {
            id: id.into(),
            name: name.map(Into::into),
            owner: owner.map(Into::into),
            provider: "local".into(),
            provider_snapshot: format!("p-{id}"),
            session: "i1".into(),
            sandbox_id: "sb".into(),
            template: Some("base".into()),
            created_ms: at,
        }
    }

    #[test]
    fn names_are_short_plain_words() {
        for ok in ["keep", "snap-filter-1a2b", "v1.2_x", &"a".repeat(MAX_NAME)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "",
            "-x",
            ".x",
            "a b",
            "a/b",
            "a:b",
            "é",
            &"a".repeat(MAX_NAME + 1),
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[tokio::test]
    async fn records_survive_a_reopen_and_a_name_moves_to_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("snapshots");
        let s = Snapshots::open(path.clone()).await.unwrap();
        assert_eq!(
            s.put(&rec("s1", Some("keep"), Some("a"), 1)).await.unwrap(),
            None
        );
        assert_eq!(
            s.put(&rec("s2", Some("keep"), Some("b"), 2)).await.unwrap(),
            None
        );
        // The same owner's name moves; the record it left is returned and gone.
        let old = s.put(&rec("s3", Some("keep"), Some("a"), 3)).await.unwrap();
        assert_eq!(old.map(|r| r.id), Some("s1".into()));
        // A torn write and a file that is no record, as a crash or a hand could leave.
        std::fs::write(path.join("s9.tmp"), b"{\"id\":").unwrap();
        std::fs::write(path.join("s8.json"), b"not json").unwrap();
        let s = Snapshots::open(path.clone()).await.unwrap();
        assert!(!path.join("s9.tmp").exists());
        assert!(
            path.join("s8.json").exists(),
            "an unreadable record is left alone"
        );
        let a = Scope::Owner(Some("a"));
        let ids: Vec<String> = s
            .list(Scope::Any, None, None)
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(ids, ["s2", "s3"]);
        assert_eq!(s.find("keep:default", a).map(|r| r.id), Some("s3".into()));
        assert_eq!(
            s.find("keep", Scope::Owner(Some("b"))).map(|r| r.id),
            Some("s2".into())
        );
        assert_eq!(s.find("s3", a).map(|r| r.id), Some("s3".into()));
        assert_eq!(s.find("keep:v2", a), None, "one tag: default");
        assert_eq!(s.find("s2", a), None, "another owner's");
        assert_eq!(s.find("keep", Scope::Owner(None)), None);
        let named = |n: &str| -> Vec<String> {
            s.list(a, None, Some(n)).into_iter().map(|r| r.id).collect()
        };
        assert_eq!(named("keep:default"), ["s3"]);
        assert_eq!(named("s3"), ["s3"]);
        assert!(named("keep:v1").is_empty());
        s.remove("s3").await.unwrap();
        assert_eq!(s.find("keep", a), None);
        assert!(!path.join("s3.json").exists());
    }
}

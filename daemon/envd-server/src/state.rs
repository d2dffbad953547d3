//! envd's per-sandbox state.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};

/// envd's state of one sandbox: what envd itself keeps, beyond the sandbox's files and
/// processes.
#[derive(Debug)]
pub struct EnvdState {
    pub(crate) init: RwLock<InitState>,
    /// Command ids that the client chose (E2B tags), as opposed to generated ones.
    pub(crate) tags: RwLock<HashSet<String>>,
    /// User metadata of files written through `/files` (`X-Metadata-*`), by path.
    pub(crate) file_meta: RwLock<HashMap<String, BTreeMap<String, String>>>,
    pub(crate) watchers: RwLock<HashMap<String, Arc<crate::filesystem::Watcher>>>,
    /// Uploads in flight (`None`) or just answered (until when), by path: the watches
    /// drop the provider's own events of these paths and report envd's instead.
    pub(crate) uploads: RwLock<HashMap<String, Option<tokio::time::Instant>>>,
    /// envd's events of answered uploads, for the `WatchDir` streams.
    pub(crate) announced: tokio::sync::broadcast::Sender<crate::filesystem::Announced>,
    /// Deadline of the front's own file operations on this sandbox (from config).
    pub(crate) fs_op: std::time::Duration,
}

/// How long after an upload was answered the provider's events of its path are dropped.
const UPLOAD_QUIET: std::time::Duration = std::time::Duration::from_secs(2);

/// Announcements a slow `WatchDir` stream may lag behind before it loses some.
const ANNOUNCE_BUFFER: usize = 256;

/// Defaults set by envd's `POST /init`.
#[derive(Debug, Clone, Default)]
pub(crate) struct InitState {
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) default_user: Option<String>,
    pub(crate) default_workdir: Option<String>,
}

impl EnvdState {
    /// A sandbox's state before its first request; the server's own file operations on
    /// it are bounded by `fs_op`.
    pub fn new(fs_op: std::time::Duration) -> Self {
        Self {
            fs_op,
            init: RwLock::new(InitState::default()),
            tags: RwLock::new(HashSet::new()),
            file_meta: RwLock::new(HashMap::new()),
            watchers: RwLock::new(HashMap::new()),
            uploads: RwLock::new(HashMap::new()),
            announced: tokio::sync::broadcast::channel(ANNOUNCE_BUFFER).0,
        }
    }

    /// An upload of `path` starts: the watches stop reporting the provider's events of it.
    pub(crate) fn upload_started(&self, path: &str) {
        if let Ok(mut u) = self.uploads.write() {
            let now = tokio::time::Instant::now();
            u.retain(|_, until| until.is_none_or(|t| t > now));
            u.insert(path.to_owned(), None);
        }
    }

    /// An upload of `path` was answered: the provider's late events of it stay dropped for
    /// a moment.
    pub(crate) fn upload_ended(&self, path: &str) {
        if let Ok(mut u) = self.uploads.write() {
            u.insert(
                path.to_owned(),
                Some(tokio::time::Instant::now() + UPLOAD_QUIET),
            );
        }
    }

    /// Whether the provider's events of `path` are dropped now.
    pub(crate) fn upload_quiet(&self, path: &str) -> bool {
        self.uploads
            .read()
            .ok()
            .and_then(|u| u.get(path).copied())
            .is_some_and(|until| until.is_none_or(|t| t > tokio::time::Instant::now()))
    }

    pub(crate) fn init(&self) -> InitState {
        self.init.read().map(|g| g.clone()).unwrap_or_default()
    }

    pub(crate) fn is_tag(&self, command_id: &str) -> bool {
        self.tags
            .read()
            .map(|t| t.contains(command_id))
            .unwrap_or(false)
    }

    pub(crate) fn meta_of(&self, path: &str) -> BTreeMap<String, String> {
        self.file_meta
            .read()
            .ok()
            .and_then(|m| m.get(path).cloned())
            .unwrap_or_default()
    }

    pub(crate) fn set_meta(&self, path: &str, meta: Option<BTreeMap<String, String>>) {
        if let Ok(mut m) = self.file_meta.write() {
            match meta {
                Some(meta) if !meta.is_empty() => {
                    m.insert(path.to_owned(), meta);
                }
                _ => {
                    m.remove(path);
                }
            }
        }
    }

    /// A path was removed or moved away: its metadata (and that of anything below it) goes
    /// with it, to `to` when it was moved.
    pub(crate) fn move_meta(&self, from: &str, to: Option<&str>) {
        if let Ok(mut m) = self.file_meta.write() {
            let prefix = format!("{}/", from.trim_end_matches('/'));
            let moved: Vec<String> = m
                .keys()
                .filter(|k| *k == from || k.starts_with(&prefix))
                .cloned()
                .collect();
            for k in moved {
                if let Some(v) = m.remove(&k)
                    && let Some(to) = to
                {
                    m.insert(format!("{to}{}", &k[from.len()..]), v);
                }
            }
        }
    }

    /// Stop the sandbox's watchers (it is gone).
    pub fn stop_watchers(&self) {
        let all: Vec<_> = self
            .watchers
            .write()
            .map(|mut w| w.drain().map(|(_, v)| v).collect())
            .unwrap_or_default();
        for w in all {
            w.stop();
        }
    }
}

//! The lease ledger: a durable local record of every sandbox the daemon asked for.
//!
//! Before a provider is asked to create a sandbox, the intent is appended and synced;
//! the sandbox id is appended once known; the release is appended when the sandbox is
//! destroyed. Every sandbox is also stamped with `tether.session` and `tether.daemon`
//! metadata at the provider, so the reconciler can find this daemon's sandboxes that no
//! live session owns (a crash between create and record included) and destroy them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

/// Metadata key holding the owning session id.
pub const META_SESSION: &str = "tether.session";
/// Metadata key holding the owning daemon's id.
pub const META_DAEMON: &str = "tether.daemon";

/// One line of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LeaseRecord {
    /// A sandbox is about to be created for the session.
    Intent {
        /// Session id.
        session: String,
        /// Provider name.
        provider: String,
        /// Time, ms since the epoch.
        time: i64,
    },
    /// The provider created it.
    Created {
        /// Session id.
        session: String,
        /// Sandbox id.
        sandbox_id: String,
        /// Time.
        time: i64,
    },
    /// It was destroyed (or found gone).
    Released {
        /// Session id.
        session: String,
        /// Why.
        reason: String,
        /// Time.
        time: i64,
    },
}

/// The state of one lease, folded from the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lease {
    /// Provider name.
    pub provider: String,
    /// Sandbox id once created.
    pub sandbox_id: Option<String>,
    /// Released.
    pub released: bool,
}

/// The append-only ledger file `<state_dir>/leases.jsonl`.
#[derive(Debug)]
pub struct LeaseLedger {
    path: PathBuf,
    file: Mutex<Option<tokio::fs::File>>,
}

impl LeaseLedger {
    /// Open (or create) the ledger.
    pub async fn open(state_dir: &Path) -> std::io::Result<Self> {
        tokio::fs::create_dir_all(state_dir).await?;
        let path = state_dir.join("leases.jsonl");
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await?;
        Ok(Self {
            path,
            file: Mutex::new(Some(file)),
        })
    }

    /// Append a record and sync it.
    pub async fn record(&self, rec: &LeaseRecord) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(rec).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut guard = self.file.lock().await;
        let f = guard
            .as_mut()
            .ok_or_else(|| std::io::Error::other("ledger closed"))?;
        f.write_all(&line).await?;
        f.sync_data().await
    }

    /// Fold the ledger into the state of every lease. A torn last line is ignored.
    pub async fn load(&self) -> std::io::Result<BTreeMap<String, Lease>> {
        let text = tokio::fs::read_to_string(&self.path)
            .await
            .unwrap_or_default();
        let mut out: BTreeMap<String, Lease> = BTreeMap::new();
        for line in text.lines() {
            let Ok(rec) = serde_json::from_str::<LeaseRecord>(line) else {
                continue;
            };
            match rec {
                LeaseRecord::Intent {
                    session, provider, ..
                } => {
                    out.insert(
                        session,
                        Lease {
                            provider,
                            sandbox_id: None,
                            released: false,
                        },
                    );
                }
                LeaseRecord::Created {
                    session,
                    sandbox_id,
                    ..
                } => {
                    out.entry(session).or_default().sandbox_id = Some(sandbox_id);
                }
                LeaseRecord::Released { session, .. } => {
                    out.entry(session).or_default().released = true;
                }
            }
        }
        Ok(out)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ledger_folds_records() {
        let dir = tempfile::tempdir().unwrap();
        let l = LeaseLedger::open(dir.path()).await.unwrap();
        l.record(&LeaseRecord::Intent {
            session: "a".into(),
            provider: "local".into(),
            time: 1,
        })
        .await
        .unwrap();
        l.record(&LeaseRecord::Created {
            session: "a".into(),
            sandbox_id: "sb".into(),
            time: 2,
        })
        .await
        .unwrap();
        l.record(&LeaseRecord::Intent {
            session: "b".into(),
            provider: "local".into(),
            time: 3,
        })
        .await
        .unwrap();
        l.record(&LeaseRecord::Released {
            session: "a".into(),
            reason: "closed".into(),
            time: 4,
        })
        .await
        .unwrap();
        let m = l.load().await.unwrap();
        assert_eq!(
            m["a"],
            Lease {
                provider: "local".into(),
                sandbox_id: Some("sb".into()),
                released: true
            }
        );
        assert_eq!(
            m["b"],
            Lease {
                provider: "local".into(),
                sandbox_id: None,
                released: false
            }
        );
    }
}

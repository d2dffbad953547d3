//! Session-log append throughput under group commit.
//!
//! For 1, 16 and 256 concurrent writers, appends 20 000 events (fsync on, invariants on, as
//! the daemon runs) to a fresh log and prints events/s and the number of `fdatasync`s the
//! writer made: with group commit, concurrent appenders share one write and one sync per
//! batch, so throughput grows with concurrency while syncs per event fall.
//!
//! Run: `cargo bench -p tether-tests --bench log_append`. The log lives in a temporary
//! directory (`TMPDIR`), so the figures are those of that file system.

// A benchmark: a panic is how it reports a failed setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::error::Error;
use std::sync::Arc;

use tether_daemon::session_log::{LogConfig, LogError, SessionLog};
use tether_protocol::events::EventBody;
use tokio::time::Instant;

/// Events appended per run.
const EVENTS: u64 = 20_000;
/// Concurrent writers per run.
const WRITERS: [u64; 3] = [1, 16, 256];

fn main() -> Result<(), Box<dyn Error>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run())
}

async fn run() -> Result<(), Box<dyn Error>> {
    let base = tempfile::tempdir()?;
    println!(
        "session log append, group commit, fsync on, {EVENTS} events per run, in {}",
        base.path().display()
    );
    println!();
    println!("| writers | events | seconds | events/s | fdatasyncs | events/fdatasync |");
    println!("|--------:|-------:|--------:|---------:|-----------:|-----------------:|");
    for writers in WRITERS {
        let id = format!("bench-{writers}");
        let dir = base.path().join(&id);
        let log = SessionLog::create(
            &dir,
            SessionLog::new_header(
                &id,
                tether_protocol::events::SessionParams {
                    provider: "bench".into(),
                    template: None,
                    env: Default::default(),
                    network: false,
                    metadata: Default::default(),
                    owner: None,
                    expiry: Default::default(),
                    limits: Default::default(),
                    ports: Default::default(),
                    snapshot: None,
                    lifecycle: Default::default(),
                    egress: Default::default(),
                },
            ),
            LogConfig::default(),
        )
        .await?;
        let start = Instant::now();
        let tasks: Vec<_> = (0..writers)
            .map(|w| {
                // Spread EVENTS over the writers, the remainder to the first ones.
                let count = EVENTS / writers + u64::from(w < EVENTS % writers);
                tokio::spawn(append_many(log.clone(), w, count))
            })
            .collect();
        for t in tasks {
            t.await??;
        }
        let secs = start.elapsed().as_secs_f64();
        let stats = log.stats();
        log.close().await;
        if stats.durable_events != EVENTS {
            return Err(
                format!("{} events durable, {EVENTS} expected", stats.durable_events).into(),
            );
        }
        println!(
            "| {writers:>7} | {EVENTS:>6} | {secs:>7.3} | {:>8.0} | {:>10} | {:>16.1} |",
            EVENTS as f64 / secs,
            stats.fdatasyncs,
            EVENTS as f64 / stats.fdatasyncs.max(1) as f64,
        );
    }
    Ok(())
}

/// One writer: `count` sequential appends of a small, typical event.
async fn append_many(log: Arc<SessionLog>, writer: u64, count: u64) -> Result<(), LogError> {
    for i in 0..count {
        log.append(EventBody::FsOp {
            op: "write".into(),
            path: format!("/home/user/src/module_{writer}/file_{i}.rs"),
            outcome: "ok".into(),
            bytes: Some(4096 + i),
        })
        .await?;
    }
    Ok(())
}

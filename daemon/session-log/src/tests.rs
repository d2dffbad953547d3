//! Tests of the session log against real files in temporary directories.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::{StreamExt, TryStreamExt};
use serde_json::json;
use tether_protocol::ErrorCode;
use tether_protocol::events::{Event, EventBody, Message, Source, ToolResult, TurnEndKind};
use tether_protocol::process::{ExitStatus, ProcessSpec, StreamKind};

use super::*;

fn params() -> SessionParams {
    SessionParams {
        provider: "local".into(),
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
    }
}

fn header(id: &str) -> SessionHeader {
    SessionLog::new_header(id, params())
}

fn user(text: &str) -> EventBody {
    EventBody::UserMessage {
        content: text.into(),
        source: Source::User,
    }
}

fn turn_start(turn: u64, ids: &[&str]) -> EventBody {
    EventBody::TurnStart {
        turn,
        call_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
    }
}

fn call(id: &str) -> EventBody {
    EventBody::ToolCall {
        call_id: id.into(),
        name: "bash".into(),
        arguments: json!({"command": "ls"}),
    }
}

fn result(id: &str, call_seq: u64) -> EventBody {
    EventBody::ToolResult {
        result: ToolResult {
            call_id: id.into(),
            is_error: false,
            content: format!("out of {id}"),
            error: None,
            additional_contexts: vec![],
        },
        call_seq: Some(call_seq),
    }
}

fn turn_end(turn: u64) -> EventBody {
    EventBody::TurnEnd {
        turn,
        kind: TurnEndKind::Completed,
    }
}

async fn new_log(dir: &Path, id: &str) -> Arc<SessionLog> {
    SessionLog::create(dir, header(id), LogConfig::default())
        .await
        .unwrap()
}

/// The event lines on disk, parsed independently of the log.
fn disk_events(dir: &Path) -> Vec<Event> {
    let text = std::fs::read_to_string(dir.join(EVENTS_FILE)).unwrap();
    text.lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn file_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(EVENTS_FILE)).unwrap().len()
}

// === create, append, open ===

#[tokio::test]
async fn round_trip_through_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s1");
    let log = new_log(&dir, "s1").await;
    assert_eq!(log.next_seq(), 0);
    let first = log.append(user("hello")).await.unwrap();
    assert_eq!(first.seq, 0);
    let rest = log
        .append_all(vec![
            turn_start(0, &["c1"]),
            EventBody::AssistantMessage {
                content: "looking".into(),
            },
            call("c1"),
            result("c1", 3),
            turn_end(0),
        ])
        .await
        .unwrap();
    assert_eq!(
        rest.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );
    assert_eq!(log.next_seq(), 6);
    assert_eq!(log.open_turn(), None);
    let events = log.events_after(None).await.unwrap();
    assert_eq!(
        log.events_after(Some(3)).await.unwrap(),
        events[4..].to_vec()
    );
    assert_eq!(
        log.events_after(Some(99)).await.unwrap(),
        Vec::<Event>::new()
    );
    assert_eq!(disk_events(&dir), events);
    let messages = log.derive_messages().await.unwrap();
    assert_eq!(messages.len(), 3);
    log.close().await;
    assert!(log.is_closed());
    assert_eq!(
        log.append(user("late")).await.unwrap_err().code(),
        ErrorCode::SessionNotFound
    );

    let (again, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
    assert!(!report.changed(), "{report:?}");
    assert_eq!(again.header(), log.header());
    assert_eq!(again.events_after(None).await.unwrap(), events);
    assert_eq!(again.derive_messages().await.unwrap(), messages);
    assert_eq!(again.append(user("more")).await.unwrap().seq, 6);
    again.close().await;
}

#[tokio::test]
async fn create_open_and_writers_are_exclusive() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s1");
    let log = new_log(&dir, "s1").await;
    let err = SessionLog::create(&dir, header("s1"), LogConfig::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    // One live writer: a second open while the first is live is refused.
    let err = SessionLog::open(&dir, LogConfig::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    log.close().await;
    let (again, _) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
    again.close().await;

    let err = SessionLog::open(&tmp.path().join("nope"), LogConfig::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::SessionNotFound);
    let err = SessionLog::create(&tmp.path().join("x"), header("../x"), LogConfig::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidRequest);
}

#[tokio::test]
async fn list_sessions_finds_logs_only() {
    let tmp = tempfile::tempdir().unwrap();
    let sessions = sessions_dir(tmp.path());
    assert_eq!(
        list_sessions(&sessions).await.unwrap(),
        Vec::<String>::new()
    );
    for id in ["b", "a"] {
        new_log(&session_dir(tmp.path(), id).unwrap(), id)
            .await
            .close()
            .await;
    }
    std::fs::create_dir_all(sessions.join("stray")).unwrap();
    assert_eq!(
        list_sessions(&sessions).await.unwrap(),
        vec!["a".to_owned(), "b".to_owned()]
    );
}

// === group commit and durability ===

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seqs_are_contiguous_under_256_concurrent_appenders() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    let mut tasks = Vec::new();
    for w in 0..256u32 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let one = log.append(user(&format!("w{w} single"))).await.unwrap();
            let group = log
                .append_all(vec![
                    user(&format!("w{w} g0")),
                    user(&format!("w{w} g1")),
                    user(&format!("w{w} g2")),
                ])
                .await
                .unwrap();
            (one, group)
        }));
    }
    let mut seqs = Vec::new();
    for t in tasks {
        let (one, group) = t.await.unwrap();
        // A group's events are contiguous.
        assert_eq!(
            group.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (group[0].seq..group[0].seq + 3).collect::<Vec<_>>()
        );
        seqs.push(one.seq);
        seqs.extend(group.iter().map(|e| e.seq));
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (0..1024).collect::<Vec<_>>());
    let on_disk = disk_events(&dir);
    assert_eq!(
        on_disk.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (0..1024).collect::<Vec<_>>()
    );
    assert_eq!(on_disk, log.events_after(None).await.unwrap());
    let stats = log.stats();
    assert_eq!(stats.durable_events, 1024);
    assert!(stats.fdatasyncs <= 512, "{stats:?}");
    log.close().await;
}

/// On a single-threaded runtime every appender queues before the writer runs again, so
/// 256 appends share very few `fdatasync`s.
#[tokio::test]
async fn concurrent_appends_share_fdatasyncs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    let tasks: Vec<_> = (0..256)
        .map(|i| {
            let log = log.clone();
            tokio::spawn(async move { log.append(user(&i.to_string())).await.unwrap() })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let stats = log.stats();
    assert_eq!(stats.durable_events, 256);
    assert_eq!(stats.fdatasyncs, stats.batches);
    assert!(
        stats.fdatasyncs <= 8,
        "256 appends took {} fdatasyncs",
        stats.fdatasyncs
    );
    log.close().await;
}

#[tokio::test]
async fn an_acknowledged_append_is_synced_and_on_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    for i in 0..5u64 {
        let e = log.append(user(&format!("m{i}"))).await.unwrap();
        let stats = log.stats();
        // Acknowledged only after the batch's fdatasync: the counters already include it.
        assert!(stats.durable_events > e.seq);
        assert_eq!(stats.fdatasyncs, i + 1);
        assert_eq!(disk_events(&dir).last(), Some(&e));
    }
    log.close().await;

    let unsynced = SessionLog::create(
        &tmp.path().join("u"),
        header("u"),
        LogConfig {
            fsync: false,
            ..LogConfig::default()
        },
    )
    .await
    .unwrap();
    unsynced.append(user("x")).await.unwrap();
    assert_eq!(unsynced.stats().fdatasyncs, 0);
    assert_eq!(unsynced.stats().batches, 1);
    unsynced.close().await;
}

#[tokio::test]
async fn a_failed_write_leaves_no_half_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append(user("before")).await.unwrap();
    let len = file_len(&dir);
    log.stats.fail_next_write.store(true, Ordering::SeqCst);
    let err = log
        .append(user("a long message that is written only halfway"))
        .await
        .unwrap_err();
    assert!(matches!(err, LogError::Io { .. }), "{err:?}");
    assert_eq!(
        file_len(&dir),
        len,
        "the half-written batch was not truncated"
    );
    assert_eq!(log.next_seq(), 1);
    // The failed seq is not skipped.
    assert_eq!(log.append(user("after")).await.unwrap().seq, 1);
    log.close().await;
    let (again, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
    assert!(!report.changed(), "{report:?}");
    assert_eq!(again.events_after(None).await.unwrap().len(), 2);
    again.close().await;
}

// === invariants ===

#[tokio::test]
async fn an_invariant_violation_refuses_the_whole_group() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append(call("c1")).await.unwrap();
    let err = log
        .append_all(vec![user("x"), result("c1", 0), result("c1", 0)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Invariant);
    let LogError::Invariant { violation } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(
        (violation.module, violation.check),
        ("session", "tool_call_single_result")
    );
    assert_eq!(log.next_seq(), 1, "nothing of the refused group was logged");
    assert_eq!(disk_events(&dir).len(), 1);
    let err = log.append(result("ghost", 0)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Invariant);
    let err = log.append(turn_end(0)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Invariant);
    // The log goes on, seqs unbroken.
    assert_eq!(log.append(result("c1", 0)).await.unwrap().seq, 1);
    assert_eq!(
        log.append(result("c1", 0)).await.unwrap_err().code(),
        ErrorCode::Invariant
    );
    log.close().await;
}

#[tokio::test]
async fn a_log_violating_invariants_is_refused_on_open_unless_disabled() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let off = LogConfig {
        invariants: crate::invariants::Invariants::disabled(),
        ..LogConfig::default()
    };
    let log = SessionLog::create(&dir, header("s"), off.clone())
        .await
        .unwrap();
    log.append_all(vec![call("c1"), result("c1", 0), result("c1", 0)])
        .await
        .unwrap();
    log.close().await;
    let err = SessionLog::open(&dir, LogConfig::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Invariant);
    let (log, _) = SessionLog::open(&dir, off).await.unwrap();
    assert_eq!(log.next_seq(), 3);
    log.close().await;
}

#[tokio::test]
async fn verify_detects_a_log_changed_behind_the_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append(user("the original text")).await.unwrap();
    log.verify().await.unwrap();
    let path = dir.join(EVENTS_FILE);
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("the original text", "a different thing");
    std::fs::write(&path, text).unwrap();
    let err = log.verify().await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Invariant);
    log.close().await;
}

// === crash repair ===

/// A closed log of three user events in `<tmp>/s`, and the bytes of its file.
async fn closed_log_of_three(tmp: &tempfile::TempDir) -> (PathBuf, Vec<u8>) {
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append_all(vec![user("a"), user("b"), user("c")])
        .await
        .unwrap();
    log.close().await;
    let good = std::fs::read(dir.join(EVENTS_FILE)).unwrap();
    (dir, good)
}

#[tokio::test]
async fn a_torn_last_line_is_truncated() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, good) = closed_log_of_three(&tmp).await;
    let line = serde_json::to_vec(&Event {
        seq: 3,
        time: 1,
        body: user("never acknowledged"),
    })
    .unwrap();
    let half = &line[..line.len() / 2];
    for torn in [half.to_vec(), [half, b"\n"].concat()] {
        std::fs::write(dir.join(EVENTS_FILE), [good.as_slice(), &torn].concat()).unwrap();
        let (log, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
        assert_eq!(report.truncated_bytes, torn.len() as u64);
        assert_eq!(file_len(&dir), good.len() as u64);
        assert_eq!(log.next_seq(), 3);
        assert_eq!(log.append(user("d")).await.unwrap().seq, 3);
        log.close().await;
        let (log, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
        assert!(!report.changed());
        assert_eq!(disk_events(&dir).len(), 4);
        log.close().await;
        std::fs::write(dir.join(EVENTS_FILE), &good).unwrap();
    }
}

#[tokio::test]
async fn opening_shows_every_event_of_the_file_once_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, good) = closed_log_of_three(&tmp).await;
    let torn = br#"{"seq":3,"time":1,"ty"#;
    std::fs::write(dir.join(EVENTS_FILE), [good.as_slice(), torn].concat()).unwrap();
    let mut seen = Vec::new();
    let (log, report) = SessionLog::open_seeing(&dir, LogConfig::default(), |e| {
        seen.push(e.clone());
    })
    .await
    .unwrap();
    assert_eq!(report.truncated_bytes, torn.len() as u64);
    // What the file holds, each once: not the torn line.
    assert_eq!(seen, disk_events(&dir));
    assert_eq!(
        seen.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(seen[1].body, user("b"));
    log.close().await;
}

#[tokio::test]
async fn corruption_before_the_last_line_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append_all(vec![user("a"), user("b"), user("c")])
        .await
        .unwrap();
    log.close().await;
    let path = dir.join(EVENTS_FILE);
    let good = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    let unknown = r#"{"seq":3,"time":1,"type":"from/the-future","data":{}}"#;
    let gap = serde_json::to_string(&Event {
        seq: 9,
        time: 1,
        body: user("d"),
    })
    .unwrap();
    let cases: Vec<(String, u64)> = vec![
        // Garbage in the middle (line 3), valid lines after it.
        (
            format!(
                "{}\n{}\n{{\"seq\":1,\"ti\n{}\n",
                lines[0], lines[1], lines[3]
            ),
            3,
        ),
        // A well-formed last line that is not a known event: not a torn write.
        (format!("{good}{unknown}\n"), 5),
        // A seq out of order.
        (format!("{good}{gap}\n"), 5),
        // A broken header.
        (format!("{{\"type\":\"session\"\n{}\n", lines[1]), 1),
    ];
    for (text, line) in cases {
        std::fs::write(&path, &text).unwrap();
        let err = SessionLog::open(&dir, LogConfig::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, LogError::Corrupt { line: l, .. } if l == line),
            "{err:?}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            text,
            "a refused log must be left untouched"
        );
    }
}

#[tokio::test]
async fn unanswered_calls_and_the_open_turn_are_repaired() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append_all(vec![
        user("go"),                      // 0
        turn_start(0, &["a", "b", "c"]), // 1
        call("a"),                       // 2
        result("a", 2),                  // 3
        call("b"),                       // 4: dispatched, no result
    ])
    .await
    .unwrap();
    // The daemon stops here (what is on disk is what a crash leaves).
    log.close().await;

    let (log, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(report.outcome_unknown, vec!["b".to_owned()]);
    assert_eq!(report.not_started, vec!["c".to_owned()]);
    assert!(report.turn_closed);
    assert!(report.changed());
    let repaired = log.events_after(Some(4)).await.unwrap();
    assert_eq!(repaired.len(), 3);
    let EventBody::ToolResult {
        result: b,
        call_seq,
    } = &repaired[0].body
    else {
        panic!("{repaired:?}")
    };
    assert_eq!(
        (b.call_id.as_str(), *call_seq, b.is_error),
        ("b", Some(4), true)
    );
    assert_eq!(
        b.error.as_ref().map(|e| e.code),
        Some(ErrorCode::ToolOutcomeUnknown)
    );
    assert_eq!(b.content, format!("Error: {OUTCOME_UNKNOWN_MESSAGE}"));
    let EventBody::ToolResult {
        result: c,
        call_seq,
    } = &repaired[1].body
    else {
        panic!("{repaired:?}")
    };
    assert_eq!((c.call_id.as_str(), *call_seq), ("c", None));
    assert_eq!(
        c.error.as_ref().map(|e| e.code),
        Some(ErrorCode::ToolNotStarted)
    );
    assert_eq!(c.content, format!("Error: {NOT_STARTED_MESSAGE}"));
    assert_eq!(
        repaired[2].body,
        EventBody::TurnEnd {
            turn: 0,
            kind: TurnEndKind::Interrupted
        }
    );
    assert_eq!(log.open_turn(), None);
    // The model sees every call answered.
    let tools: Vec<String> = log
        .derive_messages()
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            Message::Tool { result } => Some(result.call_id),
            _ => None,
        })
        .collect();
    assert_eq!(tools, ["a", "b", "c"]);
    assert_eq!(disk_events(&dir), log.events_after(None).await.unwrap());
    log.close().await;

    // Repair is durable and done once.
    let (log, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
    assert!(!report.changed(), "{report:?}");
    log.close().await;
}

#[tokio::test]
async fn an_open_turn_without_calls_is_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let log = new_log(&dir, "s").await;
    log.append_all(vec![turn_start(0, &[]), turn_end(0), turn_start(1, &[])])
        .await
        .unwrap();
    assert_eq!(log.open_turn(), Some(1));
    log.close().await;
    let (log, report) = SessionLog::open(&dir, LogConfig::default()).await.unwrap();
    assert_eq!(
        report,
        RepairReport {
            turn_closed: true,
            ..RepairReport::default()
        }
    );
    assert_eq!(
        log.events_after(Some(2)).await.unwrap()[0].body,
        EventBody::TurnEnd {
            turn: 1,
            kind: TurnEndKind::Interrupted
        }
    );
    log.close().await;
}

// === fork ===

/// user(0) turn(1) call(2) result(3) end(4) user(5) turn(6) call(7), turn 1 open.
async fn parent_with_open_turn(dir: &Path) -> Arc<SessionLog> {
    let log = new_log(dir, "parent").await;
    log.append_all(vec![
        user("one"),
        turn_start(0, &["c1"]),
        call("c1"),
        result("c1", 2),
        turn_end(0),
        user("two"),
        turn_start(1, &["c2"]),
        call("c2"),
    ])
    .await
    .unwrap();
    log
}

#[tokio::test]
async fn fork_at_the_default_boundary_stops_before_the_open_turn() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = parent_with_open_turn(&tmp.path().join("parent")).await;
    let child = parent
        .fork(&tmp.path().join("child"), "child", None, params())
        .await
        .unwrap();
    let h = child.header();
    assert_eq!(
        (h.id.as_str(), h.parent_session.as_deref(), h.seed_length),
        ("child", Some("parent"), Some(6))
    );
    assert_eq!(h.params, parent.header().params);
    let events = child.events_after(None).await.unwrap();
    assert_eq!(events[..6], parent.events_after(None).await.unwrap()[..6]);
    assert_eq!(
        events[6].body,
        EventBody::EndSeed {
            parent_session: "parent".into(),
            boundary_seq: 5
        }
    );
    assert_eq!(
        child.derive_messages().await.unwrap(),
        derive(&parent.events_after(None).await.unwrap()[..6])
    );
    assert_eq!(child.open_turn(), None);
    assert_eq!(parent.open_turn(), Some(1), "the parent is untouched");
    child.close().await;
    let (again, report) = SessionLog::open(&tmp.path().join("child"), LogConfig::default())
        .await
        .unwrap();
    assert!(!report.changed());
    assert_eq!(again.events_after(None).await.unwrap(), events);
    again.close().await;

    // Default boundary of a log with no open turn: its last event.
    parent
        .append_all(vec![result("c2", 7), turn_end(1)])
        .await
        .unwrap();
    let full = parent
        .fork(&tmp.path().join("full"), "full", None, params())
        .await
        .unwrap();
    assert_eq!(full.header().seed_length, Some(10));
    full.close().await;
    parent.close().await;
}

#[tokio::test]
async fn fork_at_explicit_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = parent_with_open_turn(&tmp.path().join("parent")).await;
    let at_end = parent
        .fork(&tmp.path().join("a"), "a", Some(4), params())
        .await
        .unwrap();
    assert_eq!(at_end.header().seed_length, Some(5));
    assert_eq!(
        at_end.events_after(None).await.unwrap()[5].body,
        EventBody::EndSeed {
            parent_session: "parent".into(),
            boundary_seq: 4
        }
    );
    at_end.close().await;
    let at_zero = parent
        .fork(&tmp.path().join("z"), "z", Some(0), params())
        .await
        .unwrap();
    assert_eq!(at_zero.next_seq(), 2);
    at_zero.close().await;

    for inside in [1, 2, 3, 6, 7] {
        let err = parent
            .fork(
                &tmp.path().join(format!("in{inside}")),
                &format!("in{inside}"),
                Some(inside),
                params(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Conflict, "boundary {inside}");
        assert!(
            !tmp.path()
                .join(format!("in{inside}"))
                .join(EVENTS_FILE)
                .exists()
        );
    }
    let err = parent
        .fork(&tmp.path().join("far"), "far", Some(8), params())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidRequest);
    // An existing child is refused before the boundary is looked at.
    let err = parent
        .fork(&tmp.path().join("a"), "a", Some(99), params())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    parent.close().await;
}

#[tokio::test]
async fn fork_copies_the_journals_the_prefix_refers_to() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = new_log(&tmp.path().join("p"), "p").await;
    let j = parent.journal("cmd1").await.unwrap();
    j.append(StreamKind::Stdout, 0, b"hello").await.unwrap();
    j.append(StreamKind::Stderr, 0, b"oops").await.unwrap();
    j.sync().await.unwrap();
    let spec = ProcessSpec::shell("echo hello; echo oops >&2");
    parent
        .append_all(vec![
            EventBody::ProcessStarted {
                command_id: "cmd1".into(),
                pid: 7,
                spec,
                deadline_ms: None,
                output_idle_ms: None,
            },
            EventBody::ProcessExited {
                command_id: "cmd1".into(),
                status: ExitStatus {
                    code: Some(0),
                    signal: None,
                },
                stdout_bytes: 5,
                stderr_bytes: 4,
                clock: None,
                limit: None,
            },
        ])
        .await
        .unwrap();
    // Bytes journaled after the prefix's exit record are not part of the fork.
    j.append(StreamKind::Stdout, 5, b" later").await.unwrap();
    let child = parent
        .fork(&tmp.path().join("c"), "c", None, params())
        .await
        .unwrap();
    let cj = child.journal("cmd1").await.unwrap();
    assert_eq!(cj.len(StreamKind::Stdout), 5);
    assert_eq!(
        cj.tail(StreamKind::Stdout, 100).await.unwrap().0.as_ref(),
        b"hello"
    );
    assert_eq!(
        cj.tail(StreamKind::Stderr, 100).await.unwrap().0.as_ref(),
        b"oops"
    );
    child.close().await;
    parent.close().await;
}

// === follow ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_receives_backlog_then_live_appends_and_ends_on_close() {
    let tmp = tempfile::tempdir().unwrap();
    let log = new_log(&tmp.path().join("s"), "s").await;
    log.append_all(vec![user("0"), user("1")]).await.unwrap();
    let mut all = log.follow(None);
    let mut after_first = log.follow(Some(0));
    assert_eq!(all.next().await.map(|e| e.unwrap().seq), Some(0));
    assert_eq!(all.next().await.map(|e| e.unwrap().seq), Some(1));
    assert_eq!(after_first.next().await.map(|e| e.unwrap().seq), Some(1));
    let writer = {
        let log = log.clone();
        tokio::spawn(async move {
            for i in 2..10 {
                log.append(user(&i.to_string())).await.unwrap();
            }
        })
    };
    let live: Vec<u64> = (&mut all).take(8).map(|e| e.unwrap().seq).collect().await;
    assert_eq!(live, (2..10).collect::<Vec<_>>());
    writer.await.unwrap();
    log.close().await;
    assert!(
        all.next().await.is_none(),
        "follow ends when the log is closed"
    );
    let rest: Vec<u64> = after_first.map(|e| e.unwrap().seq).collect().await;
    assert_eq!(rest, (2..10).collect::<Vec<_>>());
}

// === output journals ===

#[tokio::test]
async fn journal_dedupes_overlap_and_refuses_gaps() {
    let tmp = tempfile::tempdir().unwrap();
    let log = new_log(&tmp.path().join("s"), "s").await;
    let j = log.journal("c1").await.unwrap();
    assert!(Arc::ptr_eq(&j, &log.journal("c1").await.unwrap()));
    j.append(StreamKind::Stdout, 0, b"hello").await.unwrap();
    // A resumed stream re-sends from offset 3: only " world" past "lo" is new.
    j.append(StreamKind::Stdout, 3, b"lo world").await.unwrap();
    j.append(StreamKind::Stdout, 0, b"hel").await.unwrap();
    assert_eq!(j.len(StreamKind::Stdout), 11);
    let err = j.append(StreamKind::Stdout, 12, b"!").await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidRequest);
    assert_eq!(j.len(StreamKind::Stderr), 0);
    let chunks: Vec<(u64, bytes::Bytes)> = j
        .read(StreamKind::Stdout, 0, false)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(chunks, vec![(0, bytes::Bytes::from_static(b"hello world"))]);
    let from6: Vec<(u64, bytes::Bytes)> = j
        .read(StreamKind::Stdout, 6, false)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(from6, vec![(6, bytes::Bytes::from_static(b"world"))]);
    let beyond: Result<Vec<_>, _> = j.read(StreamKind::Stdout, 12, false).try_collect().await;
    assert_eq!(beyond.unwrap_err().code(), ErrorCode::InvalidRequest);
    assert_eq!(
        std::fs::read(j.path(StreamKind::Stdout)).unwrap(),
        b"hello world"
    );
    j.finish().await;
    assert_eq!(
        j.append(StreamKind::Stdout, 11, b"!")
            .await
            .unwrap_err()
            .code(),
        ErrorCode::Conflict
    );
    j.append(StreamKind::Stdout, 6, b"world").await.unwrap();
    assert_eq!(
        log.journal("../x").await.unwrap_err().code(),
        ErrorCode::InvalidRequest
    );
    log.close().await;

    // Lengths survive a restart.
    let (log, _) = SessionLog::open(&tmp.path().join("s"), LogConfig::default())
        .await
        .unwrap();
    let j = log.journal("c1").await.unwrap();
    assert_eq!(j.len(StreamKind::Stdout), 11);
    j.append(StreamKind::Stdout, 0, b"hello world, again")
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(j.path(StreamKind::Stdout)).unwrap(),
        b"hello world, again"
    );
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_follow_reads_until_finished() {
    let tmp = tempfile::tempdir().unwrap();
    let log = new_log(&tmp.path().join("s"), "s").await;
    let j = log.journal("c1").await.unwrap();
    let mut reader = j.read(StreamKind::Pty, 0, true);
    j.append(StreamKind::Pty, 0, b"abc").await.unwrap();
    assert_eq!(
        reader.next().await.unwrap().unwrap(),
        (0, bytes::Bytes::from_static(b"abc"))
    );
    let rest = tokio::spawn(async move { reader.map(|r| r.unwrap()).collect::<Vec<_>>().await });
    j.append(StreamKind::Pty, 3, b"def").await.unwrap();
    j.append(StreamKind::Pty, 6, b"ghi").await.unwrap();
    j.finish().await;
    let rest = rest.await.unwrap();
    let bytes: Vec<u8> = rest.iter().flat_map(|(_, b)| b.to_vec()).collect();
    assert_eq!(bytes, b"defghi");
    assert_eq!(rest[0].0, 3);
    // A reader that starts after finish() ends after the last byte.
    let all: Vec<_> = j
        .read(StreamKind::Pty, 0, true)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(all.iter().map(|(_, b)| b.len()).sum::<usize>(), 9);
    log.close().await;
}

#[tokio::test]
async fn journal_tail_keeps_the_last_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let log = new_log(&tmp.path().join("s"), "s").await;
    let j = log.journal("c1").await.unwrap();
    assert_eq!(
        j.tail(StreamKind::Stderr, 5).await.unwrap(),
        (bytes::Bytes::new(), false)
    );
    j.append(StreamKind::Stderr, 0, b"hello world")
        .await
        .unwrap();
    assert_eq!(
        j.tail(StreamKind::Stderr, 5).await.unwrap(),
        (bytes::Bytes::from_static(b"world"), true)
    );
    assert_eq!(
        j.tail(StreamKind::Stderr, 11).await.unwrap(),
        (bytes::Bytes::from_static(b"hello world"), false)
    );
    assert_eq!(
        j.tail(StreamKind::Stderr, 100).await.unwrap(),
        (bytes::Bytes::from_static(b"hello world"), false)
    );
    log.close().await;
}

// === the held window ===

/// A log holding a few hundred bytes of events: most of what is read comes from the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_log_holds_a_bounded_window_and_reads_older_events_from_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("long");
    let cfg = LogConfig {
        held_bytes: 400,
        ..LogConfig::default()
    };
    let log = SessionLog::create(&dir, header("long"), cfg.clone())
        .await
        .unwrap();
    let mut all_follow = log.follow(None);
    for chunk in 0..30 {
        let bodies = (0..100)
            .map(|i| user(&format!("m{}", chunk * 100 + i)))
            .collect();
        log.append_all(bodies).await.unwrap();
    }
    let n = 3000u64;
    let stats = log.stats();
    assert_eq!(stats.durable_events, n);
    assert!(stats.held_bytes <= 400, "{stats:?}");
    assert!(
        (1..20).contains(&stats.held_events),
        "only the newest events are held: {stats:?}"
    );
    let disk = disk_events(&dir);
    assert_eq!(log.events_after(None).await.unwrap(), disk);
    for after in [0u64, 62, 63, 64, 65, 1000, 2990, 2998, 2999, 5000] {
        let want: Vec<Event> = disk.iter().filter(|e| e.seq > after).cloned().collect();
        assert_eq!(
            log.events_after(Some(after)).await.unwrap(),
            want,
            "after {after}"
        );
    }
    // A follower that started before the appends reads them back from the file in
    // order, then goes on live.
    let first: Vec<u64> = (&mut all_follow)
        .take(n as usize)
        .map(|e| e.unwrap().seq)
        .collect()
        .await;
    assert_eq!(first, (0..n).collect::<Vec<_>>());
    let replay: Vec<u64> = log
        .replay(Some(2900))
        .map(|e| e.unwrap().seq)
        .collect()
        .await;
    assert_eq!(
        replay,
        (2901..n).collect::<Vec<_>>(),
        "a replay ends at the end"
    );
    log.append(user("live")).await.unwrap();
    assert_eq!(all_follow.next().await.unwrap().unwrap().seq, n);
    let messages = log.derive_messages().await.unwrap();
    assert_eq!(messages.len(), n as usize + 1);
    assert_eq!(messages, derive(&disk_events(&dir)));
    log.verify().await.unwrap();
    // A fork reads its prefix from the file.
    let child = log
        .fork(&tmp.path().join("child"), "child", Some(1500), params())
        .await
        .unwrap();
    let seed = child.events_after(None).await.unwrap();
    assert_eq!(seed.len(), 1502, "1501 events and session/end-seed");
    assert_eq!(seed[..1501], disk_events(&dir)[..1501]);
    child.close().await;
    log.close().await;
    assert!(all_follow.next().await.is_none());
    // Re-opened, it holds the same window and reads the same events.
    let (again, _) = SessionLog::open(&dir, cfg.clone()).await.unwrap();
    assert!(again.stats().held_bytes <= 400);
    assert_eq!(again.events_after(None).await.unwrap(), disk_events(&dir));
    assert_eq!(
        again.events_after(Some(100)).await.unwrap().len(),
        n as usize - 100
    );
    // A line changed under the log is reported, never read around.
    again.close().await;
    let (reader, _) = SessionLog::open(&dir, cfg).await.unwrap();
    let path = dir.join(EVENTS_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let broken = text.replacen("\"seq\":70,", "\"seq\":7x,", 1);
    assert_ne!(broken, text);
    std::fs::write(&path, broken).unwrap();
    let err = reader.events_after(Some(10)).await.unwrap_err();
    assert!(matches!(err, LogError::Corrupt { line: 72, .. }), "{err:?}");
    reader.close().await;
}

/// The open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_commands_leave_no_open_journal_files() {
    let tmp = tempfile::tempdir().unwrap();
    let log = new_log(&tmp.path().join("s"), "s").await;
    let before = open_fds();
    for i in 0..400 {
        let j = log.journal(&format!("c{i}")).await.unwrap();
        j.append(StreamKind::Stdout, 0, b"out").await.unwrap();
        j.append(StreamKind::Stderr, 0, b"err").await.unwrap();
        j.sync().await.unwrap();
        j.finish().await;
    }
    let after = open_fds();
    assert!(
        after < before + 50,
        "{before} fds before 400 finished commands, {after} after"
    );
    // Their output is still there to read.
    let j = log.journal("c7").await.unwrap();
    let out: Vec<(u64, bytes::Bytes)> = j
        .read(StreamKind::Stderr, 0, false)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(out, vec![(0, bytes::Bytes::from_static(b"err"))]);
    log.close().await;
}

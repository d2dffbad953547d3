//! The native API (`/v1/...`): sessions, tool calls, events, messages, fork, processes,
//! files and directories. Requests are decoded into typed bodies once; every handler
//! returns a typed response or a [`DaemonError`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use tether_protocol::api::*;
use tether_protocol::events::{EventBody, Source};
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{Command, ProcessSpec, StreamKind};
use tether_provider::clock::clamp_timeout;
use tether_provider::{CallCtx, Signal, StreamOffsets};
use tracing::Instrument;

use crate::auth::Principal;
use crate::error::{DaemonError, Result};
use crate::exec::{self, ExecLimits};
use crate::http::{ApiJson, RequestCtx};
use crate::ops::{self, FsOp, Surface};
use crate::session_manager::{NewSession, Session, SnapshotRecord};
use crate::state::AppState;
use tether_protocol::events::Expiry;
use tether_provider::Clock;

type St = State<Arc<AppState>>;

/// The native API's routes.
pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/sessions", post(create_session).get(list_sessions))
        .route("/v1/sessions/{id}", get(get_session).delete(delete_session))
        .route("/v1/sessions/{id}/tool-calls", post(tool_calls))
        .route("/v1/sessions/{id}/events", get(events))
        .route(
            "/v1/sessions/{id}/messages",
            post(post_message).get(get_messages),
        )
        .route("/v1/sessions/{id}/fork", post(fork))
        .route("/v1/sessions/{id}/snapshots", post(create_snapshot))
        .route("/v1/snapshots", get(list_snapshots))
        .route("/v1/snapshots/{sid}", delete(delete_snapshot))
        .route("/v1/sessions/{id}/pause", post(pause_session))
        .route("/v1/sessions/{id}/resume", post(resume_session))
        .route("/v1/sessions/{id}/network", put(set_network))
        .route(
            "/v1/sessions/{id}/processes",
            post(start_process).get(list_processes),
        )
        .route(
            "/v1/sessions/{id}/processes/{cid}/output",
            get(process_output),
        )
        .route(
            "/v1/sessions/{id}/processes/{cid}/stdin",
            post(process_stdin),
        )
        .route(
            "/v1/sessions/{id}/processes/{cid}/signal",
            post(process_signal),
        )
        .route("/v1/sessions/{id}/processes/{cid}/wait", post(process_wait))
        .route(
            "/v1/sessions/{id}/files",
            get(get_file)
                .put(put_file)
                .delete(delete_file)
                .head(head_file),
        )
        .route("/v1/sessions/{id}/dirs", get(list_dir).post(make_dir))
}

/// A running (or ended) command of a session, for an operation on it.
async fn command(
    state: &AppState,
    id: &str,
    cid: String,
    who: &Principal,
) -> Result<Arc<crate::exec::RunningCommand>> {
    session(state, id, who)
        .await?
        .command(&cid)
        .ok_or(DaemonError::CommandNotFound { id: cid })
}

/// A session for an operation: a closed one is found (its calls then fail with
/// `SANDBOX_NOT_FOUND`), an unknown one is `SESSION_NOT_FOUND`.
async fn session(state: &AppState, id: &str, who: &Principal) -> Result<Arc<Session>> {
    let s = state.sessions.lookup(id, who.scope()).await?;
    s.touch();
    Ok(s)
}

async fn health(State(state): St) -> ApiJson<HealthResponse> {
    ApiJson(HealthResponse {
        status: "ok".into(),
        api_version: tether_protocol::API_VERSION.into(),
        daemon_version: env!("CARGO_PKG_VERSION").into(),
        providers: state.sessions.providers().names(),
    })
}

async fn create_session(
    State(state): St,
    who: Principal,
    RequestCtx(ctx): RequestCtx,
    ApiJson(req): ApiJson<CreateSessionRequest>,
) -> Result<Response> {
    let ttl = Duration::from_secs(req.ttl_s.unwrap_or(state.config.leases.ttl_s));
    if ttl.is_zero() {
        return Err(DaemonError::invalid("ttl_s must be positive"));
    }
    let new = NewSession {
        provider: req.provider,
        template: req.template,
        env: req.env,
        metadata: req.metadata,
        network: req.network.unwrap_or(false),
        limits: req.limits,
        ports: Default::default(),
        snapshot: req.snapshot,
        lifecycle: Default::default(),
        egress: req.egress,
        // A tenant's session is its own (and, like one made through the E2B front, an
        // E2B sandbox of that tenant); an admin's has no owner.
        owner: who.owner(),
        expiry: Expiry::Idle {
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        },
    };
    // Sandbox creation owns remote work: it runs to completion even if the client leaves.
    let session = state.sessions.create_owned(&ctx, new).await?;
    Ok((StatusCode::CREATED, ApiJson(session.info())).into_response())
}

async fn list_sessions(State(state): St, who: Principal) -> ApiJson<ListSessionsResponse> {
    ApiJson(ListSessionsResponse {
        sessions: state.sessions.infos(who.scope()),
    })
}

async fn get_session(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
) -> Result<ApiJson<SessionInfo>> {
    Ok(ApiJson(
        state.sessions.lookup(&id, who.scope()).await?.info(),
    ))
}

async fn delete_session(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    let s2 = Arc::clone(&state);
    state
        .tasks
        .spawn(
            async move {
                s2.sessions
                    .close(&id, who.scope(), "closed by the client")
                    .await
            }
            .in_current_span(),
        )
        .await
        .map_err(|e| DaemonError::internal(e.to_string()))??;
    Ok(StatusCode::NO_CONTENT)
}

/// Pause the session's sandbox (frozen, or its VM stopped; with `{"kind": "filesystem"}`
/// its processes end and resume boots it again); logged, so it stays paused across a
/// restart. `CONFLICT` when already paused, `UNSUPPORTED` when its provider cannot pause
/// so.
async fn pause_session(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    body: Bytes,
) -> Result<ApiJson<SessionInfo>> {
    let req: PauseRequest = optional_json(&body)?;
    let s = session(&state, &id, &who).await?;
    s.pause(&ctx, req.kind).await?;
    Ok(ApiJson(s.info()))
}

/// Resume a paused session's sandbox (`{"reboot": true}`: by booting it again).
/// `CONFLICT` when it is not paused.
async fn resume_session(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    body: Bytes,
) -> Result<ApiJson<SessionInfo>> {
    let req: ResumeRequest = optional_json(&body)?;
    let s = session(&state, &id, &who).await?;
    s.resume(&ctx, req.reboot).await?;
    Ok(ApiJson(s.info()))
}

/// Replace a running session's egress rules (the body is the rules, as at create).
/// Durable on return; `INVALID_REQUEST` without network, `UNSUPPORTED` or
/// `ISOLATION_UNAVAILABLE` where the provider cannot change them, and then the rules in
/// force stay.
async fn set_network(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    ApiJson(egress): ApiJson<tether_protocol::network::Egress>,
) -> Result<ApiJson<SessionInfo>> {
    let s = session(&state, &id, &who).await?;
    s.set_egress(&ctx, egress).await?;
    Ok(ApiJson(s.info()))
}

async fn tool_calls(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    ApiJson(req): ApiJson<ToolCallsRequest>,
) -> Result<ApiJson<ToolCallsResponse>> {
    let session = session(&state, &id, &who).await?;
    // A closed or detached session has no sandbox: refuse before anything is logged.
    session.sandbox()?;
    // The batch runs in a tracked task: a client that disconnects cancels it (cooperatively:
    // started calls finish and are logged), it is never dropped mid-flight.
    let s2 = Arc::clone(&state);
    let results = state
        .tasks
        .spawn(
            async move { s2.pipeline.run_batch(&session, &ctx, req.calls).await }.in_current_span(),
        )
        .await
        .map_err(|e| DaemonError::internal(e.to_string()))??;
    Ok(ApiJson(ToolCallsResponse { results }))
}

fn ndjson<S, T>(stream: S) -> Response
where
    S: futures_util::Stream<Item = T> + Send + 'static,
    T: serde::Serialize + 'static,
{
    try_ndjson(stream.map(Ok))
}

/// [`ndjson`] over a stream whose error ends the body.
fn try_ndjson<S, T>(stream: S) -> Response
where
    S: futures_util::Stream<Item = std::io::Result<T>> + Send + 'static,
    T: serde::Serialize + 'static,
{
    let body = stream.map(|item| {
        let mut line = serde_json::to_vec(&item?).map_err(std::io::Error::other)?;
        line.push(b'\n');
        Ok::<_, std::io::Error>(Bytes::from(line))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response()
}

async fn events(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    q: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response> {
    let Query(q) = q.map_err(|e| DaemonError::invalid(e.body_text()))?;
    let s = state.sessions.lookup(&id, who.scope()).await?;
    let events = if q.follow {
        s.log.follow(q.after)
    } else {
        s.log.replay(q.after)
    };
    // A log that cannot be read back ends the body with an error (the client sees a cut
    // stream, never a silently short one).
    let id = s.id.clone();
    Ok(try_ndjson(events.map(move |r| {
        r.map_err(|e| {
            tracing::error!(session.id = %id, error = %e, "Reading a session's events failed");
            std::io::Error::other(e)
        })
    })))
}

async fn post_message(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PostMessageRequest>,
) -> Result<StatusCode> {
    let s = session(&state, &id, &who).await?;
    let body = match req.role.as_str() {
        "user" => EventBody::UserMessage {
            content: req.content,
            source: Source::User,
        },
        "assistant" => EventBody::AssistantMessage {
            content: req.content,
        },
        other => {
            return Err(DaemonError::invalid(format!(
                "role must be user or assistant, not {other:?}"
            )));
        }
    };
    if s.log.open_turn().is_some() {
        return Err(DaemonError::Conflict {
            message: "a tool-call batch is running in this session".into(),
        });
    }
    let is_user = matches!(body, EventBody::UserMessage { .. });
    s.log.append(body).await?;
    if is_user {
        state.pipeline.on_user_message(&s.id);
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn get_messages(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
) -> Result<ApiJson<MessagesResponse>> {
    let s = state.sessions.lookup(&id, who.scope()).await?;
    Ok(ApiJson(MessagesResponse {
        messages: s.log.derive_messages().await?,
    }))
}

/// A JSON body that may be left out (its default then).
fn optional_json<T: Default + serde::de::DeserializeOwned>(body: &Bytes) -> Result<T> {
    if body.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| DaemonError::invalid(format!("invalid JSON body: {e}")))
}

async fn fork(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    body: Bytes,
) -> Result<Response> {
    let req: ForkRequest = optional_json(&body)?;
    let s2 = Arc::clone(&state);
    let child = state
        .tasks
        .spawn(
            async move { s2.sessions.fork(&ctx, &id, req.at_seq, who.scope()).await }
                .in_current_span(),
        )
        .await
        .map_err(|e| DaemonError::internal(e.to_string()))??;
    Ok((StatusCode::CREATED, ApiJson(child.info())).into_response())
}

fn snapshot_info(r: SnapshotRecord) -> SnapshotInfo {
    SnapshotInfo {
        id: r.id,
        name: r.name,
        session_id: r.session,
        sandbox_id: r.sandbox_id,
        provider: r.provider,
        created_ms: r.created_ms,
    }
}

async fn create_snapshot(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    body: Bytes,
) -> Result<Response> {
    let req: CreateSnapshotRequest = optional_json(&body)?;
    let rec = state
        .sessions
        .snapshot(&ctx, &id, req.name, who.scope())
        .await?;
    Ok((StatusCode::CREATED, ApiJson(snapshot_info(rec))).into_response())
}

async fn list_snapshots(
    State(state): St,
    who: Principal,
    Query(q): Query<ListSnapshotsQuery>,
) -> ApiJson<ListSnapshotsResponse> {
    let snapshots = state
        .sessions
        .snapshots()
        .list(who.scope(), q.session_id.as_deref(), q.name.as_deref())
        .into_iter()
        .map(snapshot_info)
        .collect();
    ApiJson(ListSnapshotsResponse { snapshots })
}

async fn delete_snapshot(
    State(state): St,
    who: Principal,
    Path(sid): Path<String>,
) -> Result<StatusCode> {
    state.sessions.delete_snapshot(&sid, who.scope()).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn start_process(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    ApiJson(req): ApiJson<StartProcessRequest>,
) -> Result<Response> {
    let s = session(&state, &id, &who).await?;
    let command = match (req.cmd, req.argv) {
        (Some(c), None) => Command::Shell(c),
        (None, Some(a)) if !a.is_empty() => Command::Argv(a),
        _ => {
            return Err(DaemonError::invalid(
                "exactly one of cmd and argv (non-empty) is required",
            ));
        }
    };
    let limits = &state.config.limits;
    let total = match req.timeout_ms {
        Some(ms) => Some(
            clamp_timeout(
                Some(ms as f64),
                limits.command_timeout_ms as f64,
                limits.command_timeout_max_ms as f64,
                "timeout_ms",
            )
            .map_err(|e| DaemonError::invalid(e.to_string()))?,
        ),
        None => None,
    };
    let idle = match req.idle_timeout_ms {
        Some(0) => return Err(DaemonError::invalid("idle_timeout_ms must be positive")),
        Some(ms) => Some(ms),
        None if limits.output_idle_ms > 0 && total.is_some() => Some(limits.output_idle_ms),
        None => None,
    };
    let mut env: BTreeMap<String, Option<String>> = s
        .params
        .env
        .iter()
        .map(|(k, v)| (k.clone(), Some(v.clone())))
        .collect();
    env.extend(req.env);
    let spec = ProcessSpec {
        command,
        cwd: req.cwd,
        env,
        stdin: req.stdin,
        stdout_max_bytes: None,
        stderr_max_bytes: None,
        pty: req.pty,
        grace_ms: tether_protocol::process::DEFAULT_GRACE_MS,
        command_id: req.command_id,
        user: None,
    };
    let limits = ExecLimits {
        total: total.map(|ms| Duration::from_millis(ms as u64)),
        output_idle: idle.map(Duration::from_millis),
    };
    let sctx = ctx.with_timeout(s.deadlines.process_start, Clock::Total);
    let cmd = exec::start(&s, &sctx, spec, limits).await?;
    Ok((
        StatusCode::CREATED,
        ApiJson(StartProcessResponse {
            command_id: cmd.command_id.clone(),
            pid: cmd.pid,
        }),
    )
        .into_response())
}

async fn list_processes(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
) -> Result<ApiJson<Vec<WaitResponse>>> {
    let s = state.sessions.lookup(&id, who.scope()).await?;
    let mut v: Vec<WaitResponse> = s
        .commands()
        .iter()
        .map(|c| {
            let o = c.outcome();
            WaitResponse {
                command_id: c.command_id.clone(),
                status: o.as_ref().and_then(|o| o.status).unwrap_or(
                    tether_protocol::process::ExitStatus {
                        code: None,
                        signal: None,
                    },
                ),
                stdout_bytes: o.as_ref().map_or(0, |o| o.stdout_bytes),
                stderr_bytes: o.as_ref().map_or(0, |o| o.stderr_bytes),
                clock: o.as_ref().and_then(|o| o.clock),
                limit: o.and_then(|o| o.limit),
            }
        })
        .collect();
    v.sort_by(|a, b| a.command_id.cmp(&b.command_id));
    Ok(ApiJson(v))
}

async fn process_output(
    State(state): St,
    who: Principal,
    Path((id, cid)): Path<(String, String)>,
    q: Result<Query<OutputQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response> {
    let Query(q) = q.map_err(|e| DaemonError::invalid(e.body_text()))?;
    let s = state.sessions.lookup(&id, who.scope()).await?;
    let cmd = s
        .command(&cid)
        .ok_or(DaemonError::CommandNotFound { id: cid })?;
    let from = StreamOffsets {
        stdout: q.offset,
        stderr: q.stderr_offset,
    };
    if q.follow {
        let stream = cmd.events(from).map(|r| {
            r.unwrap_or_else(|e| tether_protocol::process::ProcessEvent::Output {
                stream: StreamKind::Stderr,
                offset: 0,
                data: format!("tether: output stream failed: {}", e.code()).into_bytes(),
            })
        });
        return Ok(ndjson(stream));
    }
    // Without follow: what is journaled now, then Exited if the command has ended.
    let first = if cmd.spec.pty.is_some() {
        StreamKind::Pty
    } else {
        StreamKind::Stdout
    };
    let mut out = Vec::new();
    for (kind, off) in [(first, from.stdout), (StreamKind::Stderr, from.stderr)] {
        let chunks: Vec<_> = cmd.journal.read(kind, off, false).try_collect().await?;
        for (offset, data) in chunks {
            out.push(tether_protocol::process::ProcessEvent::Output {
                stream: kind,
                offset,
                data: data.to_vec(),
            });
        }
    }
    if let Some(o) = cmd.outcome() {
        out.push(tether_protocol::process::ProcessEvent::Exited {
            status: o.status.unwrap_or(tether_protocol::process::ExitStatus {
                code: None,
                signal: None,
            }),
            stdout_bytes: o.stdout_bytes,
            stderr_bytes: o.stderr_bytes,
        });
    }
    Ok(ndjson(futures_util::stream::iter(out)))
}

async fn process_stdin(
    State(state): St,
    who: Principal,
    Path((id, cid)): Path<(String, String)>,
    RequestCtx(ctx): RequestCtx,
    ApiJson(req): ApiJson<StdinRequest>,
) -> Result<StatusCode> {
    let cmd = command(&state, &id, cid, &who).await?;
    if !req.data.is_empty() {
        cmd.handle.write_stdin(&ctx, Bytes::from(req.data)).await?;
    }
    if req.eof {
        cmd.handle.close_stdin(&ctx).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn process_signal(
    State(state): St,
    who: Principal,
    Path((id, cid)): Path<(String, String)>,
    RequestCtx(ctx): RequestCtx,
    ApiJson(req): ApiJson<SignalRequest>,
) -> Result<StatusCode> {
    let cmd = command(&state, &id, cid, &who).await?;
    if req.signal.eq_ignore_ascii_case("terminate") {
        cmd.kill("terminate requested");
        return Ok(StatusCode::ACCEPTED);
    }
    let sig = Signal::parse(&req.signal)
        .ok_or_else(|| DaemonError::invalid(format!("unknown signal {:?}", req.signal)))?;
    cmd.handle.signal(&ctx, sig).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn process_wait(
    State(state): St,
    who: Principal,
    Path((id, cid)): Path<(String, String)>,
    RequestCtx(ctx): RequestCtx,
) -> Result<ApiJson<WaitResponse>> {
    let cmd = command(&state, &id, cid, &who).await?;
    let o = tokio::select! {
        o = cmd.wait() => o,
        _ = ctx.cancel.cancelled() => return Err(tether_provider::ProviderError::from_reason(
            ctx.cancel.reason().unwrap_or(tether_provider::clock::CancelReason::Caller("wait")),
        ).into()),
    };
    Ok(ApiJson(WaitResponse {
        command_id: cmd.command_id.clone(),
        status: o.status.unwrap_or(tether_protocol::process::ExitStatus {
            code: None,
            signal: None,
        }),
        stdout_bytes: o.stdout_bytes,
        stderr_bytes: o.stderr_bytes,
        clock: o.clock,
        limit: o.limit,
    }))
}

/// The query of a file route, decoded strictly: a `path` (or any value) whose percent
/// escapes are not valid UTF-8 is refused with `INVALID_REQUEST`, never decoded lossily
/// into a path that names another file. (`Query` decodes with replacement characters.)
struct FsQuery(PathQuery);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for FsQuery {
    type Rejection = DaemonError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self> {
        let raw = parts.uri.query().unwrap_or_default();
        for pair in raw.split('&') {
            let value = pair.split_once('=').map_or(pair, |(_, v)| v);
            let spaced = value.replace('+', " ");
            if percent_encoding::percent_decode_str(&spaced)
                .decode_utf8()
                .is_err()
            {
                return Err(DaemonError::invalid(
                    "the query is not valid UTF-8 once percent-decoded",
                ));
            }
        }
        Query::<PathQuery>::try_from_uri(&parts.uri)
            .map(|Query(q)| Self(q))
            .map_err(|e| DaemonError::invalid(e.body_text()))
    }
}

/// One file operation of the native API through the operation layer: the file-operation
/// deadline, its span and metric, its `fs/op` event for a change.
async fn api_fs<'a, T, F, Fut>(
    s: &'a Session,
    ctx: &CallCtx,
    op: FsOp,
    path: &'a str,
    f: F,
) -> Result<T>
where
    F: FnOnce(Arc<dyn tether_provider::Sandbox>, CallCtx, &'a str) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, tether_provider::ProviderError>>,
{
    let sandbox = s.sandbox()?;
    Ok(ops::api(s, ctx, op, path, |c, p| f(sandbox, c, p)).await?)
}

/// Stat through the operation layer.
async fn stat(s: &Session, ctx: &CallCtx, path: &str) -> Result<tether_protocol::fs::FileStat> {
    api_fs(s, ctx, FsOp::Stat, path, |sb, c, p| async move {
        sb.fs().stat(&c, p).await
    })
    .await
}

/// A download describes one object: its stat (size, version) and its bytes. Only a regular
/// file has both; a directory or a symbolic link (whose stat is the link's own, while a
/// read would follow it) is refused with a code instead of a short 200.
fn regular_file(st: &tether_protocol::fs::FileStat, path: &str) -> Result<()> {
    use tether_protocol::fs::FileKind;
    let (code, why) = match st.kind {
        FileKind::File => return Ok(()),
        FileKind::Dir => (tether_protocol::ErrorCode::FsIsDirectory, "is a directory"),
        FileKind::Symlink => (
            tether_protocol::ErrorCode::FsNotRegularFile,
            "is a symbolic link: download its target",
        ),
        FileKind::Other => (
            tether_protocol::ErrorCode::FsNotRegularFile,
            "is not a regular file",
        ),
    };
    Err(tether_provider::ProviderError::fs(code, path.to_owned(), why).into())
}

fn etag(v: &tether_protocol::fs::Version) -> String {
    format!("\"{}\"", v.0)
}

async fn head_file(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    FsQuery(q): FsQuery,
) -> Result<Response> {
    let s = session(&state, &id, &who).await?;
    let st = stat(&s, &ctx, &q.path).await?;
    regular_file(&st, &q.path)?;
    Ok((
        [
            (header::ETAG, etag(&st.version)),
            (header::CONTENT_LENGTH, st.size.to_string()),
        ],
        (),
    )
        .into_response())
}

async fn get_file(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    FsQuery(q): FsQuery,
) -> Result<Response> {
    let s = session(&state, &id, &who).await?;
    let st = stat(&s, &ctx, &q.path).await?;
    regular_file(&st, &q.path)?;
    let tag = etag(&st.version);
    if headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        == Some(tag.as_str())
    {
        return Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, tag)]).into_response());
    }
    let range = ByteRange {
        offset: q.offset.unwrap_or(0),
        length: q.length,
    };
    // The body streams after this handler returns: bound it by the shutdown token and the
    // transfer deadline, not the request's (which ends with the handler).
    let tctx = CallCtx::with_cancel(ctx.request_id.clone(), state.shutdown.child())
        .with_timeout(s.deadlines.transfer, Clock::Total);
    let stream = api_fs(&s, &tctx, FsOp::Read, &q.path, |sb, c, p| async move {
        sb.fs().read(&c, p, range).await
    })
    .await?;
    let stream = bounded(stream, tctx);
    let len = st
        .size
        .saturating_sub(range.offset)
        .min(range.length.unwrap_or(u64::MAX));
    Ok((
        [
            (header::ETAG, tag),
            (header::CONTENT_TYPE, "application/octet-stream".into()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// A download's body, ended with an error (so the client sees a broken transfer, never a
/// short success) when `ctx` is cancelled: the transfer deadline, or shutdown. The
/// context, and with it its timer, lives as long as the body.
fn bounded(
    stream: tether_provider::ByteStream,
    ctx: CallCtx,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> + Send {
    futures_util::stream::unfold(Some((stream, ctx)), |st| async move {
        let (mut stream, ctx) = st?;
        tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => {
                let why = ctx.cancel.reason().map_or_else(|| "cancelled".to_owned(), |r| r.to_string());
                Some((Err(std::io::Error::other(format!("transfer ended: {why}"))), None))
            }
            item = stream.next() => match item {
                Some(Ok(b)) => Some((Ok(b), Some((stream, ctx)))),
                Some(Err(e)) => Some((Err(std::io::Error::other(e.to_string())), None)),
                None => None,
            },
        }
    })
}

async fn put_file(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    FsQuery(q): FsQuery,
    body: Body,
) -> Result<Response> {
    let s = session(&state, &id, &who).await?;
    let guard = match (
        headers.get(header::IF_MATCH),
        headers.get(header::IF_NONE_MATCH),
    ) {
        (Some(_), Some(_)) => {
            return Err(DaemonError::invalid(
                "If-Match and If-None-Match are exclusive",
            ));
        }
        (Some(v), None) => {
            let v = v
                .to_str()
                .map_err(|_| DaemonError::invalid("bad If-Match"))?
                .trim()
                .trim_matches('"');
            WriteGuard::ReplaceIfVersion {
                version: tether_protocol::fs::Version(v.to_owned()),
            }
        }
        (None, Some(v)) if v.as_bytes() == b"*" => WriteGuard::CreateIfAbsent,
        (None, Some(_)) => return Err(DaemonError::invalid("If-None-Match supports only *")),
        (None, None) => WriteGuard::None,
    };
    let limit = state.config.server.max_file_bytes;
    let mut seen: u64 = 0;
    let stream = body.into_data_stream().map(move |chunk| {
        let chunk = chunk.map_err(|e| tether_provider::ProviderError::InvalidRequest {
            message: format!("upload failed: {e}"),
        })?;
        seen += chunk.len() as u64;
        if seen > limit {
            return Err(tether_provider::ProviderError::fs(
                tether_protocol::ErrorCode::FsTooLarge,
                "",
                format!("upload is larger than {limit} bytes"),
            ));
        }
        Ok(chunk)
    });
    let sandbox = s.sandbox()?;
    let span = ops::fs_span(FsOp::Write, &s, &q.path);
    let path = q.path.as_str();
    let out = ops::fs(
        &s,
        &ctx,
        FsOp::Write,
        &q.path,
        Surface::Api,
        s.deadlines.transfer,
        span.clone(),
        |o: &tether_protocol::fs::WriteOutcome| Some(o.size),
        |c| async move { sandbox.fs().write(&c, path, stream.boxed(), guard).await },
    )
    .await?;
    span.record("bytes.in", i64::try_from(out.size).unwrap_or(i64::MAX));
    let status = if out.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, [(header::ETAG, etag(&out.version))], ApiJson(out)).into_response())
}

async fn delete_file(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    FsQuery(q): FsQuery,
) -> Result<StatusCode> {
    let s = session(&state, &id, &who).await?;
    let recursive = q.recursive;
    api_fs(&s, &ctx, FsOp::Remove, &q.path, |sb, c, p| async move {
        sb.fs().remove(&c, p, recursive).await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_dir(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    FsQuery(q): FsQuery,
) -> Result<Response> {
    let depth = q.depth.unwrap_or(1);
    if depth == 0 || depth > 64 {
        return Err(DaemonError::invalid("depth must be between 1 and 64"));
    }
    let s = session(&state, &id, &who).await?;
    let entries = api_fs(&s, &ctx, FsOp::List, &q.path, |sb, c, p| async move {
        sb.fs().list(&c, p, depth).await
    })
    .await?;
    Ok(ApiJson(entries).into_response())
}

async fn make_dir(
    State(state): St,
    who: Principal,
    Path(id): Path<String>,
    RequestCtx(ctx): RequestCtx,
    FsQuery(q): FsQuery,
) -> Result<Response> {
    let s = session(&state, &id, &who).await?;
    let st = api_fs(&s, &ctx, FsOp::Mkdir, &q.path, |sb, c, p| async move {
        sb.fs().mkdir(&c, p, true).await
    })
    .await?;
    Ok((StatusCode::CREATED, ApiJson(st)).into_response())
}

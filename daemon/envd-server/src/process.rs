//! envd's `process.Process` service over Connect, on the host's command table.
//!
//! Every process is started by the host ([`HostedSandbox::start`]), which supervises it
//! (tetherd journals, bounds and logs it like any command of the session); its output
//! reaches the SDK from the host's record of it ([`HostedCommand::events`]). E2B
//! semantics kept here:
//!
//! - `Connect-Timeout-Ms` of `Start` is the process's own deadline (envd kills the process
//!   when it passes; `timeout=0` in the SDK sends none: unlimited);
//! - closing the stream does not kill the process;
//! - `Connect` streams only what the process prints after it subscribed (envd's output
//!   multiplexer does not replay), then the end;
//! - the stream is `start{pid}`, `data`, `keepalive` when idle, `end`, and the end frame.
//!
//! The requested user (`user` or `root`) is recorded in the logged process spec; the
//! local provider runs both as its one confined user.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use http::HeaderMap;
use tether_protocol::e2b::{
    ConnectCode, DataEvent, Empty, EndEvent, ListResponse, ProcessConfig, ProcessEventMsg,
    ProcessEventResponse, ProcessInfoMsg, ProcessInput, ProcessSelector, PtyMsg, SelectRequest,
    SendInputRequest, SendSignalRequest, SignalMsg, StartEvent, StartRequest, StreamInputRequest,
    UpdateRequest,
};
use tether_protocol::process::{
    Command, ExitStatus, ProcessEvent, ProcessSpec, PtySize, StdinMode, StreamKind,
};
use tether_provider::{CallCtx, Signal, StreamOffsets};

use crate::connect::{self, CallOpts, RpcError, StreamOpts};
use crate::util::resolve_path;
use crate::{Failure, Host, HostedCommand, HostedSandbox, RequestCtx, Target, rest};
use tether_provider::Clock;

pub(crate) fn routes<H: Host>() -> Router<Arc<H>> {
    Router::new().route("/process.Process/{method}", post(rpc::<H>))
}

/// The methods of `process.Process`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Start,
    Connect,
    List,
    SendInput,
    StreamInput,
    SendSignal,
    CloseStdin,
    Update,
}

impl Method {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "Start" => Self::Start,
            "Connect" => Self::Connect,
            "List" => Self::List,
            "SendInput" => Self::SendInput,
            "StreamInput" => Self::StreamInput,
            "SendSignal" => Self::SendSignal,
            "CloseStdin" => Self::CloseStdin,
            "Update" => Self::Update,
            _ => return None,
        })
    }

    fn streaming(self) -> bool {
        matches!(self, Self::Start | Self::Connect | Self::StreamInput)
    }

    /// The span's name in the trace vocabulary (`docs/telemetry.md`).
    fn span_name(self) -> &'static str {
        match self {
            Self::Start => "e2b.process.start",
            Self::Connect => "e2b.process.connect",
            Self::List => "e2b.process.list",
            Self::SendInput => "e2b.process.send_input",
            Self::StreamInput => "e2b.process.stream_input",
            Self::SendSignal => "e2b.process.send_signal",
            Self::CloseStdin => "e2b.process.close_stdin",
            Self::Update => "e2b.process.update",
        }
    }

    fn span<S: HostedSandbox>(self, t: &Target<S>, user: &str) -> tracing::Span {
        let (s, id) = (t.sandbox.session_id(), &t.id);
        // One callsite for every method; `otel.name` carries the method's span name.
        tracing::info_span!(
            "e2b.process",
            otel.name = self.span_name(),
            session.id = %s,
            sandbox.id = %id,
            user = %user,
            command.id = tracing::field::Empty,
            outcome = tracing::field::Empty,
        )
    }
}

async fn rpc<H: Host>(
    State(host): State<Arc<H>>,
    Path(method): Path<String>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Some(m) = Method::parse(&method) else {
        return RpcError::new(
            ConnectCode::Unimplemented,
            format!("process.Process/{method} is not a method of this service"),
        )
        .into_response();
    };
    let (opts, target, user) = match rest::admit(&*host, &headers, m.streaming()) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let span = m.span(&target, &user);
    let resp = async {
        match m {
            Method::Start => start(&ctx, opts, &target, user, body).await,
            Method::Connect => connect_stream(opts, &target, body).await,
            Method::StreamInput => stream_input(&ctx, opts, &target, body).await,
            _ => {
                let cctx = opts
                    .timeout
                    .map_or_else(|| ctx.clone(), |t| ctx.with_timeout(t, Clock::Total));
                let r = match connect::read_body(body, connect::MAX_MESSAGE_BYTES).await {
                    Ok(bytes) => unary(m, &cctx, &target, host.limits(), &bytes).await,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(resp) => resp,
                    Err(e) => e.into_response(),
                }
            }
        }
    };
    crate::traced(span, resp).await
}

async fn unary<S: HostedSandbox>(
    m: Method,
    ctx: &CallCtx,
    t: &Target<S>,
    limits: crate::Limits,
    body: &[u8],
) -> Result<Response, RpcError> {
    match m {
        Method::List => Ok(connect::unary_ok(&list(t))),
        Method::SendInput => {
            let req: SendInputRequest = connect::decode_unary(body)?;
            let cmd = running(t, req.process.as_ref())?;
            let data = match req.input {
                Some(ProcessInput::Stdin(b) | ProcessInput::Pty(b)) => b,
                None => return Err(RpcError::invalid("input is required")),
            };
            ctx.run(cmd.handle().write_stdin(ctx, Bytes::from(data)))
                .await?;
            Ok(connect::unary_ok(&Empty {}))
        }
        Method::SendSignal => {
            let req: SendSignalRequest = connect::decode_unary(body)?;
            let signal = match req.signal {
                SignalMsg::Sigkill => Signal::Kill,
                SignalMsg::Sigterm => Signal::Term,
                SignalMsg::Unspecified | SignalMsg::Other(_) => {
                    return Err(RpcError::new(
                        ConnectCode::Unimplemented,
                        "only SIGTERM and SIGKILL can be sent",
                    ));
                }
            };
            let cmd = running(t, req.process.as_ref())?;
            ctx.run(cmd.handle().signal(ctx, signal)).await?;
            if signal == Signal::Kill && !limits.kill_wait.is_zero() {
                // As envd, which reaps its child at once: the killed process is gone
                // (not a zombie awaiting its reaper) when the call answers. Bounded; a
                // group that outlives it is reported by the command's own end.
                let wctx = ctx.with_timeout(limits.kill_wait, Clock::Total);
                let _ = wctx.run(cmd.handle().wait(&wctx)).await;
            }
            Ok(connect::unary_ok(&Empty {}))
        }
        Method::CloseStdin => {
            let req: SelectRequest = connect::decode_unary(body)?;
            let cmd = running(t, req.process.as_ref())?;
            ctx.run(cmd.handle().close_stdin(ctx)).await?;
            Ok(connect::unary_ok(&Empty {}))
        }
        Method::Update => {
            let req: UpdateRequest = connect::decode_unary(body)?;
            let cmd = running(t, req.process.as_ref())?;
            if let Some(size) = pty_size(req.pty.as_ref()) {
                ctx.run(cmd.handle().resize(ctx, size)).await?;
            }
            Ok(connect::unary_ok(&Empty {}))
        }
        Method::Start | Method::Connect | Method::StreamInput => Err(RpcError::new(
            ConnectCode::Internal,
            "a streaming method was dispatched as unary",
        )),
    }
}

// === selectors ===

/// A command of the sandbox by selector, preferring a running one (pids can be reused).
fn select<S: HostedSandbox>(
    t: &Target<S>,
    sel: Option<&ProcessSelector>,
) -> Result<Arc<S::Command>, RpcError> {
    let sel = sel.ok_or_else(|| RpcError::invalid("process selector is required"))?;
    let found = match sel {
        ProcessSelector::Pid(pid) => {
            let all: Vec<_> = t
                .sandbox
                .commands()
                .into_iter()
                .filter(|c| c.pid() == *pid)
                .collect();
            all.iter()
                .find(|c| c.is_running())
                .or_else(|| all.first())
                .cloned()
        }
        ProcessSelector::Tag(tag) => t.sandbox.command(tag).filter(|_| t.state.is_tag(tag)),
    };
    found.ok_or_else(|| RpcError::not_found(describe(sel)))
}

/// A running command by selector (envd forgets processes once they end).
fn running<S: HostedSandbox>(
    t: &Target<S>,
    sel: Option<&ProcessSelector>,
) -> Result<Arc<S::Command>, RpcError> {
    let cmd = select(t, sel)?;
    if cmd.is_running() {
        Ok(cmd)
    } else {
        Err(RpcError::not_found(describe(
            sel.unwrap_or(&ProcessSelector::Pid(cmd.pid())),
        )))
    }
}

fn describe(sel: &ProcessSelector) -> String {
    match sel {
        ProcessSelector::Pid(p) => format!("process with pid {p} not found"),
        ProcessSelector::Tag(t) => format!("process with tag {t} not found"),
    }
}

fn pty_size(pty: Option<&PtyMsg>) -> Option<PtySize> {
    let s = pty?.size?;
    let clamp = |v: u32| u16::try_from(v.max(1)).unwrap_or(u16::MAX);
    Some(PtySize {
        rows: clamp(s.rows),
        cols: clamp(s.cols),
    })
}

// === List ===

fn list<S: HostedSandbox>(t: &Target<S>) -> ListResponse {
    let mut processes: Vec<ProcessInfoMsg> = t
        .sandbox
        .commands()
        .into_iter()
        .filter(|c| c.is_running())
        .map(|c| {
            let (cmd, args) = match &c.spec().command {
                Command::Argv(v) => (
                    v.first().cloned().unwrap_or_default(),
                    v.iter().skip(1).cloned().collect(),
                ),
                Command::Shell(s) => (
                    "/bin/bash".to_owned(),
                    vec!["-l".to_owned(), "-c".to_owned(), s.clone()],
                ),
            };
            let envs = c
                .spec()
                .env
                .iter()
                .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
                .filter(|(k, _)| !k.starts_with("TRACE"))
                .collect();
            ProcessInfoMsg {
                config: ProcessConfig {
                    cmd,
                    args,
                    envs,
                    cwd: c.spec().cwd.clone(),
                },
                pid: c.pid(),
                tag: t.state.is_tag(c.id()).then(|| c.id().to_owned()),
            }
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    ListResponse { processes }
}

// === Start and Connect ===

async fn start<S: HostedSandbox>(
    ctx: &CallCtx,
    opts: CallOpts,
    t: &Target<S>,
    user: String,
    body: Body,
) -> Response {
    // Taken before the process starts, so the stream's deadline passes no later than the
    // process's own (which kills it): as with envd, the stream then ends with
    // `deadline_exceeded`, not with the killed process's `end`.
    let deadline = opts.deadline();
    let req: StartRequest = match connect::read_single_message(body).await {
        Ok(r) => r,
        Err(e) => return connect::stream_error(&e),
    };
    match start_process(ctx, opts, t, user, req).await {
        Ok(cmd) => {
            tracing::Span::current().record("command.id", cmd.id());
            let events = cmd.events(StreamOffsets::default());
            respond(t, cmd.pid(), events, opts, deadline)
        }
        Err(e) => connect::stream_error(&e),
    }
}

async fn start_process<S: HostedSandbox>(
    ctx: &CallCtx,
    opts: CallOpts,
    t: &Target<S>,
    user: String,
    req: StartRequest,
) -> Result<Arc<S::Command>, RpcError> {
    let cfg = req
        .process
        .ok_or_else(|| RpcError::invalid("process is required"))?;
    if cfg.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is required"));
    }
    let init = t.state.init();
    let cwd = cfg
        .cwd
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(|c| resolve_path(c, &user))
        .or_else(|| init.default_workdir.map(|w| resolve_path(&w, &user)));
    if let Some(dir) = &cwd {
        // envd checks the working directory before it starts anything.
        let sandbox = t.sandbox.sandbox()?;
        let sctx = ctx.with_timeout(t.state.fs_op, Clock::Total);
        match sandbox.fs().stat(&sctx, dir).await {
            Ok(st) if st.kind == tether_protocol::fs::FileKind::Dir => {}
            Ok(_) => return Err(RpcError::invalid(format!("cwd '{dir}' is not a directory"))),
            Err(e) if e.code() == tether_protocol::ErrorCode::FsNotFound => {
                return Err(RpcError::invalid(format!("cwd '{dir}' does not exist")));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let mut spec = ProcessSpec::argv(std::iter::once(cfg.cmd).chain(cfg.args));
    spec.cwd = cwd;
    // What E2B gives every process, so a program knows it runs in a sandbox and which;
    // `/init`'s variables and the request's own come after, and win.
    let markers = [
        ("E2B_SANDBOX", Some("true".to_owned())),
        ("E2B_SANDBOX_ID", Some(t.id.clone())),
        ("E2B_TEMPLATE_ID", t.sandbox.template()),
    ];
    for (k, v) in markers {
        if let Some(v) = v {
            spec.env.insert(k.to_owned(), Some(v));
        }
    }
    for (k, v) in init.env.into_iter().chain(cfg.envs) {
        spec.env.insert(k, Some(v));
    }
    spec.pty = pty_size(req.pty.as_ref());
    // A pty always takes input; otherwise stdin is open unless the client said no
    // (absent means open, for old clients).
    spec.stdin = if spec.pty.is_some() || req.stdin.unwrap_or(true) {
        StdinMode::Pipe
    } else {
        StdinMode::Ignore
    };
    spec.user = Some(user);
    // envd kills with SIGKILL at the deadline, without a grace period.
    spec.grace_ms = 0;
    let tag = req.tag.filter(|s| !s.is_empty());
    spec.command_id = tag.clone();
    let mut sctx = ctx.clone();
    sctx.trace = tether_telemetry::current_trace_context(&tracing::Span::current());
    let cmd = t.sandbox.start(&sctx, spec, opts.timeout).await?;
    if let Some(tag) = tag
        && let Ok(mut tags) = t.state.tags.write()
    {
        tags.insert(tag);
    }
    Ok(cmd)
}

async fn connect_stream<S: HostedSandbox>(opts: CallOpts, t: &Target<S>, body: Body) -> Response {
    let req: SelectRequest = match connect::read_single_message(body).await {
        Ok(r) => r,
        Err(e) => return connect::stream_error(&e),
    };
    let cmd = match select(t, req.process.as_ref()) {
        Ok(c) => c,
        Err(e) => return connect::stream_error(&e),
    };
    // Only output produced from now on, as envd (no replay).
    let first = if cmd.spec().pty.is_some() {
        StreamKind::Pty
    } else {
        StreamKind::Stdout
    };
    let from = StreamOffsets {
        stdout: cmd.printed(first),
        stderr: cmd.printed(StreamKind::Stderr),
    };
    respond(t, cmd.pid(), cmd.events(from), opts, opts.deadline())
}

/// The process stream: `start`, then the command's output and its end.
fn respond<S: HostedSandbox>(
    t: &Target<S>,
    pid: u32,
    events: BoxStream<'static, Result<ProcessEvent, Failure>>,
    opts: CallOpts,
    deadline: Option<tokio::time::Instant>,
) -> Response {
    let first = connect::msg(&ProcessEventResponse {
        event: ProcessEventMsg::Start(StartEvent { pid }),
    });
    let rest = events.map(|ev| match ev {
        Ok(ProcessEvent::Output { stream, data, .. }) => {
            let data = match stream {
                StreamKind::Stdout => DataEvent::Stdout(data),
                StreamKind::Stderr => DataEvent::Stderr(data),
                StreamKind::Pty => DataEvent::Pty(data),
            };
            Ok(Some(connect::msg(&ProcessEventResponse {
                event: ProcessEventMsg::Data(data),
            })))
        }
        Ok(ProcessEvent::Exited { status, .. }) => Ok(Some(connect::msg(&ProcessEventResponse {
            event: ProcessEventMsg::End(end_event(status)),
        }))),
        Ok(ProcessEvent::Started { .. }) => Ok(None),
        Err(e) => Err(RpcError::from(e)),
    });
    let messages = futures_util::stream::once(async move { Ok(first) })
        .chain(rest.filter_map(|r| async move { r.transpose() }))
        .boxed();
    let keepalive_msg = connect::msg(&ProcessEventResponse {
        event: ProcessEventMsg::Keepalive(Empty {}),
    });
    connect::stream_response(
        messages,
        StreamOpts {
            keepalive: opts.keepalive,
            keepalive_msg,
            deadline,
            sever: Some(t.sandbox.lifetime().clone()),
            span: tracing::Span::current(),
        },
    )
}

/// An `EndEvent` shaped like Go's `ProcessState`: `exit status N`, or `signal: killed`
/// with exit code -1.
pub(crate) fn end_event(status: ExitStatus) -> EndEvent {
    match (status.code, status.signal) {
        (Some(code), _) => EndEvent::exited_with(code),
        (None, Some(sig)) => EndEvent::signaled(sig),
        (None, None) => EndEvent::unknown(),
    }
}

// === StreamInput ===

async fn stream_input<S: HostedSandbox>(
    ctx: &CallCtx,
    opts: CallOpts,
    t: &Target<S>,
    body: Body,
) -> Response {
    let mut messages = connect::message_stream::<StreamInputRequest>(body);
    let deadline = opts.deadline();
    let work = async {
        let cmd = match messages.next().await {
            Some(Ok(StreamInputRequest::Start(s))) => running(t, s.process.as_ref())?,
            Some(Ok(_)) => {
                return Err(RpcError::invalid(
                    "the first message of StreamInput must be start",
                ));
            }
            Some(Err(e)) => return Err(e),
            None => return Err(RpcError::invalid("StreamInput got no message")),
        };
        while let Some(m) = messages.next().await {
            match m? {
                StreamInputRequest::Data(d) => match d.input {
                    Some(ProcessInput::Stdin(b) | ProcessInput::Pty(b)) => {
                        ctx.run(cmd.handle().write_stdin(ctx, Bytes::from(b)))
                            .await?;
                    }
                    None => return Err(RpcError::invalid("data without input")),
                },
                StreamInputRequest::Keepalive(_) => {}
                StreamInputRequest::Start(_) => {
                    return Err(RpcError::invalid("start may only be the first message"));
                }
            }
        }
        Ok(())
    };
    let r = match deadline {
        Some(d) => tokio::time::timeout_at(d, work).await.unwrap_or_else(|_| {
            Err(RpcError::new(
                ConnectCode::DeadlineExceeded,
                "the call's Connect-Timeout-Ms expired",
            ))
        }),
        None => work.await,
    };
    match r {
        Ok(()) => {
            let mut body = match connect::envelope(b"{}") {
                Ok(frame) => frame.to_vec(),
                Err(e) => return connect::stream_error(&e),
            };
            body.extend_from_slice(&connect::end_frame(None));
            (
                http::StatusCode::OK,
                [(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static(connect::STREAM_JSON),
                )],
                body,
            )
                .into_response()
        }
        Err(e) => connect::stream_error(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_events_read_like_go_process_state() {
        let ok = end_event(ExitStatus {
            code: Some(0),
            signal: None,
        });
        assert_eq!(
            (ok.exit_code, ok.exited, ok.status.as_str(), ok.error),
            (0, true, "exit status 0", None)
        );
        let fail = end_event(ExitStatus {
            code: Some(3),
            signal: None,
        });
        assert_eq!(
            (fail.exit_code, fail.error.as_deref()),
            (3, Some("exit status 3"))
        );
        let killed = end_event(ExitStatus {
            code: None,
            signal: Some(9),
        });
        assert_eq!(
            (killed.exit_code, killed.exited, killed.status.as_str()),
            (-1, false, "signal: killed")
        );
        assert_eq!(Method::parse("Start"), Some(Method::Start));
        assert_eq!(Method::parse("start"), None);
        assert!(Method::StreamInput.streaming() && !Method::SendSignal.streaming());
    }
}

//! The span vocabulary: every span name and attribute key tether emits, in one place.
//!
//! These names are a stable interface (dashboards and alerts query them); `docs/telemetry.md`
//! documents each one, its parent and its attributes. Spans are created with
//! `tracing::info_span!(TOOL_CALL, ...)`-style calls; with the OpenTelemetry layer the span
//! name becomes the OTel span name and every field (including ones declared
//! `tracing::field::Empty` and recorded later) becomes an attribute.
//!
//! Record numeric attributes (`bytes.in`, `bytes.out`, `exit_code`, `retry.count`) as `i64`:
//! tracing-opentelemetry has no `u64` path and exports a `u64` field as a string.
//!
//! `tracing` needs span names and field names as literals, so call sites spell them out;
//! these constants exist for code that builds spans dynamically, for tests that assert on
//! exported spans, and as the single list the documentation follows.

// --- span names ---

/// One inbound HTTP request (native API or E2B front). Root of a request's trace, or a
/// child of the caller's span when the request carries `traceparent`.
pub const HTTP_REQUEST: &str = "http.request";
/// Creating a session (leasing its sandbox).
pub const SESSION_CREATE: &str = "session.create";
/// Ending a session (releasing its sandbox).
pub const SESSION_END: &str = "session.end";
/// One model reply's batch of tool calls.
pub const TOOL_BATCH: &str = "tool.batch";
/// One tool call, through the pre-execute, execute and post-execute waterfalls.
pub const TOOL_CALL: &str = "tool.call";
/// `Provider::create`.
pub const SANDBOX_CREATE: &str = "sandbox.create";
/// `Provider::connect`.
pub const SANDBOX_CONNECT: &str = "sandbox.connect";
/// `Provider::destroy`.
pub const SANDBOX_DESTROY: &str = "sandbox.destroy";
/// `Provider::renew`.
pub const SANDBOX_RENEW: &str = "sandbox.renew";
/// `Provider::list` (lease reconciliation).
pub const SANDBOX_LIST: &str = "sandbox.list";
/// Pausing a session's sandbox (`Provider::pause`).
pub const SANDBOX_PAUSE: &str = "sandbox.pause";
/// Resuming a session's paused sandbox (`Provider::resume`).
pub const SANDBOX_RESUME: &str = "sandbox.resume";
/// Reading a sandbox's resource use (`Provider::metrics`).
pub const SANDBOX_METRICS: &str = "sandbox.metrics";
/// Taking a snapshot of a session's sandbox (`Provider::snapshot`), for a snapshot or a
/// fork.
pub const SANDBOX_SNAPSHOT: &str = "sandbox.snapshot";
/// Replacing a session's sandbox's egress rules (`Provider::set_egress`).
pub const SANDBOX_NETWORK: &str = "sandbox.network";
/// Creating a sandbox from a snapshot (`Provider::create_from_snapshot`), for a session
/// made from a snapshot or a fork.
pub const SANDBOX_RESTORE: &str = "sandbox.restore";
/// `Process::spawn`, until the command runs.
pub const PROCESS_START: &str = "process.start";
/// Streaming a command's output until it exits or a clock fires.
pub const PROCESS_STREAM: &str = "process.stream";
/// Re-attaching to a running command after a broken stream.
pub const PROCESS_ATTACH: &str = "process.attach";
/// Terminating a command's process group (TERM, grace, KILL, verify).
pub const PROCESS_KILL: &str = "process.kill";
/// `Fs::stat`.
pub const FS_STAT: &str = "fs.stat";
/// `Fs::read`.
pub const FS_READ: &str = "fs.read";
/// `Fs::write`.
pub const FS_WRITE: &str = "fs.write";
/// `Fs::list`.
pub const FS_LIST: &str = "fs.list";
/// `Fs::mkdir`.
pub const FS_MKDIR: &str = "fs.mkdir";
/// `Fs::rename`.
pub const FS_RENAME: &str = "fs.rename";
/// `Fs::remove`.
pub const FS_REMOVE: &str = "fs.remove";
/// Reconciling the lease ledger with the providers' sandbox lists.
pub const LEASE_RECONCILE: &str = "lease.reconcile";
/// A session log's group-commit writer task (lives as long as the open session).
pub const SESSION_WRITER: &str = "session.writer";

/// Prefix of the E2B front's spans: `e2b.sandbox.*` (control plane), `e2b.process.*`,
/// `e2b.filesystem.*` (envd Connect RPCs) and `e2b.files.*` (envd file transfer), each a
/// child of `http.request`.
pub const E2B_PREFIX: &str = "e2b.";

/// Every span name above.
pub const ALL_SPANS: &[&str] = &[
    HTTP_REQUEST,
    SESSION_CREATE,
    SESSION_END,
    TOOL_BATCH,
    TOOL_CALL,
    SANDBOX_CREATE,
    SANDBOX_CONNECT,
    SANDBOX_DESTROY,
    SANDBOX_RENEW,
    SANDBOX_LIST,
    SANDBOX_PAUSE,
    SANDBOX_RESUME,
    SANDBOX_METRICS,
    SANDBOX_SNAPSHOT,
    SANDBOX_NETWORK,
    SANDBOX_RESTORE,
    PROCESS_START,
    PROCESS_STREAM,
    PROCESS_ATTACH,
    PROCESS_KILL,
    FS_STAT,
    FS_READ,
    FS_WRITE,
    FS_LIST,
    FS_MKDIR,
    FS_RENAME,
    FS_REMOVE,
    LEASE_RECONCILE,
    SESSION_WRITER,
];

/// The remote operations that `tether.remote_op.duration` is labelled with: the provider
/// spans above (a bounded set, so a safe metric label). Derived from [`ALL_SPANS`], where
/// they stand together from `SANDBOX_CREATE` to `FS_REMOVE`.
pub const REMOTE_OPS: &[&str] = ALL_SPANS.split_at(5).1.split_at(22).0;

// --- attribute keys (span fields and metric labels) ---

/// The daemon's request id (also in error bodies and the `x-request-id` header).
pub const REQUEST_ID: &str = "request.id";
/// The request's path.
pub const URL_PATH: &str = "url.path";
/// A sandbox path a file operation works on.
pub const FS_PATH: &str = "fs.path";
/// The tether session id.
pub const SESSION_ID: &str = "session.id";
/// The provider's sandbox id.
pub const SANDBOX_ID: &str = "sandbox.id";
/// The provider kind: `local`, `e2b`, `ssh`.
pub const PROVIDER_KIND: &str = "provider.kind";
/// The tool's name: `bash`, `read_file`, ...
pub const TOOL_NAME: &str = "tool.name";
/// The model's id for the tool call.
pub const TOOL_CALL_ID: &str = "tool.call_id";
/// The number of tool calls in a batch.
pub const TOOL_CALLS: &str = "tool.calls";
/// `ok`, or the `ErrorCode` (e.g. `TOOL_TIMEOUT`).
pub const OUTCOME: &str = "outcome";
/// The `ErrorCode` of a failed operation.
pub const ERROR_CODE: &str = "error.code";
/// Which clock fired: `connect`, `transport_idle`, `output_idle`, `total`, `tool`.
pub const TIMEOUT_CLOCK: &str = "timeout.clock";
/// How many times the operation was retried.
pub const RETRY_COUNT: &str = "retry.count";
/// Bytes sent to the sandbox (file content written, stdin).
pub const BYTES_IN: &str = "bytes.in";
/// Bytes received from the sandbox (file content read, command output).
pub const BYTES_OUT: &str = "bytes.out";
/// A command's exit code.
pub const EXIT_CODE: &str = "exit_code";
/// The remote operation (one of [`REMOTE_OPS`]); a metric label only.
pub const REMOTE_OP: &str = "remote.op";
/// The command id of a process (client-chosen or generated).
pub const COMMAND_ID: &str = "command.id";
/// HTTP method of an inbound request.
pub const HTTP_METHOD: &str = "http.request.method";
/// The matched route template, e.g. `/v1/sessions/{id}/tool-calls`.
pub const HTTP_ROUTE: &str = "http.route";
/// HTTP status code of the response.
pub const HTTP_STATUS: &str = "http.response.status_code";
/// Set to `ERROR` to mark the OTel span status as an error (tracing-opentelemetry).
pub const OTEL_STATUS_CODE: &str = "otel.status_code";
/// The OTel status description (tracing-opentelemetry).
pub const OTEL_STATUS_DESCRIPTION: &str = "otel.status_description";
/// The OTel span kind: `server`, `client`, `internal` (tracing-opentelemetry).
pub const OTEL_KIND: &str = "otel.kind";

/// The `outcome` value of a success.
pub const OUTCOME_OK: &str = "ok";

// The `timeout.clock` values are the names of `tether_protocol::Clock`.

#[cfg(test)]
mod remote_ops_tests {
    use super::*;

    #[test]
    fn remote_ops_are_the_provider_spans() {
        assert_eq!(REMOTE_OPS.first(), Some(&SANDBOX_CREATE));
        assert_eq!(REMOTE_OPS.last(), Some(&FS_REMOVE));
        assert_eq!(REMOTE_OPS.len(), 22);
        assert!(REMOTE_OPS.iter().all(|op| op.starts_with("sandbox.")
            || op.starts_with("process.")
            || op.starts_with("fs.")));
    }
}

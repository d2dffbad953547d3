//! The E2B control plane: sandboxes as tether sessions.
//!
//! `POST /sandboxes` (v1) and `POST /v2/sandboxes` create a session owned by the API key's
//! tenant, expiring at `now + timeout` (the daemon's reaper closes it then); its id is the
//! sandbox id. List, get, kill, set-timeout, refresh, connect and pause/resume follow, all
//! scoped to the tenant: another tenant's sandbox id reads as not found. Every answer and
//! error has the JSON shape the SDKs' generated parsers demand (`201` on create, a
//! `{code, message}` body on every error status).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde::de::DeserializeOwned;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{
    ConnectSandboxRequest, ENVD_PORT, ENVD_VERSION, ListedSandbox, NewSandboxRequest,
    PauseSandboxRequest, RefreshRequest, SandboxDetail, SandboxLifecycle, SandboxMetric,
    SandboxNetwork, SandboxNetworkDetail, SandboxNetworkUpdate, SandboxResponse, SandboxState,
    SandboxesMetrics, TimeoutRequest,
};
use tether_provider::CallCtx;
use tokio::sync::watch;
use tracing::Instrument;

use super::auth::Tenant;
use super::{
    CLIENT_ID, Claim, Keyed, RestError, SandboxExtra, form_pairs, now_ms, percent_decode, rfc3339,
    sandbox_not_found,
};
use crate::http::RequestCtx;
use crate::session_manager::{NewSession, Scope, Session, SessionState};
use crate::state::AppState;
use tether_protocol::events::{Expiry, Lifecycle, PauseKind, PortAccess};
use tether_protocol::network::{Cidr, Egress};

mod snapshots;

/// Largest page of `GET /v2/sandboxes` and `GET /snapshots`.
const MAX_PAGE: usize = 100;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/sandboxes", post(create_v1).get(list_v1))
        .route("/v2/sandboxes", post(create_v2).get(list_v2))
        .route("/sandboxes/{id}", get(get_one).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/connect", post(connect_v1))
        .route("/v2/sandboxes/{id}/connect", post(connect_v2))
        .route("/sandboxes/metrics", get(metrics_many))
        .route("/sandboxes/{id}/metrics", get(metrics_one))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/network", put(update_network))
        .merge(snapshots::routes())
        .route("/sandboxes/{id}/{*rest}", any(unsupported))
        .route("/v2/sandboxes/{id}/{*rest}", any(unsupported))
}

// === helpers ===

fn tenant(state: &AppState, headers: &HeaderMap) -> Result<Tenant, RestError> {
    state
        .e2b
        .keys
        .tenant(headers, crate::auth::is_development(&state.config))
}

/// The tenant's live sandbox `id`, or 404 (also for another tenant's id).
fn owned(
    state: &AppState,
    tenant: &Tenant,
    id: &str,
) -> Result<(Arc<Session>, Arc<SandboxExtra>), RestError> {
    match state.sessions.get(id, Scope::Owner(Some(&tenant.0))) {
        Ok(s) if s.state() == SessionState::Active => {
            let extra = state.e2b.extra(id, s.params.template.as_deref());
            Ok((s, extra))
        }
        Ok(_) => {
            state.e2b.forget(id);
            Err(sandbox_not_found(id))
        }
        Err(_) => Err(sandbox_not_found(id)),
    }
}

/// A JSON body; an empty body is `T::default()` where the operation allows it.
fn json_body<T: DeserializeOwned + Default>(body: &Bytes, required: bool) -> Result<T, RestError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return if required {
            Err(RestError::bad_request("a JSON body is required"))
        } else {
            Ok(T::default())
        };
    }
    serde_json::from_slice(body)
        .map_err(|e| RestError::bad_request(format!("invalid JSON body: {e}")))
}

fn check_timeout(state: &AppState, secs: i64, min: i64) -> Result<i64, RestError> {
    let max = i64::try_from(state.e2b.cfg.max_timeout_s).unwrap_or(i64::MAX);
    if secs < min {
        return Err(RestError::bad_request(format!(
            "timeout must be at least {min} seconds"
        )));
    }
    if secs > max {
        return Err(RestError::bad_request(format!(
            "timeout must be at most {max} seconds"
        )));
    }
    Ok(secs)
}

fn ms_after(secs: i64) -> i64 {
    now_ms().saturating_add(secs.saturating_mul(1000))
}

/// CPUs, memory (MiB) and disk (MiB) reported for every sandbox: the host's, which is what
/// a local sandbox shares.
fn resources(state: &AppState) -> (u32, u64, u64) {
    static RES: OnceLock<(u32, u64, u64)> = OnceLock::new();
    *RES.get_or_init(|| {
        let cpus = std::thread::available_parallelism()
            .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX));
        let mem_mb = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(0, |kb| kb / 1024);
        let disk_mb = nix::sys::statvfs::statvfs(state.config.server.state_dir.as_path())
            .map_or(0, |s| {
                s.blocks().saturating_mul(s.fragment_size()) / (1024 * 1024)
            });
        (cpus, mem_mb, disk_mb)
    })
}

fn sandbox_response(state: &AppState, s: &Session, extra: &SandboxExtra) -> SandboxResponse {
    SandboxResponse {
        template_id: extra.template.clone(),
        sandbox_id: s.id.clone(),
        client_id: CLIENT_ID.into(),
        envd_version: ENVD_VERSION.into(),
        alias: Some(extra.template.clone()),
        envd_access_token: Some(state.e2b.access_token(&s.id)),
        traffic_access_token: (!s.params.ports.public).then(|| state.e2b.traffic_token(&s.id)),
        domain: Some(state.e2b.cfg.domain.clone()),
    }
}

/// Egress rules by name (`what`, for the error): networks only.
fn cidrs(what: &str, rules: &Option<Vec<String>>) -> Result<Vec<Cidr>, RestError> {
    rules
        .iter()
        .flatten()
        .map(|r| {
            r.trim().parse::<Cidr>().map_err(|e| {
                RestError::bad_request(format!(
                    "{what}: {e} (host names are not supported: give networks)"
                ))
            })
        })
        .collect()
}

/// Refuse any option of `other` that is set: a rule is enforced or refused, never
/// dropped.
fn refuse_other(
    prefix: &str,
    other: &BTreeMap<String, serde_json::Value>,
) -> Result<(), RestError> {
    let set = |v: &serde_json::Value| match v {
        serde_json::Value::Null => false,
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
        _ => true,
    };
    match other.iter().find(|(_, v)| set(v)) {
        Some((name, _)) => Err(RestError::bad_request(format!(
            "{prefix}{name} is not supported by this server"
        ))),
        None => Ok(()),
    }
}

/// The egress rules of `PUT /sandboxes/{id}/network`.
fn network_update_of(n: SandboxNetworkUpdate) -> Result<Egress, RestError> {
    let mut deny = cidrs("denyOut", &n.deny_out)?;
    if n.allow_internet_access == Some(false) {
        deny.extend(Cidr::everything());
    }
    refuse_other("", &n.other)?;
    Ok(Egress {
        allow: cidrs("allowOut", &n.allow_out)?,
        deny,
    })
}

/// E2B's `allowInternetAccess` of a session: it has network, and its rules in force do
/// not deny every address (a create with `allow_internet_access: false` or a network
/// update that says so made such rules; `allowOut` may still admit some).
fn internet_allowed(s: &Session) -> bool {
    let deny = s.egress().deny;
    s.params.network && !Cidr::everything().iter().all(|c| deny.contains(c))
}

/// The port proxy's admission and the egress rules of a create's `network`. A rule is
/// enforced or refused, never dropped: one that names a domain (E2B also filters by
/// host name) is refused, as is a provider that cannot enforce them (at create).
fn network_of(n: SandboxNetwork) -> Result<(PortAccess, Egress), RestError> {
    let egress = Egress {
        allow: cidrs("network.allowOut", &n.allow_out)?,
        deny: cidrs("network.denyOut", &n.deny_out)?,
    };
    refuse_other("network.", &n.other)?;
    let mask_host = n.mask_request_host.filter(|h| !h.is_empty());
    if let Some(h) = &mask_host
        && http::HeaderValue::from_str(&h.replace("${PORT}", "1")).is_err()
    {
        return Err(RestError::bad_request(
            "network.maskRequestHost is not a valid host",
        ));
    }
    let https_ports: std::collections::BTreeSet<u16> =
        n.https_ports.unwrap_or_default().into_iter().collect();
    if https_ports.contains(&ENVD_PORT) || https_ports.contains(&0) {
        return Err(RestError::bad_request(format!(
            "network.httpsPorts: port 0 and envd's port {ENVD_PORT} cannot be listed"
        )));
    }
    let ports = PortAccess {
        public: n.allow_public_traffic.unwrap_or(true),
        mask_host,
        https_ports,
    };
    Ok((ports, egress))
}

fn state_of(session: &Session) -> SandboxState {
    if session.is_paused() {
        SandboxState::Paused
    } else {
        SandboxState::Running
    }
}

// === create ===

async fn create_v1(
    state: State<Arc<AppState>>,
    ctx: RequestCtx,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    create(state, ctx, headers, body).await
}

async fn create_v2(
    state: State<Arc<AppState>>,
    ctx: RequestCtx,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    create(state, ctx, headers, body).await
}

async fn create(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!(
        "e2b.sandbox.create",
        session.id = tracing::field::Empty,
        sandbox.id = tracing::field::Empty,
        template = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let r = do_create(&state, &ctx, &headers, &body)
        .instrument(span.clone())
        .await;
    match r {
        Ok(resp) => {
            span.record("session.id", resp.sandbox_id.as_str());
            span.record("sandbox.id", resp.sandbox_id.as_str());
            span.record("outcome", "ok");
            (StatusCode::CREATED, axum::Json(resp)).into_response()
        }
        Err(e) => {
            span.record("outcome", e.status().as_str());
            e.into_response()
        }
    }
}

async fn do_create(
    state: &Arc<AppState>,
    ctx: &CallCtx,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<SandboxResponse, RestError> {
    let tenant = tenant(state, headers)?;
    let mut req: NewSandboxRequest = json_body(body, true)?;
    if req.template_id.trim().is_empty() {
        return Err(RestError::bad_request("templateID is required"));
    }
    tracing::Span::current().record("template", req.template_id.as_str());
    // E2B resolves the name before anything else (`name:tag` names a tag of `name`) and
    // answers a name it does not know 404 `template '<name>' not found`.
    let identifier = req
        .template_id
        .split_once(':')
        .map_or(req.template_id.as_str(), |(name, _)| name)
        .trim();
    // A snapshot of the tenant's is a template too (E2B's snapshot templates).
    let snapshot = if state.e2b.cfg.templates.iter().any(|t| t == identifier) {
        None
    } else {
        match state
            .sessions
            .snapshots()
            .find(req.template_id.trim(), Scope::Owner(Some(&tenant.0)))
        {
            Some(rec) => Some(rec.id),
            None => {
                return Err(RestError::new(
                    StatusCode::NOT_FOUND,
                    format!("template '{identifier}' not found"),
                ));
            }
        }
    };
    let default = i64::try_from(state.e2b.cfg.default_timeout_s).unwrap_or(300);
    let timeout = check_timeout(state, req.timeout.unwrap_or(default), 1)?;
    let idem = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(|k| (tenant.0.clone(), k.to_owned()));
    let provider = state.e2b.cfg.provider.clone();
    let provider_name = provider
        .clone()
        .unwrap_or_else(|| state.sessions.providers().default_name().to_owned());
    let pause_kind = PauseKind::keeping_memory(req.auto_pause_memory);
    if pause_kind == PauseKind::Filesystem && req.auto_pause != Some(true) {
        // As E2B answers it.
        return Err(RestError::bad_request(
            "autoPauseMemory=false only applies when autoPause is true.",
        ));
    }
    if req.auto_pause == Some(true) {
        let caps = state
            .sessions
            .providers()
            .get(&provider_name)
            .map(|p| p.capabilities());
        if !caps.is_some_and(|c| c.pause) {
            return Err(RestError::bad_request(format!(
                "autoPause: the {provider_name} provider cannot pause sandboxes"
            )));
        }
        if pause_kind == PauseKind::Filesystem && !caps.is_some_and(|c| c.pause_filesystem) {
            return Err(RestError::bad_request(format!(
                "autoPauseMemory=false: the {provider_name} provider cannot pause a sandbox \
                 without its memory"
            )));
        }
    }
    let auto_resume = req.auto_resume.is_some_and(|a| a.enabled);
    if auto_resume && req.auto_pause != Some(true) {
        // As the SDKs refuse it: only a sandbox that pauses can resume.
        return Err(RestError::bad_request(
            "autoResume can only be enabled when autoPause is",
        ));
    }
    if auto_resume && pause_kind == PauseKind::Filesystem {
        return Err(RestError::bad_request(
            "autoPauseMemory=false: a filesystem-only snapshot cannot be auto-resumed by \
             traffic and must be resumed explicitly.",
        ));
    }
    let lifecycle = Lifecycle {
        pause_on_expiry: req.auto_pause == Some(true),
        auto_resume,
        resume_ttl_ms: u64::try_from(timeout.saturating_mul(1000)).ok(),
        pause_kind,
    };
    let allow_internet = req.allow_internet_access.unwrap_or(true);
    let (ports, mut egress) = network_of(req.network.take().unwrap_or_default())?;
    // `allow_internet_access: false` is, as on E2B, a rule (everything but `allowOut` is
    // denied) that a network update may lift later, where the provider enforces rules;
    // elsewhere the sandbox gets no network at all.
    let rules = state
        .sessions
        .providers()
        .get(&provider_name)
        .is_some_and(|p| p.capabilities().egress);
    if !allow_internet && rules {
        egress.deny.extend(Cidr::everything());
    }
    let new = NewSession {
        provider,
        template: Some(req.template_id.clone()),
        env: req.env_vars.unwrap_or_default(),
        metadata: req.metadata.unwrap_or_default(),
        network: allow_internet || rules,
        owner: Some(tenant.0.clone()),
        expiry: Expiry::At {
            at_ms: ms_after(timeout),
        },
        limits: Default::default(),
        ports,
        snapshot,
        lifecycle,
        egress,
    };
    let Some(key) = idem else {
        return make(state, ctx, new, &req.template_id, None).await;
    };
    // A retry under the key joins the create in flight (a client whose answer was slow
    // retries while the first is still being made) or gets the sandbox it made.
    for _ in 0..CLAIM_ROUNDS {
        match state.e2b.claim(&key) {
            Claim::Join(mut rx) => {
                let done = ctx
                    .run(async {
                        Ok(rx
                            .wait_for(|k| *k != Keyed::InFlight)
                            .await
                            .map(|k| k.clone())
                            .unwrap_or(Keyed::Failed))
                    })
                    .await
                    .map_err(|e| RestError::from(crate::error::DaemonError::from(e)))?;
                if let Keyed::Made(id) = done {
                    match owned(state, &tenant, &id) {
                        Ok((s, extra)) => return Ok(sandbox_response(state, &s, &extra)),
                        Err(_) => state.e2b.unclaim(&key, &id),
                    }
                }
            }
            Claim::Make(tx) => {
                // The create runs to its end and announces it even if this request is
                // dropped (its client gave up): the retry then finds it.
                let st = Arc::clone(state);
                let template = req.template_id.clone();
                let cctx = ctx.clone();
                return state
                    .tasks
                    .spawn(
                        async move { make(&st, &cctx, new, &template, Some(tx)).await }
                            .in_current_span(),
                    )
                    .await
                    .map_err(|e| {
                        RestError::from(crate::error::DaemonError::internal(format!(
                            "the create task failed: {e}"
                        )))
                    })?;
            }
            Claim::Unkeyed => break,
        }
    }
    make(state, ctx, new, &req.template_id, None).await
}

/// How many times a create under a key looks again after the one it joined failed or its
/// sandbox is gone, before it makes one without the key.
const CLAIM_ROUNDS: usize = 3;

/// Make the session of a create; `announce` tells those waiting under its key.
async fn make(
    state: &AppState,
    ctx: &CallCtx,
    new: NewSession,
    template: &str,
    announce: Option<watch::Sender<Keyed>>,
) -> Result<SandboxResponse, RestError> {
    prune(state);
    // A create owns remote work: it runs to completion even if the client leaves.
    let r = state.sessions.create_owned(ctx, new).await;
    let session = match r {
        Ok(s) => s,
        Err(e) => {
            if let Some(tx) = announce {
                tx.send_replace(Keyed::Failed);
            }
            return Err(e.into());
        }
    };
    let extra = state
        .e2b
        .insert_extra(&session.id, SandboxExtra::new(template, state.e2b.fs_op));
    write_markers(state, &session).await;
    if let Some(tx) = announce {
        tx.send_replace(Keyed::Made(session.id.clone()));
    }
    Ok(sandbox_response(state, &session, &extra))
}

/// Drop the front's extras of sandboxes that ended without the front seeing it (expired
/// by the reaper), so they do not accumulate.
fn prune(state: &AppState) {
    let ids: Vec<String> = state
        .e2b
        .sandboxes
        .read()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    for id in ids {
        let live = state
            .sessions
            .get(&id, Scope::Any)
            .is_ok_and(|s| s.state() == SessionState::Active);
        if !live {
            state.e2b.forget(&id);
        }
    }
}

// === list ===

/// The filters of a listing.
#[derive(Debug, Default)]
struct ListQuery {
    metadata: BTreeMap<String, String>,
    states: Vec<SandboxState>,
    ascending: bool,
    started_after_ms: Option<i64>,
    template: Option<String>,
    next_token: Option<String>,
    limit: usize,
}

impl ListQuery {
    fn parse(q: Option<&str>) -> Result<Self, RestError> {
        let mut out = Self {
            limit: MAX_PAGE,
            ..Self::default()
        };
        for (k, v) in form_pairs(q.unwrap_or("")) {
            match k.as_str() {
                // `metadata` is itself a query string whose keys and values were
                // percent-encoded once more (`urlencode({quote(k): quote(v)})`).
                "metadata" => {
                    for (mk, mv) in form_pairs(&v) {
                        out.metadata
                            .insert(percent_decode(&mk), percent_decode(&mv));
                    }
                }
                "state" => {
                    for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                        let st = SandboxState::parse(s).ok_or_else(|| {
                            RestError::bad_request(format!("invalid state {s:?}"))
                        })?;
                        out.states.push(st);
                    }
                }
                "order" => {
                    out.ascending = match v.as_str() {
                        "asc" => true,
                        "desc" => false,
                        other => {
                            return Err(RestError::bad_request(format!("invalid order {other:?}")));
                        }
                    }
                }
                "startedAfter" => {
                    let ms = super::parse_rfc3339(&v)
                        .ok_or_else(|| RestError::bad_request("startedAfter must be RFC 3339"))?;
                    out.started_after_ms = Some(ms);
                }
                "template" => out.template = Some(v),
                "nextToken" => out.next_token = Some(v).filter(|t| !t.is_empty()),
                "limit" => {
                    let n: usize = v
                        .parse()
                        .map_err(|_| RestError::bad_request("limit must be an integer"))?;
                    if !(1..=MAX_PAGE).contains(&n) {
                        return Err(RestError::bad_request(format!(
                            "limit must be between 1 and {MAX_PAGE}"
                        )));
                    }
                    out.limit = n;
                }
                _ => {}
            }
        }
        Ok(out)
    }
}

fn listed(state: &AppState, s: &Session, extra: &SandboxExtra) -> ListedSandbox {
    let (cpu, mem, disk) = resources(state);
    ListedSandbox {
        template_id: extra.template.clone(),
        sandbox_id: s.id.clone(),
        client_id: CLIENT_ID.into(),
        started_at: rfc3339(s.created_ms),
        end_at: rfc3339(s.expires_ms()),
        cpu_count: cpu,
        memory_mb: mem,
        disk_size_mb: disk,
        state: state_of(s),
        envd_version: ENVD_VERSION.into(),
        alias: Some(extra.template.clone()),
        metadata: s.params.metadata.clone(),
    }
}

/// The tenant's live sandboxes matching the filters, in the asked order.
fn matching(
    state: &AppState,
    tenant: &Tenant,
    q: &ListQuery,
) -> Vec<(Arc<Session>, Arc<SandboxExtra>)> {
    let mut v: Vec<_> = state
        .sessions
        .list(Scope::Owner(Some(&tenant.0)))
        .into_iter()
        .filter(|s| s.state() == SessionState::Active)
        .map(|s| {
            let extra = state.e2b.extra(&s.id, s.params.template.as_deref());
            (s, extra)
        })
        .filter(|(s, extra)| {
            q.metadata
                .iter()
                .all(|(k, v)| s.params.metadata.get(k) == Some(v))
                && (q.states.is_empty() || q.states.contains(&state_of(s)))
                && q.started_after_ms.is_none_or(|t| s.created_ms >= t)
                && q.template.as_ref().is_none_or(|t| &extra.template == t)
        })
        .collect();
    // `list` is oldest first; the default order is newest first.
    if !q.ascending {
        v.reverse();
    }
    v
}

async fn list_v1(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let mut q = ListQuery::parse(raw.as_deref())?;
        // v1 lists running sandboxes only, unpaged.
        q.states = vec![SandboxState::Running];
        let items: Vec<_> = matching(&state, &tenant, &q)
            .iter()
            .map(|(s, e)| listed(&state, s, e))
            .collect();
        Ok::<_, RestError>(axum::Json(items).into_response())
    }
    .instrument(tracing::info_span!("e2b.sandbox.list"))
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn list_v2(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let q = ListQuery::parse(raw.as_deref())?;
        let all = matching(&state, &tenant, &q);
        let total_running = all.iter().filter(|(s, _)| !s.is_paused()).count();
        let (page, next) = paged(&all, q.next_token.as_deref(), q.limit, |(s, _)| &s.id)?;
        let items: Vec<ListedSandbox> = page.iter().map(|(s, e)| listed(&state, s, e)).collect();
        let mut resp = axum::Json(&items).into_response();
        if let Some(v) = next {
            resp.headers_mut().insert("x-next-token", v);
        }
        if let Ok(v) = HeaderValue::from_str(&total_running.to_string()) {
            resp.headers_mut().insert("x-total-running", v);
        }
        Ok::<_, RestError>(resp)
    }
    .instrument(tracing::info_span!("e2b.sandbox.list"))
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// One page of `all` (E2B's cursor paging): the items after the one whose id is
/// `next_token` (all from the first without it), at most `limit`, and the cursor of the
/// next page (`x-next-token`) when there is one.
fn paged<'a, T>(
    all: &'a [T],
    next_token: Option<&str>,
    limit: usize,
    id: impl Fn(&T) -> &str,
) -> Result<(&'a [T], Option<HeaderValue>), RestError> {
    let start = match next_token {
        Some(tok) => match all.iter().position(|x| id(x) == tok) {
            Some(i) => i + 1,
            None => return Err(RestError::bad_request("invalid nextToken")),
        },
        None => 0,
    };
    let page = &all[start..(start + limit).min(all.len())];
    let next = page
        .last()
        .filter(|_| start + page.len() < all.len())
        .and_then(|last| HeaderValue::from_str(id(last)).ok());
    Ok((page, next))
}

// === one sandbox ===

async fn get_one(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.get", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, extra) = owned(&state, &tenant, &id)?;
        let (cpu, mem, disk) = resources(&state);
        let detail = SandboxDetail {
            template_id: extra.template.clone(),
            sandbox_id: s.id.clone(),
            client_id: CLIENT_ID.into(),
            started_at: rfc3339(s.created_ms),
            end_at: rfc3339(s.expires_ms()),
            envd_version: ENVD_VERSION.into(),
            cpu_count: cpu,
            memory_mb: mem,
            disk_size_mb: disk,
            state: state_of(&s),
            alias: Some(extra.template.clone()),
            envd_access_token: Some(state.e2b.access_token(&s.id)),
            allow_internet_access: Some(internet_allowed(&s)),
            domain: Some(state.e2b.cfg.domain.clone()),
            metadata: s.params.metadata.clone(),
            lifecycle: Some(SandboxLifecycle {
                auto_resume: s.params.lifecycle.auto_resume,
                on_timeout: if s.params.lifecycle.pause_on_expiry {
                    "pause"
                } else {
                    "kill"
                }
                .into(),
            }),
            network: Some(SandboxNetworkDetail {
                allow_public_traffic: s.params.ports.public,
                mask_request_host: s.params.ports.mask_host.clone(),
                https_ports: s.params.ports.https_ports.iter().copied().collect(),
            }),
        };
        Ok::<_, RestError>(axum::Json(detail).into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn kill(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.kill", sandbox.id = %id, session.id = %id, outcome = tracing::field::Empty);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        owned(&state, &tenant, &id)?;
        state.e2b.forget(&id);
        state
            .sessions
            .close(&id, Scope::Owner(Some(&tenant.0)), "killed")
            .await?;
        Ok::<_, RestError>(StatusCode::NO_CONTENT.into_response())
    }
    .instrument(span.clone())
    .await;
    span.record("outcome", r.as_ref().map_or("error", |_| "ok"));
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn set_timeout(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.set_timeout", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, _) = owned(&state, &tenant, &id)?;
        let req: TimeoutRequest = serde_json::from_slice(&body)
            .map_err(|e| RestError::bad_request(format!("invalid JSON body: {e}")))?;
        let secs = check_timeout(&state, req.timeout, 0)?;
        // The new end may be earlier than the old one: E2B's timeout sets, not extends.
        s.set_expiry(ms_after(secs)).await?;
        Ok::<_, RestError>(StatusCode::NO_CONTENT.into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn refresh(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.refresh", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, _) = owned(&state, &tenant, &id)?;
        let req: RefreshRequest = json_body(&body, false)?;
        let secs = req.duration.unwrap_or(0);
        if !(0..=3600).contains(&secs) {
            return Err(RestError::bad_request(
                "duration must be between 0 and 3600 seconds",
            ));
        }
        // A refresh only extends.
        let at = ms_after(secs.max(15));
        if at > s.expires_ms() {
            s.set_expiry(at).await?;
        }
        Ok(StatusCode::NO_CONTENT.into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn connect_v1(
    state: State<Arc<AppState>>,
    ctx: RequestCtx,
    headers: HeaderMap,
    id: Path<String>,
    body: Bytes,
) -> Response {
    connect(state, ctx, headers, id, body, true).await
}

async fn connect_v2(
    state: State<Arc<AppState>>,
    ctx: RequestCtx,
    headers: HeaderMap,
    id: Path<String>,
    body: Bytes,
) -> Response {
    connect(state, ctx, headers, id, body, false).await
}

/// Connect: 200 with the sandbox (and its token) when running; a paused sandbox is resumed
/// (201). The timeout, when longer than what is left, extends the sandbox's life.
async fn connect(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
    v1: bool,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.connect", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, extra) = owned(&state, &tenant, &id)?;
        let req: ConnectSandboxRequest = json_body(&body, v1)?;
        let default = i64::try_from(state.e2b.cfg.default_timeout_s).unwrap_or(300);
        let secs = check_timeout(&state, req.timeout.unwrap_or(default), 1)?;
        // The new expiry first: a sandbox resumed past its old one would be ended (or
        // paused again) by the expiry sweep before it could be set.
        let at = ms_after(secs);
        if at > s.expires_ms() {
            s.set_expiry(at).await?;
        }
        let resumed = if s.is_paused() {
            resume_sandbox(&state, &ctx, &s, req.memory == Some(false)).await?;
            true
        } else {
            false
        };
        let status = if resumed {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        };
        Ok::<_, RestError>(
            (status, axum::Json(sandbox_response(&state, &s, &extra))).into_response(),
        )
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `start`/`end` of `GET /sandboxes/{id}/metrics`, Unix seconds.
#[derive(Debug, serde::Deserialize)]
struct MetricsRange {
    start: Option<i64>,
    end: Option<i64>,
}

/// `GET /sandboxes/{id}/metrics`: a sample taken now through the provider (the CPU share
/// since the previous sample), within `start..=end` when given; 501 where the provider
/// cannot tell.
async fn metrics_one(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    range: Result<axum::extract::Query<MetricsRange>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.metrics", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let axum::extract::Query(range) =
            range.map_err(|e| RestError::bad_request(e.body_text()))?;
        let (s, extra) = owned(&state, &tenant, &id)?;
        let m = sample(&state, &ctx, &s, &extra).await?;
        let inside = range.start.is_none_or(|a| m.timestamp_unix >= a)
            && range.end.is_none_or(|b| m.timestamp_unix <= b);
        let out: Vec<SandboxMetric> = if inside { vec![m] } else { Vec::new() };
        Ok::<_, RestError>(axum::Json(out).into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// The most sandboxes one `GET /sandboxes/metrics` names (as E2B's API).
const MAX_METRICS_IDS: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: a sample of each of the tenant's sandboxes
/// named (others are left out, as missing ones).
async fn metrics_many(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let ids: Vec<String> = tether_envd_server::util::query_param(q.as_deref(), "sandbox_ids")
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        if ids.is_empty() || ids.len() > MAX_METRICS_IDS {
            return Err(RestError::bad_request(format!(
                "sandbox_ids must name 1 to {MAX_METRICS_IDS} sandboxes"
            )));
        }
        let mut out = SandboxesMetrics {
            sandboxes: BTreeMap::new(),
        };
        for id in ids {
            if let Ok((s, extra)) = owned(&state, &tenant, &id) {
                out.sandboxes
                    .insert(id, sample(&state, &ctx, &s, &extra).await?);
            }
        }
        Ok::<_, RestError>(axum::Json(out).into_response())
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// One metrics sample of `s` now.
async fn sample(
    state: &AppState,
    ctx: &CallCtx,
    s: &Session,
    extra: &SandboxExtra,
) -> Result<SandboxMetric, RestError> {
    let m = match s.resource_use(ctx).await {
        Ok(m) => m,
        Err(e) if e.code() == ErrorCode::Unsupported => {
            return Err(RestError::new(
                StatusCode::NOT_IMPLEMENTED,
                format!(
                    "metrics are not supported by the {} provider this sandbox runs on",
                    s.provider_kind
                ),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    let (host_cpus, host_mem_mb, host_disk_mb) = resources(state);
    let cpus = m.cpus.unwrap_or_else(|| {
        s.params.limits.cpu_millis.map_or(host_cpus, |c| {
            u32::try_from(c.div_ceil(1000).max(1)).unwrap_or(u32::MAX)
        })
    });
    let now = now_ms();
    let (since_ms, since_us) = extra
        .cpu_sample
        .read()
        .ok()
        .and_then(|g| *g)
        .unwrap_or((s.created_ms, 0));
    if let Ok(mut g) = extra.cpu_sample.write() {
        *g = Some((now, m.cpu_usage_us));
    }
    let wall_us = (now.saturating_sub(since_ms)).max(1) as f64 * 1000.0;
    let used_us = m.cpu_usage_us.saturating_sub(since_us) as f64;
    let pct = (used_us / wall_us / f64::from(cpus) * 100.0).clamp(0.0, 100.0);
    Ok(SandboxMetric {
        timestamp: rfc3339(now),
        timestamp_unix: now.div_euclid(1000),
        cpu_count: cpus,
        cpu_used_pct: pct as f32,
        mem_used: m.memory_bytes,
        mem_total: m.memory_limit_bytes.unwrap_or(host_mem_mb << 20),
        mem_cache: 0,
        disk_used: m.disk_used_bytes,
        disk_total: m.disk_limit_bytes.unwrap_or(host_disk_mb << 20),
    })
}

/// Pause through the provider (`{"memory": false}`: the file system only, and resume
/// boots it again); a provider that cannot pause so answers 501.
async fn pause(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.pause", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, _) = owned(&state, &tenant, &id)?;
        let req: PauseSandboxRequest = json_body(&body, false)?;
        let kind = PauseKind::keeping_memory(req.memory);
        match s.pause(&ctx, kind).await {
            Ok(()) => Ok(StatusCode::NO_CONTENT.into_response()),
            Err(crate::error::DaemonError::Conflict { .. }) => Err(RestError::new(
                StatusCode::CONFLICT,
                format!("sandbox {id} is already paused"),
            )),
            Err(e) if e.code() == ErrorCode::Unsupported => Err(RestError::new(
                StatusCode::NOT_IMPLEMENTED,
                format!(
                    "pause{} is not supported by the {} provider this sandbox runs on",
                    if kind.is_memory() {
                        ""
                    } else {
                        " without memory"
                    },
                    s.provider_kind
                ),
            )),
            Err(e) => Err(e.into()),
        }
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn update_network(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.network", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, _) = owned(&state, &tenant, &id)?;
        let egress = network_update_of(json_body(&body, false)?)?;
        match s.set_egress(&ctx, egress).await {
            Ok(()) => Ok(StatusCode::NO_CONTENT.into_response()),
            Err(e) if e.code() == ErrorCode::Unsupported => Err(RestError::new(
                StatusCode::NOT_IMPLEMENTED,
                format!(
                    "changing the network of a running sandbox is not supported by the {} \
                     provider this sandbox runs on",
                    s.provider_kind
                ),
            )),
            Err(e) => Err(e.into()),
        }
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// The files E2B puts in every sandbox's `/run/e2b` (`.E2B_SANDBOX`: `true`,
/// `.E2B_SANDBOX_ID`, `.E2B_TEMPLATE_ID`; programs read them to learn they run in a
/// sandbox, and which), written as root by one command at create and after a resume (a
/// boot starts with an empty `/run`). Only in a sandbox that is a machine of its own: on
/// a host that sandboxes share (SSH, `isolation = "none"`), `/run` is the host's.
/// Bounded by the sandbox-operation deadline; a failure is logged and fails nothing.
async fn write_markers(state: &AppState, s: &Session) {
    const SCRIPT: &str = "mkdir -p /run/e2b && cd /run/e2b && printf true > .E2B_SANDBOX \
        && printf %s \"$1\" > .E2B_SANDBOX_ID && printf %s \"$2\" > .E2B_TEMPLATE_ID \
        && chmod 644 .E2B_SANDBOX .E2B_SANDBOX_ID .E2B_TEMPLATE_ID";
    let Ok(sandbox) = s.sandbox() else { return };
    if sandbox.info().enforcement == tether_provider::Enforcement::None {
        return;
    }
    let ctx = CallCtx::new(format!("markers-{}", s.id)).with_timeout(
        state.config.limits.deadlines().sandbox_op,
        tether_provider::Clock::Total,
    );
    let template = s.params.template.clone().unwrap_or_default();
    let mut spec = tether_protocol::process::ProcessSpec::argv([
        "sh",
        "-c",
        SCRIPT,
        "tether",
        s.id.as_str(),
        template.as_str(),
    ]);
    spec.user = Some("root".into());
    let r = async {
        let h = sandbox.process().spawn(&ctx, spec).await?;
        h.wait(&ctx).await
    }
    .await;
    match r {
        Ok(st) if st.code == Some(0) => {}
        Ok(st) => {
            tracing::warn!(session.id = %s.id, status = ?st, "Could not write a sandbox's /run/e2b markers")
        }
        Err(e) => {
            tracing::warn!(session.id = %s.id, error = %e, "Could not write a sandbox's /run/e2b markers")
        }
    }
}

/// Resume `s` (`reboot`: by a boot, its memory dropped); 501 where its provider cannot.
async fn resume_sandbox(
    state: &AppState,
    ctx: &CallCtx,
    s: &Arc<Session>,
    reboot: bool,
) -> Result<(), RestError> {
    match s.resume(ctx, reboot).await {
        Ok(()) => {
            write_markers(state, s).await;
            Ok(())
        }
        Err(e) if e.code() == ErrorCode::Unsupported => Err(RestError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "resume is not supported by the {} provider",
                s.provider_kind
            ),
        )),
        Err(e) => Err(e.into()),
    }
}

/// Deprecated `POST /sandboxes/{id}/resume`: 201 when a paused sandbox was resumed, 409
/// when it runs.
async fn resume(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.resume", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let (s, extra) = owned(&state, &tenant, &id)?;
        let req: ConnectSandboxRequest = json_body(&body, false)?;
        if !s.is_paused() {
            return Err(RestError::new(
                StatusCode::CONFLICT,
                format!("sandbox {id} is already running"),
            ));
        }
        let default = i64::try_from(state.e2b.cfg.default_timeout_s).unwrap_or(300);
        // The new expiry first (see `connect`).
        s.set_expiry(ms_after(check_timeout(
            &state,
            req.timeout.unwrap_or(default),
            1,
        )?))
        .await?;
        resume_sandbox(&state, &ctx, &s, req.memory == Some(false)).await?;
        Ok((
            StatusCode::CREATED,
            axum::Json(sandbox_response(&state, &s, &extra)),
        )
            .into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// Operations of the E2B API tether does not serve (metrics, logs, snapshots, forks,
/// network rules): a proper `{code, message}` 501, after auth and scoping.
async fn unsupported(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((id, rest)): Path<(String, String)>,
) -> Response {
    let r = (|| {
        let tenant = tenant(&state, &headers)?;
        owned(&state, &tenant, &id)?;
        Err::<Response, _>(RestError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("/{rest} is not supported by tether's E2B front"),
        ))
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

//! E2B's snapshots and forks, served by the session manager's (one operation for both
//! surfaces): `POST /sandboxes/{id}/snapshots`, `GET /snapshots`, `DELETE
//! /templates/{id}` of a snapshot, a create whose `templateID` names one, and `POST
//! /sandboxes/{id}/fork`. A snapshot belongs to its sandbox's tenant; another tenant's is
//! not found.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tether_protocol::e2b::{ApiError, ForkRequest, ForkResult, SnapshotInfo, SnapshotRequest};
use tether_protocol::events::Expiry;
use tracing::Instrument;

use super::{
    MAX_PAGE, RestError, SandboxExtra, check_timeout, form_pairs, json_body, ms_after, owned,
    paged, sandbox_response, tenant,
};
use crate::http::RequestCtx;
use crate::session_manager::{MAX_FORKS, SNAPSHOT_TAG, Scope, SnapshotRecord};
use crate::state::AppState;

/// A fork's time to live when the request gives none (E2B's default).
const FORK_DEFAULT_TIMEOUT_S: i64 = 15;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/sandboxes/{id}/snapshots", post(create))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/snapshots", get(list))
        .route("/templates/{template}", delete(delete_template))
}

/// A snapshot as E2B names it: `<name or id>:default`.
fn info(r: &SnapshotRecord) -> SnapshotInfo {
    let full = format!("{}:{SNAPSHOT_TAG}", r.name.as_deref().unwrap_or(&r.id));
    SnapshotInfo {
        snapshot_id: full.clone(),
        names: vec![full],
    }
}

async fn create(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.snapshot", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let req: SnapshotRequest = json_body(&body, false)?;
        owned(&state, &tenant, &id)?;
        if let Some(n) = &req.name
            && state.e2b.cfg.templates.iter().any(|t| t == n)
        {
            return Err(RestError::bad_request(format!(
                "name {n:?} is a template's"
            )));
        }
        let rec = state
            .sessions
            .snapshot(&ctx, &id, req.name, Scope::Owner(Some(&tenant.0)))
            .await?;
        Ok((StatusCode::CREATED, axum::Json(info(&rec))).into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`: the tenant's snapshots, oldest
/// first, paged as `GET /v2/sandboxes` (`x-next-token`).
async fn list(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let r = (|| {
        let tenant = tenant(&state, &headers)?;
        let (mut sandbox, mut name, mut next, mut limit) = (None, None, None, MAX_PAGE);
        for (k, v) in form_pairs(raw.as_deref().unwrap_or("")) {
            match k.as_str() {
                "sandboxID" => sandbox = Some(v),
                "name" => name = Some(v),
                "nextToken" => next = Some(v).filter(|t| !t.is_empty()),
                "limit" => {
                    limit = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE).contains(n))
                        .ok_or_else(|| {
                            RestError::bad_request(format!(
                                "limit must be an integer between 1 and {MAX_PAGE}"
                            ))
                        })?;
                }
                _ => {}
            }
        }
        let all = state.sessions.snapshots().list(
            Scope::Owner(Some(&tenant.0)),
            sandbox.as_deref(),
            name.as_deref(),
        );
        let (page, next) = paged(&all, next.as_deref(), limit, |s| &s.id)?;
        let items: Vec<SnapshotInfo> = page.iter().map(info).collect();
        let mut resp = axum::Json(items).into_response();
        if let Some(v) = next {
            resp.headers_mut().insert("x-next-token", v);
        }
        Ok::<_, RestError>(resp)
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `DELETE /templates/{id}`: a snapshot is deleted (204); a configured template cannot
/// be (400); anything else is not found (404).
async fn delete_template(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(template): Path<String>,
) -> Response {
    let span = tracing::info_span!("e2b.snapshot.delete", snapshot.id = %template);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let name = template
            .split_once(':')
            .map_or(template.as_str(), |(n, _)| n);
        if state.e2b.cfg.templates.iter().any(|t| t == name) {
            return Err(RestError::bad_request(format!(
                "template '{name}' is configured in tetherd and cannot be deleted"
            )));
        }
        match state
            .sessions
            .delete_snapshot(&template, Scope::Owner(Some(&tenant.0)))
            .await
        {
            Ok(_) => Ok(StatusCode::NO_CONTENT.into_response()),
            Err(crate::error::DaemonError::SnapshotNotFound { .. }) => Err(RestError::new(
                StatusCode::NOT_FOUND,
                format!("template '{template}' not found"),
            )),
            Err(e) => Err(e.into()),
        }
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /sandboxes/{id}/fork {timeout?, count?}`: 201 with one result per fork.
async fn fork(
    State(state): State<Arc<AppState>>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let span = tracing::info_span!("e2b.sandbox.fork", sandbox.id = %id, session.id = %id);
    let r = async {
        let tenant = tenant(&state, &headers)?;
        let req: ForkRequest = json_body(&body, false)?;
        let count = req.count.unwrap_or(1);
        let count = usize::try_from(count)
            .ok()
            .filter(|n| (1..=MAX_FORKS).contains(n))
            .ok_or_else(|| {
                RestError::bad_request(format!("count must be between 1 and {MAX_FORKS}"))
            })?;
        let timeout = check_timeout(&state, req.timeout.unwrap_or(FORK_DEFAULT_TIMEOUT_S), 1)?;
        let (_, parent) = owned(&state, &tenant, &id)?;
        let expiry = Expiry::At {
            at_ms: ms_after(timeout),
        };
        let forks = state
            .sessions
            .fork_many(&ctx, &id, count, expiry, Scope::Owner(Some(&tenant.0)))
            .await?;
        let results: Vec<ForkResult> = forks
            .into_iter()
            .map(|f| match f {
                Ok(s) => {
                    let extra = state
                        .e2b
                        .insert_extra(&s.id, SandboxExtra::new(&parent.template, state.e2b.fs_op));
                    ForkResult {
                        sandbox: Some(sandbox_response(&state, &s, &extra)),
                        error: None,
                    }
                }
                Err(e) => {
                    let e = RestError::from(e);
                    ForkResult {
                        sandbox: None,
                        error: Some(ApiError {
                            code: e.status().as_u16(),
                            message: e.message().to_owned(),
                            error_code: None,
                        }),
                    }
                }
            })
            .collect();
        Ok::<_, RestError>((StatusCode::CREATED, axum::Json(results)).into_response())
    }
    .instrument(span)
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

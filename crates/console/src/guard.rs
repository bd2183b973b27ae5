//! The gate every page and API request passes: authentication (401, or
//! 429 while a client address or a name has failed too often, see
//! [`sas_runtime::login_limit`]), the operator role for actions (403), and the
//! CSRF checks of actions
//! (403): the `Origin` header, when sent, must be this host, and the user's
//! CSRF token must come in `X-CSRF-Token` or the `csrf_token` form field.
//! See [`crate::auth`] for why.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;

use crate::auth::{Principal, Role};
use crate::error::{ApiFailure, Failure, PageFailure};
use crate::Console;

/// Header carrying the CSRF token of an API action.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// Form field carrying the CSRF token of a page's action.
pub const CSRF_FIELD: &str = "csrf_token";
/// Largest form body read to find its CSRF token.
const MAX_FORM_BYTES: usize = 64 * 1024;

fn answer(api: bool, failure: Failure) -> Response {
    metrics::counter!("sas_console_refused_total", "status" => failure.status.as_str().to_owned())
        .increment(1);
    if api {
        ApiFailure(failure).into_response()
    } else {
        PageFailure(failure).into_response()
    }
}

/// Whether `origin` (`scheme://host[:port]`) names `host` (the `Host` header).
fn same_origin(origin: &str, host: &str) -> bool {
    origin
        .split_once("://")
        .is_some_and(|(_, rest)| rest.trim_end_matches('/').eq_ignore_ascii_case(host))
}

/// What failed logins are counted against: the client's address, and the
/// name a basic-auth header claims.
fn login_keys(request: &Request, authorization: Option<&str>) -> Vec<String> {
    let mut keys = Vec::new();
    if let Some(ConnectInfo(peer)) = request.extensions().get::<ConnectInfo<SocketAddr>>() {
        keys.push(format!("ip:{}", peer.ip()));
    }
    let claimed = authorization
        .and_then(|value| value.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("basic"))
        .and_then(|(_, value)| {
            base64::engine::general_purpose::STANDARD
                .decode(value.trim())
                .ok()
        })
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .and_then(|text| text.split_once(':').map(|(name, _)| name.to_owned()));
    if let Some(name) = claimed {
        keys.push(format!("user:{name}"));
    }
    keys
}

/// The middleware; see the module docs.
pub async fn guard(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    let api = request.uri().path().starts_with("/api/");
    // Owned before any await: a borrowed request would not be Send.
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let keys = login_keys(&request, authorization.as_deref());
    let principal = match authenticate(&console, authorization.as_deref(), &keys).await {
        Ok(principal) => principal,
        Err(refusal) => return refusal.answer(api),
    };
    let mut request = request;
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        request = match may_act(&console, &principal, request).await {
            Ok(request) => request,
            Err(failure) => return answer(api, failure),
        };
    }
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// Why a request was not let in, and the header that goes with the answer.
struct Refusal {
    failure: Failure,
    header: (header::HeaderName, HeaderValue),
}

impl Refusal {
    fn answer(self, api: bool) -> Response {
        let mut response = answer(api, self.failure);
        response.headers_mut().insert(self.header.0, self.header.1);
        response
    }
}

/// Who sent the request: 429 (with `Retry-After`) while its address or
/// name has failed too often, 401 (with `WWW-Authenticate`) for no or bad
/// credentials, which count as a failed login.
async fn authenticate(
    console: &Console,
    authorization: Option<&str>,
    keys: &[String],
) -> Result<Principal, Refusal> {
    if authorization.is_some() {
        if let Some(wait) = console.logins.blocked(keys) {
            let seconds = wait.as_secs().max(1);
            return Err(Refusal {
                failure: Failure::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("too many failed logins from this address or for this name: try again in {seconds} s"),
                ),
                header: (header::RETRY_AFTER, HeaderValue::from(seconds)),
            });
        }
    }
    console
        .auth
        .authenticate(authorization)
        .await
        .map_err(|refusal| {
            if authorization.is_some() {
                console.logins.failed(keys);
                metrics::counter!("sas_console_login_failures_total").increment(1);
                tracing::warn!(keys = ?keys, %refusal, "console login refused");
            }
            Refusal {
                failure: Failure::new(StatusCode::UNAUTHORIZED, refusal.to_string()),
                header: (
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"sas console\", charset=\"UTF-8\""),
                ),
            }
        })
}

/// Whether `principal` may act with `request`: the operator role, an
/// `Origin` (when sent) of this host, and the user's CSRF token in the
/// header or, for a form, its field. Returns the request (with the form
/// body read and put back) or why not (403, 413).
async fn may_act(
    console: &Console,
    principal: &Principal,
    request: Request,
) -> Result<Request, Failure> {
    if principal.role < Role::Operator {
        return Err(Failure::new(
            StatusCode::FORBIDDEN,
            format!(
                "{} has the {} role: actions need the operator role",
                principal.name,
                principal.role.as_str()
            ),
        ));
    }
    // Owned before any await: a borrowed request would not be Send.
    let (host, origin, is_form, header_token) = {
        let headers = request.headers();
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let is_form = text(header::CONTENT_TYPE.as_str())
            .is_some_and(|value| value.starts_with("application/x-www-form-urlencoded"));
        (
            text(header::HOST.as_str()).unwrap_or_default(),
            headers
                .get(header::ORIGIN)
                .map(|origin| origin.to_str().unwrap_or("null").to_owned()),
            is_form,
            text(CSRF_HEADER),
        )
    };
    if let Some(origin) = origin {
        if !same_origin(&origin, &host) {
            return Err(Failure::new(
                StatusCode::FORBIDDEN,
                format!("CSRF check failed: a request from {origin} may not act on the console at {host}"),
            ));
        }
    }
    let (token, request) = match header_token {
        Some(token) => (Some(token), request),
        None if is_form => form_token(request).await?,
        None => (None, request),
    };
    match token {
        None => Err(Failure::new(
            StatusCode::FORBIDDEN,
            format!("CSRF token missing: send it in the {CSRF_HEADER} header (GET /api/session returns it) or the {CSRF_FIELD} form field"),
        )),
        Some(token) if !console.auth.csrf_matches(principal, &token) => Err(Failure::new(
            StatusCode::FORBIDDEN,
            "CSRF token does not match this user's: reload the page, or get it again from GET /api/session",
        )),
        Some(_) => Ok(request),
    }
}

/// A form's CSRF field, and the request with its body read and put back
/// (413 past [`MAX_FORM_BYTES`]).
async fn form_token(request: Request) -> Result<(Option<String>, Request), Failure> {
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_FORM_BYTES).await else {
        return Err(Failure::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a form of more than {MAX_FORM_BYTES} bytes"),
        ));
    };
    let token = form_urlencoded::parse(&bytes)
        .find(|(name, _)| name == CSRF_FIELD)
        .map(|(_, value)| value.into_owned());
    Ok((token, Request::from_parts(parts, Body::from(bytes))))
}

#[cfg(test)]
mod tests {
    use super::same_origin;

    #[test]
    fn an_origin_matches_only_its_own_host_and_port() {
        assert!(same_origin("http://127.0.0.1:9104", "127.0.0.1:9104"));
        assert!(same_origin("https://Console.example", "console.example"));
        assert!(!same_origin("http://evil.example", "127.0.0.1:9104"));
        assert!(!same_origin("http://127.0.0.1:9105", "127.0.0.1:9104"));
        assert!(!same_origin("null", "127.0.0.1:9104"));
    }
}

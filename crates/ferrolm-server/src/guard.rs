//! What a request must pass before a handler sees it: a `Host` the server answers to (a web
//! page that rebinds its own domain to 127.0.0.1 cannot drive the server), a JSON body
//! (browsers send `text/plain` across origins without asking first), and a whole body read
//! within its deadline (a body trickled a byte at a time cannot hold a connection).

use std::net::IpAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::ApiError;
use crate::http::AppState;

/// The `Host` names a server answers to.
#[derive(Clone, Debug)]
pub struct AllowedHosts {
    /// Lowercase names, without port; IPv6 addresses in brackets.
    names: Vec<String>,
    any: bool,
}

impl AllowedHosts {
    /// The loopback names, the address listened on (unless it is 0.0.0.0 or ::), and `extra`
    /// (`*` allows any host).
    pub fn new(listen: IpAddr, extra: &[String]) -> AllowedHosts {
        let mut names: Vec<String> = ["localhost", "127.0.0.1", "[::1]"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if !listen.is_unspecified() {
            names.push(match listen {
                IpAddr::V4(a) => a.to_string(),
                IpAddr::V6(a) => format!("[{a}]"),
            });
        }
        names.extend(extra.iter().map(|h| h.trim().to_ascii_lowercase()));
        AllowedHosts {
            any: names.iter().any(|n| n == "*"),
            names,
        }
    }

    /// Whether a `Host` header value (`name[:port]`) names this server.
    pub fn allows(&self, host: &str) -> bool {
        if self.any {
            return true;
        }
        let host = host.trim().to_ascii_lowercase();
        let name = match host.rfind(':') {
            // `[::1]:8080`, `name:8080`; a bare IPv6 address has colons but no brackets.
            Some(i)
                if host[i + 1..].bytes().all(|b| b.is_ascii_digit()) && !host[..i].is_empty() =>
            {
                if host.starts_with('[') || !host[..i].contains(':') {
                    &host[..i]
                } else {
                    host.as_str()
                }
            }
            _ => host.as_str(),
        };
        let name = name.strip_suffix('.').unwrap_or(name);
        self.names.iter().any(|n| n == name)
    }
}

/// Every route: the `Host` header must name this server.
pub async fn check_host(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    match host {
        Some(h) if state.allowed_hosts.allows(h) => next.run(request).await,
        Some(h) => ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!(
                "this server does not answer to the host {h:?}; start it with --allowed-host {} to allow it",
                h.split(':').next().unwrap_or(h)
            ),
        )
        .with_code("host_not_allowed")
        .into_response(),
        None => ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "the request has no Host header",
        )
        .with_code("host_not_allowed")
        .into_response(),
    }
}

/// Whether the body is declared JSON: `application/json`, any parameters.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// POST routes: a JSON body (415 otherwise), read whole within the body deadline (408) and
/// the size limit (413), before the handler runs.
pub async fn read_json_body(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    if !is_json(request.headers()) {
        return ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "the body must be JSON, sent with `Content-Type: application/json`",
        )
        .with_code("unsupported_media_type")
        .into_response();
    }
    let (parts, body) = request.into_parts();
    let limit = state.config.max_body_bytes;
    let deadline = state.config.body_timeout;
    let read = tokio::time::timeout(deadline, Limited::new(body, limit).collect()).await;
    let bytes = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return too_large().into_response()
        }
        Ok(Err(e)) => {
            return ApiError::invalid(format!("reading the body failed: {e}")).into_response()
        }
        Err(_) => return too_slow(deadline).into_response(),
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

pub fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        "the request body is larger than the server accepts (--max-body-bytes)",
    )
    .with_code("request_too_large")
}

fn too_slow(deadline: Duration) -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "invalid_request_error",
        format!(
            "the request body did not arrive within {} s (--body-timeout)",
            deadline.as_secs_f64()
        ),
    )
    .with_code("request_timeout")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_with_any_port_are_allowed_and_others_are_not() {
        let h = AllowedHosts::new("127.0.0.1".parse().unwrap(), &[]);
        for ok in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:1",
            "[::1]:80",
            "[::1]",
            "LOCALHOST.",
        ] {
            assert!(h.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.2",
            "",
            "::1x",
        ] {
            assert!(!h.allows(bad), "{bad}");
        }
        let h = AllowedHosts::new("0.0.0.0".parse().unwrap(), &["My-Box".into()]);
        assert!(h.allows("my-box:8080") && !h.allows("0.0.0.0"));
        let h = AllowedHosts::new("10.1.2.3".parse().unwrap(), &[]);
        assert!(h.allows("10.1.2.3:8080"));
        assert!(AllowedHosts::new("::".parse().unwrap(), &["*".into()]).allows("anything"));
    }
}

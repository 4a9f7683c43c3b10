//! `GET /` and `GET /ui/{asset}`: the live page, its four files embedded in the binary
//! (no external network, no CDN, no build step). The page holds no data: it reads the
//! API from the browser, with the bearer token when one is configured (given in the
//! page's form, or as `#token=…` in the address, which the page removes), so these
//! routes need no token.
//!
//! Answers carry a content security policy that allows only this origin (scripts,
//! style sheets, `fetch`; inline `style` attributes, which the page sets for its
//! timeline bars, are allowed too), and `no-cache`: a new aggregator's page replaces an
//! old one.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::dto::ErrorDto;
use ringwatch_transport::http;

const INDEX: &str = include_str!("../../ui/index.html");
const JS: &str = include_str!("../../ui/app.js");
const CSS: &str = include_str!("../../ui/app.css");
const ICON: &str = include_str!("../../ui/favicon.svg");

/// The page's files by name: `(name, content type, body)`.
pub const ASSETS: &[(&str, &str, &str)] = &[
    ("app.js", "text/javascript; charset=utf-8", JS),
    ("app.css", "text/css; charset=utf-8", CSS),
    ("favicon.svg", "image/svg+xml", ICON),
];

/// Whether `path` is the page's (served without a token: no data under it; an unknown
/// `/ui/` file is a 404 either way).
#[must_use]
pub fn is_public(path: &str) -> bool {
    path == "/" || path.starts_with("/ui/")
}

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    r
}

/// `GET /`.
#[utoipa::path(get, path = "/", tag = "page", responses((status = 200, description = "the live page (HTML; it reads the API with the browser's fetch)", content_type = "text/html", body = String)))]
pub async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

/// `GET /ui/{asset}`.
#[utoipa::path(get, path = "/ui/{asset}", tag = "page", params(("asset" = String, Path, description = "app.js, app.css or favicon.svg")), responses((status = 200, description = "one of the page's files", content((String = "text/javascript"), (String = "text/css"), (String = "image/svg+xml"))), (status = 404, description = "no such file", body = ErrorDto)))]
pub async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, ct, body)) => page(ct, body),
        None => http::error(
            StatusCode::NOT_FOUND,
            format!("/ui/{name}: no such file (the page has app.js, app.css and favicon.svg)"),
        ),
    }
}

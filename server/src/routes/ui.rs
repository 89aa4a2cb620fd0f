//! `/` without a web UI directory: the catalog browser built into the binary (the repository's
//! `web-ui/`, plain files without a build step), so `tessera serve` and `tessera demo` show it
//! with no flags. `--web-ui DIR` serves a directory instead.

use axum::http::header;
use axum::response::{Html, IntoResponse};

const INDEX: &str = include_str!("../../../web-ui/index.html");
const APP_JS: &str = include_str!("../../../web-ui/app.js");
const STYLE_CSS: &str = include_str!("../../../web-ui/style.css");
const FAVICON_SVG: &str = include_str!("../../../web-ui/favicon.svg");

/// The built-in index page.
pub(crate) async fn index() -> Html<&'static str> {
    Html(INDEX)
}

/// The built-in web UI's script.
pub(crate) async fn app_js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        APP_JS,
    )
}

/// The built-in web UI's style sheet.
pub(crate) async fn style_css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        STYLE_CSS,
    )
}

/// The built-in web UI's icon (also answers `/favicon.ico`, which browsers ask for unprompted).
pub(crate) async fn favicon() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "image/svg+xml")], FAVICON_SVG)
}

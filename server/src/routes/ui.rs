//! `/` without a web UI directory: a small page pointing at the API.

use axum::response::Html;

const INDEX: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tessera</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 2em auto">
<h1>tessera</h1>
<p>Checkpoint catalog and load planning service.</p>
<ul>
<li><a href="/v1/checkpoints">/v1/checkpoints</a>: the catalog</li>
<li><a href="/openapi.json">/openapi.json</a>: the API</li>
<li><a href="/metrics">/metrics</a>, <a href="/readyz">/readyz</a>, <a href="/healthz">/healthz</a></li>
</ul>
<p>Start the server with <code>--web-ui DIR</code> to serve the catalog browser here.</p>
</body></html>
"#;

/// The built-in index page.
pub(crate) async fn index() -> Html<&'static str> {
    Html(INDEX)
}

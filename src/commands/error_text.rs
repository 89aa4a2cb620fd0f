//! How the binary prints an error: each cause once, and a store's answer in plain words first.
//!
//! An error chain repeats itself when a wrapper's message includes its source's and the source
//! is also reported as the next cause (object_store's errors nest four deep this way, and
//! `{:#}` printed "Generic S3 error ... NoSuchBucket" five times in one line). Here a cause that
//! an earlier message already says is dropped, and a message ending with its source's text is
//! cut before it.

use std::fmt::Write as _;

/// Where a store's XML error body starts: cut once it is summarized (the code is in the
/// summary; the rest is noise).
const XML_MARK: &str = "<?xml";

/// The text after `error: ` for `err`: the plain-words reason when the store's answer is a
/// known one (a missing bucket, denied access), then the chain with each cause once.
pub fn error_text(err: &anyhow::Error) -> String {
    let messages: Vec<String> = err.chain().map(ToString::to_string).collect();
    let mut parts: Vec<&str> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let mut own = message.as_str();
        // A wrapper that ends with its source's words: keep only its own.
        if let Some(next) = messages.get(i + 1)
            && !next.is_empty()
            && let Some(head) = own.strip_suffix(next.as_str())
        {
            own = head.trim_end_matches([':', ' ', '-', ',']);
        }
        if own.is_empty() || parts.iter().any(|p| p.contains(own)) {
            continue;
        }
        parts.push(own);
    }
    let mut chain = parts.join(": ");
    let Some(reason) = store_reason(&chain) else {
        return chain;
    };
    // The summary has the code; the XML body adds nothing a reader needs.
    if let Some(at) = chain.find(XML_MARK) {
        chain.truncate(at);
        let kept = chain.trim_end_matches([':', ' ']).len();
        chain.truncate(kept);
    }
    let mut out = reason;
    let _ = write!(out, "\n  while {chain}");
    out
}

/// A store's error answer in plain words, from the codes S3, GCS and Azure put in their bodies
/// (object_store passes the body on as text), naming the bucket when the chain has its URL.
fn store_reason(text: &str) -> Option<String> {
    let bucket = bucket_of(text);
    let name = |what: &str| match &bucket {
        Some(b) => format!("{what} {b}"),
        None => format!("the {what}"),
    };
    let code = |code: &str| text.contains(&format!("<Code>{code}</Code>"));
    if code("NoSuchBucket") || text.contains("The specified bucket does not exist") {
        return Some(format!(
            "{} does not exist (404 NoSuchBucket)",
            name("bucket")
        ));
    }
    if code("ContainerNotFound") {
        return Some(format!(
            "{} does not exist (404 ContainerNotFound)",
            name("container")
        ));
    }
    for (code_name, meaning) in [
        (
            "InvalidAccessKeyId",
            "the access key is not known to the store",
        ),
        (
            "SignatureDoesNotMatch",
            "the secret key does not match the access key",
        ),
        ("ExpiredToken", "the session token has expired"),
        ("AccessDenied", "access denied"),
    ] {
        if code(code_name) {
            return Some(format!(
                "{meaning} for {} (403 {code_name})",
                name("bucket")
            ));
        }
    }
    None
}

/// The bucket (or container) of the first `s3://`, `gs://` or `az://` location in `text`.
fn bucket_of(text: &str) -> Option<String> {
    ["s3://", "gs://", "az://"].iter().find_map(|scheme| {
        let rest = &text[text.find(scheme)? + scheme.len()..];
        let end = rest
            .find(|c: char| c == '/' || c == ':' || c.is_whitespace())
            .unwrap_or(rest.len());
        (end > 0).then(|| rest[..end].to_string())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer {
        text: String,
        source: Option<Box<Layer>>,
    }

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.text)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.source.as_deref().map(|s| s as _)
        }
    }

    /// A chain whose every message includes its source's, as object_store's do.
    fn nested(parts: &[&str]) -> Layer {
        let mut layer: Option<Layer> = None;
        for part in parts.iter().rev() {
            let text = match &layer {
                Some(inner) => format!("{part}: {}", inner.text),
                None => (*part).to_string(),
            };
            layer = Some(Layer {
                text,
                source: layer.map(Box::new),
            });
        }
        layer.unwrap()
    }

    #[test]
    fn each_cause_is_said_once() {
        let err = anyhow::Error::new(nested(&["listing a", "Generic error", "GET x", "404"]))
            .context("opening checkpoint file:///a");
        assert_eq!(
            format!("{err:#}").matches("404").count(),
            4,
            "the chain as anyhow prints it"
        );
        assert_eq!(
            error_text(&err),
            "opening checkpoint file:///a: listing a: Generic error: GET x: 404"
        );
    }

    #[test]
    fn a_missing_bucket_is_named_first() {
        let err = anyhow::Error::new(nested(&[
            "listing run",
            "Generic S3 error",
            "Server returned non-2xx status code: 404 Not Found",
            "<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code></Error>",
        ]))
        .context("opening checkpoint s3://nope/run");
        assert_eq!(
            error_text(&err),
            "bucket nope does not exist (404 NoSuchBucket)\n  while opening checkpoint \
             s3://nope/run: listing run: Generic S3 error: Server returned non-2xx status \
             code: 404 Not Found"
        );
    }
}

//! Checkpoint ids, `<run>/<step>`, checked before they touch storage so that no request reaches
//! outside the catalog root. Segments come from URL paths (already percent-decoded by the router,
//! so `%2e%2e` arrives as `..` and `%2F` as `/`) and from JSON bodies; both go through
//! [`CheckpointId::from_parts`].

use std::fmt;

use object_store::path::{Path, PathPart};

use crate::ApiError;

/// The step name that stands for the run's `latest` pointer.
pub(crate) const LATEST: &str = "latest";

/// Longest run or step name accepted: a file name on every common file system and object store.
const MAX_SEGMENT: usize = 255;

/// A checked checkpoint id: a run directory under the catalog root and a checkpoint directory in
/// it. Each segment is 1 to 255 ASCII letters, digits and `-` `_` `.` `+` `=` `@` `,` `~`, and does
/// not start with `.`, which rules out `.`, `..`, hidden directories, `/`, `\`, `%`, `:` (no
/// URL schemes, drive letters or re-encoded input), whitespace and control characters.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CheckpointId {
    run: String,
    step: String,
}

impl CheckpointId {
    /// Parses `<run>/<step>`.
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let mut parts = text.split('/');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(run), Some(step), None) => Self::from_parts(run, step),
            _ => Err(ApiError::bad_id(format!(
                "checkpoint id {:?} is not <run>/<step> (e.g. gpt/step-000100 or gpt/latest)",
                truncate(text)
            ))),
        }
    }

    /// An id from its two segments.
    pub fn from_parts(run: &str, step: &str) -> Result<Self, ApiError> {
        check_segment("run", run)?;
        check_segment("step", step)?;
        Ok(Self {
            run: run.to_string(),
            step: step.to_string(),
        })
    }

    /// The run name.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// The checkpoint directory name (or `latest`).
    pub fn step(&self) -> &str {
        &self.step
    }

    /// Whether this names the run's `latest` pointer rather than a directory.
    pub fn is_latest(&self) -> bool {
        self.step == LATEST
    }

    /// The same run with another checkpoint directory (checked).
    pub(crate) fn with_step(&self, step: &str) -> Result<Self, ApiError> {
        Self::from_parts(&self.run, step)
    }

    /// The run's prefix under `root`.
    pub(crate) fn run_prefix(&self, root: &Path) -> Path {
        join(root, &self.run)
    }

    /// The checkpoint's prefix under `root`.
    pub(crate) fn prefix(&self, root: &Path) -> Path {
        join(&self.run_prefix(root), &self.step)
    }
}

impl fmt::Display for CheckpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.run, self.step)
    }
}

/// Whether `name` would pass as a run or step name (used to skip odd directories in listings).
pub(crate) fn is_valid_segment(name: &str) -> bool {
    segment_problem(name).is_none()
}

fn check_segment(what: &str, name: &str) -> Result<(), ApiError> {
    match segment_problem(name) {
        None => Ok(()),
        Some(problem) => Err(ApiError::bad_id(format!(
            "{what} name {:?} {problem}",
            truncate(name)
        ))),
    }
}

fn segment_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("is empty");
    }
    if name.len() > MAX_SEGMENT {
        return Some("is longer than 255 bytes");
    }
    if name.starts_with('.') {
        return Some("starts with '.' (no '.', '..' or hidden directories)");
    }
    let allowed = |c: char| {
        c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+' | '=' | '@' | ',' | '~')
    };
    if !name.chars().all(allowed) {
        return Some(
            "has characters other than ASCII letters, digits and - _ . + = @ , ~ (no '/', '\\', '%', ':' or spaces)",
        );
    }
    None
}

/// `root/segment`. Segments are checked already, so `PathPart::from` has nothing to escape.
fn join(root: &Path, segment: &str) -> Path {
    root.clone().join(PathPart::from(segment))
}

/// At most 100 characters of untrusted input, for messages.
pub(crate) fn truncate(text: &str) -> String {
    match text.char_indices().nth(100) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_ids() {
        for text in ["gpt/step-000100", "run_1/latest", "a.b/c+d=e@f,g~h"] {
            assert!(CheckpointId::parse(text).is_ok(), "{text}");
        }
    }

    #[test]
    fn refuses_escapes() {
        for text in [
            "../step-1",
            "gpt/..",
            "gpt/.",
            "/gpt/step-1",
            "gpt/step-1/",
            "gpt//step-1",
            "gpt/step-1/..",
            "gpt\\step-1",
            "gpt/%2e%2e",
            "file:/gpt",
            "s3://bucket/x",
            "gpt/.hidden",
            "gpt/step 1",
            "gpt/step\u{0}",
            "",
            "gpt",
            "gpt/step-1/extra",
        ] {
            assert!(CheckpointId::parse(text).is_err(), "{text:?} was accepted");
        }
        assert!(CheckpointId::parse(&format!("gpt/{}", "a".repeat(256))).is_err());
    }

    #[test]
    fn prefixes_stay_under_the_root() {
        let root = Path::from("catalog");
        let id = CheckpointId::parse("gpt/step-000100").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(id.prefix(&root).as_ref(), "catalog/gpt/step-000100");
        assert_eq!(id.run_prefix(&root).as_ref(), "catalog/gpt");
    }
}

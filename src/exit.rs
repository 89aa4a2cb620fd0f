//! The one place that turns a command's error into the process exit code and the `--json` error
//! document. Scripts branch on the class of a failure (retry when storage was unreachable, page
//! someone when a checksum failed), so each class gets its own code; the classes are listed in
//! `tessera --help` ([`EXIT_CODES_HELP`]) and the README.

use std::error::Error as StdError;

use serde_json::json;
use tessera_loader::LoaderError;
use tessera_loader::plan_client::PlanClientError;
use tessera_metadata::MetadataError;
use tessera_ops::OpsError;
use tessera_storage::StorageError;
use tessera_synth::SynthError;

/// What kind of failure ended a command; each has its own exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Anything not below: bad input, an unreadable format, a full disk.
    Other,
    /// A bad command line (clap's own code).
    Usage,
    /// The checkpoint, a file it names, or an input file does not exist.
    NotFound,
    /// Data that does not match its checksums or metadata (a bad block, a truncated file).
    VerificationFailed,
    /// Storage (or the plan server) could not be reached or kept failing after the retries.
    Unreachable,
    /// Another rank failed, timed out, or the ranks could not meet.
    PeerFailed,
}

impl ErrorClass {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            ErrorClass::Other => 1,
            ErrorClass::Usage => 2,
            ErrorClass::NotFound => 3,
            ErrorClass::VerificationFailed => 4,
            ErrorClass::Unreachable => 5,
            ErrorClass::PeerFailed => 6,
        }
    }

    /// The class a process's exit code says (a rank process of `load --transport tcp`).
    pub fn from_code(code: i32) -> ErrorClass {
        match code {
            2 => ErrorClass::Usage,
            3 => ErrorClass::NotFound,
            4 => ErrorClass::VerificationFailed,
            5 => ErrorClass::Unreachable,
            6 => ErrorClass::PeerFailed,
            _ => ErrorClass::Other,
        }
    }

    /// The `kind` of the JSON error document.
    pub fn kind(self) -> &'static str {
        match self {
            ErrorClass::Other => "other",
            ErrorClass::Usage => "usage",
            ErrorClass::NotFound => "not_found",
            ErrorClass::VerificationFailed => "verification_failed",
            ErrorClass::Unreachable => "unreachable",
            ErrorClass::PeerFailed => "peer_failed",
        }
    }
}

/// The exit codes as `tessera --help` lists them (keep in step with [`ErrorClass::code`] and the
/// README).
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success
  1  other error (invalid input, unsupported format, local I/O)
  2  usage: a bad command line (kind usage)
  3  not found: the checkpoint, a file it lists, or an input file does not exist
  4  verification failed: a checksum mismatch, a truncated or corrupt file, loaded values
     that are not what they should be
  5  unreachable: storage or the plan server did not answer (after the retries)
  6  peer failed: another rank failed or timed out, or the ranks could not meet

Machine output: --json on inspect, plan, load, verify, convert and synth prints one JSON
document on stdout; on failure it is {\"error\": {\"kind\", \"code\", \"message\"}} (kind is
other, usage, not_found, verification_failed, unreachable or peer_failed; code the exit code).";

/// A verification that found problems: `problems` are one line each (a bad block, a stray file),
/// the message lists them and says that `location` failed. Its own type so that the exit code
/// tells it from a checkpoint that could not be read at all.
#[derive(Debug)]
pub struct VerificationFailed {
    /// The checkpoint as given.
    pub location: String,
    /// What is wrong, one line each.
    pub problems: Vec<String>,
}

impl std::fmt::Display for VerificationFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for line in &self.problems {
            writeln!(f, "{line}")?;
        }
        write!(f, "{}: verification failed", self.location)
    }
}

impl StdError for VerificationFailed {}

/// Ranks of a load that failed: `failures` are `rank R: why`, one per rank.
#[derive(Debug)]
pub struct RanksFailed {
    /// `rank R: why`, one per failed rank.
    pub failures: Vec<String>,
    /// The class of the failure that caused the others: when one rank hits a bad block its peers
    /// then time out on it, and the exit code should say the block, not the peers.
    pub class: ErrorClass,
}

impl std::fmt::Display for RanksFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the load failed:\n  {}", self.failures.join("\n  "))
    }
}

impl StdError for RanksFailed {}

/// The class of `error`: the most specific (innermost) cause that has one decides, so a checksum
/// mismatch found while converting is a verification failure, not a convert failure.
pub fn classify(error: &anyhow::Error) -> ErrorClass {
    let mut class = ErrorClass::Other;
    for cause in error.chain() {
        if let Some(c) = classify_cause(cause) {
            class = c;
        }
    }
    class
}

/// The class of one error of the chain, looking through the crates' wrapper variants (some of
/// which, like `OpsError::Context`, keep their inner error out of `source()` so that a chain
/// printer does not repeat it).
fn classify_cause(cause: &(dyn StdError + 'static)) -> Option<ErrorClass> {
    if cause.is::<VerificationFailed>() {
        return Some(ErrorClass::VerificationFailed);
    }
    if let Some(e) = cause.downcast_ref::<RanksFailed>() {
        return Some(e.class);
    }
    if let Some(e) = cause.downcast_ref::<OpsError>() {
        return ops(e);
    }
    if let Some(e) = cause.downcast_ref::<LoaderError>() {
        return loader(e);
    }
    if let Some(e) = cause.downcast_ref::<MetadataError>() {
        return metadata(e);
    }
    if let Some(e) = cause.downcast_ref::<StorageError>() {
        return storage(e);
    }
    if let Some(e) = cause.downcast_ref::<SynthError>() {
        return match e {
            SynthError::Mismatch(_) => Some(ErrorClass::VerificationFailed),
            SynthError::Write { inner, .. } => metadata(inner),
            _ => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<PlanClientError>() {
        return plan_client(e);
    }
    if let Some(e) = cause.downcast_ref::<object_store::Error>() {
        return object(e);
    }
    if let Some(e) = cause.downcast_ref::<std::io::Error>() {
        return (e.kind() == std::io::ErrorKind::NotFound).then_some(ErrorClass::NotFound);
    }
    None
}

fn ops(e: &OpsError) -> Option<ErrorClass> {
    match e {
        OpsError::Storage(e) => storage(e),
        OpsError::Metadata(e) => metadata(e),
        OpsError::Loader(e) => loader(e),
        OpsError::PlanClient(e) => plan_client(e),
        OpsError::RanksFailed { .. } | OpsError::RankFailed { .. } => Some(ErrorClass::PeerFailed),
        OpsError::UnknownPublication { .. } => Some(ErrorClass::NotFound),
        OpsError::Context { inner, .. } => ops(inner),
        _ => None,
    }
}

fn plan_client(e: &PlanClientError) -> Option<ErrorClass> {
    match e {
        PlanClientError::Unreachable { .. } => Some(ErrorClass::Unreachable),
        PlanClientError::Server { status: 404, .. } => Some(ErrorClass::NotFound),
        _ => None,
    }
}

/// The class of one rank's loader error, [`ErrorClass::Other`] when it has none of its own.
pub fn classify_loader(e: &LoaderError) -> ErrorClass {
    loader(e).unwrap_or(ErrorClass::Other)
}

/// The class of ranks that failed with `classes`: the first that is not a peer failure (the rank
/// whose own trouble made its peers fail), else a peer failure.
pub fn root_class(classes: impl IntoIterator<Item = ErrorClass>) -> ErrorClass {
    classes
        .into_iter()
        .find(|c| *c != ErrorClass::PeerFailed)
        .unwrap_or(ErrorClass::PeerFailed)
}

fn loader(e: &LoaderError) -> Option<ErrorClass> {
    match e {
        LoaderError::Metadata(e) => metadata(e),
        LoaderError::Storage(e) => storage(e),
        LoaderError::MissingFile { .. } => Some(ErrorClass::NotFound),
        LoaderError::ShortRead { .. }
        | LoaderError::Checksum { .. }
        | LoaderError::JointChecksum(_) => Some(ErrorClass::VerificationFailed),
        LoaderError::Transport { .. }
        | LoaderError::PeerTimeout { .. }
        | LoaderError::Rendezvous { .. } => Some(ErrorClass::PeerFailed),
        _ => None,
    }
}

fn metadata(e: &MetadataError) -> Option<ErrorClass> {
    match e {
        MetadataError::ChecksumMismatch { .. } | MetadataError::BoxChecksumMismatch { .. } => {
            Some(ErrorClass::VerificationFailed)
        }
        // A truncated file: a data file shorter than its metadata says (as the loader's short
        // read is), or a metadata file with no bytes at all. Metadata that cannot be decoded
        // stays `other`: a decoder cannot tell damaged bytes from a newer or foreign writer's.
        MetadataError::ByteRangePastEnd { .. } | MetadataError::EmptyFile { .. } => {
            Some(ErrorClass::VerificationFailed)
        }
        MetadataError::Store { source, .. } => object(source),
        // Nothing stored at the location (a missing S3 prefix, a local path that is not there).
        MetadataError::NotFound { .. } => Some(ErrorClass::NotFound),
        _ => None,
    }
}

fn storage(e: &StorageError) -> Option<ErrorClass> {
    match e {
        // A bad location is a usage-like error, except a local directory that is not there.
        StorageError::Location { location, .. } => tessera_storage::local_directory(location)
            .is_some_and(|dir| !dir.exists())
            .then_some(ErrorClass::NotFound),
        StorageError::Store { source, .. } => object(source),
        _ => None,
    }
}

fn object(e: &object_store::Error) -> Option<ErrorClass> {
    if matches!(e, object_store::Error::NotFound { .. }) {
        return Some(ErrorClass::NotFound);
    }
    if !tessera_storage::is_transient(e) {
        return None;
    }
    // A `Generic` error is an answer the store gave (object_store maps only some 404s to
    // `NotFound`: a list in a bucket that does not exist stays `Generic`) or no answer at all.
    match http_status(e) {
        Some(404) => Some(ErrorClass::NotFound),
        // Refused (bad credentials, no permission, a bad request): the store answered.
        Some(status) if (400..500).contains(&status) && status != 408 && status != 429 => None,
        // No answer, a timeout, or 5xx still failing after every retry.
        _ => Some(ErrorClass::Unreachable),
    }
}

/// The HTTP status a store answered with, read from the message: object_store keeps the status
/// of its request errors in a private type, and its message says `status code: 404 Not Found`.
fn http_status(e: &object_store::Error) -> Option<u16> {
    const MARK: &str = "status code: ";
    let mut source: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = source {
        let text = err.to_string();
        if let Some(at) = text.find(MARK) {
            let digits = text.get(at + MARK.len()..at + MARK.len() + 3)?;
            return digits.parse().ok();
        }
        source = err.source();
    }
    None
}

/// The `--json` error document of a bad command line (`message`: clap's).
pub fn usage_json(message: &str) -> serde_json::Value {
    json!({"error": {
        "kind": ErrorClass::Usage.kind(),
        "code": ErrorClass::Usage.code(),
        "message": message.trim_end(),
    }})
}

/// The `--json` error document: `{"error": {"kind", "code", "message"}}`, plus `problems` (one
/// line each) for a verification that found some.
pub fn error_json(error: &anyhow::Error) -> serde_json::Value {
    let class = classify(error);
    let mut doc = json!({
        "kind": class.kind(),
        "code": class.code(),
        "message": crate::commands::error_text::error_text(error),
    });
    if let Some(failed) = error
        .chain()
        .find_map(|c| c.downcast_ref::<VerificationFailed>())
    {
        doc["problems"] = json!(failed.problems);
    }
    json!({ "error": doc })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn innermost_class_wins_through_context_and_wrappers() {
        let checksum = LoaderError::Checksum {
            path: "data/rank-0".to_string(),
            start: 0,
            end: 8,
            expected: 1,
            actual: 2,
        };
        let wrapped = OpsError::Context {
            context: "loading rank 0".to_string(),
            inner: Box::new(OpsError::from(checksum)),
        };
        let error = anyhow::Error::new(wrapped).context("converting ckpt");
        assert_eq!(classify(&error), ErrorClass::VerificationFailed);
        let doc = error_json(&error);
        assert_eq!(doc["error"]["kind"], "verification_failed");
        assert_eq!(doc["error"]["code"], 4);
        assert!(
            doc["error"]["message"]
                .as_str()
                .unwrap()
                .contains("checksum mismatch in data/rank-0 bytes 0..8"),
            "{doc}"
        );
    }

    #[test]
    fn store_errors_by_source() {
        let store = |source| {
            anyhow::Error::new(StorageError::Store {
                action: "reading".to_string(),
                path: "ckpt/manifest.json".to_string(),
                source,
            })
        };
        let generic = object_store::Error::Generic {
            store: "S3",
            source: "connection refused".into(),
        };
        let missing = object_store::Error::NotFound {
            path: "ckpt/manifest.json".to_string(),
            source: "404".into(),
        };
        assert_eq!(classify(&store(generic)), ErrorClass::Unreachable);
        assert_eq!(classify(&store(missing)), ErrorClass::NotFound);
        let plain: anyhow::Result<()> = Err(anyhow::anyhow!("bad layout"));
        let plain = plain.context("planning").unwrap_err();
        assert_eq!(classify(&plain), ErrorClass::Other);
        assert_eq!(error_json(&plain)["error"]["code"], 1);
    }

    #[test]
    fn codes_are_distinct_listed_in_the_help_and_read_back() {
        let classes = [
            ErrorClass::Other,
            ErrorClass::Usage,
            ErrorClass::NotFound,
            ErrorClass::VerificationFailed,
            ErrorClass::Unreachable,
            ErrorClass::PeerFailed,
        ];
        let codes: std::collections::BTreeSet<u8> = classes.iter().map(|c| c.code()).collect();
        assert_eq!(codes.len(), classes.len());
        for class in classes {
            assert_eq!(ErrorClass::from_code(i32::from(class.code())), class);
            assert!(
                EXIT_CODES_HELP.contains(&format!("\n  {}  ", class.code())),
                "{class:?} is not in the help"
            );
            assert!(EXIT_CODES_HELP.contains(class.kind()), "{class:?}");
        }
    }

    #[test]
    fn the_rank_with_its_own_trouble_decides_a_failed_load() {
        use ErrorClass::*;
        assert_eq!(
            root_class([PeerFailed, VerificationFailed, PeerFailed]),
            VerificationFailed
        );
        assert_eq!(root_class([PeerFailed, PeerFailed]), PeerFailed);
        assert_eq!(root_class([PeerFailed, Other]), Other);
    }

    #[test]
    fn a_store_answer_is_told_from_no_answer_by_its_status() {
        let generic = |message: &str| object_store::Error::Generic {
            store: "S3",
            source: message.to_string().into(),
        };
        let status = |code: &str| {
            generic(&format!(
                "Error performing GET http://s3/b in 5ms - Server returned non-2xx status code: {code}: <Error/>"
            ))
        };
        assert_eq!(object(&status("404 Not Found")), Some(ErrorClass::NotFound));
        assert_eq!(object(&status("403 Forbidden")), None);
        assert_eq!(
            object(&status("503 Service Unavailable")),
            Some(ErrorClass::Unreachable)
        );
        assert_eq!(
            object(&status("429 Too Many Requests")),
            Some(ErrorClass::Unreachable)
        );
        assert_eq!(
            object(&generic("error sending request: connection refused")),
            Some(ErrorClass::Unreachable)
        );
    }
}

//! Where checkpoints live: a local path or `file://` URL, opened as an object store plus the
//! checkpoint's prefix inside it. (Object-store URLs such as `s3://` come with the loader.)

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path;

/// An opened location: the store and the prefix of the checkpoint (or catalog root) in it.
#[derive(Clone, Debug)]
pub struct Location {
    /// The store.
    pub store: Arc<dyn ObjectStore>,
    /// The prefix inside the store.
    pub prefix: Path,
    /// What the user typed, for messages.
    pub display: String,
}

/// Opens `location`: a local path (relative or absolute) or a `file://` URL. The local store is
/// rooted at `/` so that a checkpoint's run directory (its `latest` pointer) is reachable too.
pub fn open(location: &str) -> Result<Location> {
    if let Some((scheme, _)) = location.split_once("://")
        && scheme != "file"
    {
        bail!(
            "{location}: {scheme}:// storage is not supported yet; use a local path or file:// URL"
        );
    }
    let raw = location.strip_prefix("file://").unwrap_or(location);
    if raw.is_empty() {
        bail!("empty checkpoint location");
    }
    let absolute = if std::path::Path::new(raw).is_absolute() {
        std::path::PathBuf::from(raw)
    } else {
        std::env::current_dir()
            .context("reading the current directory")?
            .join(raw)
    };
    let mut parts = Vec::new();
    for component in absolute.components() {
        match component {
            std::path::Component::Normal(part) => {
                let Some(part) = part.to_str() else {
                    bail!("{location}: path is not valid UTF-8");
                };
                parts.push(part.to_string());
            }
            std::path::Component::ParentDir => {
                parts.pop();
            }
            _ => {}
        }
    }
    let prefix = Path::from_iter(parts);
    Ok(Location {
        store: Arc::new(LocalFileSystem::new()),
        prefix,
        display: location.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::open;

    #[test]
    fn local_paths_and_file_urls_open() {
        let a = open("/tmp/x/../ckpt/step-000001").expect("open");
        assert_eq!(a.prefix.as_ref(), "tmp/ckpt/step-000001");
        let b = open("file:///tmp/ckpt").expect("open");
        assert_eq!(b.prefix.as_ref(), "tmp/ckpt");
        let err = open("gs://bucket/x").expect_err("unsupported");
        assert!(
            err.to_string()
                .contains("gs:// storage is not supported yet")
        );
    }
}

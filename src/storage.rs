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

/// Opens `location` for reading: a local path (relative or absolute) or a `file://` URL. The
/// local store is rooted at the checkpoint's parent directory (its run directory, where the
/// `latest` pointer lives), so object paths in messages are short and the run stays reachable.
pub fn open(location: &str) -> Result<Location> {
    let (root, name) = local_parts(location)?;
    if !root.is_dir() {
        bail!("{location}: directory {} does not exist", root.display());
    }
    located(location, &root, &name)
}

/// Opens `location` for writing a checkpoint, creating its parent directories.
pub fn create(location: &str) -> Result<Location> {
    let (root, name) = local_parts(location)?;
    std::fs::create_dir_all(&root)
        .with_context(|| format!("creating directory {}", root.display()))?;
    located(location, &root, &name)
}

fn located(location: &str, root: &std::path::Path, name: &str) -> Result<Location> {
    let store = LocalFileSystem::new_with_prefix(root)
        .with_context(|| format!("opening {}", root.display()))?;
    Ok(Location {
        store: Arc::new(store),
        prefix: Path::from(name),
        display: location.to_string(),
    })
}

/// Splits a local location into its absolute parent directory and last component.
fn local_parts(location: &str) -> Result<(std::path::PathBuf, String)> {
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
    let joined = if std::path::Path::new(raw).is_absolute() {
        std::path::PathBuf::from(raw)
    } else {
        std::env::current_dir()
            .context("reading the current directory")?
            .join(raw)
    };
    // Normalize `.` and `..` without touching the file system (the path may not exist yet).
    let mut absolute = std::path::PathBuf::from("/");
    for component in joined.components() {
        match component {
            std::path::Component::Normal(part) => absolute.push(part),
            std::path::Component::ParentDir => {
                absolute.pop();
            }
            _ => {}
        }
    }
    let Some(name) = absolute
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
    else {
        bail!("{location}: needs a directory name (not the file system root), in UTF-8");
    };
    let root = absolute
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| "/".into());
    Ok((root, name))
}

#[cfg(test)]
mod tests {
    use super::{create, open};

    #[test]
    fn local_paths_and_file_urls_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().display().to_string();
        let a = create(&format!("{base}/x/../run/step-000001")).expect("create");
        assert_eq!(a.prefix.as_ref(), "step-000001");
        assert!(dir.path().join("run").is_dir());
        let b = open(&format!("file://{base}/run/step-000001")).expect("open");
        assert_eq!(b.prefix.as_ref(), "step-000001");
        let missing = open(&format!("{base}/nope/step-1")).expect_err("missing parent");
        assert_eq!(
            missing.to_string(),
            format!("{base}/nope/step-1: directory {base}/nope does not exist")
        );
        let err = open("gs://bucket/x").expect_err("unsupported");
        assert_eq!(
            err.to_string(),
            "gs://bucket/x: gs:// storage is not supported yet; use a local path or file:// URL"
        );
    }
}

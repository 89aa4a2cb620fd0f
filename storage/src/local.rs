//! What object_store's local file system store leaves on disk that its own API cannot see.
//!
//! `LocalFileSystem` writes every object to a staging file `<name>#<n>` first (n = 1, 2, ... the
//! first free number) and renames it into place when the upload completes. A writer killed
//! mid-upload leaves that staging file behind, and the store hides it: listings skip names ending
//! in `#<digits>` and refuse them as paths, so neither `list` nor `delete` reaches it. A retry then
//! stages under `#2` and the stale `#1` stays inside the checkpoint forever. These helpers find
//! and remove such files through the file system.

use std::path::{Path, PathBuf};

use crate::StorageError;

/// The directory a local location (a path or `file://`) names, absolute; `None` for cloud and
/// HTTP locations. Nothing is checked on disk.
pub fn local_directory(location: &str) -> Option<PathBuf> {
    match crate::location::parse(location).ok()? {
        crate::location::Parsed::Local(raw) => {
            let (root, name) = crate::location::local_parts(location, raw).ok()?;
            Some(root.join(name))
        }
        crate::location::Parsed::Cloud { .. } | crate::location::Parsed::Live(_) => None,
    }
}

/// True for a file name of a staged (unfinished) local upload: `<name>#<digits>`.
pub fn is_staged_upload(file_name: &str) -> bool {
    match file_name.rsplit_once('#') {
        Some((_, suffix)) => !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// Staged uploads under `dir` (recursively), as `/`-separated paths relative to it, sorted. A
/// directory that does not exist holds none.
pub fn staged_uploads(dir: &Path) -> Result<Vec<String>, StorageError> {
    let mut found = Vec::new();
    walk(dir, "", &mut found)?;
    found.sort();
    Ok(found)
}

/// Removes the staged uploads under `dir` (see [`staged_uploads`]) for which `stale(relative
/// path)` says so, and returns what it removed. Only call this for uploads no live writer can be
/// making (the caller holds the write claim; the claim's own staging files belong to writers
/// trying to take it, so callers keep those).
pub fn remove_staged_uploads(
    dir: &Path,
    stale: impl Fn(&str) -> bool,
) -> Result<Vec<String>, StorageError> {
    let mut found = staged_uploads(dir)?;
    found.retain(|relative| stale(relative));
    for relative in &found {
        let path = dir.join(relative);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error("removing", &path, e)),
        }
    }
    Ok(found)
}

fn walk(dir: &Path, relative: &str, found: &mut Vec<String>) -> Result<(), StorageError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error("listing", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_error("listing", dir, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let path = if relative.is_empty() {
            name.clone()
        } else {
            format!("{relative}/{name}")
        };
        let kind = entry
            .file_type()
            .map_err(|e| io_error("listing", &entry.path(), e))?;
        if kind.is_dir() {
            walk(&entry.path(), &path, found)?;
        } else if is_staged_upload(&name) {
            found.push(path);
        }
    }
    Ok(())
}

fn io_error(action: &str, path: &Path, source: std::io::Error) -> StorageError {
    StorageError::Store {
        action: action.to_string(),
        path: path.display().to_string(),
        source: object_store::Error::Generic {
            store: "LocalFileSystem",
            source: Box::new(source),
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn staged_names_are_hash_digits_only() {
        assert!(is_staged_upload("rank-00000.bin#1"));
        assert!(is_staged_upload("x#123"));
        assert!(!is_staged_upload("rank-00000.bin"));
        assert!(!is_staged_upload("a#b"));
        assert!(!is_staged_upload("a#"));
    }

    #[test]
    fn finds_and_removes_staged_uploads_recursively() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        for name in [
            "data/rank-00000.bin#1",
            "data/rank-00000.bin",
            "manifest.json#2",
        ] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        assert_eq!(
            staged_uploads(dir.path()).unwrap(),
            vec!["data/rank-00000.bin#1", "manifest.json#2"]
        );
        let removed = remove_staged_uploads(dir.path(), |p| p.starts_with("data/")).unwrap();
        assert_eq!(removed, vec!["data/rank-00000.bin#1"]);
        assert_eq!(staged_uploads(dir.path()).unwrap(), vec!["manifest.json#2"]);
        assert!(dir.path().join("data/rank-00000.bin").exists());
        assert!(
            staged_uploads(&dir.path().join("absent"))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn local_directory_of_locations() {
        assert_eq!(
            local_directory("/tmp/run/step-1"),
            Some(PathBuf::from("/tmp/run/step-1"))
        );
        assert_eq!(
            local_directory("file:///tmp/run/../x"),
            Some(PathBuf::from("/tmp/x"))
        );
        assert_eq!(local_directory("s3://bucket/run"), None);
    }
}

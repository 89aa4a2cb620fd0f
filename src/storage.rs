//! Where checkpoints live: a local path, `file://`, `s3://`, `gs://`, `az://` or `http(s)://`
//! location opened as an object store plus the checkpoint's prefix inside it. The loader owns
//! this (ranks open the same locations); the tool re-exports it.

pub use tessera_storage::{Location, StorageOptions, create, create_with, open, open_with};

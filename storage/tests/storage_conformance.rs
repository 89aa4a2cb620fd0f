//! The storage conformance suite: what the loader and the native format need from an
//! `ObjectStore`, checked against every store tessera runs on (local disk, memory, S3 over HTTP
//! through the in-process test server). Each check is an `async fn` over `&dyn ObjectStore` and a
//! base prefix it may write under; `conformance!` runs every check against every backend.

use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tempfile::TempDir;
use tessera_storage::testing::S3TestServer;

/// `len` bytes that differ at every offset a test looks at (no period that divides a range).
fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed)
        .collect::<Vec<u8>>()
        .into()
}

async fn put(store: &dyn ObjectStore, path: &Path, bytes: &Bytes) {
    store
        .put(path, PutPayload::from(bytes.clone()))
        .await
        .unwrap_or_else(|e| panic!("put {path}: {e}"));
}

/// Sub-ranges of one object read back exactly: first byte, middle, last bytes, whole object.
pub async fn put_then_range_reads(store: &dyn ObjectStore, base: &Path) {
    let path = base.clone().join("data").join("rank-0.bin");
    let data = pattern(1 << 20, 1);
    put(store, &path, &data).await;
    let len = data.len() as u64;
    for range in [0..1, 10..1000, 4096..8192, len - 5..len, 0..len] {
        let got = store
            .get_range(&path, range.clone())
            .await
            .unwrap_or_else(|e| panic!("get_range {range:?}: {e}"));
        assert_eq!(
            got,
            data.slice(range.start as usize..range.end as usize),
            "{range:?}"
        );
    }
    let whole = store
        .get(&path)
        .await
        .expect("get")
        .bytes()
        .await
        .expect("bytes");
    assert_eq!(whole, data);
    assert_eq!(store.head(&path).await.expect("head").size, len);
}

/// `get_ranges` answers each range in order, overlapping and unordered ones included.
pub async fn get_ranges_match(store: &dyn ObjectStore, base: &Path) {
    let path = base.clone().join("ranges.bin");
    let data = pattern(300_000, 2);
    put(store, &path, &data).await;
    let ranges = vec![
        200_000..299_999,
        0..1,
        5..70_000,
        60_000..60_001,
        0..300_000,
        123..124,
    ];
    let got = store.get_ranges(&path, &ranges).await.expect("get_ranges");
    assert_eq!(got.len(), ranges.len());
    for (range, bytes) in ranges.iter().zip(got) {
        assert_eq!(
            bytes,
            data.slice(range.start as usize..range.end as usize),
            "{range:?}"
        );
    }
}

/// A range that starts past the end is an error; one that only ends past it comes back short
/// (the scheduler turns that into a `ShortRead` naming the truncated file).
pub async fn ranges_past_the_end(store: &dyn ObjectStore, base: &Path) {
    let path = base.clone().join("short.bin");
    let data = pattern(1000, 3);
    put(store, &path, &data).await;
    let err = store
        .get_range(&path, 2000..2100)
        .await
        .expect_err("a range starting past the end");
    assert!(
        !matches!(err, object_store::Error::NotFound { .. }),
        "the object exists: {err}"
    );
    let short = store
        .get_range(&path, 900..1100)
        .await
        .expect("a range ending past the end");
    assert_eq!(short, data.slice(900..1000));
}

/// Reading or heading an object that does not exist is `NotFound` (the loader reports it as a
/// missing data file, the catalog as an incomplete checkpoint).
pub async fn missing_object_not_found(store: &dyn ObjectStore, base: &Path) {
    let path = base.clone().join("nope").join("missing.bin");
    for result in [
        store.get(&path).await.map(|_| ()),
        store.get_range(&path, 0..10).await.map(|_| ()),
        store.head(&path).await.map(|_| ()),
    ] {
        let err = result.expect_err("a missing object");
        assert!(
            matches!(err, object_store::Error::NotFound { .. }),
            "expected NotFound, got {err}"
        );
    }
}

/// Listing a prefix returns exactly the objects under it (recursively), with their sizes, and
/// not those of a sibling whose name merely starts the same way.
pub async fn list_under_prefix(store: &dyn ObjectStore, base: &Path) {
    let run = base.clone().join("run");
    let step = run.clone().join("step-000001");
    let files = [
        (step.clone().join("manifest.json"), 10),
        (step.clone().join("data").join("rank-0.bin"), 5000),
        (step.clone().join("data").join("rank-1.bin"), 7),
    ];
    for (path, len) in &files {
        put(store, path, &pattern(*len, 4)).await;
    }
    put(
        store,
        &run.clone().join("step-0000010").join("x"),
        &pattern(3, 5),
    )
    .await;
    put(
        store,
        &run.clone().join("latest"),
        &Bytes::from_static(b"step-000001"),
    )
    .await;

    let mut listed: Vec<(String, u64)> = store
        .list(Some(&step))
        .map_ok(|meta| (meta.location.to_string(), meta.size))
        .try_collect()
        .await
        .expect("list");
    listed.sort();
    let mut expected: Vec<(String, u64)> = files
        .iter()
        .map(|(p, len)| (p.to_string(), *len as u64))
        .collect();
    expected.sort();
    assert_eq!(listed, expected);

    let top = store
        .list_with_delimiter(Some(&run))
        .await
        .expect("list_with_delimiter");
    let mut dirs: Vec<String> = top
        .common_prefixes
        .iter()
        .map(ToString::to_string)
        .collect();
    dirs.sort();
    assert_eq!(
        dirs,
        [
            run.clone().join("step-000001").to_string(),
            run.clone().join("step-0000010").to_string()
        ]
    );
    let objects: Vec<String> = top.objects.iter().map(|o| o.location.to_string()).collect();
    assert_eq!(objects, [run.clone().join("latest").to_string()]);
}

/// A multipart upload of more than 10 MiB (parts of 6 MiB, above S3's 5 MiB minimum, and a
/// short last one) reads back byte for byte.
pub async fn multipart_reassembles(store: &dyn ObjectStore, base: &Path) {
    let path = base.clone().join("big.bin");
    let data = pattern(13 * 1024 * 1024 + 12_345, 6);
    let mut upload = store.put_multipart(&path).await.expect("put_multipart");
    for part in data.chunks(6 * 1024 * 1024) {
        upload
            .put_part(PutPayload::from(data.slice_ref(part)))
            .await
            .expect("put_part");
    }
    upload.complete().await.expect("complete");
    assert_eq!(
        store.head(&path).await.expect("head").size,
        data.len() as u64
    );
    let whole = store
        .get(&path)
        .await
        .expect("get")
        .bytes()
        .await
        .expect("bytes");
    assert!(whole == data, "the reassembled object differs");
    let seam = 6 * 1024 * 1024;
    let across = store
        .get_range(&path, (seam - 10) as u64..(seam + 10) as u64)
        .await
        .expect("a range across a part boundary");
    assert_eq!(across, data.slice(seam - 10..seam + 10));
}

/// Many range reads of one object in flight at once (what the scheduler does) all come back
/// right.
pub async fn concurrent_range_reads(store: &dyn ObjectStore, base: &Path) {
    let path = base.clone().join("shared.bin");
    let data = pattern(2 * 1024 * 1024, 7);
    put(store, &path, &data).await;
    let piece = 65_536u64;
    let ranges: Vec<_> = (0..32u64)
        .map(|i| {
            let start = (i * 61_001) % (data.len() as u64 - piece);
            start..start + piece
        })
        .collect();
    let results: Vec<(std::ops::Range<u64>, Bytes)> =
        futures::stream::iter(ranges.into_iter().map(|range| {
            let path = &path;
            async move {
                let bytes = store.get_range(path, range.clone()).await;
                bytes.map(|b| (range, b))
            }
        }))
        .buffer_unordered(16)
        .try_collect()
        .await
        .expect("concurrent range reads");
    assert_eq!(results.len(), 32);
    for (range, bytes) in results {
        assert_eq!(
            bytes,
            data.slice(range.start as usize..range.end as usize),
            "{range:?}"
        );
    }
}

/// A store under test and what must live as long as it (dropped server first, then directory).
struct Backend {
    store: Arc<dyn ObjectStore>,
    _server: Option<S3TestServer>,
    _dir: Option<TempDir>,
}

fn local() -> Backend {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LocalFileSystem::new_with_prefix(dir.path()).expect("local store");
    Backend {
        store: Arc::new(store),
        _server: None,
        _dir: Some(dir),
    }
}

fn memory() -> Backend {
    Backend {
        store: Arc::new(InMemory::new()),
        _server: None,
        _dir: None,
    }
}

fn s3() -> Backend {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start(dir.path());
    server.create_bucket("conformance");
    Backend {
        store: server.store("conformance"),
        _server: Some(server),
        _dir: Some(dir),
    }
}

macro_rules! conformance {
    ($backend:ident: $($check:ident),+ $(,)?) => {
        mod $backend {
            $(
                #[tokio::test]
                async fn $check() {
                    let backend = super::$backend();
                    let base = object_store::path::Path::from("suite");
                    super::$check(backend.store.as_ref(), &base).await;
                }
            )+
        }
    };
}

macro_rules! every_backend {
    ($($backend:ident),+) => {
        $(
            conformance!($backend:
                put_then_range_reads,
                get_ranges_match,
                ranges_past_the_end,
                missing_object_not_found,
                list_under_prefix,
                multipart_reassembles,
                concurrent_range_reads,
            );
        )+
    };
}

every_backend!(local, memory, s3);

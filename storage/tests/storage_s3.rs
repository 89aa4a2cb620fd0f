//! A native checkpoint saved to and loaded from `s3://` through [`tessera_storage::create_with`] and
//! [`tessera_storage::open_with`], against the in-process S3 server: the whole write path (multipart
//! data files, conditional manifest put, `latest`) and read path over real HTTP.

use object_store::ObjectStoreExt;
use object_store::path::Path;
use tessera_metadata::formats::native::{
    NativeWriter, WriteOptions, open_checkpoint, read_latest, verify_checkpoint,
};
use tessera_metadata::{DType, TensorBox, TensorMeta};
use tessera_storage::testing::S3TestServer;
use tessera_storage::{self, StorageOptions};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(11) as u8 ^ seed)
        .collect()
}

/// What one saved box holds: tensor index, box, bytes.
type Saved = (u32, TensorBox, Vec<u8>);

/// Saves a checkpoint at `location`: a 12 MiB tensor in two row blocks on two data files (so
/// each file goes up as a multipart upload), a small tensor, and an object.
async fn save(location: &str, options: &StorageOptions) -> Vec<Saved> {
    let loc = tessera_storage::create_with(location, options).expect("create");
    let rows = 3 * 1024;
    let cols = 1024;
    let tensors = vec![
        TensorMeta::new("model.embed.weight", DType::F32, vec![rows, cols]),
        TensorMeta::new("model.norm.weight", DType::F32, vec![cols]),
    ];
    let writer = NativeWriter::create(
        loc.store.clone(),
        loc.prefix.clone(),
        tensors,
        WriteOptions::default(),
    )
    .await
    .expect("writer");
    let half = rows / 2;
    let saved: Vec<Saved> = vec![
        (
            0,
            TensorBox::new(vec![0, 0], vec![half, cols]),
            pattern((half * cols * 4) as usize, 1),
        ),
        (
            0,
            TensorBox::new(vec![half, 0], vec![rows - half, cols]),
            pattern(((rows - half) * cols * 4) as usize, 2),
        ),
        (
            1,
            TensorBox::new(vec![0], vec![cols]),
            pattern(cols as usize * 4, 3),
        ),
    ];
    let mut rank0 = writer.data_file("rank-0").expect("data file");
    let mut rank1 = writer.data_file("rank-1").expect("data file");
    rank0
        .write_box(saved[0].0, saved[0].1.clone(), &saved[0].2)
        .await
        .expect("write");
    rank1
        .write_box(saved[1].0, saved[1].1.clone(), &saved[1].2)
        .await
        .expect("write");
    rank1
        .write_box(saved[2].0, saved[2].1.clone(), &saved[2].2)
        .await
        .expect("write");
    rank0
        .write_object("train.step", b"1")
        .await
        .expect("object");
    let files = vec![
        rank0.finish().await.expect("finish"),
        rank1.finish().await.expect("finish"),
    ];
    writer.commit(files).await.expect("commit");
    saved
}

#[tokio::test]
async fn native_checkpoint_round_trips_through_s3() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start(dir.path());
    server.create_bucket("ckpt");
    let options = server.options();

    let saved = save("s3://ckpt/run/step-000001", &options).await;

    let loc = tessera_storage::open_with("s3://ckpt/run/step-000001", &options).expect("open");
    assert_eq!(loc.prefix.as_ref(), "run/step-000001");
    assert_eq!(loc.display, "s3://ckpt/run/step-000001");
    let store = loc.store.as_ref();
    let checkpoint = open_checkpoint(store, &loc.prefix)
        .await
        .expect("open_checkpoint");
    assert_eq!(checkpoint.manifest.step, Some(1));
    let meta = &checkpoint.meta;
    assert_eq!(meta.tensors().len(), 2);
    assert_eq!(meta.chunks().len(), saved.len());

    // Byte-exact: every saved box read back by range from its data file.
    for (tensor, region, bytes) in &saved {
        let chunk = meta
            .chunks()
            .iter()
            .find(|c| c.tensor == *tensor && &c.region == region)
            .unwrap_or_else(|| panic!("no saved box {region} of tensor {tensor}"));
        let file = &meta.files()[chunk.bytes.file as usize];
        let path = Path::parse(format!("{}/{}", loc.prefix, file.path)).expect("path");
        let got = store
            .get_range(
                &path,
                chunk.bytes.offset..chunk.bytes.offset + chunk.bytes.length,
            )
            .await
            .expect("range read");
        assert!(got.as_ref() == bytes.as_slice(), "box {region} differs");
    }
    let object = &meta.objects()[0];
    let file = &meta.files()[object.file as usize];
    let path = Path::parse(format!("{}/{}", loc.prefix, file.path)).expect("path");
    let got = store
        .get_range(&path, object.offset..object.offset + object.length)
        .await
        .expect("object read");
    assert_eq!(got.as_ref(), b"1");

    let report = verify_checkpoint(store, &loc.prefix).await.expect("verify");
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.files, 2);

    // The pointer sits next to the step, in the same bucket, reachable through the same store.
    let run = Path::from("run");
    assert_eq!(
        read_latest(store, &run).await.expect("latest").as_deref(),
        Some("step-000001")
    );
    // A second step moves it forward; the first stays readable.
    save("s3://ckpt/run/step-000002", &options).await;
    assert_eq!(
        read_latest(store, &run).await.expect("latest").as_deref(),
        Some("step-000002")
    );
    open_checkpoint(store, &loc.prefix)
        .await
        .expect("step 1 still opens");

    // The bytes are really in the server's directory, one file per object.
    assert!(
        dir.path()
            .join("ckpt/run/step-000001/manifest.json")
            .is_file()
    );
}

#[tokio::test]
async fn committing_an_s3_prefix_twice_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start(dir.path());
    server.create_bucket("ckpt");
    let options = server.options();
    save("s3://ckpt/run/step-000003", &options).await;
    let loc = tessera_storage::create_with("s3://ckpt/run/step-000003", &options).expect("create");
    let err = NativeWriter::create(
        loc.store.clone(),
        loc.prefix.clone(),
        vec![TensorMeta::new("x", DType::F32, vec![1])],
        WriteOptions::default(),
    )
    .await
    .expect_err("a committed prefix");
    assert!(
        err.to_string()
            .contains("already holds a committed checkpoint"),
        "{err}"
    );
}

#[tokio::test]
async fn wrong_credentials_are_refused_by_the_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start(dir.path());
    server.create_bucket("ckpt");
    let mut options = server.options();
    options
        .env
        .push(("AWS_SECRET_ACCESS_KEY".to_string(), "wrong".to_string()));
    let loc = tessera_storage::open_with("s3://ckpt/run/step-000001", &options).expect("open");
    let err = loc
        .store
        .get(&Path::from("run/latest"))
        .await
        .expect_err("a bad signature");
    assert!(
        !matches!(err, object_store::Error::NotFound { .. }),
        "the signature must be checked before the key: {err}"
    );
}

#[test]
fn dropping_the_server_stops_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start(dir.path());
    let address = server
        .endpoint()
        .strip_prefix("http://")
        .expect("http endpoint")
        .to_string();
    assert!(std::net::TcpStream::connect(&address).is_ok(), "serving");
    let started = std::time::Instant::now();
    drop(server);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "shutdown took {:?}",
        started.elapsed()
    );
    assert!(
        std::net::TcpStream::connect(&address).is_err(),
        "still accepting after drop"
    );
}

/// A server started with a link of N bytes/s sends every answer's body through it: the bytes
/// arrive whole and equal, and two concurrent reads of 1 MiB each on a 4 MiB/s link take at
/// least the half second the link needs for both, less its 5 ms of slack (a lower bound only:
/// never faster than the link, however slow the machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_server_sends_through_one_link_of_its_bandwidth() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start_with_link(dir.path(), Some(4 << 20));
    server.create_bucket("linked");
    let store = server.store("linked");
    let body = pattern(1 << 20, 9);
    for name in ["x", "y"] {
        store
            .put(&Path::from(name), body.clone().into())
            .await
            .expect("put");
    }
    let (px, py) = (Path::from("x"), Path::from("y"));
    let started = std::time::Instant::now();
    let (x, y) = tokio::join!(store.get(&px), store.get(&py));
    let (x, y) = (
        x.expect("get x").bytes().await.expect("x"),
        y.expect("get y").bytes().await.expect("y"),
    );
    let took = started.elapsed();
    assert_eq!(&x[..], &body[..]);
    assert_eq!(&y[..], &body[..]);
    assert!(
        took >= std::time::Duration::from_millis(440),
        "2 MiB through a 4 MiB/s link in {took:?}"
    );
}

//! Shared fixtures of the native format tests: a small checkpoint with several dtypes, a 0-dim
//! tensor, empty and uneven boxes and objects in two data files; the store wrapper that records
//! the order in which objects are written is the storage crate's `RecordingStore`.
#![allow(clippy::unwrap_used, dead_code)]

use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path;
use tessera_metadata::formats::native::{Manifest, NativeWriter, WriteOptions, WrittenFile};
use tessera_metadata::{DType, MetadataError, TensorBox, TensorMeta};

/// One saved box of the fixture: data file (0 or 1), tensor index, region, bytes.
#[derive(Clone, Debug)]
pub struct FixtureBox {
    pub file: usize,
    pub tensor: u32,
    pub region: TensorBox,
    pub bytes: Vec<u8>,
}

/// One object of the fixture: data file, key, bytes.
#[derive(Clone, Debug)]
pub struct FixtureObject {
    pub file: usize,
    pub key: String,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug)]
pub struct Fixture {
    pub tensors: Vec<TensorMeta>,
    pub boxes: Vec<FixtureBox>,
    pub objects: Vec<FixtureObject>,
}

pub const FILE_NAMES: [&str; 2] = ["rank0", "rank1"];

/// Deterministic, non-periodic bytes (an LCG), different per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 56) as u8
        })
        .collect()
}

fn b(offsets: &[u64], lengths: &[u64]) -> TensorBox {
    TensorBox::new(offsets.to_vec(), lengths.to_vec())
}

/// Six tensors (bf16, f32, i64 0-dim, a tensor with an empty box, a tensor with no element, a
/// tensor spanning several 64 KiB blocks), eleven boxes, three objects, two data files.
pub fn fixture() -> Fixture {
    let tensors = vec![
        TensorMeta::new("model.embed.weight", DType::Bf16, vec![10, 6]),
        TensorMeta::new("model.layers.0.attn.qkv.weight", DType::F32, vec![4, 5]),
        TensorMeta::new("optim.step", DType::I64, vec![]),
        TensorMeta::new("model.layers.0.mlp.bias", DType::F32, vec![3]),
        TensorMeta::new("model.empty", DType::F32, vec![0, 4]),
        TensorMeta::new("model.layers.0.mlp.fc1.weight", DType::F32, vec![100, 300]),
    ];
    let layout: Vec<(usize, u32, TensorBox)> = vec![
        (0, 0, b(&[0, 0], &[7, 6])),
        (1, 0, b(&[7, 0], &[3, 6])),
        (0, 1, b(&[0, 0], &[3, 2])),
        (1, 1, b(&[0, 2], &[3, 3])),
        (1, 1, b(&[3, 0], &[1, 2])),
        (0, 1, b(&[3, 2], &[1, 3])),
        (0, 2, b(&[], &[])),
        (1, 3, b(&[0], &[3])),
        (0, 3, b(&[3], &[0])),
        (1, 4, b(&[0, 0], &[0, 4])),
        (0, 5, b(&[0, 0], &[37, 300])),
        (1, 5, b(&[37, 0], &[63, 300])),
    ];
    let boxes = layout
        .into_iter()
        .enumerate()
        .map(|(i, (file, tensor, region))| {
            let len = (region.numel() * tensors[tensor as usize].dtype.size()) as usize;
            FixtureBox {
                file,
                tensor,
                region,
                bytes: pattern(i as u64 + 1, len),
            }
        })
        .collect();
    let objects = vec![
        FixtureObject {
            file: 0,
            key: "extra.config".to_string(),
            bytes: br#"{"lr": 0.001, "layers": 1}"#.to_vec(),
        },
        FixtureObject {
            file: 1,
            key: "extra.rng".to_string(),
            bytes: pattern(99, 100),
        },
        FixtureObject {
            file: 1,
            key: "extra.empty".to_string(),
            bytes: Vec::new(),
        },
    ];
    Fixture {
        tensors,
        boxes,
        objects,
    }
}

impl Fixture {
    /// Total bytes of all tensors.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorMeta::nbytes).sum()
    }

    /// Writes data file `file` of the fixture with `writer`'s data file writer.
    pub async fn write_file(
        &self,
        writer: &NativeWriter,
        file: usize,
    ) -> Result<WrittenFile, MetadataError> {
        let mut data = writer.data_file(FILE_NAMES[file])?;
        for fb in self.boxes.iter().filter(|fb| fb.file == file) {
            data.write_box(fb.tensor, fb.region.clone(), &fb.bytes)
                .await?;
        }
        for fo in self.objects.iter().filter(|fo| fo.file == file) {
            data.write_object(&fo.key, &fo.bytes).await?;
        }
        data.finish().await
    }

    /// Writes the fixture's two data files concurrently (one in a spawned task) and commits.
    pub async fn write(
        &self,
        store: Arc<dyn ObjectStore>,
        prefix: &Path,
        options: WriteOptions,
    ) -> Result<Manifest, MetadataError> {
        let writer =
            NativeWriter::create(store, prefix.clone(), self.tensors.clone(), options).await?;
        let mut data1 = writer.data_file(FILE_NAMES[1])?;
        let own = self.clone();
        let task = tokio::spawn(async move {
            for fb in own.boxes.iter().filter(|fb| fb.file == 1) {
                data1
                    .write_box(fb.tensor, fb.region.clone(), &fb.bytes)
                    .await?;
            }
            for fo in own.objects.iter().filter(|fo| fo.file == 1) {
                data1.write_object(&fo.key, &fo.bytes).await?;
            }
            data1.finish().await
        });
        let mut data0 = writer.data_file(FILE_NAMES[0])?;
        for fb in self.boxes.iter().filter(|fb| fb.file == 0) {
            data0
                .write_box(fb.tensor, fb.region.clone(), &fb.bytes)
                .await?;
        }
        for fo in self.objects.iter().filter(|fo| fo.file == 0) {
            data0.write_object(&fo.key, &fo.bytes).await?;
        }
        let file0 = data0.finish().await?;
        let file1 = task.await.unwrap()?;
        writer.commit(vec![file0, file1]).await
    }
}

/// A directory-backed store and the directory (kept alive by the caller).
pub fn local_store() -> (tempfile::TempDir, Arc<dyn ObjectStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
    (dir, Arc::new(store))
}

pub fn memory_store() -> Arc<dyn ObjectStore> {
    Arc::new(object_store::memory::InMemory::new())
}

#[allow(unused_imports)]
pub use tessera_storage::testing::RecordingStore;

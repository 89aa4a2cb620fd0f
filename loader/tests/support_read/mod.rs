//! Shared fixtures of the read path tests: native checkpoints whose bytes follow the synth
//! formula (so every box's expected bytes are known), a hand-built checkpoint with a transposed
//! (element-strided) source, plans from layouts, and a loader loop that reads, checks every piece
//! and places it.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(dead_code, clippy::unwrap_used, missing_docs, clippy::result_large_err)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::exchange::place::{allocate, place_piece};
use tessera_loader::load::{LoadOptions, LoadedRank, load_rank};
use tessera_loader::read::{ReadOptions, ReadStats, read_pieces};
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_metadata::formats::native::{
    BlockChecksums, FileBlocks, NativeWriter, WriteOptions, open_checkpoint, read_block_checksums,
};
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta, validate,
};
use tessera_planner::{Layout, PlanOptions, RankPlan, Target, plan};
use tessera_storage::RetryPolicy;
use tessera_synth::{box_bytes, flat_bytes};

/// Checksum block size of the fixture checkpoints: small, so that a few hundred KiB of data span
/// many blocks and verification's extension is visible.
pub const BLOCK: u64 = 8192;

pub const PREFIX: &str = "runs/demo/step-000010";

pub fn prefix() -> Path {
    Path::from(PREFIX)
}

/// A directory-backed store and its directory (kept alive by the caller).
pub fn local_store() -> (tempfile::TempDir, Arc<dyn ObjectStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
    (dir, Arc::new(store))
}

/// The checkpoint at [`prefix`] in the local store over `dir`, opened with its local root (so
/// pieces that allow it are read by position from the files).
pub async fn open_local(dir: &tempfile::TempDir, store: Arc<dyn ObjectStore>) -> Checkpoint {
    let location = tessera_storage::Location {
        store,
        prefix: prefix(),
        display: dir.path().display().to_string(),
        local_root: Some(dir.path().to_path_buf()),
        shared_files: Default::default(),
    };
    Checkpoint::open(location).await.unwrap()
}

/// The fixture checkpoint ([`write_checkpoint`]) in a fresh local directory, opened.
pub async fn local_checkpoint() -> (tempfile::TempDir, Checkpoint) {
    let (dir, store) = local_store();
    write_checkpoint(&store).await;
    let checkpoint = open_local(&dir, store).await;
    (dir, checkpoint)
}

/// A synthetic gpt-tiny checkpoint (native, block and box checksums) saved Shard(0) by `world`
/// ranks (`fsdp`) in a fresh local directory, opened.
pub async fn synth_saved_by_rows(world: u32) -> (tempfile::TempDir, Checkpoint) {
    let (dir, store) = local_store();
    let options = tessera_synth::SynthOptions {
        model: tessera_synth::Model::GptTiny,
        optimizer: false,
        metadata_only: false,
        dist_optimizer: None,
        step: Some(1),
        progress: None,
    };
    let display = dir.path().display().to_string();
    tessera_synth::synthesize(
        Arc::clone(&store),
        &prefix(),
        &display,
        &tessera_planner::presets::fsdp(world).unwrap(),
        &options,
    )
    .await
    .unwrap();
    let checkpoint = open_local(&dir, store).await;
    (dir, checkpoint)
}

pub fn memory_store() -> Arc<dyn ObjectStore> {
    Arc::new(object_store::memory::InMemory::new())
}

fn b(offsets: &[u64], lengths: &[u64]) -> TensorBox {
    TensorBox::new(offsets.to_vec(), lengths.to_vec())
}

pub fn tensors() -> Vec<TensorMeta> {
    vec![
        TensorMeta::new("model.embed.weight", DType::F32, vec![256, 96]),
        TensorMeta::new(
            "model.layers.0.attn.qkv.weight",
            DType::Bf16,
            vec![300, 130],
        ),
        TensorMeta::new("model.layers.0.mlp.bias", DType::F32, vec![7]),
        TensorMeta::new("train.step", DType::I64, vec![]),
    ]
}

/// The boxes of each data file (`rank0`, `rank1`): the tensors saved row-sharded over two ranks.
pub fn saved_boxes() -> Vec<Vec<(u32, TensorBox)>> {
    vec![
        vec![
            (0, b(&[0, 0], &[128, 96])),
            (1, b(&[0, 0], &[150, 130])),
            (2, b(&[0], &[7])),
            (3, b(&[], &[])),
        ],
        vec![
            (0, b(&[128, 0], &[128, 96])),
            (1, b(&[150, 0], &[150, 130])),
        ],
    ]
}

pub const FILES: [&str; 2] = ["rank0", "rank1"];

/// The path of data file `name` in the store.
pub fn data_path(name: &str) -> Path {
    Path::from(format!("{PREFIX}/data/{name}.bin"))
}

/// A committed native checkpoint at [`PREFIX`]: its metadata and block checksums.
pub struct Written {
    pub meta: Arc<CheckpointMeta>,
    pub checksums: BlockChecksums,
}

/// Writes the fixture checkpoint (synth bytes) to `store` and opens it again.
pub async fn write_checkpoint(store: &Arc<dyn ObjectStore>) -> Written {
    let tensors = tensors();
    let options = WriteOptions {
        block_size: BLOCK,
        ..WriteOptions::default()
    };
    let writer = NativeWriter::create(Arc::clone(store), prefix(), tensors.clone(), options)
        .await
        .unwrap();
    let mut written = Vec::new();
    for (name, boxes) in FILES.iter().zip(saved_boxes()) {
        let mut file = writer.data_file(name).unwrap();
        for (t, region) in boxes {
            let bytes = box_bytes(&tensors[t as usize], &region).unwrap();
            file.write_box(t, region, &bytes).await.unwrap();
        }
        written.push(file.finish().await.unwrap());
    }
    writer.commit(written).await.unwrap();
    open(store).await
}

pub async fn open(store: &Arc<dyn ObjectStore>) -> Written {
    let opened = open_checkpoint(store.as_ref(), &prefix()).await.unwrap();
    let checksums = read_block_checksums(store.as_ref(), &prefix(), &opened.manifest)
        .await
        .unwrap();
    Written {
        meta: Arc::new(opened.meta),
        checksums,
    }
}

/// Every rank's plan for `layout` (JSON).
pub fn rank_plans(meta: &Arc<CheckpointMeta>, layout: &str, dedup: bool) -> Vec<RankPlan> {
    let layout = Layout::from_json(layout).unwrap();
    let requests = layout.resolve(meta.tensors()).unwrap();
    let plan = plan(
        meta,
        &requests,
        &PlanOptions {
            dedup,
            ..PlanOptions::default()
        },
    )
    .unwrap();
    (0..plan.world_size())
        .map(|r| plan.rank_plan(r).unwrap())
        .collect()
}

/// Every rank's plan for `layout` (JSON) against `checkpoint` (its own checksum blocks) in
/// `read_order`.
pub fn plans_in_read_order(
    checkpoint: &Checkpoint,
    layout: &str,
    read_order: tessera_planner::ReadOrder,
) -> Vec<RankPlan> {
    let requests = Layout::from_json(layout)
        .unwrap()
        .resolve(checkpoint.meta.tensors())
        .unwrap();
    let options = PlanOptions {
        read_order,
        ..PlanOptions::default()
    };
    let plan = checkpoint.plan(&requests, &options).unwrap();
    (0..plan.world_size())
        .map(|r| plan.rank_plan(r).unwrap())
        .collect()
}

/// One rank that reads everything.
pub const WHOLE: &str = r#"{"mesh": [{"name": "dp", "size": 1}],
    "rules": [{"match": "*", "placements": ["replicate"]}]}"#;

/// Three ranks, matrices split by columns (every read is strided: one run per row), the bias
/// replicated.
pub const COLUMNS_TP3: &str = r#"{"mesh": [{"name": "tp", "size": 3}],
    "rules": [{"match": "*bias", "placements": ["replicate"]},
              {"match": "*", "placements": ["shard(1)"]}]}"#;

/// Two data-parallel replicas of a tp=2 column split: with dedup, each piece is read by one rank
/// of its group.
pub const DP2_TP2: &str = r#"{"mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}],
    "rules": [{"match": "*bias", "placements": ["replicate", "replicate"]},
              {"match": "*", "placements": ["replicate", "shard(1)"]}]}"#;

/// Loads every rank's plan concurrently over one in-process mesh and checks every destination
/// of every rank against the formula; returns the loaded ranks in rank order.
pub async fn load_every_rank(
    checkpoint: &Checkpoint,
    plans: Vec<RankPlan>,
    options: &LoadOptions,
) -> Vec<LoadedRank> {
    let checkpoints = vec![checkpoint.clone(); plans.len()];
    load_every_rank_from(&checkpoints, plans, options).await
}

/// [`load_every_rank`], each rank reading through its own opening of the checkpoint
/// (`checkpoints[rank]`: another store in front of the same bytes).
pub async fn load_every_rank_from(
    checkpoints: &[Checkpoint],
    plans: Vec<RankPlan>,
    options: &LoadOptions,
) -> Vec<LoadedRank> {
    let mesh = InProcTransport::mesh(
        plans.len() as u32,
        TransportOptions::with_timeout(std::time::Duration::from_secs(10)),
    );
    let tasks: Vec<_> = plans
        .into_iter()
        .zip(mesh)
        .zip(checkpoints)
        .map(|((plan, transport), checkpoint)| {
            let (checkpoint, options) = (checkpoint.clone(), options.clone());
            tokio::spawn(async move { load_rank(&checkpoint, plan, &transport, &options).await })
        })
        .collect();
    let mut loaded = Vec::new();
    for task in tasks {
        let rank = task.await.unwrap().unwrap();
        for d in 0..rank.plan.destinations.len() {
            assert!(
                rank.buffers[d] == expected_destination(&rank.plan, d),
                "rank {} destination {d} ({}) holds the wrong bytes",
                rank.plan.rank,
                rank.plan.tensors[rank.plan.destinations[d].tensor as usize].fqn
            );
        }
        loaded.push(rank);
    }
    loaded
}

/// The formula's bytes of destination `d` of `plan`.
pub fn expected_destination(plan: &RankPlan, d: usize) -> Vec<u8> {
    let dest = &plan.destinations[d];
    let tensor = &plan.tensors[dest.tensor as usize];
    match &dest.target {
        Target::Box(region) => box_bytes(tensor, region).unwrap(),
        Target::Flat { start, end } => flat_bytes(tensor, *start, *end).unwrap(),
    }
}

/// The formula's bytes of piece `p` of `plan` (row-major over the piece).
pub fn expected_piece(plan: &RankPlan, p: usize) -> Vec<u8> {
    let piece = &plan.pieces[p];
    box_bytes(&plan.tensors[piece.tensor as usize], &piece.region).unwrap()
}

/// What [`load`] saw.
pub struct Loaded {
    pub buffers: Vec<Vec<u8>>,
    pub stats: ReadStats,
    /// Plan piece indices in the order `on_piece` got them.
    pub delivered: Vec<usize>,
    /// Sum of the progress calls.
    pub progress: u64,
}

/// Reads `plan`'s pieces, checks each piece's wire bytes against `expected_piece` (as an
/// `InvalidPlan` error naming the piece, so a test sees it), and places them.
pub async fn load_with(
    store: Arc<dyn ObjectStore>,
    plan: &RankPlan,
    checksums: Option<&BlockChecksums>,
    options: &ReadOptions,
    expected_piece: impl Fn(&RankPlan, usize) -> Vec<u8>,
) -> Result<Loaded, LoaderError> {
    let mut buffers = allocate(plan);
    let mut delivered = Vec::new();
    let progress = AtomicU64::new(0);
    let report = |n: u64| {
        progress.fetch_add(n, Ordering::Relaxed);
    };
    let stats = read_pieces(
        store,
        &prefix(),
        plan,
        checksums,
        None,
        options,
        |p, wire| {
            if wire != expected_piece(plan, p).as_slice() {
                return Err(LoaderError::InvalidPlan {
                    detail: format!("piece {} arrived with the wrong bytes", plan.pieces[p].id),
                });
            }
            delivered.push(p);
            place_piece(plan, p, wire, &mut buffers)
        },
        Some(&report),
    )
    .await?;
    Ok(Loaded {
        buffers,
        stats,
        delivered,
        progress: progress.load(Ordering::Relaxed),
    })
}

pub async fn load(
    store: Arc<dyn ObjectStore>,
    plan: &RankPlan,
    checksums: Option<&BlockChecksums>,
    options: &ReadOptions,
) -> Result<Loaded, LoaderError> {
    load_with(store, plan, checksums, options, expected_piece).await
}

/// Checks a load's outcome: every read piece delivered exactly once, progress adding up to the
/// bytes needed, and, when the rank reads everything itself, every destination byte-exact.
pub fn check_loaded(plan: &RankPlan, loaded: &Loaded) {
    let mut delivered = loaded.delivered.clone();
    delivered.sort_unstable();
    let reads: Vec<usize> = (0..plan.pieces.len())
        .filter(|&p| plan.pieces[p].read.is_some())
        .collect();
    assert_eq!(delivered, reads, "rank {}: pieces delivered", plan.rank);
    assert_eq!(loaded.stats.pieces, reads.len());
    assert_eq!(loaded.stats.bytes_needed, plan.summary.bytes_read);
    assert_eq!(loaded.progress, loaded.stats.bytes_needed);
    if reads.len() == plan.pieces.len() {
        for d in 0..plan.destinations.len() {
            assert!(
                loaded.buffers[d] == expected_destination(plan, d),
                "rank {} destination {d} differs from the formula",
                plan.rank
            );
        }
    }
}

/// Fault-free read options with short backoff (tests wait less).
pub fn options(verify: bool) -> ReadOptions {
    ReadOptions {
        verify,
        retry: RetryPolicy {
            first_backoff: std::time::Duration::from_millis(1),
            ..RetryPolicy::default()
        },
        ..ReadOptions::default()
    }
}

/// A checkpoint written by hand (no native writer): `weight`, f32 `[rows, cols]`, saved as one
/// box stored transposed (column-major, element strides `[1, rows]`), so that every element of a
/// row-major piece is its own source run. Returns the metadata and block checksums of its one
/// data file `data/t.bin`.
pub async fn write_transposed(
    store: &Arc<dyn ObjectStore>,
    rows: u64,
    cols: u64,
    block: u64,
) -> Written {
    let tensor = TensorMeta::new("weight", DType::F32, vec![rows, cols]);
    let row_major = box_bytes(&tensor, &tensor.full_box()).unwrap();
    let mut data = vec![0u8; row_major.len()];
    for i in 0..rows {
        for j in 0..cols {
            let from = ((i * cols + j) * 4) as usize;
            let to = ((j * rows + i) * 4) as usize;
            data[to..to + 4].copy_from_slice(&row_major[from..from + 4]);
        }
    }
    let relative = "data/t.bin";
    let size = data.len() as u64;
    let chunk = SavedChunk {
        tensor: 0,
        region: tensor.full_box(),
        bytes: ByteMeta {
            file: 0,
            offset: 0,
            length: size,
            strides: Some(vec![1, rows]),
        },
        crc32c: None,
        crc32: None,
    };
    let meta = CheckpointMeta::new(
        vec![tensor],
        vec![chunk],
        Vec::new(),
        vec![DataFile {
            path: relative.to_string(),
            size: Some(size),
            encoded: None,
        }],
    )
    .unwrap();
    validate(&meta).unwrap();
    let crcs = data
        .chunks(block as usize)
        .map(crc32c::crc32c)
        .collect::<Vec<u32>>();
    let checksums = BlockChecksums::new(
        block,
        vec![FileBlocks {
            path: relative.to_string(),
            size,
            crcs,
        }],
    )
    .unwrap();
    store
        .put(
            &Path::from(format!("{PREFIX}/{relative}")),
            PutPayload::from(data),
        )
        .await
        .unwrap();
    Written {
        meta: Arc::new(meta),
        checksums,
    }
}

/// Rewrites the committed checkpoint's `metadata.arrow` with `edit` applied to its saved boxes,
/// and the manifest's record of it (size, crc32c), as a bug or a hand edit that keeps the
/// metadata file itself consistent would.
pub async fn rewrite_boxes(store: &Arc<dyn ObjectStore>, edit: impl FnOnce(&mut Vec<SavedChunk>)) {
    use tessera_metadata::formats::native::{encode_metadata, read_manifest};
    let opened = open_checkpoint(store.as_ref(), &prefix()).await.unwrap();
    let meta = opened.meta;
    let mut chunks = meta.chunks().to_vec();
    edit(&mut chunks);
    let edited = CheckpointMeta::new(
        meta.tensors().to_vec(),
        chunks,
        meta.objects().to_vec(),
        meta.files().to_vec(),
    )
    .unwrap();
    validate(&edited).unwrap();
    let bytes = encode_metadata(&edited).unwrap();
    let mut manifest = read_manifest(store.as_ref(), &prefix()).await.unwrap();
    manifest.metadata.size = bytes.len() as u64;
    manifest.metadata.crc32c = crc32c::crc32c(&bytes);
    let root = prefix();
    store
        .put(
            &root.clone().join("metadata.arrow"),
            PutPayload::from(bytes),
        )
        .await
        .unwrap();
    store
        .put(
            &root.join("manifest.json"),
            PutPayload::from(manifest.to_json().unwrap()),
        )
        .await
        .unwrap();
}

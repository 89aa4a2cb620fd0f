//! Shared test support: in-memory checkpoints with known element values, and an in-memory
//! executor that carries out rank plans (reads, ring exchange, placement) on real bytes.
#![allow(dead_code, clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;

use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta,
    row_major_strides, validate,
};
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, Layout, MeshDim, Plan, PlanOptions, RankPlan, ReadOrder,
    ReadSources, RequestSet, Rule, Stages, Target, assign_writers, plan_with_sources,
};

/// A checkpoint held in memory: metadata plus the bytes of every data file.
pub struct Saved {
    pub meta: Arc<CheckpointMeta>,
    pub files: Vec<Vec<u8>>,
}

/// Deterministic bytes of element `flat` of tensor `tensor` (a splitmix64 of both).
pub fn element(tensor: u32, flat: u64, esize: u64) -> Vec<u8> {
    let mut z = (u64::from(tensor) << 40) ^ flat ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    z.to_le_bytes()[..esize as usize].to_vec()
}

/// Global coordinates of element `i` (row-major over the box) of a box.
pub fn coords_of(region: &TensorBox, i: u64) -> Vec<u64> {
    let strides = row_major_strides(&region.lengths);
    (0..region.ndim())
        .map(|d| region.offsets[d] + (i / strides[d]) % region.lengths[d])
        .collect()
}

/// Global row-major flat index of `coords` in a tensor of `shape`.
pub fn flat_of(coords: &[u64], shape: &[u64]) -> u64 {
    coords
        .iter()
        .zip(row_major_strides(shape))
        .map(|(c, s)| c * s)
        .sum()
}

/// One stored box: tensor, region, and optional non-row-major element strides.
pub struct StoredBox {
    pub tensor: u32,
    pub region: TensorBox,
    pub strides: Option<Vec<u64>>,
}

/// Builds a checkpoint whose file `f` holds `files[f]`'s boxes back to back (strided boxes laid out
/// by their strides).
pub fn save_boxes(tensors: Vec<TensorMeta>, files: Vec<Vec<StoredBox>>) -> Saved {
    let mut chunks = Vec::new();
    let mut datas = Vec::new();
    let mut data_files = Vec::new();
    for (f, boxes) in files.into_iter().enumerate() {
        let mut data = Vec::new();
        for b in boxes {
            let tensor = &tensors[b.tensor as usize];
            let esize = tensor.dtype.size();
            let strides = b
                .strides
                .clone()
                .unwrap_or_else(|| row_major_strides(&b.region.lengths));
            let numel = b.region.numel();
            let span = if numel == 0 {
                0
            } else {
                b.region
                    .lengths
                    .iter()
                    .zip(&strides)
                    .map(|(l, s)| (l - 1) * s)
                    .sum::<u64>()
                    + 1
            };
            let offset = data.len() as u64;
            data.resize((offset + span * esize) as usize, 0);
            let local_rm = row_major_strides(&b.region.lengths);
            for i in 0..numel {
                let c = coords_of(&b.region, i);
                let local: u64 = (0..c.len())
                    .map(|d| (c[d] - b.region.offsets[d]) * strides[d])
                    .sum();
                let _ = &local_rm;
                let bytes = element(b.tensor, flat_of(&c, &tensor.shape), esize);
                let at = (offset + local * esize) as usize;
                data[at..at + esize as usize].copy_from_slice(&bytes);
            }
            let stored = &data[offset as usize..(offset + span * esize) as usize];
            chunks.push(SavedChunk {
                tensor: b.tensor,
                region: b.region,
                bytes: ByteMeta {
                    file: f as u32,
                    offset,
                    length: span * esize,
                    strides: b.strides,
                },
                // The box's own crc32c, as native checkpoints record it (joint checks need one).
                crc32: None,
                crc32c: Some(crc32c::crc32c(stored)),
            });
        }
        data_files.push(DataFile {
            path: format!("data/rank-{f:05}.bin"),
            size: Some(data.len() as u64),
            encoded: None,
        });
        datas.push(data);
    }
    let meta = CheckpointMeta::new(tensors, chunks, Vec::new(), data_files).unwrap();
    validate(&meta).unwrap();
    Saved {
        meta: Arc::new(meta),
        files: datas,
    }
}

/// Saves `tensors` as `layout` would: every distinct box once, one file per writing rank.
pub fn save_layout(tensors: Vec<TensorMeta>, layout: &Layout) -> Saved {
    let holdings = layout.resolve(&tensors).unwrap();
    let writes = assign_writers(&tensors, &holdings).unwrap();
    let files = writes
        .into_iter()
        .map(|items| {
            items
                .into_iter()
                .map(|w| StoredBox {
                    tensor: w.tensor,
                    region: w.region,
                    strides: None,
                })
                .collect()
        })
        .collect();
    save_boxes(tensors, files)
}

/// The expected bytes of a destination buffer.
pub fn expected(tensor_index: u32, tensor: &TensorMeta, target: &Target) -> Vec<u8> {
    let esize = tensor.dtype.size();
    let mut out = Vec::new();
    match target {
        Target::Box(region) => {
            for i in 0..region.numel() {
                out.extend(element(
                    tensor_index,
                    flat_of(&coords_of(region, i), &tensor.shape),
                    esize,
                ));
            }
        }
        Target::Flat { start, end } => {
            for flat in *start..*end {
                out.extend(element(tensor_index, flat, esize));
            }
        }
    }
    out
}

/// Plans `requests` against `saved` and checks the result end to end (see [`execute`]).
pub fn plan_and_check(saved: &Saved, requests: &RequestSet, options: &PlanOptions) -> Plan {
    plan_and_check_with(saved, requests, options, &ReadSources::none())
}

/// [`plan_and_check`] with copies of data files outside storage.
#[allow(dead_code)]
pub fn plan_and_check_with(
    saved: &Saved,
    requests: &RequestSet,
    options: &PlanOptions,
    sources: &ReadSources,
) -> Plan {
    let plan = plan_with_sources(&saved.meta, requests, options, sources).unwrap();
    let rank_plans: Vec<RankPlan> = (0..plan.world_size())
        .map(|r| plan.rank_plan(r).unwrap())
        .collect();
    let buffers = execute(&rank_plans, saved);
    for (r, rp) in rank_plans.iter().enumerate() {
        // What a loader checks before executing it: the plan agrees with the metadata.
        rp.check_against(&saved.meta)
            .unwrap_or_else(|e| panic!("rank {r}'s honest plan refused: {e}"));
        for (d, dest) in rp.destinations.iter().enumerate() {
            let tensor = &rp.tensors[dest.tensor as usize];
            let global = saved.meta.tensor_index(&tensor.fqn).unwrap();
            assert_eq!(
                buffers[r][d],
                expected(global, tensor, &dest.target),
                "rank {r} destination {d} ({} {:?})",
                tensor.fqn,
                dest.target
            );
        }
    }
    plan
}

/// Carries out rank plans in memory: every reader reads its pieces through the read runs into
/// wire buffers; the ring rounds deliver them (each received piece must come from the peer the
/// round names, which must be its reader, and be sent by that peer in the same round); every
/// piece is placed through its place runs. Each destination byte must be written exactly once.
pub fn execute(rank_plans: &[RankPlan], saved: &Saved) -> Vec<Vec<Vec<u8>>> {
    let file_index: HashMap<&str, usize> = saved
        .meta
        .files()
        .iter()
        .enumerate()
        .map(|(i, f)| (f.path.as_str(), i))
        .collect();
    // Phase 1: reads.
    let mut wire: HashMap<u32, Vec<u8>> = HashMap::new();
    for rp in rank_plans {
        for p in &rp.pieces {
            let Some(read) = &p.read else { continue };
            assert_eq!(p.reader, rp.rank);
            let file = &saved.files[file_index[rp.files[read.file as usize].as_str()]];
            let mut buf = vec![0u8; p.bytes as usize];
            let n = read.runs.run_bytes as usize;
            for (src, dst) in read.runs.iter() {
                buf[dst as usize..dst as usize + n]
                    .copy_from_slice(&file[src as usize..src as usize + n]);
            }
            assert_eq!(read.runs.total_bytes(), p.bytes);
            // A small piece of a wide group is read by each of its holders, all the same bytes;
            // any other piece is read exactly once.
            if let Some(earlier) = wire.insert(p.id, buf) {
                assert!(p.read_by_holders, "piece {} read twice", p.id);
                assert_eq!(earlier, wire[&p.id], "piece {} read differently", p.id);
            }
        }
    }
    // Phase 2: the ring. Sends are indexed by (group, round, from, to).
    let mut sent: HashMap<(u32, u32, u32, u32), Vec<u32>> = HashMap::new();
    for rp in rank_plans {
        for e in &rp.exchanges {
            for round in &e.rounds {
                assert_eq!(
                    e.members[(e.position as usize + round.round as usize) % e.members.len()],
                    round.send_to
                );
                sent.insert(
                    (e.group, round.round, rp.rank, round.send_to),
                    round.send.clone(),
                );
            }
        }
    }
    let mut out = Vec::new();
    for rp in rank_plans {
        let mut received: HashMap<u32, u32> = HashMap::new();
        for e in &rp.exchanges {
            for round in &e.rounds {
                let got = sent
                    .get(&(e.group, round.round, round.recv_from, rp.rank))
                    .cloned()
                    .unwrap_or_default();
                assert_eq!(
                    got, round.recv,
                    "rank {} group {} round {}",
                    rp.rank, e.group, round.round
                );
                for id in got {
                    received.insert(id, round.recv_from);
                }
            }
        }
        let mut buffers: Vec<Vec<u8>> = rp
            .destinations
            .iter()
            .map(|d| vec![0u8; d.bytes as usize])
            .collect();
        let mut written: Vec<Vec<u8>> = rp
            .destinations
            .iter()
            .map(|d| vec![0u8; d.bytes as usize])
            .collect();
        for p in &rp.pieces {
            if p.read.is_none() {
                assert_eq!(
                    received.get(&p.id),
                    Some(&p.reader),
                    "rank {} never received piece {}",
                    rp.rank,
                    p.id
                );
            }
            let data = &wire[&p.id];
            for place in &p.places {
                let n = place.runs.run_bytes as usize;
                let buf = &mut buffers[place.destination as usize];
                let mark = &mut written[place.destination as usize];
                for (src, dst) in place.runs.iter() {
                    let (src, dst) = (src as usize, dst as usize);
                    buf[dst..dst + n].copy_from_slice(&data[src..src + n]);
                    for m in &mut mark[dst..dst + n] {
                        *m += 1;
                    }
                }
            }
        }
        for (d, mark) in written.iter().enumerate() {
            assert!(
                mark.iter().all(|&m| m == 1),
                "rank {} destination {d}: bytes not written exactly once",
                rp.rank
            );
        }
        out.push(buffers);
    }
    out
}

/// A small GPT-shaped model with the FQNs of the synthetic models (uneven sizes on purpose).
pub fn small_gpt(layers: u64, optimizer: bool) -> Vec<TensorMeta> {
    let (h, v, qkv, f) = (8u64, 50u64, 24u64, 14u64);
    let mut params = vec![TensorMeta::new(
        "model.embed_tokens.weight",
        DType::Bf16,
        vec![v, h],
    )];
    for i in 0..layers {
        params.push(TensorMeta::new(
            format!("model.layers.{i}.attn.qkv.weight"),
            DType::Bf16,
            vec![qkv, h],
        ));
        params.push(TensorMeta::new(
            format!("model.layers.{i}.attn.proj.weight"),
            DType::Bf16,
            vec![h, h],
        ));
        params.push(TensorMeta::new(
            format!("model.layers.{i}.mlp.fc1.weight"),
            DType::Bf16,
            vec![2 * f, h],
        ));
        params.push(TensorMeta::new(
            format!("model.layers.{i}.mlp.fc2.weight"),
            DType::Bf16,
            vec![h, f],
        ));
        params.push(TensorMeta::new(
            format!("model.layers.{i}.input_norm.weight"),
            DType::Bf16,
            vec![h],
        ));
        params.push(TensorMeta::new(
            format!("model.layers.{i}.post_attn_norm.weight"),
            DType::Bf16,
            vec![h],
        ));
    }
    params.push(TensorMeta::new(
        "model.final_norm.weight",
        DType::Bf16,
        vec![h],
    ));
    params.push(TensorMeta::new(
        "model.lm_head.weight",
        DType::Bf16,
        vec![v, h],
    ));
    let mut all = params.clone();
    if optimizer {
        for p in &params {
            for state in ["master", "exp_avg", "exp_avg_sq"] {
                all.push(TensorMeta::new(
                    format!("optim.state.{}.{state}", p.fqn),
                    DType::F32,
                    p.shape.clone(),
                ));
            }
        }
    }
    all.push(TensorMeta::new("train.step", DType::I64, vec![]));
    all
}

/// A layout over `mesh` with one rule per tensor: each mesh dim either replicates or shards a
/// random tensor dim (so nested shards of one dim happen too); the first may be a pipeline.
pub fn layout_for(mesh: &[u32], tensors: &[TensorMeta], choices: &[u32]) -> Layout {
    let mut c = choices.iter().cycle();
    let rules = tensors
        .iter()
        .map(|t| Rule {
            pattern: t.fqn.clone(),
            placements: mesh
                .iter()
                .enumerate()
                .map(|(i, _)| {
                    let pick = *c.next().unwrap() as usize;
                    // The first mesh dim sometimes acts as a pipeline over the tensors' layers.
                    if i == 0 && pick % 5 == 4 {
                        return "stage(layer)".to_string();
                    }
                    if t.shape.is_empty() || pick.is_multiple_of(3) {
                        "replicate".to_string()
                    } else {
                        format!("shard({})", pick % t.shape.len())
                    }
                })
                .collect(),
        })
        .collect();
    Layout {
        mesh: mesh
            .iter()
            .enumerate()
            .map(|(i, &size)| MeshDim {
                name: format!("m{i}"),
                size,
            })
            .collect(),
        rules,
        stages: Some(Stages {
            layer_pattern: r"layers\.(\d+)\.".to_string(),
            num_layers: Some(tensors.len() as u64),
            first: Vec::new(),
            last: Vec::new(),
        }),
    }
}

/// Tensors `layers.<i>.weight` of the given shapes and dtypes (one layer each, for pipelines).
pub fn tensors_from(specs: Vec<(Vec<u64>, DType)>) -> Vec<TensorMeta> {
    specs
        .into_iter()
        .enumerate()
        .map(|(i, (shape, dtype))| TensorMeta::new(format!("layers.{i}.weight"), dtype, shape))
        .collect()
}

/// Every rank's plan.
pub fn rank_plans(plan: &Plan) -> Vec<RankPlan> {
    (0..plan.world_size())
        .map(|r| plan.rank_plan(r).unwrap())
        .collect()
}

/// No storage byte is read twice inside a group (a piece every holder reads: not twice by one
/// rank); returns total bytes read.
pub fn check_group_reads(saved: &Saved, plans: &[RankPlan]) -> u64 {
    // Byte ranges per (group, reader of a holder-read piece, file), checked for overlap sorted.
    type Key<'a> = (u32, u32, &'a str);
    let mut ranges: HashMap<Key<'_>, Vec<(u64, u64)>> = HashMap::new();
    let mut total = 0;
    for rp in plans {
        for p in &rp.pieces {
            let Some(read) = &p.read else { continue };
            let file = rp.files[read.file as usize].as_str();
            let reader = if p.read_by_holders { rp.rank } else { u32::MAX };
            let n = read.runs.run_bytes;
            let list = ranges.entry((p.group, reader, file)).or_default();
            for (src, _) in read.runs.iter() {
                list.push((src, src + n));
                total += n;
            }
        }
    }
    for ((group, _, file), mut list) in ranges {
        list.sort_unstable();
        for w in list.windows(2) {
            assert!(
                w[1].0 >= w[0].1,
                "group {group} reads {file} bytes {}..{} twice",
                w[1].0,
                w[0].1.min(w[1].1)
            );
        }
    }
    let _ = saved;
    total
}

/// A request of `tensor` drawn from random numbers: the flat range between two of them when
/// `flat`, else the box between two of them in every dimension (`nums` holds at least
/// 2 · ndim numbers; empty ranges included).
pub fn explicit_request(tensor: &TensorMeta, flat: bool, nums: &[u64]) -> ExplicitRequest {
    if flat {
        let n = tensor.numel();
        let (a, b) = (nums[0] % (n + 1), nums[1] % (n + 1));
        return ExplicitRequest::Flat {
            fqn: tensor.fqn.clone(),
            flat: [a.min(b), a.max(b)],
        };
    }
    let mut offsets = Vec::new();
    let mut lengths = Vec::new();
    for (d, &size) in tensor.shape.iter().enumerate() {
        let (a, b) = (nums[2 * d] % (size + 1), nums[2 * d + 1] % (size + 1));
        offsets.push(a.min(b));
        lengths.push(a.max(b) - a.min(b));
    }
    ExplicitRequest::Box {
        fqn: tensor.fqn.clone(),
        offsets,
        lengths,
    }
}

/// Bytes read more than once because every holder of a small piece reads it itself (the read
/// amplification above 1.00 that [`PlanOptions::holder_read_max_bytes`] accepts).
pub fn holder_read_extra(plans: &[RankPlan]) -> u64 {
    let mut readers: HashMap<u32, (u64, u64)> = HashMap::new();
    for rp in plans {
        for p in rp.pieces.iter().filter(|p| p.read_by_holders) {
            assert!(
                p.read.is_some(),
                "rank {} holds piece {} unread",
                rp.rank,
                p.id
            );
            assert_eq!(p.reader, rp.rank);
            readers.entry(p.id).or_insert((p.bytes, 0)).1 += 1;
        }
    }
    readers.values().map(|(bytes, n)| bytes * (n - 1)).sum()
}

/// The summary invariants of every plan: bytes read are the distinct bytes needed (plus what
/// small pieces of wide groups cost when every holder reads them), nothing is read twice inside
/// a group, and what ranks end up with is what they read and received, less what slab readers
/// only relayed.
pub fn check_summary(saved: &Saved, plan: &Plan, plans: &[RankPlan]) {
    check_joint_checks(saved, plans);
    let read = check_group_reads(saved, plans);
    let s = plan.summary();
    let extra = holder_read_extra(plans);
    assert_eq!(read, s.bytes_read);
    assert_eq!(s.bytes_read, s.unique_bytes_needed + extra);
    if extra == 0 {
        assert_eq!(s.read_amplification, 1.0);
    }
    let relayed: u64 = plans
        .iter()
        .flat_map(|rp| &rp.pieces)
        .filter(|p| p.read.is_some() && p.places.is_empty())
        .map(|p| p.bytes)
        .sum();
    assert_eq!(relayed, s.bytes_relayed);
    let received: u64 = plans.iter().map(|rp| rp.summary.bytes_received).sum();
    assert_eq!(received, s.bytes_exchanged);
}

/// Options that read every row-major chunk in storage order with slabs of a few bytes and a
/// small alignment drawn from `seed`, so that the small tensors of property tests get several
/// slabs, cuts that land on block boundaries and cuts that cannot.
pub fn storage_options(seed: u64) -> PlanOptions {
    PlanOptions {
        read_order: ReadOrder::Storage,
        slab_bytes: 1 + seed % 96,
        slab_alignment: [1, 4, 8, 24, 64][(seed / 96 % 5) as usize],
        ..PlanOptions::default()
    }
}

/// The saved box a joint check of `rp` names.
fn saved_box_of<'m>(
    meta: &'m CheckpointMeta,
    rp: &RankPlan,
    check: &tessera_planner::JointCheck,
) -> &'m SavedChunk {
    let fqn = &rp.tensors[check.tensor as usize].fqn;
    let t = meta.tensor_index(fqn).unwrap();
    meta.chunks_of(t)
        .iter()
        .find(|c| c.region == check.region)
        .unwrap_or_else(|| panic!("joint check {} names no saved box", check.id))
}

/// Every joint check is sound, judged from the rank plans' byte runs alone: the pieces its readers
/// list read every byte of the saved box exactly once and nothing outside it, its readers are
/// exactly the ranks that list pieces, every rank that places or reads a byte of the box is a
/// member, and every member's plan carries the same check.
pub fn check_joint_checks(saved: &Saved, plans: &[RankPlan]) {
    use std::collections::BTreeMap;
    let meta = &saved.meta;
    let mut seen: BTreeMap<u32, (&tessera_planner::JointCheck, Vec<u32>)> = BTreeMap::new();
    for rp in plans {
        for check in &rp.joint_checks {
            let chunk = saved_box_of(meta, rp, check);
            assert!(
                check.members.contains(&rp.rank),
                "rank {} not a member",
                rp.rank
            );
            assert!(check.members.windows(2).all(|w| w[0] < w[1]));
            assert!(check.readers.windows(2).all(|w| w[0] < w[1]));
            assert!(check.readers.iter().all(|r| check.members.contains(r)));
            assert_eq!(check.readers.contains(&rp.rank), !check.pieces.is_empty());
            let entry = seen.entry(check.id).or_insert_with(|| (check, Vec::new()));
            assert_eq!(
                (&entry.0.region, &entry.0.readers, &entry.0.members),
                (&check.region, &check.readers, &check.members),
                "ranks disagree on joint check {}",
                check.id
            );
            entry.1.push(rp.rank);
            // This rank's pieces of the box: read by it, inside the box's bytes.
            let file = &meta.files()[chunk.bytes.file as usize].path;
            let (start, end) = (chunk.bytes.offset, chunk.bytes.offset + chunk.bytes.length);
            for id in &check.pieces {
                let piece = rp.pieces.iter().find(|p| p.id == *id).unwrap();
                let read = piece.read.as_ref().unwrap();
                assert_eq!(&rp.files[read.file as usize], file);
                for (src, _) in read.runs.iter() {
                    assert!(src >= start && src + read.runs.run_bytes <= end);
                }
            }
        }
    }
    for (id, (check, holders)) in &seen {
        assert_eq!(
            &check.members, holders,
            "joint check {id}: members without it"
        );
        let holder = &plans[holders[0] as usize];
        let t_fqn = &holder.tensors[check.tensor as usize].fqn;
        let chunk = saved_box_of(meta, holder, check);
        let start = chunk.bytes.offset;
        let mut count = vec![0u32; chunk.bytes.length as usize];
        let mut readers = Vec::new();
        for &r in &check.members {
            let rp = &plans[r as usize];
            let mine = rp.joint_checks.iter().find(|c| c.id == *id).unwrap();
            if !mine.pieces.is_empty() {
                readers.push(r);
            }
            for pid in &mine.pieces {
                let piece = rp.pieces.iter().find(|p| p.id == *pid).unwrap();
                let read = piece.read.as_ref().unwrap();
                for (src, _) in read.runs.iter() {
                    for b in src - start..src - start + read.runs.run_bytes {
                        count[b as usize] += 1;
                    }
                }
            }
        }
        assert_eq!(readers, check.readers, "joint check {id}: readers");
        assert!(
            count.iter().all(|&c| c == 1),
            "joint check {id}: bytes of the box not read exactly once"
        );
        // Every rank holding a byte of the box takes part.
        for rp in plans {
            let holds = rp.pieces.iter().any(|p| {
                &rp.tensors[p.tensor as usize].fqn == t_fqn && p.region.overlaps(&check.region)
            });
            assert_eq!(
                holds,
                check.members.contains(&rp.rank),
                "joint check {id}: rank {}",
                rp.rank
            );
        }
    }
}

/// A [rows, cols] f32 matrix saved Shard(0) by `world` ranks, one file each.
pub fn saved_by_rows(rows: u64, cols: u64, world: u64) -> (TensorMeta, Saved) {
    let tensor = TensorMeta::new("layers.0.weight", DType::F32, vec![rows, cols]);
    let per = rows / world;
    let files = (0..world)
        .map(|r| {
            vec![StoredBox {
                tensor: 0,
                region: TensorBox::new(vec![r * per, 0], vec![per, cols]),
                strides: None,
            }]
        })
        .collect();
    (tensor.clone(), save_boxes(vec![tensor], files))
}

/// Each of `ranks` ranks wants one box of the [rows, cols] `tensor`: `box_of(rank)` gives its
/// (offsets, lengths).
pub fn boxes_per_rank(
    tensor: &TensorMeta,
    ranks: u64,
    box_of: impl Fn(u64) -> (Vec<u64>, Vec<u64>),
) -> RequestSet {
    ExplicitRequests {
        ranks: (0..ranks)
            .map(|r| {
                let (offsets, lengths) = box_of(r);
                vec![ExplicitRequest::Box {
                    fqn: tensor.fqn.clone(),
                    offsets,
                    lengths,
                }]
            })
            .collect(),
    }
    .resolve(std::slice::from_ref(tensor))
    .unwrap()
}

/// Rank r of `ranks` wants column block `r % tp` of `tp` of the [rows, cols] `tensor` (ranks r and
/// r + tp are replicas; `tp == ranks` is Shard(1)).
pub fn columns(tensor: &TensorMeta, ranks: u64, tp: u64) -> RequestSet {
    let [rows, cols] = tensor.shape[..] else {
        unreachable!()
    };
    let per = cols / tp;
    boxes_per_rank(tensor, ranks, |r| {
        (vec![0, (r % tp) * per], vec![rows, per])
    })
}

/// Rank r of `ranks` wants row block r of the [rows, cols] `tensor` (Shard(0)).
pub fn rows(tensor: &TensorMeta, ranks: u64) -> RequestSet {
    let [rows, cols] = tensor.shape[..] else {
        unreachable!()
    };
    let per = rows / ranks;
    boxes_per_rank(tensor, ranks, |r| (vec![r * per, 0], vec![per, cols]))
}

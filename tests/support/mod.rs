//! Helpers of the end-to-end tests: running the `tessera` binary as a real process, preparing
//! layouts and synthetic checkpoints in temporary directories, reading checkpoints back through
//! the metadata crate, and executing rank plans against the real data files the way a loader
//! would (read runs into wire buffers, hand pieces over, place runs into destination buffers).

// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

pub mod reference;
pub mod served;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tessera_metadata::formats::native::{NativeCheckpoint, open_checkpoint};
use tessera_planner::{RankPlan, Target};
use tessera_synth as synth;

/// The binary under test, built by cargo for this test target.
pub const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// The binary [`run_in`] runs: `TESSERA_TEST_BIN` where it is set (a test binary carried to a
/// machine without the build tree, as `scripts/gpu-check.sh` does), else [`BIN`].
pub fn bin() -> std::ffi::OsString {
    std::env::var_os("TESSERA_TEST_BIN").unwrap_or_else(|| BIN.into())
}

/// The save layout of the test checkpoint: Megatron tp2 pp2 dp2 with a distributed optimizer,
/// so optimizer states nest dp and tp shards and gpt-tiny's uneven sizes give uneven boxes.
pub const MEGATRON_TP2_PP2_DP2: &[&str] = &[
    "megatron-gpt",
    "--tp",
    "2",
    "--pp",
    "2",
    "--dp",
    "2",
    "--num-layers",
    "4",
    "--zero1",
];

/// Copies directory `from` into `to` recursively, every file writable (the fixtures are
/// read-only; tests damage their copies).
pub fn copy_dir_writable(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir_writable(&entry.path(), &target);
        } else {
            // Written anew rather than `fs::copy`d: a copy keeps the read-only permission.
            std::fs::write(&target, std::fs::read(entry.path()).unwrap()).unwrap();
        }
    }
}

/// The outcome of one run of the binary.
#[derive(Debug)]
pub struct Run {
    /// What the command line was, for failure messages.
    pub command: String,
    /// Exit code (`None` when killed by a signal).
    pub code: Option<i32>,
    /// Raw standard output.
    pub stdout: Vec<u8>,
    /// Standard error as text.
    pub stderr: String,
}

impl Run {
    /// Standard output as text (it must be UTF-8).
    pub fn text(&self) -> String {
        String::from_utf8(self.stdout.clone()).expect("stdout is UTF-8")
    }
}

/// Runs `tessera <args>` in `cwd` (or the test's working directory) with no standard input.
pub fn run_in<I, S>(cwd: Option<&Path>, args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let mut command = Command::new(bin());
    command
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    let output = command.output().expect("spawning the tessera binary");
    Run {
        command: format!(
            "tessera {}",
            args.iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        code: output.status.code(),
        stdout: output.stdout,
        stderr: String::from_utf8(output.stderr).expect("stderr is UTF-8"),
    }
}

/// Runs `tessera <args>` and checks that it exits 0.
#[track_caller]
pub fn ok<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let run = run_in(None, args);
    assert_eq!(
        run.code,
        Some(0),
        "{} failed; stderr:\n{}",
        run.command,
        run.stderr
    );
    run
}

/// Runs `tessera <args>` and checks that it fails the way the binary reports errors: exit code 1
/// (an error of no more specific class), nothing on stdout, and a message on stderr (returned).
#[track_caller]
pub fn fails<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    fails_with(1, args)
}

/// Exit codes of the classes of failure (`tessera --help`).
pub const NOT_FOUND: i32 = 3;
/// A checksum mismatch, a truncated or corrupt file.
pub const VERIFICATION_FAILED: i32 = 4;
/// Storage that did not answer after the retries.
pub const UNREACHABLE: i32 = 5;
/// Another rank failed or timed out.
pub const PEER_FAILED: i32 = 6;

/// [`fails`] with the exit code of a verification failure (a checksum, a truncated file).
#[track_caller]
pub fn fails_verifying<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    fails_with(VERIFICATION_FAILED, args)
}

/// [`fails`] with the exit code of something that does not exist.
#[track_caller]
pub fn fails_not_found<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    fails_with(NOT_FOUND, args)
}

/// [`fails`] with the exit code of a peer that failed.
#[track_caller]
pub fn fails_peer<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    fails_with(PEER_FAILED, args)
}

/// [`fails`] with exit code `code`.
#[track_caller]
pub fn fails_with<I, S>(code: i32, args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let run = run_in(None, args);
    assert_eq!(
        run.code,
        Some(code),
        "{} should fail with exit code {code}; stdout:\n{}\nstderr:\n{}",
        run.command,
        String::from_utf8_lossy(&run.stdout),
        run.stderr
    );
    assert!(
        run.stdout.is_empty(),
        "{} printed to stdout although it failed: {}",
        run.command,
        String::from_utf8_lossy(&run.stdout)
    );
    run.stderr
}

/// A path as `&str` (temporary directories have UTF-8 paths).
pub fn s(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// Writes `tessera layout <preset args>` to `<dir>/<name>` and returns the file's path.
pub fn layout_file(dir: &Path, name: &str, preset: &[&str]) -> PathBuf {
    let mut args = vec!["layout"];
    args.extend_from_slice(preset);
    let run = ok(args);
    let path = dir.join(name);
    std::fs::write(&path, &run.stdout).expect("writing the layout file");
    path
}

/// Synthesizes gpt-tiny (with optimizer states) saved with [`MEGATRON_TP2_PP2_DP2`] at
/// `<dir>/run/step-000005` and returns the checkpoint directory.
pub fn synth_tiny(dir: &Path) -> PathBuf {
    let layout = layout_file(dir, "save-layout.json", MEGATRON_TP2_PP2_DP2);
    synth_gpt_tiny(&layout, &dir.join("run").join("step-000005"))
}

/// Synthesizes gpt-tiny (without optimizer states) saved with the layout `tessera layout
/// <preset>` prints, at `<dir>/run/step-000001`, and returns the checkpoint directory.
pub fn synth_saved_as(dir: &Path, preset: &[&str]) -> PathBuf {
    let layout = layout_file(dir, "saved.json", preset);
    synth_gpt_tiny(&layout, &dir.join("run").join("step-000001"))
}

/// `tessera synth --model gpt-tiny --layout <layout> --out <ckpt>`; returns `ckpt`.
fn synth_gpt_tiny(layout: &Path, ckpt: &Path) -> PathBuf {
    ok([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(layout),
        "--out",
        s(ckpt),
    ]);
    ckpt.to_path_buf()
}

/// Opens a checkpoint directory with the metadata crate (independently of the binary).
pub fn open(ckpt: &Path) -> NativeCheckpoint {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let store = object_store::local::LocalFileSystem::new();
    let prefix =
        object_store::path::Path::from_absolute_path(ckpt).expect("checkpoint path as a prefix");
    runtime
        .block_on(open_checkpoint(&store, &prefix))
        .expect("opening the checkpoint")
}

/// crc32c (Castagnoli), bit by bit: slow, but independent of the product's implementation.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Checks that `actual` equals `expected` without printing megabytes when it does not.
#[track_caller]
pub fn assert_same_bytes(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    if let Some(i) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        panic!(
            "{what}: first difference at byte {i}: found {:#04x}, expected {:#04x}",
            actual[i], expected[i]
        );
    }
}

/// The formula's bytes of a destination buffer.
pub fn expected_destination(plan: &RankPlan, destination: usize) -> Vec<u8> {
    let dest = &plan.destinations[destination];
    let tensor = &plan.tensors[dest.tensor as usize];
    match &dest.target {
        Target::Box(region) => synth::box_bytes(tensor, region),
        Target::Flat { start, end } => synth::flat_bytes(tensor, *start, *end),
    }
    .expect("formula bytes of a destination")
}

/// Executes every rank's plan against the checkpoint's data files as a loader would and checks
/// the outcome: each reader copies its pieces' runs from the files into wire buffers; every rank
/// places the pieces it needs (its own reads, or the reader's wire bytes for the rest) into its
/// destination buffers through the placement runs. Every destination byte must be written exactly
/// once and every buffer must equal the formula's bytes. The ring schedule is checked too: a piece
/// a rank does not read is received from its reader, and what one rank sends in a round is what
/// its peer receives. Returns the bytes read from storage per rank.
pub fn execute_and_check(ckpt: &Path, plans: &[RankPlan]) -> Vec<u64> {
    let world = plans.len() as u32;
    let mut files: HashMap<String, Vec<u8>> = HashMap::new();
    // (reader, piece id) -> the piece's wire bytes, row-major over the piece.
    let mut wire: HashMap<(u32, u32), Vec<u8>> = HashMap::new();
    let mut bytes_read = vec![0u64; plans.len()];
    for (r, plan) in plans.iter().enumerate() {
        assert_eq!(plan.rank, r as u32, "plans are given in rank order");
        assert_eq!(plan.world, world, "rank {r}: world size");
        for piece in &plan.pieces {
            let Some(read) = &piece.read else {
                continue;
            };
            assert_eq!(piece.reader, plan.rank, "rank {r} reads piece {}", piece.id);
            let name = &plan.files[read.file as usize];
            let data = files
                .entry(name.clone())
                .or_insert_with(|| std::fs::read(ckpt.join(name)).expect("reading a data file"));
            let run = read.runs.run_bytes as usize;
            let mut buf = vec![0u8; piece.bytes as usize];
            let mut filled = 0usize;
            for (src, dst) in read.runs.iter() {
                let (src, dst) = (src as usize, dst as usize);
                assert!(
                    src + run <= data.len(),
                    "rank {r} piece {}: run {src}..{} past the end of {name} ({} bytes)",
                    piece.id,
                    src + run,
                    data.len()
                );
                buf[dst..dst + run].copy_from_slice(&data[src..src + run]);
                filled += run;
            }
            assert_eq!(filled, buf.len(), "rank {r} piece {}: bytes read", piece.id);
            bytes_read[r] += filled as u64;
            assert!(
                wire.insert((plan.rank, piece.id), buf).is_none(),
                "rank {r} reads piece {} twice",
                piece.id
            );
        }
        assert_eq!(
            plan.summary.bytes_read, bytes_read[r],
            "rank {r}: bytes_read"
        );
    }

    // What each sender sends to each receiver in each group, seen from both sides.
    let mut sent: BTreeMap<(u32, u32, u32), Vec<u32>> = BTreeMap::new();
    let mut received: BTreeMap<(u32, u32, u32), Vec<u32>> = BTreeMap::new();
    for plan in plans {
        for exchange in &plan.exchanges {
            assert_eq!(
                exchange.members[exchange.position as usize], plan.rank,
                "rank {}: its position in group {}",
                plan.rank, exchange.group
            );
            for round in &exchange.rounds {
                if !round.send.is_empty() {
                    sent.insert(
                        (exchange.group, plan.rank, round.send_to),
                        round.send.clone(),
                    );
                }
                if !round.recv.is_empty() {
                    received.insert(
                        (exchange.group, round.recv_from, plan.rank),
                        round.recv.clone(),
                    );
                }
            }
        }
    }
    assert_eq!(
        sent, received,
        "ring rounds: what is sent is what is received"
    );

    for plan in plans {
        let r = plan.rank;
        let mut dests: Vec<Vec<u8>> = plan
            .destinations
            .iter()
            .map(|d| vec![0xA5; d.bytes as usize])
            .collect();
        let mut writes: Vec<Vec<u8>> = plan
            .destinations
            .iter()
            .map(|d| vec![0; d.bytes as usize])
            .collect();
        let recv: BTreeSet<(u32, u32)> = received
            .iter()
            .filter(|((_, _, to), _)| *to == r)
            .flat_map(|((_, from, _), ids)| ids.iter().map(move |id| (*id, *from)))
            .collect();
        for piece in &plan.pieces {
            if piece.read.is_none() {
                assert!(
                    recv.contains(&(piece.id, piece.reader)),
                    "rank {r} needs piece {} but no round receives it from its reader {}",
                    piece.id,
                    piece.reader
                );
            }
            let bytes = wire.get(&(piece.reader, piece.id)).unwrap_or_else(|| {
                panic!(
                    "rank {r} needs piece {} that its reader {} never read",
                    piece.id, piece.reader
                )
            });
            assert_eq!(bytes.len() as u64, piece.bytes, "piece {} size", piece.id);
            for place in &piece.places {
                let d = place.destination as usize;
                let run = place.runs.run_bytes as usize;
                for (src, dst) in place.runs.iter() {
                    let (src, dst) = (src as usize, dst as usize);
                    dests[d][dst..dst + run].copy_from_slice(&bytes[src..src + run]);
                    for w in &mut writes[d][dst..dst + run] {
                        *w += 1;
                    }
                }
            }
        }
        for (d, buf) in dests.iter().enumerate() {
            let dest = &plan.destinations[d];
            let fqn = &plan.tensors[dest.tensor as usize].fqn;
            if let Some(i) = writes[d].iter().position(|&w| w != 1) {
                panic!(
                    "rank {r} destination {d} ({fqn} {:?}): byte {i} written {} times",
                    dest.target, writes[d][i]
                );
            }
            assert_same_bytes(
                buf,
                &expected_destination(plan, d),
                &format!("rank {r} destination {d} ({fqn} {:?})", dest.target),
            );
        }
    }
    bytes_read
}

/// Swaps where two same-sized saved boxes of the checkpoint live (file and byte offset) in its
/// `metadata.arrow`, and records the rewritten file's size and crc32c in the manifest: metadata
/// that opens and validates but points each box at the other's bytes. Returns the two boxes as
/// `(fqn, region, file, start, end)` where each now points.
pub fn swap_two_boxes(ckpt: &Path) -> Vec<(String, String, String, u64, u64)> {
    use tessera_metadata::CheckpointMeta;
    use tessera_metadata::formats::native::encode_metadata;
    let opened = open(ckpt);
    let meta = &opened.meta;
    let mut chunks = meta.chunks().to_vec();
    // The first two non-empty boxes of equal byte length in different places.
    let mut pair = None;
    'outer: for (i, a) in chunks.iter().enumerate() {
        for (j, b) in chunks.iter().enumerate().skip(i + 1) {
            if a.bytes.length > 0 && a.bytes.length == b.bytes.length && a.region != b.region {
                pair = Some((i, j));
                break 'outer;
            }
        }
    }
    let (i, j) = pair.expect("two boxes of equal size");
    let (bi, bj) = (chunks[i].bytes.clone(), chunks[j].bytes.clone());
    chunks[i].bytes = bj;
    chunks[j].bytes = bi;
    let described = [i, j]
        .iter()
        .map(|&k| {
            let c = &chunks[k];
            (
                meta.tensors()[c.tensor as usize].fqn.clone(),
                c.region.to_string(),
                meta.files()[c.bytes.file as usize].path.clone(),
                c.bytes.offset,
                c.bytes.offset + c.bytes.length,
            )
        })
        .collect();
    let edited = CheckpointMeta::new(
        meta.tensors().to_vec(),
        chunks,
        meta.objects().to_vec(),
        meta.files().to_vec(),
    )
    .expect("edited metadata");
    let bytes = encode_metadata(&edited).expect("encoding metadata");
    let mut manifest = opened.manifest.clone();
    manifest.metadata.size = bytes.len() as u64;
    manifest.metadata.crc32c = crc32c(&bytes);
    std::fs::write(ckpt.join("metadata.arrow"), &bytes).expect("writing metadata.arrow");
    std::fs::write(
        ckpt.join("manifest.json"),
        manifest.to_json().expect("manifest JSON"),
    )
    .expect("writing manifest.json");
    described
}

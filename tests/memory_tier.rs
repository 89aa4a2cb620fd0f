//! `tessera load --memory-tier` and `tessera gc --memory-tier` as real processes: a checkpoint
//! saved by 4 ranks whose node tier kept the files of old ranks 0 and 1 loads at another world
//! size (in-process and as spawned rank processes), the formula-checked bytes right, the held
//! files read from the tier (even with their durable copies deleted) and storage only for the
//! rest; the report says which is which.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::{layout_file, ok, s, synth_saved_as};
use tessera_loader::tier::{TIER_FORMAT, TIER_VERSION, TierEntry, TierRecord, write_copy};

/// Leaves tier copies of data files `files` of `ckpt` under `tier`, as a save with
/// `memory_tier=` does; returns the box bytes of each data file.
fn leave_copies(ckpt: &Path, tier: &Path, files: &[usize]) -> Vec<u64> {
    let opened = support::open(ckpt);
    let manifest = std::fs::read(ckpt.join("manifest.json")).unwrap();
    let identity = tessera_metadata::native_identity(&manifest);
    let meta = &opened.meta;
    let mut per_file = vec![0u64; meta.files().len()];
    for c in meta.chunks() {
        per_file[c.bytes.file as usize] += c.bytes.length;
    }
    for &f in files {
        let data = &meta.files()[f];
        let bytes = std::fs::read(ckpt.join(&data.path)).unwrap();
        // Every entry of the file, tensor boxes and plain values: (offset, length, crc32c).
        let mut entries: Vec<(u64, u64, u32)> = meta
            .chunks()
            .iter()
            .filter(|c| c.bytes.file as usize == f)
            .map(|c| (c.bytes.offset, c.bytes.length, c.crc32c.unwrap()))
            .collect();
        entries.extend(
            meta.objects()
                .iter()
                .filter(|o| o.file as usize == f)
                .map(|o| (o.offset, o.length, o.crc32c.unwrap())),
        );
        let record = TierRecord {
            format: TIER_FORMAT.into(),
            version: TIER_VERSION,
            checkpoint: s(ckpt).into(),
            identity: identity.clone(),
            step: opened.manifest.step,
            file: data.path.clone(),
            size: bytes.len() as u64,
            entries: entries
                .iter()
                .map(|&(offset, length, crc32c)| TierEntry {
                    offset,
                    length,
                    crc32c,
                })
                .collect(),
            saved_unix_ms: 1,
        };
        let slices: Vec<&[u8]> = entries
            .iter()
            .map(|&(offset, length, _)| &bytes[offset as usize..(offset + length) as usize])
            .collect();
        write_copy(tier, &record, &slices).unwrap();
    }
    per_file
}

fn load_json(ckpt: &Path, layout: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["load", s(ckpt), "--layout", s(layout), "--check", "--json"];
    args.extend_from_slice(extra);
    serde_json::from_slice(&ok(args).stdout).unwrap()
}

#[test]
fn a_load_reads_the_held_files_from_the_tier_and_the_rest_from_storage() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt: PathBuf = synth_saved_as(dir.path(), &["fsdp", "--dp", "4"]);
    let tier = dir.path().join("tier");
    let per_file = leave_copies(&ckpt, &tier, &[0, 1]);
    let held: u64 = per_file[..2].iter().sum();
    let rest: u64 = per_file[2..].iter().sum();
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);

    for transport in ["inproc", "tcp"] {
        let report = load_json(
            &ckpt,
            &layout,
            &["--memory-tier", s(&tier), "--transport", transport],
        );
        let totals = &report["totals"];
        assert_eq!(
            totals["bytes_from_memory_tier"], held,
            "{transport}: {totals}"
        );
        assert_eq!(totals["bytes_from_storage"], rest, "{transport}: {totals}");
        assert_eq!(totals["bytes_read"], held + rest, "{transport}");
        assert_eq!(report["plan"]["bytes_read_from_tier"], held, "{transport}");
    }
    // Without the tier everything comes from storage.
    let plain = load_json(&ckpt, &layout, &[]);
    assert_eq!(plain["totals"]["bytes_from_storage"], held + rest);
    assert_eq!(plain["totals"]["bytes_from_memory_tier"], 0);

    // The durable copies of the held files are gone: the load still checks out from the tier,
    // and the text report says where the bytes came from.
    let opened = support::open(&ckpt);
    for f in 0..2 {
        std::fs::remove_file(ckpt.join(&opened.meta.files()[f].path)).unwrap();
    }
    let run = ok([
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--check",
        "--memory-tier",
        s(&tier),
    ]);
    let text = String::from_utf8(run.stdout).unwrap();
    assert!(text.contains("from memory tier"), "{text}");

    // gc: one copy in the tier; keeping one removes nothing, a byte budget of 1 removes it.
    let kept = ok(["gc", s(&tier), "--memory-tier", "--keep", "1", "--json"]);
    let kept: Value = serde_json::from_slice(&kept.stdout).unwrap();
    assert_eq!(kept["removed"].as_array().unwrap().len(), 0, "{kept}");
    let dry = ok([
        "gc",
        s(&tier),
        "--memory-tier",
        "--max-bytes",
        "1",
        "--dry-run",
    ]);
    let dry = String::from_utf8(dry.stdout).unwrap();
    assert!(dry.contains("would remove 1 copies"), "{dry}");
    assert!(
        tier.read_dir().unwrap().count() == 1,
        "a dry run removes nothing"
    );
    let err = support::fails(["gc", s(&tier), "--memory-tier", "--keep", "0"]);
    assert!(err.contains("--keep 0"), "{err}");
    let err = support::fails([
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--memory-tier",
        s(&tier),
        "--server",
        "http://127.0.0.1:9",
    ]);
    assert!(
        err.contains(
            "a plan server plans reads from storage only, so the memory tier's copies cannot be \
             used with --server http://127.0.0.1:9: load without a server to read from the tier"
        ),
        "{err}"
    );
}

/// Runs the CLI with `args` in `cwd`, killed after 120 s: a load blocked in `open(2)` on a FIFO
/// fails the test instead of hanging it. Returns (exit code, stdout, stderr).
fn run_bounded(cwd: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = std::process::Command::new(support::bin())
        .args(args)
        .current_dir(cwd)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "tessera {args:?} did not end within 120 s (blocked in open(2)?): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Issue 41 items 7 and 13: `tessera load --memory-tier` with a FIFO in place of one copy reads
/// that file from storage (naming the FIFO) instead of waiting in `open(2)` forever, and a tier
/// named by a relative path is read like an absolute one.
#[test]
fn a_fifo_copy_is_read_from_storage_and_a_relative_tier_loads() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt: PathBuf = synth_saved_as(dir.path(), &["fsdp", "--dp", "2"]);
    let tier = dir.path().join("tier");
    let per_file = leave_copies(&ckpt, &tier, &[0, 1]);
    let layout = layout_file(dir.path(), "fsdp2.json", &["fsdp", "--dp", "2"]);

    // Relative to the command's directory: `tier`.
    let (code, out, err) = run_bounded(
        dir.path(),
        &[
            "load",
            s(&ckpt),
            "--layout",
            s(&layout),
            "--check",
            "--json",
            "--memory-tier",
            "tier",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        report["totals"]["bytes_from_memory_tier"],
        per_file[0] + per_file[1],
        "{err}"
    );

    let fifo = std::fs::read_dir(&tier)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap()
        .join(&support::open(&ckpt).meta.files()[0].path);
    std::fs::remove_file(&fifo).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    for transport in ["inproc", "tcp"] {
        let (code, out, err) = run_bounded(
            dir.path(),
            &[
                "load",
                s(&ckpt),
                "--layout",
                s(&layout),
                "--check",
                "--json",
                "--transport",
                transport,
                "--memory-tier",
                s(&tier),
            ],
        );
        assert_eq!(code, Some(0), "{transport}: {err}");
        let report: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            report["totals"]["bytes_from_memory_tier"], per_file[1],
            "{transport}"
        );
        assert!(
            err.contains(&fifo.display().to_string()) && err.contains("a FIFO"),
            "{transport}: {err}"
        );
    }
}

//! What `tessera load` reports: the text or `--json` document printed at the end, and the
//! `--report-json` file of a load of several ranks (the totals and every rank's own report).

use std::fmt::Write as _;

use anyhow::{Context, Result};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadTotals, RankReport};
use tessera_metadata::Format;
use tessera_metadata::formats::dcp::IndexSource;
use tessera_planner::PlanSummary;

use super::LoadArgs;
use crate::human;

/// The `--report-json` of a load of several ranks: the totals and every rank's own report.
pub(super) fn write_all_ranks_json(
    path: &str,
    plan: &PlanSummary,
    reports: &[RankReport],
) -> Result<()> {
    let json = serde_json::json!({
        "totals": LoadTotals::of(plan.unique_bytes_needed, reports),
        "ranks": reports,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&json)?)
        .with_context(|| format!("writing {path}"))
}

/// The report printed at the end: text, or with `--json` one JSON document.
pub(super) fn report(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &PlanSummary,
    reports: &[RankReport],
    plan_seconds: f64,
    kind: &str,
) -> String {
    // Said even with --quiet or --json: the caller asked for verification and did not get all
    // of it.
    let unverified: u64 = reports.iter().map(|r| r.bytes_unverified).sum();
    if args.verify && unverified > 0 {
        eprintln!(
            "warning: {} of {} were read without a checksum to check them against (parts of \
             saved boxes that no joint check covers, or a format that records none)",
            human::bytes(unverified),
            args.checkpoint
        );
    }
    if args.json {
        report_json(args, checkpoint, plan, reports, plan_seconds, kind)
    } else {
        report_text(args, checkpoint, plan, reports, plan_seconds, kind)
    }
}

/// `load --json`: the plan's totals and every rank's own report (the fields of
/// `--report-json`), under stable names.
fn report_json(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &PlanSummary,
    reports: &[RankReport],
    plan_seconds: f64,
    kind: &str,
) -> String {
    let doc = serde_json::json!({
        "checkpoint": args.checkpoint,
        "format": checkpoint.format.name(),
        "transport": kind,
        "world": plan.ranks,
        "ranks_loaded": reports.len(),
        "verified": args.verify,
        "plan_seconds": plan_seconds,
        "plan": plan,
        "totals": LoadTotals::of(plan.unique_bytes_needed, reports),
        "ranks": reports,
    });
    format!("{doc:#}\n")
}

fn report_text(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &PlanSummary,
    reports: &[RankReport],
    plan_seconds: f64,
    kind: &str,
) -> String {
    let totals = LoadTotals::of(plan.unique_bytes_needed, reports);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "loaded {} into {} of {} ranks ({kind})",
        args.checkpoint,
        reports.len(),
        plan.ranks
    );
    bytes_lines(&mut out, args, reports, &totals);
    format_lines(&mut out, args, checkpoint, &totals);
    time_lines(&mut out, args, reports, &totals, plan_seconds);
    if args.check {
        let _ = writeln!(
            out,
            "check                every byte matches the synthetic formula"
        );
    }
    if let Some(dir) = &args.dump {
        let _ = writeln!(out, "dump                 {dir}/rank-<r>.safetensors");
    }
    out
}

/// A figure summed over the ranks' reports that `LoadTotals` does not keep.
fn sum(reports: &[RankReport], f: fn(&RankReport) -> u64) -> u64 {
    reports.iter().map(f).sum::<u64>()
}

/// A figure of the slowest rank (the largest of the ranks' reports).
fn max(reports: &[RankReport], f: fn(&RankReport) -> f64) -> f64 {
    reports.iter().map(f).fold(0.0, f64::max)
}

/// The report's byte counts: needed, read (from a memory tier too), fetched, transferred.
fn bytes_lines(out: &mut String, args: &LoadArgs, reports: &[RankReport], totals: &LoadTotals) {
    let needed = totals.bytes_needed;
    let (read, fetched, unique) = (
        totals.bytes_read,
        totals.bytes_fetched,
        totals.unique_needed,
    );
    let _ = writeln!(
        out,
        "bytes needed         {} (every rank's buffers)",
        human::bytes(needed)
    );
    // Two figures by name: what was read of the data (read amplification) and what the storage
    // served in all (I/O amplification), since checksum blocks around small tensors can be several
    // times the data they verify.
    let _ = writeln!(
        out,
        "bytes read           {} of data (unique needed {}, read amplification {:.2} = data read / needed)",
        human::bytes(read),
        human::bytes(unique),
        totals.read_amplification,
    );
    if args.memory_tier.is_some() {
        let _ = writeln!(
            out,
            "from memory tier     {} of the data read ({} from storage)",
            human::bytes(totals.bytes_from_memory_tier),
            human::bytes(totals.bytes_from_storage),
        );
        // Copies that changed after they were verified: read from storage instead, named.
        for r in reports {
            for why in &r.memory_tier_fallbacks {
                let _ = writeln!(out, "  rank {}: {why}", r.rank);
            }
        }
    }
    // A live publication read on its publishers' host: what came straight out of their shared
    // memory, the rest over their HTTP servers.
    let shared = sum(reports, |r| r.bytes_from_publisher_memory);
    if shared > 0 {
        let _ = writeln!(
            out,
            "publisher memory     {} of the data read, from the publishers' shared memory on this host ({} over HTTP)",
            human::bytes(shared),
            human::bytes(totals.bytes_from_storage),
        );
    }
    let boxes = totals.boxes_verified;
    // Formats without checksums (and --no-verify) fetch nothing to verify: say nothing about it.
    let verification = if totals.verify_extra_bytes > 0 || boxes > 0 {
        format!(
            "{} only to verify: checksum blocks, boxes read whole; {boxes} boxes checked by their own checksum; ",
            human::bytes(totals.verify_extra_bytes)
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "bytes fetched        {} ({verification}{} requests, {} retries)",
        human::bytes(fetched),
        totals.requests,
        sum(reports, |r| r.retries)
    );
    let _ = writeln!(
        out,
        "total I/O            {} = {:.2} x needed (I/O amplification = bytes fetched, verification included / needed)",
        human::bytes(fetched),
        totals.io_amplification,
    );
    // What the store actually returned: more than fetched only where one request spanned the gap
    // between small ranges (--coalesce-gap).
    let _ = writeln!(
        out,
        "bytes transferred    {} in {} requests = {:.2} x needed ({} of gaps spanned by --coalesce-gap)",
        human::bytes(totals.bytes_transferred),
        totals.requests,
        totals.transfer_amplification,
        human::bytes(totals.bytes_transferred.saturating_sub(fetched)),
    );
}

/// What the format's reading verified, and what opening it read of zip headers.
fn format_lines(out: &mut String, args: &LoadArgs, checkpoint: &Checkpoint, totals: &LoadTotals) {
    let read = totals.bytes_read;
    match checkpoint.format {
        Format::Native => {}
        Format::Dcp if args.verify => {
            let _ = writeln!(
                out,
                "format               PyTorch DCP, read in place, verified by each blob's zip CRC-32 (parts of a blob by their readers jointly); {} read unverified",
                human::bytes(totals.bytes_unverified)
            );
        }
        Format::Dcp => {
            let _ = writeln!(
                out,
                "format               PyTorch DCP, read in place without verification (--no-verify)"
            );
        }
        Format::ByteCheckpoint => {
            let _ = writeln!(
                out,
                "format               ByteCheckpoint, read in place without verification (ByteCheckpoint records no checksums of storage bytes)"
            );
        }
        Format::Safetensors => {
            let _ = writeln!(
                out,
                "format               safetensors, read in place without verification (safetensors records no checksums)"
            );
        }
        Format::DeepSpeed => {
            let _ = writeln!(
                out,
                "format               DeepSpeed ZeRO, read in place without verification (partial reads of torch.save records have no checksum)"
            );
        }
    }
    if let Some(index) = &checkpoint.index {
        let line = match index.source {
            IndexSource::Built => format!(
                "{} in {} requests at open, once for {} blobs ({:.1}% on top of the bytes read)",
                human::bytes(index.bytes_read),
                index.requests,
                index.blobs,
                if read == 0 {
                    0.0
                } else {
                    100.0 * index.bytes_read as f64 / read as f64
                }
            ),
            IndexSource::Memory => "none read: blob index from the in-memory cache".to_string(),
            IndexSource::Disk => "none read: blob index from the cache directory".to_string(),
        };
        let _ = writeln!(out, "zip headers          {line}");
    }
}

/// Bytes exchanged, the time each phase took (slowest rank), throughput and the upload to GPU.
fn time_lines(
    out: &mut String,
    args: &LoadArgs,
    reports: &[RankReport],
    totals: &LoadTotals,
    plan_seconds: f64,
) {
    let needed = totals.bytes_needed;
    let total = max(reports, |r| r.total_seconds);
    let (exchanged, direct) = (totals.bytes_exchanged, totals.bytes_exchanged_direct);
    let _ = writeln!(
        out,
        "bytes exchanged      {}{}",
        human::bytes(exchanged),
        if direct == 0 {
            String::new()
        } else if direct == exchanged {
            ", all copied directly between ranks' memory".to_string()
        } else {
            format!(
                ", {} copied directly between ranks' memory",
                human::bytes(direct)
            )
        }
    );
    let _ = writeln!(
        out,
        "time                 plan {plan_seconds:.3} s, read {:.3} s, exchange {:.3} s ({:.3} s of it waiting on peers), total {total:.3} s (slowest rank)",
        max(reports, |r| r.read_seconds),
        max(reports, |r| r.exchange_seconds),
        max(reports, |r| r.exchange_wait_seconds)
    );
    let _ = writeln!(
        out,
        "throughput           {:.2} GB/s of buffers filled",
        if total > 0.0 {
            needed as f64 / total / 1e9
        } else {
            0.0
        }
    );
    let h2d_bytes = sum(reports, |r| r.h2d_bytes);
    if args.device.is_cuda() {
        let h2d_seconds = max(reports, |r| r.h2d_seconds);
        let _ = writeln!(
            out,
            "h2d                  {} in {h2d_seconds:.3} s (slowest rank), {:.2} GB/s through pinned staging",
            human::bytes(h2d_bytes),
            if h2d_seconds > 0.0 {
                h2d_bytes as f64 / h2d_seconds / 1e9
            } else {
                0.0
            }
        );
    }
}

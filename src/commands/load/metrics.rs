//! `load --metrics-file`: the load's counters in the OpenMetrics text format, one series per rank,
//! for a node_exporter textfile collector or a push to a gateway. They say what was needed, what
//! was read and fetched, what the stores actually sent (gaps of coalesced requests included) and
//! in how many requests: requested vs transferred bytes, where dashboards see them.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use tessera_loader::load::RankReport;

/// One counter: its name (without `_total`), help text, and value per report.
struct Counter {
    name: &'static str,
    help: &'static str,
    value: fn(&RankReport) -> u64,
}

const COUNTERS: [Counter; 8] = [
    Counter {
        name: "tessera_load_bytes_needed",
        help: "Bytes of the rank's destination buffers.",
        value: |r| r.bytes_needed,
    },
    Counter {
        name: "tessera_load_bytes_read",
        help: "Bytes of the pieces the rank read from storage.",
        value: |r| r.bytes_read,
    },
    Counter {
        name: "tessera_load_bytes_requested",
        help: "Bytes the rank asked storage for: its pieces plus checksum-block extension.",
        value: |r| r.bytes_fetched,
    },
    Counter {
        name: "tessera_load_bytes_transferred",
        help: "Bytes the stores returned to the rank, gaps spanned by coalesced requests included.",
        value: |r| r.bytes_transferred,
    },
    Counter {
        name: "tessera_load_storage_requests",
        help: "Storage requests of the rank (retries not included).",
        value: |r| r.requests,
    },
    Counter {
        name: "tessera_load_storage_retries",
        help: "Storage requests the rank retried.",
        value: |r| r.retries,
    },
    Counter {
        name: "tessera_load_bytes_sent",
        help: "Bytes the rank passed on to other ranks.",
        value: |r| r.bytes_sent,
    },
    Counter {
        name: "tessera_load_bytes_received",
        help: "Bytes the rank received from other ranks.",
        value: |r| r.bytes_received,
    },
];

/// The OpenMetrics text of `reports` (one series per rank and counter, then the seconds).
pub fn metrics_text(reports: &[RankReport]) -> String {
    let mut out = String::new();
    for counter in &COUNTERS {
        let _ = writeln!(out, "# TYPE {} counter", counter.name);
        let _ = writeln!(out, "# HELP {} {}", counter.name, counter.help);
        for report in reports {
            let _ = writeln!(
                out,
                "{}_total{{rank=\"{}\"}} {}",
                counter.name,
                report.rank,
                (counter.value)(report)
            );
        }
    }
    let _ = writeln!(out, "# TYPE tessera_load_seconds gauge");
    let _ = writeln!(
        out,
        "# HELP tessera_load_seconds Wall time of the rank's load."
    );
    for report in reports {
        let _ = writeln!(
            out,
            "tessera_load_seconds{{rank=\"{}\"}} {}",
            report.rank, report.total_seconds
        );
    }
    out.push_str("# EOF\n");
    out
}

/// Writes [`metrics_text`] to `path` atomically (a temporary file renamed over it), so a
/// collector reading it never sees half a file.
pub fn write_metrics(path: &str, reports: &[RankReport]) -> Result<()> {
    let temporary = format!("{path}.tmp-{}", std::process::id());
    std::fs::write(&temporary, metrics_text(reports))
        .with_context(|| format!("writing {temporary}"))?;
    std::fs::rename(&temporary, path).with_context(|| format!("renaming {temporary} to {path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_has_a_series_per_rank_and_the_text_ends_with_eof() {
        let reports = [
            RankReport {
                rank: 0,
                bytes_needed: 100,
                bytes_fetched: 128,
                bytes_transferred: 4096,
                requests: 3,
                ..RankReport::default()
            },
            RankReport {
                rank: 1,
                bytes_sent: 7,
                ..RankReport::default()
            },
        ];
        let text = metrics_text(&reports);
        assert!(text.contains("tessera_load_bytes_requested_total{rank=\"0\"} 128\n"));
        assert!(text.contains("tessera_load_bytes_transferred_total{rank=\"0\"} 4096\n"));
        assert!(text.contains("tessera_load_storage_requests_total{rank=\"0\"} 3\n"));
        assert!(text.contains("tessera_load_bytes_sent_total{rank=\"1\"} 7\n"));
        assert_eq!(text.matches("_total{rank=").count(), COUNTERS.len() * 2);
        assert!(text.ends_with("# EOF\n"));
    }
}

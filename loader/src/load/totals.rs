//! A load's totals over its ranks' reports: what the job needed, read, fetched, transferred and
//! exchanged in all, and its amplifications.

use serde::Serialize;

use super::{RankReport, ratio};

/// A load's totals over every rank that reported: the sums of their [`RankReport`]s and the
/// job's amplifications (the CLI's report and `--report-json` give them under these names).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoadTotals {
    /// Ranks that reported.
    pub ranks: usize,
    /// Bytes of every rank's buffers.
    pub bytes_needed: u64,
    /// Distinct bytes of the checkpoint that the ranks need (the plan's summary).
    pub unique_needed: u64,
    /// Bytes of data read from storage, over all ranks.
    pub bytes_read: u64,
    /// Of `bytes_read`, the bytes read from the ranks' memory tiers (`--memory-tier`).
    pub bytes_from_memory_tier: u64,
    /// Of `bytes_read`, the bytes read from the checkpoint's storage.
    pub bytes_from_storage: u64,
    /// Bytes fetched from storage, verification blocks included.
    pub bytes_fetched: u64,
    /// Of `bytes_fetched`, the bytes only verification needed (checksum blocks around the data,
    /// the rest of boxes read whole to check their crc32c).
    pub verify_extra_bytes: u64,
    /// Saved boxes fetched whole and checked against their own checksum.
    pub boxes_verified: u64,
    /// Bytes read while verifying that no checksum covered.
    pub bytes_unverified: u64,
    /// `bytes_read / unique_needed`: 1.00 when no byte is read twice or needlessly.
    pub read_amplification: f64,
    /// `bytes_fetched / unique_needed`: total I/O per byte needed, verification included.
    pub io_amplification: f64,
    /// Bytes the stores returned, over all ranks: `bytes_fetched` plus the gaps that requests
    /// spanning several small ranges carried (`--coalesce-gap`).
    pub bytes_transferred: u64,
    /// `bytes_transferred / unique_needed`: what the wire carried per byte needed.
    pub transfer_amplification: f64,
    /// Storage requests over all ranks (one ranged GET each; retries not included).
    pub requests: u64,
    /// Bytes ranks sent each other.
    pub bytes_exchanged: u64,
    /// Of `bytes_exchanged`, the bytes receivers copied straight out of their sender's memory
    /// (ranks on one host; no socket).
    pub bytes_exchanged_direct: u64,
}

impl LoadTotals {
    /// The totals of `reports`, the ranks of a job whose plan needs `unique` distinct
    /// bytes of the checkpoint (its summary's `unique_bytes_needed`).
    pub fn of(unique: u64, reports: &[RankReport]) -> Self {
        let sum = |f: fn(&RankReport) -> u64| reports.iter().map(f).sum::<u64>();
        let (read, fetched) = (sum(|r| r.bytes_read), sum(|r| r.bytes_fetched));
        LoadTotals {
            ranks: reports.len(),
            bytes_needed: sum(|r| r.bytes_needed),
            unique_needed: unique,
            bytes_read: read,
            bytes_from_memory_tier: sum(|r| r.bytes_from_memory_tier),
            bytes_from_storage: sum(|r| r.bytes_from_storage),
            bytes_fetched: fetched,
            verify_extra_bytes: sum(|r| r.verify_extra_bytes),
            boxes_verified: sum(|r| r.boxes_verified),
            bytes_unverified: sum(|r| r.bytes_unverified),
            read_amplification: ratio(read, unique),
            io_amplification: ratio(fetched, unique),
            bytes_transferred: sum(|r| r.bytes_transferred),
            transfer_amplification: ratio(sum(|r| r.bytes_transferred), unique),
            requests: sum(|r| r.requests),
            bytes_exchanged: sum(|r| r.bytes_sent),
            bytes_exchanged_direct: sum(|r| r.bytes_received_direct),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(rank: u32, read: u64, fetched: u64, transferred: u64) -> RankReport {
        RankReport {
            rank,
            bytes_needed: read + 10,
            bytes_read: read,
            bytes_from_memory_tier: read / 2,
            bytes_from_storage: read - read / 2,
            bytes_fetched: fetched,
            verify_extra_bytes: fetched - read,
            boxes_verified: 1,
            bytes_unverified: 3,
            bytes_transferred: transferred,
            requests: 2,
            bytes_sent: 5,
            bytes_received_direct: 4,
            ..RankReport::default()
        }
    }

    #[test]
    fn two_ranks_sum_and_the_ratios_are_over_the_unique_bytes_needed() {
        let totals = LoadTotals::of(200, &[report(0, 100, 150, 160), report(1, 300, 350, 400)]);
        assert_eq!(
            totals,
            LoadTotals {
                ranks: 2,
                bytes_needed: 420,
                unique_needed: 200,
                bytes_read: 400,
                bytes_from_memory_tier: 200,
                bytes_from_storage: 200,
                bytes_fetched: 500,
                verify_extra_bytes: 100,
                boxes_verified: 2,
                bytes_unverified: 6,
                read_amplification: 2.0,
                io_amplification: 2.5,
                bytes_transferred: 560,
                transfer_amplification: 2.8,
                requests: 4,
                bytes_exchanged: 10,
                bytes_exchanged_direct: 8,
            }
        );
        // Nothing needed: nothing read is no waste.
        assert_eq!(LoadTotals::of(0, &[]).read_amplification, 1.0);
    }
}

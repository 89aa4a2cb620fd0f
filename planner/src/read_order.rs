//! Storage-order reads: when the ranks' targets cut across the order a saved chunk is stored in
//! (a Shard(0)-saved matrix loaded as Shard(1)), every rank reading its own part of the chunk
//! makes one small ranged request per saved row, and with block checksums every rank fetches
//! every checksum block of every row. Instead the chunk's contiguous byte range is cut into a few
//! block-aligned *slabs* (runs of whole rows of its leading dim); one reader per slab reads all
//! of it in order, and each (slab ∩ target) becomes a piece that the slab's reader hands to the
//! ranks that need it through the usual ring exchange. The reader's pieces of one slab are
//! adjacent in the file, so the loader's range scheduler merges them back into few large
//! requests that fetch every byte and every checksum block once.
//!
//! ```text
//! chunk rows (row-major)     targets (Shard(1), 4 ranks)       storage order, 2 slabs
//! ┌────────────────────┐     ┌────┬────┬────┬────┐             ┌────────────────────┐ ← slab 0: one
//! │ row 0              │     │ r0 │ r1 │ r2 │ r3 │ one request │ r0's pieces ...    │   reader, one
//! │ row 1              │     │    │    │    │    │ per row per │                    │   request
//! │ ...                │     │    │    │    │    │ rank        ├────────────────────┤ ← cut on a row
//! │ row n              │     │    │    │    │    │             │ slab 1             │   at a block
//! └────────────────────┘     └────┴────┴────┴────┘             └────────────────────┘   boundary
//! ```
//!
//! Whether a chunk is read in storage order is decided per chunk by [`ReadOrder`] and, for
//! [`ReadOrder::Auto`], by the cost model of [`storage_order_pays`]. All its constants are here.

use serde::{Deserialize, Serialize};
use tessera_metadata::{SavedChunk, TensorBox, row_major_strides};

/// How the pieces of a saved chunk are read (a [`crate::PlanOptions`] knob).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadOrder {
    /// Per chunk, whichever the cost model ([`storage_order_pays`]) finds cheaper.
    #[default]
    Auto,
    /// Every rank (or its group's reader) reads the pieces it needs, in whatever order the
    /// targets cut them: no bytes are relayed, but a target across the storage order costs one
    /// request per saved row.
    Request,
    /// Every chunk stored row-major is read in slabs (tests and measurements; see the module
    /// doc). Chunks with other strides, and plans without dedup, are read per request.
    Storage,
}

/// What one storage request costs, in bytes of transfer it is worth: 64 KiB. Measured on the
/// loopback S3 test server a request costs about as much as 50 KiB of transfer (the break-even
/// behind the loader's `OBJECT_STORE_COALESCE_GAP`); on local files a ranged read is a syscall
/// plus the scheduler's and verifier's per-range work, and a column slice of a row is often far
/// smaller than 64 KiB, so the request count is what makes such a load slow. Cloud stores (10–100
/// ms to first byte) make a request worth megabytes: this is the low end, so storage order is
/// chosen only where it wins even on a local disk.
pub const REQUEST_COST_BYTES: u64 = 64 * 1024;

/// What one request costs when the ranks read local files (`PlanOptions::local_reads`): 8 KiB.
/// From the page cache a ranged read is a positioned read plus the loader's per-range work;
/// measured in a 4-rank torch job (BENCHMARKS.md, issues 16 and 31): column slices of 16 KiB per
/// row load 2.7x faster per request (0.63 s) than in storage order (1.69 s), slices of 0.5–2.8 KiB
/// 1.75x slower (1.12 vs 0.64 s), about 3 µs per request against ~2.5 GB/s of copying, which puts
/// the break-even near 8 KiB of transfer per request.
pub const LOCAL_REQUEST_COST_BYTES: u64 = 8 * 1024;

/// What one run of a column slice costs when the ranks read local files and the slice is fetched
/// exactly (a checkpoint without block checksums, DCP or safetensors, or a box checked jointly):
/// 1 KiB. The loader then reads a whole column slice by position, its runs copied out of a
/// mapping of the file or read with one `pread` each (`tessera_loader`'s strided reads), so a
/// run is a memory copy and a page-table walk, not a request. Measured on Llama-3-8B-shaped
/// layers with fp32 Adam moments (BENCHMARKS.md, issue 31; 2 KiB to 14 KiB slices per row): per
/// request beat storage order on every layout, in a 4-rank torch job from DCP (Shard(1) 0.61 vs
/// 1.55 s, TP2×DP2 0.83 vs 1.26 s, Megatron TP4 0.51 vs 0.71 s) and with the CLI from the
/// native conversion (Shard(1) 0.82–1.02 vs 1.84–2.04 s, TP2×DP2 1.36–1.45 vs 2.32–4.22 s).
/// Storage order relays three quarters of a Shard(1) chunk (1.5 bytes of extra cost per byte at
/// [`EXCHANGE_COST_PER_BYTE`]) and half of a TP2×DP2 one (1 byte per byte); at 1 KiB a run,
/// request order wins there for every slice wider than 1 KiB, as it did in the measurements.
pub const LOCAL_RUN_COST_BYTES: u64 = 1024;

/// What a relayed byte costs (read by a rank that does not need it and passed on through the
/// exchange), relative to a byte read from storage: 2. A relayed byte is read once like any
/// other, then crosses the exchange once more (measured over TCP loopback at about the speed
/// of a page-cache read, issue 16); counting it twice makes storage order win only where it
/// saves requests or checksum blocks worth more than the extra exchange traffic.
pub const EXCHANGE_COST_PER_BYTE: u64 = 2;

/// Chunks of at most this many checksum blocks (`slab_alignment`s) are never read in storage
/// order by [`ReadOrder::Auto`]: 4 (256 KiB by default). Each rank reading its part of such a
/// chunk fetches at most those few blocks, and the loader already merges them into about one
/// request (it verifies a small box by reading it whole, object stores span gaps under 64 KiB,
/// local files batch ranges into one call), so relaying would add exchange messages and save
/// next to nothing.
pub const MIN_CHUNK_BLOCKS: u64 = 4;

/// The loader's largest single request (its default `ReadOptions::part_size`): a slab of this
/// many bytes costs one request, a larger one a request per part.
pub const MAX_REQUEST_BYTES: u64 = 16 * 1024 * 1024;

/// Default target size of a slab ([`crate::PlanOptions::slab_bytes`]): 16 MiB, one loader
/// request. Smaller slabs spread a chunk over more readers but make more pieces (slabs × the
/// targets the chunk meets) and more exchange messages; larger ones load one reader more.
pub const DEFAULT_SLAB_BYTES: u64 = MAX_REQUEST_BYTES;

/// Default alignment of slab cuts ([`crate::PlanOptions::slab_alignment`]): 64 KiB, the native
/// format's checksum block (`DEFAULT_BLOCK_SIZE`). Blocks are counted from file offset 0, so a
/// cut at an aligned file offset makes the two readers fetch disjoint blocks; a cut that cannot
/// be aligned (rows that do not divide the block) costs at most one block fetched twice.
pub const DEFAULT_SLAB_ALIGNMENT: u64 = 64 * 1024;

/// Elements of one contiguous source run of `region` inside a chunk stored row-major with
/// `chunk` lengths, and how many runs the region takes.
pub(crate) fn runs_of(chunk: &[u64], region: &[u64]) -> (u64, u64) {
    let numel: u64 = region.iter().product();
    let mut run = 1u64;
    for d in (0..chunk.len()).rev() {
        run *= region[d];
        if region[d] != chunk[d] {
            break;
        }
    }
    if run == 0 {
        return (0, 0);
    }
    (run, numel / run)
}

/// True when the chunk's elements are stored row-major and contiguous (no explicit strides, or
/// the row-major ones): only then is a run of whole leading rows one byte range.
pub(crate) fn is_row_major(chunk: &SavedChunk) -> bool {
    match &chunk.bytes.strides {
        None => true,
        Some(s) => *s == row_major_strides(&chunk.region.lengths),
    }
}

/// The slabs of a chunk: the dim they cut (the first of length > 1, so that a slab of whole
/// "rows" of it is contiguous) and the cut points relative to the chunk, starting with 0 and
/// ending with its length. `None` when the chunk has no such dim (one element or empty).
pub(crate) fn slab_cuts(
    chunk: &SavedChunk,
    esize: u64,
    readers: usize,
    slab_bytes: u64,
    alignment: u64,
) -> Option<(usize, Vec<u64>)> {
    let lengths = &chunk.region.lengths;
    let dim = lengths.iter().position(|&l| l > 1)?;
    let rows = lengths[dim];
    let row_bytes = lengths[dim + 1..].iter().product::<u64>() * esize;
    let chunk_bytes = rows.checked_mul(row_bytes)?;
    if chunk_bytes == 0 {
        return None;
    }
    let n = chunk_bytes
        .div_ceil(slab_bytes.max(1))
        .clamp(1, (readers.max(1) as u64).min(rows));
    let alignment = alignment.max(1);
    let origin = chunk.bytes.offset;
    let mut cuts = vec![0u64];
    for i in 1..n {
        // The i-th n-th of the chunk, moved to the next aligned file offset, then to the next
        // row boundary (which is that offset itself when rows divide the alignment).
        let at = origin + (u128::from(chunk_bytes) * u128::from(i) / u128::from(n)) as u64;
        let aligned = at.div_ceil(alignment).saturating_mul(alignment);
        let row = (aligned - origin).div_ceil(row_bytes);
        if row > *cuts.last().unwrap_or(&0) && row < rows {
            cuts.push(row);
        }
    }
    cuts.push(rows);
    Some((dim, cuts))
}

/// Bytes fetched to read `count` runs of `run_bytes` spanning `span` bytes when every fetch is
/// widened to whole `alignment` blocks: each run touches at most `run / alignment + 2` blocks, the
/// whole span no more than its own blocks, and never less than the bytes themselves.
fn fetched(run_bytes: u64, count: u64, span: u64, alignment: u64) -> u64 {
    let a = alignment.max(1);
    let per_run = (run_bytes / a + 2) * a;
    let spanned = (span / a + 2) * a;
    count
        .saturating_mul(per_run)
        .min(spanned)
        .max(run_bytes * count)
}

/// How the cost model prices reading one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestPricing {
    /// The checksum block fetched around each run read per request (`slab_alignment`).
    pub alignment: u64,
    /// What one request costs, in bytes of transfer ([`REQUEST_COST_BYTES`], or
    /// [`LOCAL_REQUEST_COST_BYTES`] for local files).
    pub request_cost: u64,
    /// The chunk is checked jointly: its pieces are fetched exactly, no checksum blocks.
    pub exact: bool,
    /// What one run costs when a piece is read by position from a local file, all its runs in
    /// one read ([`LOCAL_RUN_COST_BYTES`]); `None`: every run is a request.
    pub positioned_run_cost: Option<u64>,
}

/// One piece of a chunk as the cost model sees it: its region and how many ranks need it.
pub(crate) struct PieceCost<'a> {
    pub region: &'a TensorBox,
    pub holders: usize,
}

/// The cost model: true when reading `chunk` in storage order (slabs cut at `cuts` along `dim`,
/// read by one of the `readers` ranks that need part of the chunk each) is cheaper than reading
/// its `pieces` per request. Costs are in bytes of storage transfer:
///
/// - per request: `requests × request_cost + bytes fetched` (`request_cost`:
///   [`REQUEST_COST_BYTES`], or [`LOCAL_REQUEST_COST_BYTES`] for local files), where every piece
///   takes one request per contiguous run (or, read by position from a local file without
///   checksum blocks, one request and [`LOCAL_RUN_COST_BYTES`] per run) and fetches the checksum blocks around each run
///   (`slab_alignment`), shared by the runs of one piece, unless the chunk is checked jointly
///   (`exact`: its pieces are fetched as they are, their bytes only);
/// - storage order: one request per slab (per `MAX_REQUEST_BYTES` of it), the blocks of the
///   slabs, and `EXCHANGE_COST_PER_BYTE` for every byte expected to be relayed: a piece needed by
///   h of the r ranks is read by a rank that does not need it with probability (r − h) / r.
///
/// When the pieces do not cover the whole chunk a slab is not one contiguous range, nothing is
/// saved, and the answer is false; so it is for chunks of at most [`MIN_CHUNK_BLOCKS`] blocks.
pub(crate) fn storage_order_pays(
    chunk: &SavedChunk,
    esize: u64,
    pieces: &[PieceCost<'_>],
    readers: usize,
    cuts: &[u64],
    pricing: RequestPricing,
) -> bool {
    let RequestPricing {
        alignment,
        request_cost,
        exact,
        positioned_run_cost,
    } = pricing;
    let lengths = &chunk.region.lengths;
    let chunk_bytes = chunk.region.numel() * esize;
    let needed: u64 = pieces.iter().map(|p| p.region.numel() * esize).sum();
    if needed != chunk_bytes
        || readers == 0
        || chunk_bytes <= MIN_CHUNK_BLOCKS.saturating_mul(alignment.max(1))
    {
        return false;
    }
    let strides = row_major_strides(lengths);
    let (mut requests, mut fetched_bytes, mut relayed, mut run_costs) = (0u64, 0u64, 0u64, 0u64);
    for p in pieces {
        let (run, count) = runs_of(lengths, &p.region.lengths);
        let run_bytes = run * esize;
        let bytes = run_bytes * count;
        // First to last byte of the piece in the chunk.
        let span = p
            .region
            .lengths
            .iter()
            .zip(&strides)
            .map(|(l, s)| l.saturating_sub(1) * s)
            .sum::<u64>()
            * esize
            + run_bytes;
        requests += match positioned_run_cost {
            // One read per piece (a part's worth at a time), each run a copy.
            Some(run_cost) => {
                run_costs += count.saturating_mul(run_cost);
                1 + bytes / MAX_REQUEST_BYTES
            }
            None => count + bytes / MAX_REQUEST_BYTES,
        };
        fetched_bytes += if exact {
            bytes
        } else {
            fetched(run_bytes, count, span, alignment)
        };
        relayed += bytes / readers as u64 * (readers - p.holders.min(readers)) as u64;
    }
    let per_request = requests.saturating_mul(request_cost) + fetched_bytes + run_costs;

    let rows = cuts.last().copied().unwrap_or(0).max(1);
    let row_bytes = chunk_bytes / rows;
    let mut storage_requests = 0u64;
    let mut storage_fetched = 0u64;
    for w in cuts.windows(2) {
        let slab = (w[1] - w[0]) * row_bytes;
        storage_requests += 1 + slab / MAX_REQUEST_BYTES;
        storage_fetched += fetched(slab, 1, slab, alignment);
    }
    let storage_cost = storage_requests.saturating_mul(request_cost)
        + storage_fetched
        + relayed.saturating_mul(EXCHANGE_COST_PER_BYTE);
    storage_cost < per_request
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tessera_metadata::ByteMeta;

    fn chunk(offsets: Vec<u64>, lengths: Vec<u64>, at: u64) -> SavedChunk {
        let numel: u64 = lengths.iter().product();
        SavedChunk {
            tensor: 0,
            region: TensorBox::new(offsets, lengths),
            bytes: ByteMeta {
                file: 0,
                offset: at,
                length: numel * 4,
                strides: None,
            },
            crc32c: None,
            crc32: None,
        }
    }

    #[test]
    fn runs_of_a_column_slice_are_one_per_row() {
        assert_eq!(runs_of(&[8, 16], &[8, 4]), (4, 8));
        assert_eq!(runs_of(&[8, 16], &[2, 16]), (32, 1));
        assert_eq!(runs_of(&[1, 8, 16], &[1, 3, 16]), (48, 1));
        assert_eq!(runs_of(&[], &[]), (1, 1));
    }

    #[test]
    fn slab_cuts_land_on_rows_at_aligned_offsets() {
        // 256 rows of 1 KiB from offset 0: 4 slabs of 64 rows, every cut 64 KiB aligned.
        let c = chunk(vec![0, 0], vec![256, 256], 0);
        let (dim, cuts) = slab_cuts(&c, 4, 4, 64 * 1024, 64 * 1024).unwrap();
        assert_eq!((dim, cuts), (0, vec![0, 64, 128, 192, 256]));
        // Leading dims of length 1 are skipped; no more slabs than readers or rows.
        let c = chunk(vec![0, 0, 0], vec![1, 3, 256], 4096);
        let (dim, cuts) = slab_cuts(&c, 4, 8, 1, 1).unwrap();
        assert_eq!((dim, cuts), (1, vec![0, 1, 2, 3]));
        // One element: nothing to cut.
        assert!(slab_cuts(&chunk(vec![0], vec![1], 0), 4, 4, 1, 1).is_none());
    }

    #[test]
    fn a_column_reshard_of_many_rows_pays_and_a_row_reshard_does_not() {
        let c = chunk(vec![0, 0], vec![1024, 1024], 0);
        let (_, cuts) = slab_cuts(&c, 4, 4, DEFAULT_SLAB_BYTES, DEFAULT_SLAB_ALIGNMENT).unwrap();
        let columns: Vec<TensorBox> = (0..4)
            .map(|i| TensorBox::new(vec![0, i * 256], vec![1024, 256]))
            .collect();
        let costs: Vec<PieceCost<'_>> = columns
            .iter()
            .map(|region| PieceCost { region, holders: 1 })
            .collect();
        assert!(storage_order_pays(
            &c,
            4,
            &costs,
            4,
            &cuts,
            pricing(REQUEST_COST_BYTES, false)
        ));
        let whole = [PieceCost {
            region: &c.region,
            holders: 1,
        }];
        assert!(!storage_order_pays(
            &c,
            4,
            &whole,
            4,
            &cuts,
            pricing(REQUEST_COST_BYTES, false)
        ));
        // Pieces that leave part of the chunk unread never pay: a slab would not be contiguous.
        assert!(!storage_order_pays(
            &c,
            4,
            &costs[..3],
            4,
            &cuts,
            pricing(REQUEST_COST_BYTES, false)
        ));
    }

    fn pricing(request_cost: u64, exact: bool) -> RequestPricing {
        RequestPricing {
            alignment: 64 * 1024,
            request_cost,
            exact,
            positioned_run_cost: None,
        }
    }

    /// Column slices of a 4-rank Shard(1) load of one saved matrix whose rows are `row_bytes`.
    fn column_reshard_pays(rows: u64, row_bytes: u64, request_cost: u64, exact: bool) -> bool {
        let cols = row_bytes / 4;
        let c = chunk(vec![0, 0], vec![rows, cols], 0);
        let (_, cuts) = slab_cuts(&c, 4, 4, DEFAULT_SLAB_BYTES, DEFAULT_SLAB_ALIGNMENT).unwrap();
        let columns: Vec<TensorBox> = (0..4)
            .map(|i| TensorBox::new(vec![0, i * cols / 4], vec![rows, cols / 4]))
            .collect();
        let costs: Vec<PieceCost<'_>> = columns
            .iter()
            .map(|region| PieceCost { region, holders: 1 })
            .collect();
        storage_order_pays(&c, 4, &costs, 4, &cuts, pricing(request_cost, exact))
    }

    #[test]
    fn local_column_slices_of_a_jointly_checked_box_are_read_per_request_when_rows_are_wide() {
        // The measured cases (LOCAL_REQUEST_COST_BYTES): 16 KiB slices per row read per request,
        // 0.5–2.8 KiB slices in storage order.
        assert!(!column_reshard_pays(
            4096,
            64 * 1024,
            LOCAL_REQUEST_COST_BYTES,
            true
        ));
        assert!(column_reshard_pays(
            4096,
            4 * 1024,
            LOCAL_REQUEST_COST_BYTES,
            true
        ));
        // Object stores: a request costs a round trip, storage order wins for both.
        assert!(column_reshard_pays(
            4096,
            64 * 1024,
            REQUEST_COST_BYTES,
            true
        ));
        // Without joint checks request order fetches the checksum blocks of every row.
        assert!(column_reshard_pays(
            4096,
            64 * 1024,
            LOCAL_REQUEST_COST_BYTES,
            false
        ));
    }
}

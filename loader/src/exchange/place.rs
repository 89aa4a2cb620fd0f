//! Placement: a piece's wire bytes (row-major over the piece) into the rank's destination buffers
//! through the plan's place runs, and the reverse (gathering a piece back out of a destination to
//! send it to peers, so a reader keeps no second copy of what it read).

use tessera_planner::{RankPiece, RankPlan, StridedRuns};

use crate::LoaderError;

/// Host destination buffers of a rank, one per plan destination, zero-filled (large ones on huge
/// pages where the system allows: see [`crate::load::host_memory`]).
pub fn allocate(plan: &RankPlan) -> Vec<Vec<u8>> {
    plan.destinations
        .iter()
        .map(|d| crate::load::host_memory::zeroed_buffer(d.bytes as usize))
        .collect()
}

fn check_runs(
    runs: &StridedRuns,
    src_len: usize,
    dst_len: usize,
    what: &str,
) -> Result<(), LoaderError> {
    let (_, src_end) = runs.src_span();
    let (_, dst_end) = runs.dst_span();
    if src_end > src_len as u64 || dst_end > dst_len as u64 {
        return Err(LoaderError::InvalidPlan {
            detail: format!(
                "{what}: runs reach byte {src_end} of a {src_len}-byte source and byte {dst_end} of a {dst_len}-byte destination"
            ),
        });
    }
    Ok(())
}

/// Copies along `runs` from `src` into `dst` (spans already checked).
pub fn copy_runs(runs: &StridedRuns, src: &[u8], dst: &mut [u8]) {
    let n = runs.run_bytes as usize;
    if runs.num_runs() == 1 {
        let (s, d) = (runs.src_offset as usize, runs.dst_offset as usize);
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
        return;
    }
    for (s, d) in runs.iter() {
        let (s, d) = (s as usize, d as usize);
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
}

/// Places piece `plan.pieces[piece]` (its wire bytes) into every destination it lands in.
pub fn place_piece<B: AsMut<[u8]>>(
    plan: &RankPlan,
    piece: usize,
    wire: &[u8],
    buffers: &mut [B],
) -> Result<(), LoaderError> {
    let Some(p) = plan.pieces.get(piece) else {
        return Err(LoaderError::InvalidPlan {
            detail: format!("rank {}: piece index {piece} out of range", plan.rank),
        });
    };
    if wire.len() as u64 != p.bytes {
        return Err(LoaderError::InvalidPlan {
            detail: format!(
                "rank {}: piece {} has {} bytes but {} arrived",
                plan.rank,
                p.id,
                p.bytes,
                wire.len()
            ),
        });
    }
    for placement in &p.places {
        let Some(buffer) = buffers.get_mut(placement.destination as usize) else {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {}: piece {} lands in missing destination {}",
                    plan.rank, p.id, placement.destination
                ),
            });
        };
        let buffer = buffer.as_mut();
        check_runs(
            &placement.runs,
            wire.len(),
            buffer.len(),
            &format!("rank {} piece {}", plan.rank, p.id),
        )?;
        copy_runs(&placement.runs, wire, buffer);
    }
    Ok(())
}

/// The wire bytes of piece `plan.pieces[piece]`, gathered from its first destination (which holds
/// it once it was placed).
pub fn gather_piece<B: AsRef<[u8]>>(
    plan: &RankPlan,
    piece: usize,
    buffers: &[B],
) -> Result<Vec<u8>, LoaderError> {
    let Some(p) = plan.pieces.get(piece) else {
        return Err(LoaderError::InvalidPlan {
            detail: format!("rank {}: piece index {piece} out of range", plan.rank),
        });
    };
    let Some(first) = p.places.first() else {
        return Err(LoaderError::InvalidPlan {
            detail: format!("rank {}: piece {} lands nowhere", plan.rank, p.id),
        });
    };
    let Some(buffer) = buffers.get(first.destination as usize) else {
        return Err(LoaderError::InvalidPlan {
            detail: format!(
                "rank {}: piece {} lands in missing destination {}",
                plan.rank, p.id, first.destination
            ),
        });
    };
    let buffer = buffer.as_ref();
    let back = first.runs.reversed();
    check_runs(
        &back,
        buffer.len(),
        p.bytes as usize,
        &format!("rank {} piece {}", plan.rank, p.id),
    )?;
    // The wire is row-major over the piece, so the runs fill it front to back: append instead
    // of zero-filling a buffer first (this copy is on the exchange's hot path).
    let n = back.run_bytes as usize;
    let mut wire = Vec::with_capacity(p.bytes as usize);
    for (src, dst) in back.iter() {
        if dst as usize != wire.len() {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {} piece {}: place runs do not fill the wire in order",
                    plan.rank, p.id
                ),
            });
        }
        wire.extend_from_slice(&buffer[src as usize..src as usize + n]);
    }
    Ok(wire)
}

/// Places any sub-range of a piece's wire bytes (as they arrive from storage) straight into the
/// piece's destinations, so the reader never assembles a wire buffer. Relies on what place runs
/// are: their source is the wire, row-major, so run k starts at wire byte k × run_bytes.
#[derive(Debug)]
pub struct WirePlacer<'a> {
    piece: u32,
    places: Vec<(usize, &'a StridedRuns)>,
}

impl<'a> WirePlacer<'a> {
    /// Checks the piece's place runs against the plan (they come over the network).
    pub fn new(plan: &'a RankPlan, piece: &'a RankPiece) -> Result<Self, LoaderError> {
        let mut places = Vec::with_capacity(piece.places.len());
        for placement in &piece.places {
            let runs = &placement.runs;
            let bad = |why: &str| LoaderError::InvalidPlan {
                detail: format!("rank {} piece {}: place runs {why}", plan.rank, piece.id),
            };
            let Some(dest) = plan.destinations.get(placement.destination as usize) else {
                return Err(bad("land in a missing destination"));
            };
            if runs.counts.len() != runs.src_strides.len()
                || runs.counts.len() != runs.dst_strides.len()
            {
                return Err(bad("have mismatched dimensions"));
            }
            // Wire side contiguous and row-major from 0, covering exactly the piece.
            let mut expected = runs.run_bytes;
            for d in (0..runs.counts.len()).rev() {
                if runs.src_strides[d] != expected {
                    return Err(bad("do not read the wire row-major"));
                }
                expected = expected.saturating_mul(runs.counts[d]);
            }
            if runs.src_offset != 0 || expected != piece.bytes {
                return Err(bad("do not cover the piece's wire bytes"));
            }
            if runs.dst_span().1 > dest.bytes {
                return Err(bad("reach past their destination"));
            }
            places.push((placement.destination as usize, runs));
        }
        Ok(Self {
            piece: piece.id,
            places,
        })
    }

    /// Copies `bytes`, the piece's wire bytes from `wire_offset` on, into every destination.
    pub fn place<B: AsMut<[u8]>>(
        &self,
        wire_offset: u64,
        bytes: &[u8],
        buffers: &mut [B],
    ) -> Result<(), LoaderError> {
        for &(dest, runs) in &self.places {
            let Some(buffer) = buffers.get_mut(dest) else {
                return Err(LoaderError::InvalidPlan {
                    detail: format!("piece {} lands in missing destination {dest}", self.piece),
                });
            };
            let buffer = buffer.as_mut();
            let rb = runs.run_bytes;
            let mut at = wire_offset;
            let mut rest = bytes;
            while !rest.is_empty() {
                let (run, within) = (at / rb, at % rb);
                let n = ((rb - within) as usize).min(rest.len());
                // Destination of run `run`: its odometer index over the counts, last dim fastest.
                let mut k = run;
                let mut target = runs.dst_offset + within;
                for d in (0..runs.counts.len()).rev() {
                    target += (k % runs.counts[d]) * runs.dst_strides[d];
                    k /= runs.counts[d];
                }
                let t = target as usize;
                let Some(slot) = buffer.get_mut(t..t + n) else {
                    return Err(LoaderError::InvalidPlan {
                        detail: format!(
                            "piece {}: wire byte {at} lands past destination {dest}",
                            self.piece
                        ),
                    });
                };
                slot.copy_from_slice(&rest[..n]);
                at += n as u64;
                rest = &rest[n..];
            }
        }
        Ok(())
    }
}

/// Where piece `plan.pieces[piece]`'s wire bytes lie once placed: its first placement's
/// destination and byte spans there, `(offset, length)` in wire order, adjacent runs merged. A
/// direct copy between ranks of one host reads (sender) or writes (receiver) exactly these.
pub fn wire_spans(plan: &RankPlan, piece: usize) -> Result<(usize, Vec<(u64, u64)>), LoaderError> {
    let Some(p) = plan.pieces.get(piece) else {
        return Err(LoaderError::InvalidPlan {
            detail: format!("rank {}: piece index {piece} out of range", plan.rank),
        });
    };
    // Checks every placement like a read does: the wire row-major, destinations in bounds.
    WirePlacer::new(plan, p)?;
    let Some(first) = p.places.first() else {
        return Err(LoaderError::InvalidPlan {
            detail: format!("rank {}: piece {} lands nowhere", plan.rank, p.id),
        });
    };
    let runs = &first.runs;
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for (_, dst) in runs.iter() {
        crate::exchange::direct::push_span(&mut spans, dst, runs.run_bytes);
    }
    Ok((first.destination as usize, spans))
}

/// Where `piece`'s wire bytes land when they land as one stretch of one destination: its only
/// placement, laid out like the wire (row-major, no gaps). `None` for anything else. The place
/// runs must have been checked ([`WirePlacer::new`]).
pub fn contiguous_target(piece: &RankPiece) -> Option<(usize, u64)> {
    let [placement] = piece.places.as_slice() else {
        return None;
    };
    let runs = &placement.runs;
    let same_layout = runs
        .counts
        .iter()
        .zip(runs.src_strides.iter().zip(&runs.dst_strides))
        .all(|(&count, (src, dst))| count == 1 || src == dst);
    same_layout.then_some((placement.destination as usize, runs.dst_offset))
}

/// Copies piece `plan.pieces[piece]` from its first placement, where a direct copy put it, into
/// its other placements (a piece landing in several destinations).
pub fn copy_to_other_places<B: AsMut<[u8]> + AsRef<[u8]>>(
    plan: &RankPlan,
    piece: usize,
    buffers: &mut [B],
) -> Result<(), LoaderError> {
    let Some(p) = plan.pieces.get(piece) else {
        return Err(LoaderError::InvalidPlan {
            detail: format!("rank {}: piece index {piece} out of range", plan.rank),
        });
    };
    if p.places.len() < 2 {
        return Ok(());
    }
    let wire = gather_piece(plan, piece, buffers)?;
    let placer = WirePlacer::new(plan, p)?;
    // Placing over the first placement again rewrites the same bytes; only the others change.
    placer.place(0, &wire, buffers)
}

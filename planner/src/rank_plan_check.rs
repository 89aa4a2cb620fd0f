//! Checking a rank plan against the checkpoint metadata the loader opened itself: a plan that
//! came over the network (a plan server, a plan file) is only trusted as far as it agrees with
//! what the planner would have derived from that metadata. The identity check ties a plan to a
//! version of the checkpoint; this ties every piece to it: the tensor it names (dtype, shape), the
//! saved box its bytes come from (file, offset, strides, length), and where it lands. A server
//! that swaps one data file for another of the same checkpoint passes the identity check and is
//! refused here.

use std::collections::HashMap;

use tessera_metadata::{BoxIndex, CheckpointMeta, TensorBox, TensorMeta, row_major_strides};

use crate::peer_digest::target_text;
use crate::rank_plan::{place_runs, source_runs};
use crate::request::{flat_index, global_strides};
use crate::{PlanError, RankPiece, RankPlan, Request, SourceRead, Target};

/// Above this many saved boxes a tensor's boxes are looked up through an index instead of a scan.
const INDEX_ABOVE: usize = 32;

impl RankPlan {
    /// Refuses a plan that disagrees with `meta`, the metadata of the checkpoint it is executed
    /// against: a tensor whose dtype or shape differs, a destination outside its tensor, a piece
    /// outside its tensor or whose bytes, source file, offsets or strides are not those of a
    /// saved box holding it, a placement that does not put the piece where its tensor coordinates
    /// say. The error names the rank and the piece. Pure, and linear in the plan (each piece's
    /// saved box is looked up through an index for tensors saved in many boxes).
    pub fn check_against(&self, meta: &CheckpointMeta) -> Result<(), PlanError> {
        let mut check = AgainstCheckpoint::new(self, meta)?;
        check.destinations()?;
        // What lands in each destination: its bytes, and the boxes of the pieces placed there.
        let mut placed: Vec<(u64, Vec<TensorBox>)> = vec![(0, Vec::new()); self.destinations.len()];
        for piece in &self.pieces {
            let (tensor, index) = check.tensor_of(piece.tensor, &format!("piece {}", piece.id))?;
            let esize = tensor.dtype.size();
            if !inside(&piece.region, &tensor.shape) {
                return Err(check.piece_error(
                    piece,
                    tensor,
                    format!("outside the tensor's shape {:?}", tensor.shape),
                ));
            }
            if piece.bytes != piece.region.numel() * esize {
                return Err(check.piece_error(
                    piece,
                    tensor,
                    format!(
                        "{} bytes where the box holds {}",
                        piece.bytes,
                        piece.region.numel() * esize
                    ),
                ));
            }
            if let Some(read) = &piece.read {
                check.read(piece, tensor, index, read)?;
            }
            check.places(piece, tensor, &mut placed)?;
        }
        // Every byte of every destination is placed exactly once: the boxes placed there are
        // disjoint (each inside the destination, checked above) and fill it.
        for (d, ((bytes, boxes), dest)) in placed.into_iter().zip(&self.destinations).enumerate() {
            let overlap = BoxIndex::build(boxes).find_overlap();
            if bytes != dest.bytes || overlap.is_some() {
                let tensor = &self.tensors[dest.tensor as usize];
                return Err(check.error(format!(
                    "destination {d} ({} {:?}, {} bytes) is {}",
                    tensor.fqn,
                    dest.target,
                    dest.bytes,
                    if overlap.is_some() {
                        "placed twice where pieces overlap".to_string()
                    } else {
                        format!("filled with {bytes} bytes of pieces")
                    }
                )));
            }
        }
        Ok(())
    }
}

/// A rank plan being checked against the opened checkpoint's metadata
/// ([`RankPlan::check_against`]): the plan's tensors as indices into the metadata, and the box
/// indexes of tensors saved in many boxes, built on first use.
struct AgainstCheckpoint<'a> {
    plan: &'a RankPlan,
    meta: &'a CheckpointMeta,
    /// Per plan tensor, its index in the metadata.
    opened: Vec<u32>,
    indexes: HashMap<u32, BoxIndex>,
    /// Scratch for box lookups.
    candidates: Vec<u32>,
}

impl<'a> AgainstCheckpoint<'a> {
    /// Looks the plan's tensors up in the metadata: each must be there with the same dtype and
    /// shape.
    fn new(plan: &'a RankPlan, meta: &'a CheckpointMeta) -> Result<Self, PlanError> {
        let mut check = AgainstCheckpoint {
            plan,
            meta,
            opened: Vec::with_capacity(plan.tensors.len()),
            indexes: HashMap::new(),
            candidates: Vec::new(),
        };
        let mut by_name: HashMap<&str, u32> = HashMap::with_capacity(meta.tensors().len());
        for (i, t) in meta.tensors().iter().enumerate() {
            by_name.insert(t.fqn.as_str(), i as u32);
        }
        for t in &plan.tensors {
            let Some(&index) = by_name.get(t.fqn.as_str()) else {
                return Err(check.error(format!("tensor {} is not in the checkpoint", t.fqn)));
            };
            let there = &meta.tensors()[index as usize];
            if there.dtype != t.dtype || there.shape != t.shape {
                return Err(check.error(format!(
                    "tensor {} is {} {:?} in the plan but {} {:?} in the checkpoint",
                    t.fqn, t.dtype, t.shape, there.dtype, there.shape
                )));
            }
            check.opened.push(index);
        }
        Ok(check)
    }

    fn error(&self, detail: String) -> PlanError {
        PlanError::DisagreesWithCheckpoint {
            rank: self.plan.rank,
            detail,
        }
    }

    /// An error about `piece` (of `tensor`), naming it.
    fn piece_error(&self, piece: &RankPiece, tensor: &TensorMeta, detail: String) -> PlanError {
        self.error(format!(
            "piece {} ({} {:?}+{:?}): {detail}",
            piece.id, tensor.fqn, piece.region.offsets, piece.region.lengths
        ))
    }

    /// The plan's tensor `local` (named by `what`) and its index in the metadata.
    fn tensor_of(&self, local: u32, what: &str) -> Result<(&'a TensorMeta, u32), PlanError> {
        match self.opened.get(local as usize) {
            Some(&index) => Ok((&self.plan.tensors[local as usize], index)),
            None => Err(self.error(format!(
                "{what} names tensor #{local} but the plan lists {} tensors",
                self.plan.tensors.len()
            ))),
        }
    }

    /// Every destination is a part of its tensor, of the bytes that part holds.
    fn destinations(&self) -> Result<(), PlanError> {
        for (d, dest) in self.plan.destinations.iter().enumerate() {
            let (tensor, _) = self.tensor_of(dest.tensor, &format!("destination {d}"))?;
            let within = match &dest.target {
                Target::Box(b) => inside(b, &tensor.shape),
                Target::Flat { start, end } => start <= end && *end <= tensor.numel(),
            };
            if !within || dest.bytes != dest.target.numel() * tensor.dtype.size() {
                return Err(self.error(format!(
                    "destination {d} ({} bytes of tensor {}, {:?}) is not a part of the tensor \
                     {:?} of that size",
                    dest.bytes, tensor.fqn, dest.target, tensor.shape
                )));
            }
        }
        Ok(())
    }

    /// The piece's read takes its bytes from a saved box of its tensor (metadata index `index`)
    /// that holds it: the box's file, and the runs of the piece within the box.
    fn read(
        &mut self,
        piece: &RankPiece,
        tensor: &TensorMeta,
        index: u32,
        read: &SourceRead,
    ) -> Result<(), PlanError> {
        let meta = self.meta;
        let esize = tensor.dtype.size();
        let Some(file) = self.plan.files.get(read.file as usize) else {
            return Err(self.piece_error(
                piece,
                tensor,
                format!(
                    "reads file #{} but the plan lists {} files",
                    read.file,
                    self.plan.files.len()
                ),
            ));
        };
        let chunks = meta.chunks_of(index);
        self.candidates.clear();
        if chunks.len() > INDEX_ABOVE {
            self.indexes
                .entry(index)
                .or_insert_with(|| {
                    BoxIndex::build(chunks.iter().map(|c| c.region.clone()).collect())
                })
                .query(&piece.region, &mut self.candidates);
        } else {
            self.candidates.extend(0..chunks.len() as u32);
        }
        let matches = self.candidates.iter().any(|&c| {
            let chunk = &chunks[c as usize];
            chunk.region.contains(&piece.region)
                && meta
                    .files()
                    .get(chunk.bytes.file as usize)
                    .is_some_and(|f| f.path == *file)
                && source_runs(chunk, &piece.region, esize) == read.runs
        });
        if !matches {
            return Err(self.piece_error(
                piece,
                tensor,
                format!(
                    "no saved box of the tensor holds it at the bytes the plan reads ({file} \
                     from byte {}, {} runs of {} bytes)",
                    read.runs.src_offset,
                    read.runs.num_runs(),
                    read.runs.run_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Each placement of the piece puts it where it lies in a destination of its tensor that
    /// holds it; adds its bytes and box to what lands there (`placed`).
    fn places(
        &self,
        piece: &RankPiece,
        tensor: &TensorMeta,
        placed: &mut [(u64, Vec<TensorBox>)],
    ) -> Result<(), PlanError> {
        let wire = row_major_strides(&piece.region.lengths);
        for place in &piece.places {
            let Some(dest) = self.plan.destinations.get(place.destination as usize) else {
                return Err(self.piece_error(
                    piece,
                    tensor,
                    format!(
                        "lands in destination {} but the plan has {}",
                        place.destination,
                        self.plan.destinations.len()
                    ),
                ));
            };
            let holds = dest.tensor == piece.tensor
                && match &dest.target {
                    Target::Box(b) => b.contains(&piece.region),
                    Target::Flat { start, end } => {
                        // An empty piece lands nowhere.
                        flat_span(&piece.region, &tensor.shape)
                            .is_none_or(|(first, last)| *start <= first && last < *end)
                    }
                };
            if !holds || place_runs(tensor, &piece.region, &dest.target, &wire) != place.runs {
                return Err(self.piece_error(
                    piece,
                    tensor,
                    format!(
                        "its placement in destination {} ({:?} of tensor #{}) is not where the \
                         piece lies in it",
                        place.destination, dest.target, dest.tensor
                    ),
                ));
            }
            let into = &mut placed[place.destination as usize];
            into.0 += piece.bytes;
            into.1.push(piece.region.clone());
        }
        Ok(())
    }
}

impl RankPlan {
    /// Refuses a plan whose destinations are not `requests`, this rank's own requests resolved
    /// against `meta` (the opened checkpoint): the same tensors and parts, in the same order,
    /// one destination per request. The caller's buffers are its requests in order, so a plan
    /// from elsewhere (a plan server) that lists two destinations the other way round would
    /// fill each buffer with the other's bytes; [`RankPlan::check_against`] cannot see that,
    /// as every destination is a valid part of its tensor.
    pub fn check_destinations(
        &self,
        meta: &CheckpointMeta,
        requests: &[Request],
    ) -> Result<(), PlanError> {
        let bad = |detail: String| PlanError::NotTheRequests {
            rank: self.rank,
            detail,
        };
        if self.destinations.len() != requests.len() {
            return Err(bad(format!(
                "the plan has {} destinations for this rank's {} requests",
                self.destinations.len(),
                requests.len()
            )));
        }
        for (i, (dest, request)) in self.destinations.iter().zip(requests).enumerate() {
            let planned = self
                .tensors
                .get(dest.tensor as usize)
                .map(|t| t.fqn.as_str());
            let asked = meta
                .tensors()
                .get(request.tensor as usize)
                .map(|t| t.fqn.as_str());
            if planned != asked || dest.target != request.target {
                return Err(bad(format!(
                    "destination {i} is {} of tensor {} but request {i} is {} of tensor {}",
                    target_text(&dest.target),
                    planned.unwrap_or("(none)"),
                    target_text(&request.target),
                    asked.unwrap_or("(none)"),
                )));
            }
        }
        Ok(())
    }
}

/// Whether `b` is a box of a tensor of `shape` (same dims, inside it).
fn inside(b: &TensorBox, shape: &[u64]) -> bool {
    b.ndim() == shape.len()
        && b.offsets
            .iter()
            .zip(&b.lengths)
            .zip(shape)
            .all(|((o, l), s)| o.checked_add(*l).is_some_and(|end| end <= *s))
}

/// The first and last element of a non-empty box in the tensor's row-major flattening (every
/// element of the box lies between them).
fn flat_span(b: &TensorBox, shape: &[u64]) -> Option<(u64, u64)> {
    if b.is_empty() {
        return None;
    }
    let strides = global_strides(shape);
    let last: Vec<u64> = b
        .offsets
        .iter()
        .zip(&b.lengths)
        .map(|(o, l)| o + l - 1)
        .collect();
    Some((
        flat_index(&b.offsets, &strides),
        flat_index(&last, &strides),
    ))
}

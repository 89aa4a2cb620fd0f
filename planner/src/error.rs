//! The planner's one error type: every variant names the rule, tensor, rank or field at fault.

use thiserror::Error;

use crate::PlanEstimate;

/// Errors of layouts, requests and planning.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// Copies of data files offered outside the job or the checkpoint
    /// ([`crate::ReadSources`]).
    #[error("invalid read sources: {detail}")]
    InvalidSources {
        /// What is wrong, naming the rank and file.
        detail: String,
    },
    /// Layout or request JSON that does not parse.
    #[error("invalid {what} JSON: {detail}")]
    Json {
        /// `layout` or `requests`.
        what: &'static str,
        /// serde's message with line and column.
        detail: String,
    },
    /// A mesh dimension of size 0.
    #[error("mesh dimension {name:?} has size 0; every mesh dimension needs at least one rank")]
    MeshSizeZero {
        /// Mesh dim name.
        name: String,
    },
    /// Two mesh dimensions with one name.
    #[error("mesh dimension {name:?} appears twice")]
    DuplicateMeshDim {
        /// Mesh dim name.
        name: String,
    },
    /// A placement string that is not `shard(d)`, `replicate` or `stage(layer)`.
    #[error(
        "rule {rule} (match {pattern:?}): unknown placement {placement:?}; expected shard(<dim>), replicate or stage(layer)"
    )]
    UnknownPlacement {
        /// Rule index.
        rule: usize,
        /// The rule's glob.
        pattern: String,
        /// The placement as written.
        placement: String,
    },
    /// A rule with a different number of placements than the mesh has dims.
    #[error(
        "rule {rule} (match {pattern:?}) has {got} placements but the mesh has {expected} dimensions"
    )]
    PlacementCount {
        /// Rule index.
        rule: usize,
        /// The rule's glob.
        pattern: String,
        /// Mesh dims.
        expected: usize,
        /// Placements given.
        got: usize,
    },
    /// More than one `stage` placement in a rule.
    #[error("rule {rule} (match {pattern:?}) has more than one stage(...) placement")]
    MultipleStages {
        /// Rule index.
        rule: usize,
        /// The rule's glob.
        pattern: String,
    },
    /// `shard(d)` on a tensor with at most `d` dims.
    #[error(
        "tensor {fqn} ({ndim} dims) cannot take placement shard({dim}) from rule {rule} (match {pattern:?}): dim {dim} >= ndim {ndim}"
    )]
    ShardDimOutOfRange {
        /// Tensor.
        fqn: String,
        /// Rule index.
        rule: usize,
        /// The rule's glob.
        pattern: String,
        /// The shard dim.
        dim: usize,
        /// The tensor's ndim.
        ndim: usize,
    },
    /// A tensor that no rule matches: an error rather than a silent replicate.
    #[error(
        "tensor {fqn} matches no rule of the layout (add a rule, e.g. {{\"match\": \"*\", ...}})"
    )]
    NoMatchingRule {
        /// Tensor.
        fqn: String,
    },
    /// A `stage` placement on a tensor whose stage cannot be derived.
    #[error(
        "tensor {fqn}: cannot derive its pipeline stage: {reason} (see the layout's \"stages\": layer_pattern, first, last)"
    )]
    StageUnderivable {
        /// Tensor.
        fqn: String,
        /// Why not.
        reason: String,
    },
    /// A layer pattern that is not a valid regular expression with one capture group.
    #[error("stages.layer_pattern {pattern:?} is invalid: {detail}")]
    InvalidLayerPattern {
        /// The pattern.
        pattern: String,
        /// What is wrong.
        detail: String,
    },
    /// A request for a tensor the checkpoint does not have.
    #[error("rank {rank}: requested tensor {fqn} is not in the checkpoint")]
    UnknownTensor {
        /// Requesting rank.
        rank: u32,
        /// Tensor.
        fqn: String,
    },
    /// A request with the wrong number of dims, or reaching outside the tensor.
    #[error("rank {rank}: request {region} for tensor {fqn} does not fit its shape {shape}")]
    RequestOutsideShape {
        /// Requesting rank.
        rank: u32,
        /// Tensor.
        fqn: String,
        /// The requested box.
        region: String,
        /// The tensor's shape.
        shape: String,
    },
    /// A flat range outside `[0, numel]` or reversed.
    #[error("rank {rank}: flat range [{start}, {end}) of tensor {fqn} is outside [0, {numel}]")]
    FlatOutOfRange {
        /// Requesting rank.
        rank: u32,
        /// Tensor.
        fqn: String,
        /// Start.
        start: u64,
        /// End.
        end: u64,
        /// Elements of the tensor.
        numel: u64,
    },
    /// A requested element that no saved chunk holds (metadata not validated).
    #[error("rank {rank}: tensor {fqn} elements {region} are not in any saved chunk")]
    Uncovered {
        /// Requesting rank.
        rank: u32,
        /// Tensor.
        fqn: String,
        /// The requested box.
        region: String,
    },
    /// A rank number at or past the world size.
    #[error("rank {rank} is out of range for a world of {world} ranks")]
    RankOutOfRange {
        /// Rank asked for.
        rank: u32,
        /// World size.
        world: u32,
    },
    /// A rank plan that disagrees with the metadata of the checkpoint it is executed against
    /// ([`RankPlan::check_against`](crate::RankPlan::check_against)): executing it would read
    /// or place bytes that are not the ones it names.
    #[error(
        "rank {rank}: the plan disagrees with the checkpoint's own metadata: {detail}; nothing \
         was read (a plan server or plan file that does not match this checkpoint: plan it again)"
    )]
    DisagreesWithCheckpoint {
        /// The rank whose plan it is.
        rank: u32,
        /// The first disagreement: the piece, tensor, destination or file.
        detail: String,
    },
    /// A rank plan whose destinations are not the rank's own requests in order
    /// ([`RankPlan::check_destinations`](crate::RankPlan::check_destinations)): executing it
    /// would fill the caller's buffers with other tensors' or other parts' bytes.
    #[error(
        "rank {rank}: the plan's destinations are not this rank's requests: {detail}; nothing \
         was read (a plan server that planned other requests, or listed them in another order: \
         plan it again)"
    )]
    NotTheRequests {
        /// The rank whose plan it is.
        rank: u32,
        /// The first difference: the destination and the request at its place.
        detail: String,
    },
    /// A mesh (or explicit request list) with more ranks than a plan may have: checked before
    /// anything per rank is allocated, so that a typo cannot wrap the rank count or exhaust memory.
    #[error("{field} gives {ranks} ranks, more than the {limit} a plan may have")]
    WorldTooLarge {
        /// What gave the rank count, e.g. `layout mesh [pp=65536, dp=65536]` or `requests "ranks"`.
        field: String,
        /// The true rank count (wide enough never to wrap).
        ranks: u128,
        /// The limit ([`crate::MAX_WORLD`]).
        limit: u32,
    },
    /// A layout whose per-rank requests (one per rank and tensor) would not fit in memory.
    #[error(
        "{field}: {ranks} ranks x {tensors} tensors is {requests} per-rank requests, more than the {limit} a plan may hold (about {gib} GiB of memory)"
    )]
    TooManyRequests {
        /// What gave the rank count (as in [`PlanError::WorldTooLarge`]).
        field: String,
        /// Ranks.
        ranks: u32,
        /// Tensors of the checkpoint.
        tensors: u64,
        /// ranks × tensors.
        requests: u64,
        /// The limit ([`crate::MAX_REQUESTS`]).
        limit: u64,
        /// Estimated memory of the requests alone, in GiB.
        gib: u64,
    },
    /// A plan whose computation would take more memory than the caller allows one plan, by the
    /// estimate made before anything per rank is allocated ([`PlanEstimate::within`]).
    #[error(
        "planning this would take {estimate}, over the bound of {limit} bytes for one plan computation"
    )]
    TooLarge {
        /// The estimate, with its counts.
        estimate: Box<PlanEstimate>,
        /// The bound, in bytes.
        limit: u64,
    },
    /// Invalid preset arguments.
    #[error("preset {preset}: {detail}")]
    Preset {
        /// Preset name.
        preset: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A plan made for one checkpoint asked to serve another whose layout differs
    /// ([`crate::Plan::rebind`]): it must be planned anew.
    #[error("the plan is for another layout: {change}")]
    LayoutChanged {
        /// What changed, naming the tensor, saved box or data file.
        change: String,
    },
    /// Arrow encoding or decoding of a rank plan failed.
    #[error("rank plan Arrow IPC: {detail}")]
    Arrow {
        /// The message.
        detail: String,
    },
}

impl PlanError {
    /// Whether retrying cannot help: always. Planning is a pure function of the checkpoint's
    /// metadata, the layout and the requests (no IO, no clock), so the same inputs fail the same
    /// way every time; the inputs must change. Defined so that callers can classify every tessera
    /// error alike.
    pub fn is_permanent(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_plan_error_is_permanent() {
        let errors = [
            PlanError::MeshSizeZero {
                name: "dp".to_string(),
            },
            PlanError::RankOutOfRange { rank: 8, world: 4 },
            PlanError::WorldTooLarge {
                field: "layout mesh [dp=4294967296]".to_string(),
                ranks: 1 << 32,
                limit: crate::MAX_WORLD,
            },
            PlanError::Arrow {
                detail: "truncated stream".to_string(),
            },
            PlanError::TooLarge {
                estimate: Box::default(),
                limit: 1 << 30,
            },
        ];
        for error in errors {
            assert!(error.is_permanent(), "{error}");
        }
    }
}

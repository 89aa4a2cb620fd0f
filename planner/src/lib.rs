//! Pure load planning, the heart of tessera: layouts resolve to the box every rank needs, those
//! boxes are intersected with the saved chunks through a per-tensor index, overlaps become byte
//! runs of the source files, pieces needed by several ranks are read once (worst-fit by bytes) and
//! handed on in ring rounds. No IO and no async: the server and the loader both call this.
//!
//! # Glossary
//!
//! | term | type | meaning |
//! |---|---|---|
//! | layout | [`Layout`] | a device mesh (named dims, row-major rank order) and per-tensor placements; [`Layout::resolve`] turns it into requests |
//! | request | [`Request`], [`RequestSet`] | what one rank wants of one tensor: a box (`offsets`, `lengths`) or a flat range of its row-major flattening ([`Target`]) |
//! | saved chunk | `tessera_metadata::SavedChunk` | a box of a tensor as the checkpoint stores it, with the file and byte range of its elements |
//! | destination | [`Destination`], [`RankDestination`] | one buffer a rank fills: one request, as a contiguous row-major buffer |
//! | piece | [`Piece`], [`RankPiece`] | the overlap of one saved chunk with what one or more ranks need: the unit read from storage (once) and exchanged |
//! | byte run | [`StridedRuns`], [`RunIter`] | a contiguous stretch of bytes copied from the source (a saved chunk) to a destination, each side described by a [`Side`] (its shape and the box's offsets in it) |
//! | group | [`Group`] | ranks that need exactly the same pieces; pieces are read once per group, by readers balanced worst-fit by bytes |
//! | slab | [`read_order`] | a run of whole rows of a saved chunk read in file order by one rank, which relays the parts others need; chosen per chunk by a cost model ([`ReadOrder`]) |
//! | round | [`Round`], [`Exchange`] | one step of a group's ring all-to-all: in round k a rank sends its share to the rank k after it and receives from the rank k before it |
//! | plan | [`Plan`], [`RankPlan`] | every rank's destinations, reads, placements and rounds; [`Plan::rank_plan`] is one rank's view (JSON or Arrow IPC) |
//! | read amplification | [`PlanSummary`] | bytes read from storage ÷ bytes the ranks need (1.00 when nothing is read twice) |
//! | read source | [`ReadSources`] | a copy of a data file outside storage (a node's memory tier) and the ranks that can read it; pieces of it are read there and relayed |
//! | writer assignment | [`assign_writers`] | the save side: which rank writes each distinct box, replicas once, balanced worst-fit |

mod arrow;
pub mod baseline;
mod error;
mod estimate;
mod glob;
pub mod joint;
mod layout;
mod peer_digest;
mod plan;
pub mod presets;
mod rank_plan;
mod rank_plan_check;
pub mod read_order;
mod replay;
mod request;
mod runs;
mod save;
mod sources;
mod summary;

pub use error::PlanError;
pub use estimate::PlanEstimate;
pub use glob::glob_match;
pub use layout::{Layout, MAX_REQUESTS, MAX_WORLD, MeshDim, Placement, Rule, Stages, shard_box};
pub use plan::{
    Destination, Group, Piece, PieceDestination, Plan, PlanOptions, plan, plan_with_sources,
};
pub use rank_plan::{
    Exchange, JointCheck, PiecePlacement, RankDestination, RankPiece, RankPlan, RankSummary, Round,
    SourceRead,
};
pub use read_order::ReadOrder;
pub use replay::layout_change;
pub use request::{
    ExplicitRequest, ExplicitRequests, Request, RequestSet, Target, flat_range_to_boxes,
};
pub use runs::{RunIter, Side, StridedRuns};
pub use save::{WriteItem, assign_writers};
pub use sources::{ReadSources, SourceTier};
pub use summary::PlanSummary;

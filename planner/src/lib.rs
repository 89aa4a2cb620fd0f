//! Pure load planning, the heart of tessera: layouts resolve to the box every rank needs, those
//! boxes are intersected with the saved chunks through a per-tensor index, overlaps become byte
//! runs of the source files, pieces needed by several ranks are read once (worst-fit by bytes) and
//! handed on in ring rounds. No IO and no async: the server and the loader both call this.

mod arrow;
pub mod baseline;
mod error;
mod glob;
mod layout;
mod plan;
pub mod presets;
mod rank_plan;
mod request;
mod runs;
mod save;
mod summary;

pub use error::PlanError;
pub use glob::glob_match;
pub use layout::{Layout, MeshDim, Placement, Rule, Stages, shard_box};
pub use plan::{Destination, Group, Piece, PieceDestination, Plan, PlanOptions, plan};
pub use rank_plan::{
    Exchange, PiecePlacement, RankDestination, RankPiece, RankPlan, RankSummary, Round, SourceRead,
};
pub use request::{
    ExplicitRequest, ExplicitRequests, Request, RequestSet, Target, flat_range_to_boxes,
};
pub use runs::{RunIter, Side, StridedRuns};
pub use save::{WriteItem, assign_writers};
pub use summary::PlanSummary;

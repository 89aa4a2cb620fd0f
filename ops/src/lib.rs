//! The operations every tessera front end shares: the CLI (`tessera`), the Python package and,
//! for opening, the server. Front ends parse their own arguments and render their own output;
//! what a checkpoint *is* and what a multi-rank operation *does* is decided here once.
//!
//! - [`open`]: a location in any format ([`open::open_at_with`]), for loading
//!   ([`open::open_for_load`]), with the blob-index cache directory from the environment.
//! - [`describe`]: what `tessera inspect --json` prints and `tessera.inspect` returns.
//! - [`save`]: the multi-rank save-and-commit protocol of the native format: every rank writes
//!   the boxes the planner's worst-fit `assign_writers` gives it, rank 0 commits (manifest last)
//!   only after every rank reported success.
//! - [`load`]: one rank's load (the plan source, the rendezvous rule, the options every front
//!   end builds, host or CUDA destinations), the mirror of [`save`].
//! - [`memory_tier`]: the save side of a node's memory tier (a copy of each rank's data file
//!   left after the commit, pruned to a budget); the load side finds it through
//!   `tessera_loader::tier`.
//! - [`publish`]: live publications (`tessera.publish`): each rank's part of a step (its data
//!   file laid out in memory, served by the rank itself) and rank 0's commit of the step once
//!   every part is there; readers open a step as `live+file://` through `tessera_storage`.
//! - [`claim`]: the exclusive claim a writer takes on its output before writing data.
//! - [`job`]: a load job's rounds before the exchange (requests, memory tier, plan, plan
//!   agreement, read, joint checks) as one state machine every front end pumps over its channel;
//!   rank 0 plans once and each rank fetches only its own part.
//! - [`coord`]: the small messages ranks exchange before they load or save (an all-gather over
//!   the job's transport).

pub mod claim;
pub mod coord;
pub mod describe;
mod error;
pub mod job;
pub mod load;
pub mod memory_tier;
pub mod open;
pub mod publish;
pub mod save;

pub use error::{OpsError, ResultExt};

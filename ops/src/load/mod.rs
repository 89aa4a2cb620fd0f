//! One rank's load, the mirror of [`crate::save`]: what the CLI (host and GPU) and the Python
//! package (single process, tessera's own rendezvous, the job's torch process group) share.
//!
//! - [`JobPlan`] ([`plan_source`]): the job's plan, made here or by a tessera server (a server's
//!   plan checked against the opened checkpoint's identity once, before any rank reads).
//! - [`replay`]: plan once, replay: a live step's plan kept per process and bound to the next
//!   step of the same layout instead of planned again.
//! - [`rendezvous`]: the one rule for rank 0's address and port (flags, `TESSERA_PORT`,
//!   torchrun's `MASTER_ADDR` and `MASTER_PORT + 1`).
//! - [`agreement`]: what the ranks of a job must agree on at the rendezvous (the checkpoint as
//!   opened, however each rank named it).
//! - [`LoadSwitches`] ([`switches`]): the `TESSERA_*` side-by-side switches, read by the front
//!   ends and applied to [`LoadOptions`] and [`PlanOptions`]; the library crates read no
//!   environment.
//! - [`load_options`] and [`plan_options`]: the loader's and the planner's options of every load, the read order included: the
//!   planner's cost model decides it ([`ReadOrder::Auto`]) unless the user names one.
//! - [`load_rank`]: one rank's load into host buffers or, with the `cuda` feature, CUDA memory
//!   ([`Destination`]): the same pipeline (reads overlapped with the ring exchange, direct
//!   copies between ranks of one host, joint checks) either way; only the upload through pinned
//!   staging and the NCCL data plane are CUDA's own.

pub mod agreement;
pub mod plan_source;
pub mod rendezvous;
pub mod replay;
pub mod switches;

pub use plan_source::{JobPlan, PlanServer};
pub use switches::LoadSwitches;

use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, RankReport, load_rank_into};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::Transport;
use tessera_planner::{PlanOptions, RankPlan, ReadOrder};

use crate::OpsError;

/// The planner options of a load: `dedup`, the read order the user named (`None`: the cost
/// model's choice per saved chunk, [`ReadOrder::Auto`], for every front end), and the switches.
/// A device ring (NCCL) has no buffers for pieces relayed in storage order, so it plans in
/// request order.
pub fn plan_options(
    dedup: bool,
    read_order: Option<ReadOrder>,
    device_ring: bool,
    switches: &LoadSwitches,
) -> PlanOptions {
    let mut options = PlanOptions {
        dedup,
        read_order: if device_ring {
            ReadOrder::Request
        } else {
            read_order.unwrap_or(ReadOrder::Auto)
        },
        ..PlanOptions::default()
    };
    switches.apply_to_plan(&mut options);
    options
}

/// The load options of every front end: its read options (`read`: verification, retries, the
/// coalescing gap) with the switches applied.
pub fn load_options(read: ReadOptions, switches: &LoadSwitches) -> LoadOptions {
    let mut options = LoadOptions {
        read,
        ..LoadOptions::default()
    };
    switches.apply_to_load(&mut options);
    options
}

/// Where a rank's loaded bytes go.
pub enum Destination<'a, B> {
    /// Host buffers the caller owns, one per plan destination and exactly as long.
    Host(&'a mut [B]),
    /// CUDA memory ([`cuda`]).
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaDestination<'a>),
}

/// Loads rank `plan.rank` into `destination` over `transport`: reads (verified), the ring
/// exchange overlapped with them, direct copies between ranks of one host, and the joint checks
/// of boxes read in parts; for CUDA memory then the upload. Never reports partly loaded buffers
/// as success.
pub async fn load_rank<T, B>(
    checkpoint: &Checkpoint,
    plan: &RankPlan,
    transport: &T,
    destination: Destination<'_, B>,
    options: &LoadOptions,
) -> Result<RankReport, OpsError>
where
    T: Transport,
    B: AsMut<[u8]> + AsRef<[u8]> + Send,
{
    match destination {
        Destination::Host(buffers) => {
            Ok(load_rank_into(checkpoint, plan, transport, options, buffers).await?)
        }
        #[cfg(feature = "cuda")]
        Destination::Cuda(cuda) => {
            let exchange = tessera_loader::device::load::OnHost(transport);
            cuda.load(checkpoint, plan, &exchange, options).await
        }
    }
}

#[cfg(feature = "cuda")]
pub mod cuda;

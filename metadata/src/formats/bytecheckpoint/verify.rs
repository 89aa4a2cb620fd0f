//! Integrity of a ByteCheckpoint save's data, as far as the format records any: the raw storage
//! bytes of tensor chunks carry no checksum (their byte ranges, lengths and descriptors are
//! checked when opening), while bytes entries (optimizer `param_groups`, …) and per-rank
//! `extra_state`/`loader_ckpt` files are torch.save zips whose every member's CRC-32 is checked
//! here, through the DCP reader's object check.

use object_store::ObjectStore;
use object_store::path::Path;

use super::BcDetails;
use crate::formats::dcp::{BadBlob, DcpDetails, verify_dcp};
use crate::{CheckpointMeta, MetadataError};

/// What [`verify_bytecheckpoint`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BcVerifyReport {
    /// Tensor chunks whose byte ranges were checked when opening (no checksum recorded).
    pub chunks_unchecked: u64,
    /// torch.save zips (bytes entries and per-rank files) whose members' CRC-32 were checked.
    pub objects_checked: u64,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// Every object whose zip is damaged.
    pub bad: Vec<BadBlob>,
}

impl BcVerifyReport {
    /// True when nothing was wrong.
    pub fn is_ok(&self) -> bool {
        self.bad.is_empty()
    }
}

/// Checks every torch.save zip of the save opened from `root` (`meta` as
/// [`super::open_bytecheckpoint`] gave it), `concurrency` reads at a time. Mismatches are in the
/// report; storage failures are errors.
pub async fn verify_bytecheckpoint(
    store: &dyn ObjectStore,
    root: &Path,
    meta: &CheckpointMeta,
    _details: &BcDetails,
    concurrency: usize,
) -> Result<BcVerifyReport, MetadataError> {
    // No tensor blobs: the DCP check then reads exactly the objects.
    let objects_only = DcpDetails {
        metadata: Default::default(),
        blobs: Vec::new(),
        stats: Default::default(),
        metadata_files: Vec::new(),
        megatron: None,
    };
    let report = verify_dcp(store, root, meta, &objects_only, concurrency).await?;
    Ok(BcVerifyReport {
        chunks_unchecked: meta.chunks().len() as u64,
        objects_checked: report.objects_checked,
        bytes_checked: report.bytes_checked,
        bad: report.bad,
    })
}

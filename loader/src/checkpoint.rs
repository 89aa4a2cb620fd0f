//! A checkpoint opened for loading, in any format tessera reads, and what a load asks of it:
//! the plan checked against its identity, its pieces read (verified) into a rank's buffers, the
//! joint checks of boxes read in parts, and the embedded plan source (planning from its
//! metadata, no service needed).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tessera_metadata::formats::dcp::IndexStats;
use tessera_metadata::formats::native::{BlockChecksums, Manifest};
use tessera_metadata::{CheckpointMeta, Format, OpenOptions, open_any};
use tessera_planner::{
    Plan, PlanOptions, RankPlan, ReadSources, RequestSet, plan, plan_with_sources,
};
use tessera_storage::Location;

use crate::LoaderError;
use crate::load::LoadOptions;
use crate::read::decoded::{DECODED_CACHE_BYTES, DecodedStore};
use crate::read::{
    ReadOptions, ReadStats, default_coalesce_gap, exact_multi_range, read_into_with,
};
use crate::tier::{TierCopies, TierStore};
use crate::transport::Transport;

/// A checkpoint opened for loading, in any format tessera reads: its store, metadata and (native
/// checkpoints with data) block checksums. DCP and safetensors checkpoints record no checksums a
/// partial read could be checked against, so they load unverified (`checksums` is `None`).
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Where it lives; `location.prefix` is the root its data file paths are relative to (for a
    /// single safetensors file, the folder holding it).
    pub location: Location,
    /// Its format.
    pub format: Format,
    /// Its manifest (native checkpoints only).
    pub manifest: Option<Manifest>,
    /// Training step, when known.
    pub step: Option<u64>,
    /// Whether its data files are there (a native metadata-only checkpoint has none).
    pub has_data: bool,
    /// Its global metadata.
    pub meta: Arc<CheckpointMeta>,
    /// Block checksums of its data files (native checkpoints with data only).
    pub checksums: Option<Arc<BlockChecksums>>,
    /// DCP: how the per-blob zip index was obtained and what its header reads cost.
    pub index: Option<IndexStats>,
    /// DCP: what `.metadata` records beyond the checkpoint model, for front ends that hand it
    /// back to DCP (the Python `StorageReader`).
    pub dcp_record: Option<Arc<DcpRecord>>,
    /// What the open found that is not an error (files of an earlier save left in the
    /// directory, ignored): front ends show them as warnings.
    pub warnings: Vec<String>,
    /// Store paths of data files this node reads from memory-tier copies
    /// ([`Checkpoint::with_tier_copies`]), with the copies' local paths; empty otherwise.
    pub tier_files: Arc<HashMap<String, PathBuf>>,
    /// With tier copies: the checkpoint's own store, which a read that fails on a copy falls
    /// back to ([`Checkpoint::read_into_with`]). `None` otherwise.
    pub durable_store: Option<Arc<dyn object_store::ObjectStore>>,
}

/// `error` with `how` (where the bytes were read from) added to the file it names, for the
/// variants that name a data file by its store path.
fn naming_copy(error: LoaderError, how: &str) -> LoaderError {
    let named = |path: String| format!("{path} ({how})");
    match error {
        LoaderError::MissingFile { path } => LoaderError::MissingFile { path: named(path) },
        LoaderError::ShortRead {
            path,
            start,
            end,
            got,
        } => LoaderError::ShortRead {
            path: named(path),
            start,
            end,
            got,
        },
        LoaderError::Checksum {
            path,
            start,
            end,
            expected,
            actual,
        } => LoaderError::Checksum {
            path: named(path),
            start,
            end,
            expected,
            actual,
        },
        LoaderError::Metadata(tessera_metadata::MetadataError::BoxChecksumMismatch {
            path,
            entry,
            start,
            end,
            algorithm,
            expected,
            actual,
        }) => LoaderError::Metadata(tessera_metadata::MetadataError::BoxChecksumMismatch {
            path: named(path),
            entry,
            start,
            end,
            algorithm,
            expected,
            actual,
        }),
        LoaderError::JointChecksum(mut mismatch) => {
            mismatch.path = named(std::mem::take(&mut mismatch.path));
            LoaderError::JointChecksum(mismatch)
        }
        // The others name the copy themselves (opening it, the tier's store) or no file.
        other => other,
    }
}

/// What a DCP `.metadata` records beyond tensors and objects.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DcpRecord {
    /// `version` (torch 2.9 and later write "1.0.0").
    pub version: Option<String>,
    /// `planner_data`: each flattened key's path in the state dict that was saved (string and
    /// integer parts), where the planner recorded one.
    pub planner_data: std::collections::BTreeMap<String, Vec<serde_json::Value>>,
}

impl Checkpoint {
    /// Opens a checkpoint in any format ([`open_any`]) with default options: native (manifest,
    /// verified metadata, block checksums), DCP, or safetensors.
    pub async fn open(location: Location) -> Result<Checkpoint, LoaderError> {
        Checkpoint::open_with(location, &OpenOptions::default()).await
    }

    /// [`Checkpoint::open`] with options (e.g. a cache directory for DCP blob indexes).
    pub async fn open_with(
        mut location: Location,
        options: &OpenOptions,
    ) -> Result<Checkpoint, LoaderError> {
        let opened = open_any(location.store.as_ref(), &location.prefix, options).await?;
        location.prefix = opened.root.clone();
        // Blobs saved compressed are files of the model that hold their decoded bytes: every
        // read goes through the decoding view, none by position from the local files.
        let prefix = location.prefix.clone();
        if let Some(decoded) = DecodedStore::for_files(
            Arc::clone(&location.store),
            opened.meta.files(),
            |name| crate::read::resolve(&prefix, name),
            DECODED_CACHE_BYTES,
        )? {
            location.store = Arc::new(decoded);
            location.local_root = None;
        }
        Ok(Checkpoint {
            location,
            format: opened.format,
            manifest: opened.manifest().cloned(),
            step: opened.step,
            has_data: opened.has_data,
            index: opened.dcp().map(|d| d.stats.clone()),
            dcp_record: opened.dcp().map(|d| {
                Arc::new(DcpRecord {
                    version: d.metadata.version.clone(),
                    planner_data: d.metadata.planner_data.clone(),
                })
            }),
            warnings: opened.warnings(),
            tier_files: Arc::default(),
            durable_store: None,
            meta: Arc::new(opened.meta),
            checksums: opened.block_checksums.map(Arc::new),
        })
    }

    /// This checkpoint as a rank on a node holding `copies` (verified memory-tier copies of some
    /// of its data files, [`crate::tier::find_copies`]) reads it: each held file from its copy,
    /// by position and through the store alike ([`TierStore`]), everything else from storage.
    /// The plan must have been made with these copies among its sources, so that this rank
    /// reads only the files it holds or that no tier holds.
    pub fn with_tier_copies(&self, copies: &TierCopies) -> Result<Checkpoint, LoaderError> {
        if copies.files.is_empty() {
            return Ok(self.clone());
        }
        let mut files = HashMap::with_capacity(copies.files.len());
        for (&file, local) in &copies.files {
            files.insert(self.file_path(file)?.to_string(), local.clone());
        }
        let durable = self
            .durable_store
            .clone()
            .unwrap_or_else(|| Arc::clone(&self.location.store));
        let mut view = self.clone();
        view.location.store = Arc::new(TierStore::new(Arc::clone(&durable), &files)?);
        view.tier_files = Arc::new(files);
        view.durable_store = Some(durable);
        Ok(view)
    }

    /// Refuses a plan made for another checkpoint: one whose recorded identity differs from this
    /// checkpoint's ([`LoaderError::PlanForOtherCheckpoint`], naming the checkpoint and both
    /// identities). A plan without an identity against a checkpoint that has one (a server or
    /// plan file older than identities) is refused too ([`LoaderError::PlanWithoutIdentity`]):
    /// nothing would tie its offsets to these files. Only metadata assembled in memory, which
    /// has no identity, loads plans unchecked.
    ///
    /// A plan of this version is then checked piece by piece against the metadata opened here
    /// ([`RankPlan::check_against`]): a plan that reads another file or offset of the same
    /// checkpoint, or places a piece elsewhere, is refused before anything is read.
    pub fn check_plan(&self, plan: &RankPlan) -> Result<(), LoaderError> {
        self.check_plan_identity(plan)?;
        Ok(plan.check_against(&self.meta)?)
    }

    /// The identity half of [`Checkpoint::check_plan`].
    fn check_plan_identity(&self, plan: &RankPlan) -> Result<(), LoaderError> {
        match (plan.checkpoint_identity.as_deref(), self.meta.identity()) {
            (None, Some(opened)) => Err(LoaderError::PlanWithoutIdentity {
                rank: plan.rank,
                checkpoint: self.location.display.clone(),
                checkpoint_identity: opened.to_string(),
            }),
            (Some(planned), Some(opened)) if planned != opened => {
                Err(LoaderError::PlanForOtherCheckpoint {
                    rank: plan.rank,
                    checkpoint: self.location.display.clone(),
                    plan_identity: planned.to_string(),
                    checkpoint_identity: opened.to_string(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Reads the pieces `plan` has this rank read, verified when the checkpoint has block
    /// checksums (and whole saved boxes against their own crc32c), straight into `buffers` (one per
    /// plan destination), reporting progress as `options` says. A plan made for another checkpoint
    /// is refused first ([`Checkpoint::check_plan`]): every load path reads through here.
    pub async fn read_into<B: AsMut<[u8]>>(
        &self,
        plan: &RankPlan,
        options: &LoadOptions,
        buffers: &mut [B],
    ) -> Result<ReadStats, LoaderError> {
        self.read_into_with(plan, options, buffers, |_, _| Ok(()))
            .await
    }

    /// [`Checkpoint::read_into`], calling `on_complete(piece, buffers)` as each piece this rank
    /// reads is wholly placed and verified (the overlapped exchange's hook).
    pub async fn read_into_with<B: AsMut<[u8]>>(
        &self,
        plan: &RankPlan,
        options: &LoadOptions,
        buffers: &mut [B],
        on_complete: impl FnMut(usize, &mut [B]) -> Result<(), LoaderError>,
    ) -> Result<ReadStats, LoaderError> {
        self.check_plan(plan)?;
        self.read_checked_plan(plan, options, buffers, on_complete)
            .await
    }

    /// [`Checkpoint::read_into_with`] for a plan the caller has already passed through
    /// [`Checkpoint::check_plan`] (the exchange checks it before contacting any peer): the check
    /// is a pass over the whole plan, not repeated.
    pub(crate) async fn read_checked_plan<B: AsMut<[u8]>>(
        &self,
        plan: &RankPlan,
        options: &LoadOptions,
        buffers: &mut [B],
        on_complete: impl FnMut(usize, &mut [B]) -> Result<(), LoaderError>,
    ) -> Result<ReadStats, LoaderError> {
        let read = self.read_options(options);
        let progress = options
            .progress
            .as_deref()
            .map(|p| p as &(dyn Fn(u64) + Sync));
        match &self.durable_store {
            Some(durable) if !self.tier_files.is_empty() => {
                self.read_with_tier_fallback(
                    plan,
                    read,
                    Arc::clone(durable),
                    buffers,
                    progress,
                    on_complete,
                )
                .await
            }
            _ => {
                read_into_with(
                    Arc::clone(&self.location.store),
                    &self.location.prefix,
                    plan,
                    self.checksums.as_deref(),
                    Some(&self.meta),
                    &read,
                    buffers,
                    progress,
                    on_complete,
                )
                .await
            }
        }
    }

    /// The read of a rank whose node holds tier copies: a copy verified when the load began may
    /// still change before or while it is read (flipped, truncated, replaced by something that
    /// is not a file). A read that fails on a copy (its error names the copy's store path or
    /// the copy) is not the durable file's fault: the copy is dropped, named in
    /// [`ReadStats::local_copy_fallbacks`], and the pieces not yet handed on are read again,
    /// that file's from `durable`. Pieces already complete were verified (or, unverified
    /// loads, read as they were) and stay. A piece of a joint check already folded cannot be
    /// read again without breaking its fold: then the error stands.
    async fn read_with_tier_fallback<B: AsMut<[u8]>>(
        &self,
        plan: &RankPlan,
        mut read: ReadOptions,
        durable: Arc<dyn object_store::ObjectStore>,
        buffers: &mut [B],
        progress: Option<&(dyn Fn(u64) + Sync)>,
        mut on_complete: impl FnMut(usize, &mut [B]) -> Result<(), LoaderError>,
    ) -> Result<ReadStats, LoaderError> {
        let total: u64 = plan
            .pieces
            .iter()
            .filter(|p| p.read.is_some())
            .map(|p| p.bytes)
            .sum();
        // Progress adds up to the plan's bytes once, however many times a piece is read.
        let reported = std::sync::atomic::AtomicU64::new(0);
        let report = |n: u64| {
            let before = reported
                .fetch_update(
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                    |r| Some(r.saturating_add(n).min(total)),
                )
                .unwrap_or(total);
            let given = before.saturating_add(n).min(total) - before;
            if let (Some(progress), true) = (progress, given > 0) {
                progress(given);
            }
        };
        let mut tier_files: HashMap<String, PathBuf> = (*self.tier_files).clone();
        let mut store = Arc::clone(&self.location.store);
        let mut completed = vec![false; plan.pieces.len()];
        let mut counted = vec![false; plan.pieces.len()];
        let mut fallbacks: Vec<String> = Vec::new();
        let (mut done_pieces, mut done_local) = (0usize, 0u64);
        let mut current = std::borrow::Cow::Borrowed(plan);
        let joint_pieces: std::collections::HashSet<u32> = if read.joint_checks && read.verify {
            plan.joint_checks
                .iter()
                .flat_map(|c| c.pieces.iter().copied())
                .collect()
        } else {
            Default::default()
        };
        loop {
            let outcome = read_into_with(
                Arc::clone(&store),
                &self.location.prefix,
                &current,
                self.checksums.as_deref(),
                Some(&self.meta),
                &read,
                buffers,
                Some(&report),
                |piece, buffers| {
                    completed[piece] = true;
                    on_complete(piece, buffers)
                },
            )
            .await;
            let error = match outcome {
                Ok(mut stats) => {
                    stats.pieces += done_pieces;
                    stats.bytes_needed = total;
                    stats.bytes_from_local_copies += done_local;
                    stats.local_copy_fallbacks = fallbacks;
                    report(total);
                    return Ok(stats);
                }
                Err(e) => e,
            };
            let text = error.to_string();
            let Some(path) = tier_files
                .iter()
                .find(|(path, copy)| {
                    text.contains(path.as_str()) || text.contains(&*copy.to_string_lossy())
                })
                .map(|(path, _)| path.clone())
            else {
                return Err(error);
            };
            // What earlier reads completed stays: counted as read where it was read.
            for (i, piece) in plan.pieces.iter().enumerate() {
                let Some(r) = &piece.read else { continue };
                if !completed[i] || counted[i] {
                    continue;
                }
                counted[i] = true;
                done_pieces += 1;
                let key = plan.files.get(r.file as usize);
                if key.is_some_and(|k| {
                    crate::read::resolve(&self.location.prefix, k)
                        .is_ok_and(|p| tier_files.contains_key(p.as_ref()))
                }) {
                    done_local += piece.bytes;
                }
                if joint_pieces.contains(&piece.id) {
                    let copy = tier_files.get(&path).cloned().unwrap_or_default();
                    return Err(naming_copy(
                        error,
                        &format!(
                            "read from the memory-tier copy {}, which failed after it was \
                             verified; parts of this rank's reads were already checked jointly \
                             with other ranks, so they cannot be read from storage instead",
                            copy.display()
                        ),
                    ));
                }
            }
            let copy = tier_files.remove(&path).unwrap_or_default();
            fallbacks.push(format!(
                "memory-tier copy {} of {path} failed after it was verified ({error}); its \
                 pieces not yet read were read from storage instead",
                copy.display()
            ));
            store = if tier_files.is_empty() {
                Arc::clone(&durable)
            } else {
                Arc::new(TierStore::new(Arc::clone(&durable), &tier_files)?)
            };
            read.local_files = Arc::new(tier_files.clone());
            let mut again = plan.clone();
            for (piece, done) in again.pieces.iter_mut().zip(&completed) {
                if *done {
                    piece.read = None;
                }
            }
            current = std::borrow::Cow::Owned(again);
        }
    }

    /// Whether a read of this checkpoint with `verify` checks its bytes: when the checkpoint has
    /// block checksums (native) or checksums of its saved boxes (a DCP blob's zip CRC-32; parts
    /// of boxes are checked jointly, see `verify::joint`). Safetensors records none. Such a read
    /// also folds its parts of jointly checked boxes.
    pub fn verifies(&self, verify: bool) -> bool {
        verify
            && (self.checksums.is_some()
                || self.meta.chunks().iter().any(|c| c.checksum().is_some()))
    }

    /// The step after the reads of a load whose reads fold joint checks
    /// ([`ReadOptions::joint_checks`]): exchanges the folds with the other members and checks
    /// every jointly read box this rank holds bytes of ([`crate::verify::joint`]). A load reports success
    /// only after it.
    pub async fn verify_joint_checks<T: Transport>(
        &self,
        transport: &T,
        plan: &RankPlan,
        options: &LoadOptions,
        stats: &ReadStats,
    ) -> Result<(), LoaderError> {
        let verifying = self.verifies(options.read.verify);
        crate::verify::joint::verify_joint_checks(
            transport,
            plan,
            Some(&self.meta),
            verifying.then_some(stats.joint_folds.as_slice()),
            verifying,
        )
        .await
        .map_err(|e| self.name_tier_copy(e))
    }

    /// A joint check that failed on a box of a file this node read from a memory-tier copy
    /// names the copy: the parts were folded as they were read, so the mismatch is found only
    /// after the exchange, too late to read them from storage instead, and the copy (which may
    /// have changed after it was verified) is the likelier culprit than the durable file.
    fn name_tier_copy(&self, error: LoaderError) -> LoaderError {
        let LoaderError::JointChecksum(mut mismatch) = error else {
            return error;
        };
        let copy = crate::read::resolve(&self.location.prefix, &mismatch.path)
            .ok()
            .and_then(|p| self.tier_files.get(p.as_ref()));
        if let Some(copy) = copy {
            mismatch.path = format!(
                "{} (this node's ranks read it from the memory-tier copy {}, which may have \
                 changed after it was verified)",
                mismatch.path,
                copy.display()
            );
        }
        LoaderError::JointChecksum(mismatch)
    }

    /// The store path of data file `file` (an index into `meta.files()`), checked like a plan's
    /// paths: relative, inside the checkpoint.
    pub fn file_path(&self, file: u32) -> Result<object_store::path::Path, LoaderError> {
        let Some(data) = self.meta.files().get(file as usize) else {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "file #{file} is not one of the {} files of checkpoint {}",
                    self.meta.files().len(),
                    self.location.display
                ),
            });
        };
        crate::read::resolve(&self.location.prefix, &data.path)
    }

    /// The read options with the store kind's defaults filled in: the gap worth spanning and
    /// whether ranged reads of one file may share a call depend on the kind of store.
    fn read_options(&self, options: &LoadOptions) -> ReadOptions {
        let mut read = options.read.clone();
        read.coalesce_gap = Some(
            read.coalesce_gap
                .unwrap_or_else(|| default_coalesce_gap(&self.location.display)),
        );
        read.exact_multi_range = Some(
            read.exact_multi_range
                .unwrap_or_else(|| exact_multi_range(&self.location.display)),
        );
        if read.local_root.is_none() && read.positioned_reads {
            read.local_root.clone_from(&self.location.local_root);
        }
        // Tier copies are local files whatever the checkpoint's store: always read by position
        // (what `positioned_reads` switches is how the checkpoint's own files are read).
        if read.local_files.is_empty() {
            read.local_files = Arc::clone(&self.tier_files);
        }
        // A live publication's files shared on this host: by position too, whatever
        // `positioned_reads` says of the store's own files.
        if read.shared_files.is_empty() && !self.location.shared_files.is_empty() {
            read.shared_files = Arc::new(self.location.shared_files.clone());
        }
        read
    }

    /// Plans `requests` against this checkpoint (the embedded plan source). Storage-order slabs
    /// are cut at this checkpoint's own checksum blocks when it has them, and the read order's
    /// cost model prices a request as its store does (local files or an object store).
    pub fn plan(&self, requests: &RequestSet, options: &PlanOptions) -> Result<Plan, LoaderError> {
        Ok(plan(&self.meta, requests, &self.plan_options(options))?)
    }

    /// [`Checkpoint::plan`] with copies of data files outside storage (the memory tiers the
    /// job's ranks found, [`crate::tier`]): each held file is read where it is held.
    pub fn plan_with_sources(
        &self,
        requests: &RequestSet,
        options: &PlanOptions,
        sources: &ReadSources,
    ) -> Result<Plan, LoaderError> {
        Ok(plan_with_sources(
            &self.meta,
            requests,
            &self.plan_options(options),
            sources,
        )?)
    }

    /// `options` as [`Checkpoint::plan`] plans with them here: with this checkpoint's checksum
    /// blocks and its store's kind. What ranks of one job compare, since a rank reading the same
    /// checkpoint from another kind of store may price the read order differently.
    pub fn plan_options(&self, options: &PlanOptions) -> PlanOptions {
        let mut options = options.clone();
        options.local_reads = self.location.kind() == tessera_storage::LocationKind::Local;
        options.block_checksums = self.checksums.is_some();
        if let Some(blocks) = &self.checksums {
            options.slab_alignment = blocks.block_size();
        }
        options
    }
}

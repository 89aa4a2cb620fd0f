//! Replaying a plan on another checkpoint of the same layout (a live publication's next step):
//! a plan depends on the tensors, the saved boxes and where their bytes lie in which files, and
//! on the requests and options; not on the bytes themselves, their checksums or the identity.
//! [`Plan::rebind`] gives the plan made for one checkpoint as the plan of another whose layout
//! is the same ([`layout_change`] says none changed), tied to the new one's identity, so that
//! the loader's identity and piece-by-piece checks ([`crate::RankPlan::check_against`]) run
//! against the new metadata and every read verifies against the new checksums.

use std::sync::{Arc, OnceLock};

use tessera_metadata::{ByteMeta, CheckpointMeta, SavedChunk, TensorBox};

use crate::{Plan, PlanError};

/// What differs between the layouts of `planned` (the metadata a plan was made for) and `meta`,
/// in words naming the first tensor, saved box or data file that differs; `None` when a plan
/// of one is a plan of the other. Checksum values and identities are not layout: a box whose
/// checksum is recorded in one and not the other is (the plan's joint checks depend on it).
pub fn layout_change(planned: &CheckpointMeta, meta: &CheckpointMeta) -> Option<String> {
    let (old, new) = (planned.tensors(), meta.tensors());
    if old.len() != new.len() {
        return Some(format!(
            "{} tensors where there were {}",
            new.len(),
            old.len()
        ));
    }
    for (a, b) in old.iter().zip(new) {
        if a != b {
            return Some(format!(
                "tensor {} {} {:?} is now {} {} {:?}",
                a.fqn, a.dtype, a.shape, b.fqn, b.dtype, b.shape
            ));
        }
    }
    let (old, new) = (planned.files(), meta.files());
    if old.len() != new.len() {
        return Some(format!(
            "{} data files where there were {}",
            new.len(),
            old.len()
        ));
    }
    for (a, b) in old.iter().zip(new) {
        if a != b {
            return Some(format!(
                "data file {} ({:?} bytes) is now {} ({:?} bytes)",
                a.path, a.size, b.path, b.size
            ));
        }
    }
    let (old, new) = (planned.chunks(), meta.chunks());
    if old.len() != new.len() {
        return Some(format!(
            "{} saved boxes where there were {}",
            new.len(),
            old.len()
        ));
    }
    for (a, b) in old.iter().zip(new) {
        if box_layout(a) != box_layout(b) {
            let fqn = &planned.tensors()[a.tensor as usize].fqn;
            return Some(format!(
                "tensor {fqn}'s saved box {} at bytes {}..{} of file #{} is now box {} at bytes {}..{} of file #{}",
                a.region,
                a.bytes.offset,
                a.bytes.offset.saturating_add(a.bytes.length),
                a.bytes.file,
                b.region,
                b.bytes.offset,
                b.bytes.offset.saturating_add(b.bytes.length),
                b.bytes.file
            ));
        }
    }
    None
}

/// What of a saved box a plan depends on: its tensor, region and bytes, and whether a checksum
/// is recorded (not its value).
fn box_layout(c: &SavedChunk) -> (u32, &TensorBox, &ByteMeta, bool, bool) {
    (
        c.tensor,
        &c.region,
        &c.bytes,
        c.crc32c.is_some(),
        c.crc32.is_some(),
    )
}

impl Plan {
    /// This plan as the plan of `meta`, a checkpoint of the same layout ([`layout_change`]):
    /// the same reads, placements and rounds, its rank plans carrying `meta`'s identity (so a
    /// loader executes them against `meta` only, checking each piece against it first) and its
    /// summary saying it was replayed. Fails naming what changed otherwise; the caller plans
    /// anew.
    pub fn rebind(&self, meta: Arc<CheckpointMeta>) -> Result<Plan, PlanError> {
        if let Some(change) = layout_change(&self.meta, &meta) {
            return Err(PlanError::LayoutChanged { change });
        }
        let mut plan = self.clone();
        plan.meta = meta;
        plan.summary.replayed = true;
        Ok(plan)
    }

    /// This plan keeping the rank plans it cuts, for itself, its clones and its replays
    /// ([`Plan::rebind`]): a replayed load then skips cutting too, which costs about what
    /// planning does. Each kept rank plan is handed out with the identity of the checkpoint the
    /// plan is bound to at the time.
    pub fn keeping_rank_plans(mut self) -> Plan {
        if self.cut.is_none() {
            let world = self.world_size() as usize;
            self.cut = Some(Arc::new((0..world).map(|_| OnceLock::new()).collect()));
        }
        self
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{PlanOptions, RequestSet, plan};
    use tessera_metadata::{DType, DataFile, TensorMeta};

    /// A `rows`x4 f32 tensor saved as two row halves in two files, with checksums `crc`.
    fn meta(rows: u64, crc: u32) -> Arc<CheckpointMeta> {
        let half = rows / 2;
        let chunk = |r: u64| SavedChunk {
            tensor: 0,
            region: TensorBox::new(vec![r * half, 0], vec![half, 4]),
            bytes: ByteMeta {
                file: r as u32,
                offset: 0,
                length: half * 16,
                strides: None,
            },
            crc32c: Some(crc + r as u32),
            crc32: None,
        };
        let files = (0..2)
            .map(|r| DataFile {
                path: format!("data/publisher-rank-{r}.bin"),
                size: Some(half * 16),
                encoded: None,
            })
            .collect();
        Arc::new(
            CheckpointMeta::new(
                vec![TensorMeta::new("w", DType::F32, vec![rows, 4])],
                vec![chunk(0), chunk(1)],
                Vec::new(),
                files,
            )
            .unwrap()
            .with_identity(format!("native:step-{crc}")),
        )
    }

    fn requests(meta: &CheckpointMeta) -> RequestSet {
        crate::ExplicitRequests::from_json(
            r#"{"ranks": [[{"fqn": "w", "offsets": [0, 2], "lengths": [8, 2]}]]}"#,
        )
        .unwrap()
        .resolve(meta.tensors())
        .unwrap()
    }

    #[test]
    fn a_plan_rebinds_to_a_step_with_other_checksums_and_not_to_another_shape() {
        let first = meta(8, 1);
        let made = plan(&first, &requests(&first), &PlanOptions::default())
            .unwrap()
            .keeping_rank_plans();
        assert!(!made.summary().replayed);
        let cut = made.rank_plan(0).unwrap();
        assert_eq!(cut.checkpoint_identity.as_deref(), Some("native:step-1"));

        let second = meta(8, 100);
        assert_eq!(layout_change(&first, &second), None);
        let replayed = made.rebind(Arc::clone(&second)).unwrap();
        assert!(replayed.summary().replayed);
        assert!(Arc::ptr_eq(replayed.checkpoint(), &second));
        // Its rank plans are the fresh plan's, checked against the new metadata.
        let fresh = plan(&second, &requests(&second), &PlanOptions::default()).unwrap();
        // The kept rank plan, handed out with the new step's identity.
        let (a, b) = (replayed.rank_plan(0).unwrap(), fresh.rank_plan(0).unwrap());
        assert_eq!(a.checkpoint_identity.as_deref(), Some("native:step-100"));
        assert_eq!(a.to_json(), b.to_json());
        a.check_against(&second).unwrap();
        // The plan it was replayed from still hands out its own step's.
        assert_eq!(made.rank_plan(0).unwrap(), cut);

        let reshaped = meta(6, 1);
        let err = made.rebind(reshaped).unwrap_err().to_string();
        assert!(
            err.contains("tensor w f32 [8, 4] is now w f32 [6, 4]"),
            "{err}"
        );
    }
}

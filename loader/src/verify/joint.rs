//! Joint checks (`tessera_planner::joint`): a saved box read in parts by several ranks is
//! verified by its own crc32c from the parts, not by whole checksum blocks around every part.
//!
//! While reading, each reader folds the bytes it reads of the box into one 32-bit value
//! ([`crate::verify::crc_fold`]; `JointRead`). After its reads, every rank sends each peer one message
//! (tag [`JOINT_TAG`]) with its folds of the checks that peer is a member of, and receives one
//! from every reader of the checks it is a member of; then it checks every such box: the folds'
//! byte counts add up to the box, their XOR to its crc32c ([`verify_joint_checks`]). Every
//! member checks, receivers of relayed pieces included, so no rank reports success holding
//! bytes of a box that failed; a load reports success only after this step.
//!
//! Wire form of a message: one byte (1: the sender folded what it read; 0: it read without
//! verifying), then per check, in ascending id, `id: u32, bytes: u64, fold: u32`, little-endian.

use std::collections::{BTreeMap, HashMap};

use bytes::{BufMut, Bytes, BytesMut};
use tessera_metadata::{BoxChecksum, CheckpointMeta};
use tessera_planner::{JointCheck, RankPlan};

use crate::LoaderError;
use crate::error::JointMismatch;
use crate::read::scheduler::FileRange;
use crate::transport::Transport;
use crate::verify::crc_fold::{Crc, Fold, crc_of_folds};

/// Transport tag of the folds message. Exchange tags keep their top two bits clear; the
/// hand-shake uses [`crate::exchange::direct::HELLO_TAG`] and the tag after it.
pub const JOINT_TAG: u64 = crate::exchange::direct::HELLO_TAG | 2;

/// Bytes of one check in a folds message.
const ENTRY_BYTES: usize = 4 + 8 + 4;

/// One rank's fold of the bytes it read of a jointly checked box.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JointFold {
    /// Plan-wide check id.
    pub check: u32,
    /// Bytes of the box folded.
    pub bytes: u64,
    /// The fold ([`crate::verify::crc_fold::Fold::value`]).
    pub fold: u32,
}

/// The saved box of a joint check, as the checkpoint's metadata records it.
#[derive(Clone, Debug)]
pub(crate) struct JointBox {
    /// Its data file (as the plan names files).
    pub key: String,
    pub start: u64,
    pub end: u64,
    /// The checksum recorded over exactly its bytes.
    pub checksum: BoxChecksum,
    /// "tensor X box [..]", for errors.
    pub entry: String,
}

/// The box `check` names, from `meta`: an error naming the check when the metadata has no such
/// box or no crc32c for it (a plan made from other metadata).
pub(crate) fn saved_box(
    meta: &CheckpointMeta,
    plan: &RankPlan,
    check: &JointCheck,
) -> Result<JointBox, LoaderError> {
    let bad = |why: &str| LoaderError::InvalidPlan {
        detail: format!("rank {}: joint check {}: {why}", plan.rank, check.id),
    };
    let fqn = &plan
        .tensors
        .get(check.tensor as usize)
        .ok_or_else(|| bad("its tensor index is outside the plan's tensors"))?
        .fqn;
    let tensor = meta
        .tensor_index(fqn)
        .ok_or_else(|| bad(&format!("the checkpoint has no tensor {fqn}")))?;
    let entry = format!("tensor {fqn} box {}", check.region);
    let chunk = meta
        .chunks_of(tensor)
        .iter()
        .find(|c| c.region == check.region)
        .ok_or_else(|| bad(&format!("the checkpoint saved no {entry}")))?;
    let checksum = chunk
        .checksum()
        .ok_or_else(|| bad(&format!("the checkpoint records no checksum for {entry}")))?;
    let key = meta
        .files()
        .get(chunk.bytes.file as usize)
        .ok_or_else(|| bad("its box names no data file"))?
        .path
        .clone();
    Ok(JointBox {
        key,
        start: chunk.bytes.offset,
        end: chunk.bytes.offset + chunk.bytes.length,
        checksum,
        entry,
    })
}

/// The read side of one joint check: the ranges this rank reads of the box, and their fold.
#[derive(Debug)]
pub(crate) struct JointRead {
    pub check: u32,
    pub file: u32,
    pub saved: JointBox,
    /// This rank's ranges of the box fetched through the scheduler (folded by
    /// [`JointRead::fold_part`]), ascending and disjoint once [`JointRead::seal`]ed.
    pub ranges: Vec<(u64, u64)>,
    /// This rank's ranges of the box read by position, folded by the reads themselves
    /// ([`crate::read::positioned`]): never folded again from a scheduled part that spans them.
    pub by_position: Vec<(u64, u64)>,
    pub fold: Fold,
}

impl JointRead {
    pub fn new(check: u32, file: u32, saved: JointBox) -> JointRead {
        let (len, crc) = (saved.end - saved.start, Crc::of(saved.checksum));
        JointRead {
            check,
            file,
            saved,
            ranges: Vec::new(),
            by_position: Vec::new(),
            fold: Fold::new(crc, len),
        }
    }

    /// Adds a range this rank reads through the scheduler; it must lie inside the box.
    pub fn add(&mut self, range: FileRange, rank: u32) -> Result<(), LoaderError> {
        self.inside(range, rank)?;
        self.ranges.push((range.start, range.end));
        Ok(())
    }

    /// Adds a range this rank reads by position; it must lie inside the box.
    pub fn add_by_position(&mut self, range: FileRange, rank: u32) -> Result<(), LoaderError> {
        self.inside(range, rank)?;
        self.by_position.push((range.start, range.end));
        Ok(())
    }

    fn inside(&self, range: FileRange, rank: u32) -> Result<(), LoaderError> {
        if range.start < self.saved.start || range.end > self.saved.end {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {rank}: joint check {}: bytes {}..{} lie outside {} ({}..{})",
                    self.check,
                    range.start,
                    range.end,
                    self.saved.entry,
                    self.saved.start,
                    self.saved.end
                ),
            });
        }
        Ok(())
    }

    /// Sorts the ranges; two that overlap are a plan error (a byte folded twice cancels out).
    pub fn seal(&mut self, rank: u32) -> Result<u64, LoaderError> {
        self.ranges.sort_unstable();
        let mut all: Vec<(u64, u64)> = self
            .ranges
            .iter()
            .chain(&self.by_position)
            .copied()
            .collect();
        all.sort_unstable();
        for w in all.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(LoaderError::InvalidPlan {
                    detail: format!(
                        "rank {rank}: joint check {}: pieces overlap at bytes {}..{} of {}",
                        self.check, w[1].0, w[0].1, self.saved.entry
                    ),
                });
            }
        }
        Ok(all.iter().map(|r| r.1 - r.0).sum())
    }

    /// Folds what of `bytes` (fetched from file offset `at`) falls in this rank's ranges.
    pub fn fold_part(&mut self, at: u64, bytes: &[u8]) {
        let end = at + bytes.len() as u64;
        let first = self.ranges.partition_point(|r| r.1 <= at);
        let origin = self.saved.start;
        let mut run = self.fold.run();
        for &(start, stop) in &self.ranges[first..] {
            if start >= end {
                break;
            }
            let (s, e) = (start.max(at), stop.min(end));
            run.add(s - origin, &bytes[(s - at) as usize..(e - at) as usize]);
        }
    }

    pub fn result(&self) -> JointFold {
        JointFold {
            check: self.check,
            bytes: self.fold.bytes(),
            fold: self.fold.value(),
        }
    }
}

/// A rank's folds message: whether it folded (read with verification), then its folds in the
/// order given (see the module doc for the wire form).
pub fn encode(folded: bool, entries: &[JointFold]) -> Bytes {
    let mut out = BytesMut::with_capacity(1 + entries.len() * ENTRY_BYTES);
    out.put_u8(u8::from(folded));
    for e in entries {
        out.put_u32_le(e.check);
        out.put_u64_le(e.bytes);
        out.put_u32_le(e.fold);
    }
    out.freeze()
}

/// Parses a folds message from `peer`; when `expected` is given it must carry exactly those
/// checks, in that order.
pub fn decode(
    rank: u32,
    peer: u32,
    data: &[u8],
    expected: Option<&[u32]>,
) -> Result<(bool, Vec<JointFold>), LoaderError> {
    let bad = |why: String| LoaderError::Transport {
        rank,
        peer,
        detail: format!("joint checks: {why}"),
    };
    let Some((&flag, rest)) = data.split_first() else {
        return Err(bad("an empty folds message".to_string()));
    };
    if flag > 1
        || rest.len() % ENTRY_BYTES != 0
        || expected.is_some_and(|e| rest.len() != e.len() * ENTRY_BYTES)
    {
        return Err(bad(format!(
            "a folds message of {} bytes{}: the ranks' plans differ",
            data.len(),
            match expected {
                Some(e) => format!(
                    " where {} checks take {}",
                    e.len(),
                    1 + e.len() * ENTRY_BYTES
                ),
                None => String::new(),
            }
        )));
    }
    let mut entries = Vec::with_capacity(rest.len() / ENTRY_BYTES);
    for (i, chunk) in rest.chunks_exact(ENTRY_BYTES).enumerate() {
        let word = |at: usize, n: usize| -> u64 {
            chunk[at..at + n]
                .iter()
                .rev()
                .fold(0u64, |acc, &b| acc << 8 | u64::from(b))
        };
        let entry = JointFold {
            check: word(0, 4) as u32,
            bytes: word(4, 8),
            fold: word(12, 4) as u32,
        };
        if let Some(&want) = expected.and_then(|e| e.get(i))
            && entry.check != want
        {
            return Err(bad(format!(
                "folds of check {} where check {want} was expected: the ranks' plans differ",
                entry.check
            )));
        }
        entries.push(entry);
    }
    Ok((flag == 1, entries))
}

/// What each rank folded: whether it read with verification, and its folds.
pub type FoldsByRank = HashMap<u32, (bool, Vec<JointFold>)>;

/// The step after a rank's reads, over `transport`: sends its folds to the members of its joint
/// checks, receives the other readers' folds, and (when `verify`) checks every box it is a
/// member of ([`check_joint_boxes`]). `folds` is what this rank's read folded (`None` when it
/// did not fold: a load without verification).
pub async fn verify_joint_checks<T: Transport>(
    transport: &T,
    plan: &RankPlan,
    meta: Option<&CheckpointMeta>,
    folds: Option<&[JointFold]>,
    verify: bool,
) -> Result<(), LoaderError> {
    if plan.joint_checks.is_empty() {
        return Ok(());
    }
    let me = plan.rank;
    let mine: HashMap<u32, JointFold> = folds
        .unwrap_or_default()
        .iter()
        .map(|f| (f.check, *f))
        .collect();
    // What goes to each peer, and what comes from each, in ascending check id.
    let mut outgoing: BTreeMap<u32, Vec<JointFold>> = BTreeMap::new();
    let mut incoming: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut checks: Vec<&JointCheck> = plan.joint_checks.iter().collect();
    checks.sort_unstable_by_key(|c| c.id);
    for check in &checks {
        if check.readers.contains(&me) {
            let fold = mine.get(&check.id).copied().unwrap_or(JointFold {
                check: check.id,
                bytes: 0,
                fold: 0,
            });
            for &m in check.members.iter().filter(|&&m| m != me) {
                outgoing.entry(m).or_default().push(fold);
            }
        }
        for &r in check.readers.iter().filter(|&&r| r != me) {
            incoming.entry(r).or_default().push(check.id);
        }
    }
    for (&peer, entries) in &outgoing {
        transport
            .send(peer, JOINT_TAG, encode(folds.is_some(), entries))
            .await
            .map_err(|e| e.in_context("sending joint-check folds", "joint-check folds"))?;
    }
    let mut by_rank: FoldsByRank = HashMap::new();
    by_rank.insert(me, (folds.is_some(), mine.into_values().collect()));
    for (&peer, expected) in &incoming {
        let data = transport
            .recv(peer, JOINT_TAG)
            .await
            .map_err(|e| e.in_context("receiving joint-check folds", "joint-check folds"))?;
        by_rank.insert(peer, decode(me, peer, &data, Some(expected))?);
    }
    check_joint_boxes(plan, meta, &by_rank, verify)
}

/// Checks every jointly read box `plan`'s rank is a member of against the readers' folds in
/// `by_rank` (its own included): the folds must cover the box's bytes and add up to its crc32c.
/// Nothing is checked without `verify`. Fails naming the box, its file, byte range and readers
/// on a mismatch, and the reader when one read without verification or sent no fold.
pub fn check_joint_boxes(
    plan: &RankPlan,
    meta: Option<&CheckpointMeta>,
    by_rank: &FoldsByRank,
    verify: bool,
) -> Result<(), LoaderError> {
    if !verify || plan.joint_checks.is_empty() {
        return Ok(());
    }
    let me = plan.rank;
    let Some(meta) = meta else {
        return Err(LoaderError::InvalidPlan {
            detail: format!(
                "rank {me}: the plan has joint checks but no checkpoint metadata was given to verify them"
            ),
        });
    };
    for check in &plan.joint_checks {
        let saved = saved_box(meta, plan, check)?;
        let (mut bytes, mut xor) = (0u64, 0u32);
        for &reader in &check.readers {
            let folded = by_rank.get(&reader).and_then(|(folded, folds)| {
                folds
                    .iter()
                    .find(|f| f.check == check.id)
                    .map(|f| (*folded, f))
            });
            let Some((folded, fold)) = folded else {
                return Err(LoaderError::InvalidPlan {
                    detail: format!(
                        "rank {me}: no fold from rank {reader} for {} (joint check {}): the \
                         ranks' plans differ",
                        saved.entry, check.id
                    ),
                });
            };
            if !folded {
                return Err(LoaderError::InvalidPlan {
                    detail: format!(
                        "rank {me}: rank {reader} read its part of {} without verifying it; \
                         load every rank with the same verify setting",
                        saved.entry
                    ),
                });
            }
            bytes += fold.bytes;
            xor ^= fold.fold;
        }
        let len = saved.end - saved.start;
        let actual = crc_of_folds(Crc::of(saved.checksum), len, xor);
        if bytes != len || actual != saved.checksum.value() {
            return Err(LoaderError::JointChecksum(Box::new(JointMismatch {
                rank: me,
                path: saved.key,
                entry: saved.entry,
                start: saved.start,
                end: saved.end,
                readers: check.readers.clone(),
                bytes,
                algorithm: saved.checksum.algorithm(),
                expected: saved.checksum.value(),
                actual,
            })));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_folds_message_round_trips_and_one_for_other_checks_is_refused() {
        let entries = [
            JointFold {
                check: 3,
                bytes: 1 << 40,
                fold: 0xDEAD_BEEF,
            },
            JointFold {
                check: 9,
                bytes: 5,
                fold: 1,
            },
        ];
        let data = encode(true, &entries);
        assert_eq!(data.len(), 1 + 2 * ENTRY_BYTES);
        assert_eq!(
            decode(0, 1, &data, Some(&[3, 9])).unwrap(),
            (true, entries.to_vec())
        );
        let err = decode(0, 1, &data, Some(&[3, 8])).unwrap_err().to_string();
        assert!(
            err.contains("folds of check 9 where check 8 was expected"),
            "{err}"
        );
        let err = decode(0, 1, &data, Some(&[3])).unwrap_err().to_string();
        assert!(err.contains("rank 0: transport to rank 1 failed"), "{err}");
        assert!(err.contains("the ranks' plans differ"), "{err}");
        assert!(decode(0, 1, &[], None).is_err());
    }
}

//! Where saved files can be read besides the checkpoint's storage: copies of whole data files
//! that some ranks hold in a faster tier (a node's memory, a local disk), each with the set of
//! ranks that can read it. The planner reads every piece of such a file from the cheapest tier
//! that holds it, by a rank of that tier's reader set, and routes it to the ranks that need it
//! through the exchange (a reader that needs none of it relays it, as a storage-order slab's
//! reader does). Storage serves only the files no tier holds.

/// A tier that holds copies of data files, cheapest first (the derived order is the cost order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SourceTier {
    /// A node's memory (`/dev/shm`): what a save's memory tier leaves behind.
    NodeMemory,
    /// A node's local disk.
    LocalDisk,
}

/// Copies of a checkpoint's data files outside its storage, per file (an index into
/// [`tessera_metadata::CheckpointMeta::files`]): which ranks can read each, from which tier.
/// Empty: every byte comes from storage (what [`crate::plan`] plans).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadSources {
    /// Per file: (tier, ranks that can read the file's copy there, ascending), cheapest tier
    /// first.
    files: Vec<Vec<(SourceTier, Vec<u32>)>>,
}

impl ReadSources {
    /// No copies: every file from storage.
    pub fn none() -> Self {
        Self::default()
    }

    /// Records that `ranks` can read a copy of data file `file` from `tier`.
    pub fn add(&mut self, file: u32, tier: SourceTier, ranks: impl IntoIterator<Item = u32>) {
        if self.files.len() <= file as usize {
            self.files.resize(file as usize + 1, Vec::new());
        }
        let copies = &mut self.files[file as usize];
        let at = match copies.iter().position(|(t, _)| *t == tier) {
            Some(at) => at,
            None => {
                copies.push((tier, Vec::new()));
                copies.sort_by_key(|(t, _)| *t);
                copies.iter().position(|(t, _)| *t == tier).unwrap_or(0)
            }
        };
        let readers = &mut copies[at].1;
        readers.extend(ranks);
        readers.sort_unstable();
        readers.dedup();
        if readers.is_empty() {
            copies.remove(at);
        }
    }

    /// Whether no file has a copy.
    pub fn is_empty(&self) -> bool {
        self.files.iter().all(Vec::is_empty)
    }

    /// The cheapest tier holding a copy of `file` and the ranks that can read it there
    /// (ascending, never empty), or `None` when only storage has it.
    pub fn cheapest(&self, file: u32) -> Option<(SourceTier, &[u32])> {
        self.files
            .get(file as usize)?
            .first()
            .map(|(tier, ranks)| (*tier, ranks.as_slice()))
    }

    /// Whether rank `rank` reads `file` from a tier (the cheapest that holds it) rather than from
    /// storage: what its loader must do for the plan to hold.
    pub fn reads_from_tier(&self, file: u32, rank: u32) -> bool {
        self.cheapest(file)
            .is_some_and(|(_, ranks)| ranks.binary_search(&rank).is_ok())
    }

    /// Refuses sources that name a rank outside a job of `world` ranks or a file the checkpoint
    /// does not have (`files` of them).
    pub(crate) fn check(&self, world: u32, files: usize) -> Result<(), crate::PlanError> {
        if self.files.len() > files && self.files[files..].iter().any(|c| !c.is_empty()) {
            return Err(crate::PlanError::InvalidSources {
                detail: format!(
                    "a copy of data file #{} is offered but the checkpoint has {files} data files",
                    self.files.len() - 1
                ),
            });
        }
        for (file, copies) in self.files.iter().enumerate() {
            for (tier, ranks) in copies {
                if let Some(&rank) = ranks.iter().find(|&&r| r >= world) {
                    return Err(crate::PlanError::InvalidSources {
                        detail: format!(
                            "rank {rank} offers a {tier:?} copy of data file #{file} but the job has {world} ranks"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_cheapest_tier_wins_and_empty_reader_sets_are_no_copy() {
        let mut s = ReadSources::none();
        assert!(s.is_empty());
        s.add(2, SourceTier::LocalDisk, [3, 1]);
        s.add(2, SourceTier::NodeMemory, [2]);
        s.add(2, SourceTier::NodeMemory, [0, 2]);
        s.add(0, SourceTier::NodeMemory, []);
        assert_eq!(s.cheapest(2), Some((SourceTier::NodeMemory, &[0, 2][..])));
        assert_eq!(s.cheapest(0), None);
        assert_eq!(s.cheapest(9), None);
        assert!(s.reads_from_tier(2, 0) && !s.reads_from_tier(2, 1));
        assert!(!s.is_empty());
        assert!(s.check(4, 3).is_ok());
        let far = s.check(2, 3).unwrap_err().to_string();
        assert!(
            far.contains("rank 2 offers a NodeMemory copy of data file #2"),
            "{far}"
        );
        assert!(
            s.check(4, 2)
                .unwrap_err()
                .to_string()
                .contains("has 2 data files")
        );
    }
}

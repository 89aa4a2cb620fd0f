//! Checking that the bytes a rank read are the checkpoint's. Block checksums and the crc32c of
//! whole saved boxes are checked as the bytes arrive (`crate::read`); a saved box read in
//! parts by several ranks is checked jointly after the reads ([`joint`]): each reader folds the
//! bytes it read ([`crc_fold`]), and the folds of all readers combine into the box's crc32c.

pub mod crc_fold;
pub mod joint;

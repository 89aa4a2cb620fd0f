//! Checkpoint identities: a version stamp of a checkpoint derived from the metadata bytes its
//! reader read (the native manifest, DCP `.metadata`, safetensors headers and file sizes). A plan
//! records the identity of the checkpoint it was made for, and a loader refuses to execute it
//! against a checkpoint with another one: a checkpoint deleted and saved again at the same place,
//! or another checkpoint behind the same id, has other byte ranges, and a plan for the old one
//! would read the new files at the old offsets (wrong bytes, no error).

use sha2::{Digest, Sha256};

use crate::Format;

/// Hex digits of an identity's digest (128 bits of SHA-256: collisions are not a concern).
const DIGEST_HEX: usize = 32;

/// Builds an identity `<format>:<32 hex digits>` from the bytes a reader read, part by part.
pub(crate) struct IdentityHasher {
    format: Format,
    hasher: Sha256,
}

impl IdentityHasher {
    pub(crate) fn new(format: Format) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tessera-identity/1");
        Self { format, hasher }
    }

    /// Adds one part, length-prefixed so that no two different part lists hash the same bytes.
    pub(crate) fn part(&mut self, bytes: &[u8]) -> &mut Self {
        self.hasher.update((bytes.len() as u64).to_le_bytes());
        self.hasher.update(bytes);
        self
    }

    pub(crate) fn finish(self) -> String {
        let digest = self.hasher.finalize();
        let hex: String = digest[..DIGEST_HEX / 2]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{}:{hex}", self.format)
    }
}

/// The identity of a native checkpoint: its manifest's bytes as read. The manifest records the
/// size and crc32c of the metadata (whose rows carry every box's crc32c) and of the block
/// checksums, and the commit time, so any other save (other data, other layout, or the same
/// tensors saved again) has another manifest.
pub fn native_identity(manifest_bytes: &[u8]) -> String {
    let mut hasher = IdentityHasher::new(Format::Native);
    hasher.part(manifest_bytes);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_name_the_format_and_differ_with_the_bytes() {
        let a = native_identity(b"{\"step\": 1}");
        assert!(a.starts_with("native:"), "{a}");
        assert_eq!(a.len(), "native:".len() + DIGEST_HEX);
        assert_eq!(a, native_identity(b"{\"step\": 1}"));
        assert_ne!(a, native_identity(b"{\"step\": 2}"));
        let mut split = IdentityHasher::new(Format::Dcp);
        split.part(b"ab").part(b"c");
        let mut joined = IdentityHasher::new(Format::Dcp);
        joined.part(b"a").part(b"bc");
        assert_ne!(split.finish(), joined.finish(), "parts are length-prefixed");
    }
}

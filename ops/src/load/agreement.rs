//! What the ranks of one load must agree on before any of them reads, beside the world size:
//! that they load the same checkpoint. Rank 0 checks it at the rendezvous
//! ([`RendezvousConfig::job`](tessera_loader::transport::rendezvous::RendezvousConfig::job)).
//!
//! The same checkpoint is often named differently by different ranks: a relative path from
//! another working directory, an absolute one, a symbolic link, a mount at another place on
//! another host, the same bucket through another spelling of the URL. What the ranks compare is
//! therefore what was opened, not what was typed: the checkpoint's identity (the digest of its
//! metadata as read), and only where it has none its location made canonical.

use tessera_loader::checkpoint::Checkpoint;

use crate::OpsError;

/// The checkpoint `checkpoint` (opened from `location`) as the ranks of a job compare it: its
/// identity when it has one (every on-disk format records one; two ranks then agree exactly when
/// they opened the same save, wherever they found it, and a checkpoint saved again between their
/// opens is told apart); else `location` made canonical ([`tessera_storage::canonical`]).
pub fn checkpoint_key(checkpoint: &Checkpoint, location: &str) -> Result<String, OpsError> {
    match checkpoint.meta.identity() {
        Some(identity) => Ok(identity.to_string()),
        None => Ok(tessera_storage::canonical(location)?),
    }
}

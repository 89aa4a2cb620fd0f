//! The ranks of a job agree on their plans before any byte passes between them. Each rank's plan
//! is checked alone against the opened checkpoint and its own requests, but that cannot see two
//! ranks holding rank plans of *different* plans of the same job: every piece id then names the
//! right bytes of the checkpoint on each rank, only not the same bytes on both, and the exchange
//! (whose messages carry piece ids, not descriptions) would place one rank's rows where the
//! other's plan says other rows go. So every rank sends every other rank the digest of what the
//! two of them pass each other ([`RankPlan::peer_digests`]) and compares it with the peer's
//! digest of the same: any difference fails both ranks, naming each other, before the exchange.
//!
//! Every rank sends to and hears from every other, not only the peers its own plan names: a rank
//! whose plan expects nothing from a peer that expects to send it something still meets that
//! peer here and fails at once, instead of one of them waiting for its timeout. Cost: one 8-byte
//! message to and from each rank of the job.

use bytes::Bytes;
use futures::future::try_join_all;
use tessera_planner::RankPlan;

use crate::LoaderError;
use crate::exchange::direct::HELLO_TAG;
use crate::transport::Transport;

/// Transport tag of a rank's digest of what it and the receiver pass each other. In the
/// hand-shake's space (top two bits set), which no exchange tag reaches; the joint checks use
/// `HELLO_TAG | 2`.
pub const PLAN_DIGEST_TAG: u64 = HELLO_TAG | 3;

/// Checks over `transport` that every peer's plan describes what it and this rank pass each
/// other as `plan` does (see the module doc). A job of one rank has nothing to agree on.
pub async fn agree_on_plan<T: Transport>(
    transport: &T,
    plan: &RankPlan,
) -> Result<(), LoaderError> {
    let (rank, world) = (transport.rank(), transport.world());
    if world <= 1 {
        return Ok(());
    }
    let mine = plan.peer_digests();
    let peers: Vec<u32> = (0..world).filter(|&p| p != rank).collect();
    let context = |e: LoaderError| {
        e.in_context(
            "agreeing on the plan with the other ranks",
            "the other ranks' plan digests (every rank sends one before the exchange)",
        )
    };
    try_join_all(peers.iter().map(|&peer| {
        let digest = mine.get(peer as usize).copied().unwrap_or_default();
        transport.send(
            peer,
            PLAN_DIGEST_TAG,
            Bytes::copy_from_slice(&digest.to_le_bytes()),
        )
    }))
    .await
    .map_err(context)?;
    let received = try_join_all(
        peers
            .iter()
            .map(|&peer| transport.recv(peer, PLAN_DIGEST_TAG)),
    )
    .await
    .map_err(context)?;
    let theirs: Vec<(u32, Option<u64>)> = peers
        .iter()
        .zip(&received)
        .map(|(&peer, data)| (peer, decode_digest(data)))
        .collect();
    check_digests(rank, &mine, &theirs)
}

/// An 8-byte little-endian digest; `None` for anything else.
pub fn decode_digest(data: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(data.try_into().ok()?))
}

/// Fails naming every peer whose digest of what it and rank `rank` pass each other (`theirs`:
/// peer and its digest, `None` when it sent none that decodes) differs from this rank's own
/// (`mine`, indexed by peer: [`RankPlan::peer_digests`]).
pub fn check_digests(
    rank: u32,
    mine: &[u64],
    theirs: &[(u32, Option<u64>)],
) -> Result<(), LoaderError> {
    let disagree: Vec<u32> = theirs
        .iter()
        .filter(|(peer, digest)| *peer != rank && mine.get(*peer as usize).copied() != *digest)
        .map(|(peer, _)| *peer)
        .collect();
    if disagree.is_empty() {
        return Ok(());
    }
    Err(LoaderError::PlansDisagree {
        rank,
        peers: ranks_text(&disagree),
    })
}

/// `rank 1`, or `ranks 1, 2, 3` (the first eight, then how many in all): the peers of
/// [`LoaderError::PlansDisagree`].
pub fn ranks_text(ranks: &[u32]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        _ => {
            let shown: Vec<String> = ranks.iter().take(8).map(u32::to_string).collect();
            let more = if ranks.len() > 8 {
                format!(" ... ({} ranks)", ranks.len())
            } else {
                String::new()
            };
            format!("ranks {}{more}", shown.join(", "))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn digests_that_differ_name_the_peers() {
        assert!(check_digests(0, &[1, 2, 3], &[(1, Some(2)), (2, Some(3))]).is_ok());
        let err = check_digests(0, &[1, 2, 3], &[(1, Some(9)), (2, None)])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("rank 0: this rank's plan and the plan of ranks 1, 2 disagree"),
            "{err}"
        );
        let err = check_digests(2, &[1, 2, 3], &[(0, Some(2))])
            .unwrap_err()
            .to_string();
        assert!(err.contains("the plan of rank 0 disagree"), "{err}");
        assert_eq!(decode_digest(&7u64.to_le_bytes()), Some(7));
        assert_eq!(decode_digest(b"short"), None);
    }
}

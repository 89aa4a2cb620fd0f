//! Ranks of one job agreeing on things before they load or save: joining the TCP mesh (the same
//! rendezvous as `tessera load --rank`), and an all-gather of small JSON messages over any
//! transport.

use std::time::Duration;

use bytes::Bytes;
use futures::future::try_join_all;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tessera_loader::LoaderError;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{TcpTransport, Transport, TransportOptions};

use crate::{OpsError, ResultExt};

/// Tag of the save's box lists: above every ring exchange tag (group << 32 | round, with far
/// fewer than 2^31 groups). (`..._0001`, `..._0006` and `..._0007` were the load's requests and
/// memory-tier rounds before the load job's rounds took them over: `crate::job`.)
pub const TAG_SAVE_BOXES: u64 = 0xFFFF_FFFF_0000_0002;
/// Tag of the save's written files (to rank 0).
pub const TAG_SAVE_FILES: u64 = 0xFFFF_FFFF_0000_0003;
/// Tag of the save's outcome (from rank 0).
pub const TAG_SAVE_DONE: u64 = 0xFFFF_FFFF_0000_0004;
/// Tag of rank 0's word on the save's write claim (to every rank, before anyone writes).
pub const TAG_SAVE_CLAIM: u64 = 0xFFFF_FFFF_0000_0005;

/// Joins the mesh of `world` ranks through rank 0 at `addr:port`.
pub async fn connect(
    rank: u32,
    world: u32,
    addr: &str,
    port: u16,
    timeout: Duration,
) -> Result<TcpTransport, OpsError> {
    let config = RendezvousConfig::new(rank, world, addr, port)
        .with_context(|| format!("rank {rank} joining the job at {addr}:{port}"))?;
    connect_with(config, timeout).await
}

/// Joins the mesh `config` names (its job fingerprint and plan options included: rank 0 turns
/// away another job's rank and calls the job off when its ranks plan differently).
pub async fn connect_with(
    config: RendezvousConfig,
    timeout: Duration,
) -> Result<TcpTransport, OpsError> {
    TcpTransport::connect(&config, TransportOptions::with_timeout(timeout))
        .await
        .with_context(|| {
            format!(
                "rank {} joining the job at {}:{}",
                config.rank, config.master_addr, config.master_port
            )
        })
}

/// Every rank's `mine` (as JSON), indexed by rank; `what` names it in errors ("requests").
pub async fn all_gather_json<T: Transport, V: Serialize + DeserializeOwned>(
    transport: &T,
    tag: u64,
    mine: &V,
    what: &str,
) -> Result<Vec<V>, OpsError> {
    let text = Bytes::from(
        serde_json::to_vec(mine).map_err(|source| OpsError::Message {
            what: format!("this rank's {what}"),
            source,
        })?,
    );
    let all = all_gather(transport, tag, text)
        .await
        .with_context(|| format!("rank {} gathering every rank's {what}", transport.rank()))?;
    all.iter()
        .enumerate()
        .map(|(r, bytes)| {
            serde_json::from_slice(bytes).map_err(|source| OpsError::Message {
                what: format!("rank {r}'s {what}"),
                source,
            })
        })
        .collect()
}

/// Every rank's `mine`, indexed by rank.
async fn all_gather<T: Transport>(
    transport: &T,
    tag: u64,
    mine: Bytes,
) -> Result<Vec<Bytes>, LoaderError> {
    let (rank, world) = (transport.rank(), transport.world());
    let peers: Vec<u32> = (0..world).filter(|&r| r != rank).collect();
    try_join_all(
        peers
            .iter()
            .map(|&peer| transport.send(peer, tag, mine.clone())),
    )
    .await?;
    let received = try_join_all(peers.iter().map(|&peer| transport.recv(peer, tag))).await?;
    let mut all = Vec::with_capacity(world as usize);
    let mut received = received.into_iter();
    for r in 0..world {
        if r == rank {
            all.push(mine.clone());
        } else if let Some(bytes) = received.next() {
            all.push(bytes);
        }
    }
    Ok(all)
}

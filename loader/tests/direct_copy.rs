//! Direct copies between ranks of one host (`cross_memory`): ranks copy each other's shares out
//! of their buffers instead of sending bytes, land the formula's bytes (strided column pieces and
//! storage-order relays from scratch buffers included), and a share that no longer belongs to a
//! live exchange, or that lists other pieces than the plan, fails the receiver instead of
//! loading wrong bytes.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, clippy::result_large_err)]

mod support_read;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use support_read::*;
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::exchange::ExchangeMessages;
use tessera_loader::exchange::agree::PLAN_DIGEST_TAG;
use tessera_loader::exchange::direct::{
    ANSWER_TAG, Exposure, HELLO_TAG, ShareDescriptor, descriptor_tag,
};
use tessera_loader::load::{LoadOptions, RankReport, load_rank};
use tessera_loader::transport::{InProcTransport, Transport, TransportOptions};
use tessera_planner::{RankPlan, ReadOrder};
use tessera_storage::testing::ThrottledStore;

/// Every tensor on both ranks: with dedup each piece is read by one and copied by the other.
const REPLICATED_DP2: &str = r#"{"mesh": [{"name": "dp", "size": 2}],
    "rules": [{"match": "*", "placements": ["replicate"]}]}"#;

async fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    support_read::local_checkpoint().await
}

fn load_options() -> LoadOptions {
    LoadOptions {
        read: options(true),
        progress: None,
        ..LoadOptions::default()
    }
}

/// Loads every rank over one in-process mesh (destinations checked against the formula) and
/// returns the reports.
async fn load_all(checkpoint: &Checkpoint, plans: Vec<RankPlan>) -> Vec<RankReport> {
    let mut reports = Vec::new();
    for loaded in load_every_rank(checkpoint, plans, &load_options()).await {
        assert_eq!(
            loaded.report.bytes_received,
            loaded.plan.summary.bytes_received
        );
        reports.push(loaded.report);
    }
    reports
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_copy_column_pieces_and_relays_straight_out_of_each_others_buffers() {
    let (_dir, checkpoint) = checkpoint().await;
    // Column pieces (one run per row on both sides) of replica groups, and storage-order slabs
    // read into scratch buffers and relayed.
    for (layout, order) in [
        (DP2_TP2, ReadOrder::Request),
        (COLUMNS_TP3, ReadOrder::Storage),
    ] {
        let reports = load_all(&checkpoint, plans_in_read_order(&checkpoint, layout, order)).await;
        let received: u64 = reports.iter().map(|r| r.bytes_received).sum();
        assert!(received > 0, "{order:?}: the plan exchanges nothing");
        for report in &reports {
            assert_eq!(
                report.bytes_received_direct, report.bytes_received,
                "{order:?}: rank {} received bytes over the transport",
                report.rank
            );
        }
    }
}

/// Rank 0 played by hand: the hand-shake as a sender that offers its memory and a receiver
/// that declines, then one share described as `descriptor` (after `end_exchange` runs).
/// Returns rank 1's (real) load error.
async fn against_a_hand_played_rank_0(
    describe: impl FnOnce(&RankPlan, &[u8]) -> ShareDescriptor,
    end_exchange: bool,
) -> String {
    let (_dir, checkpoint) = checkpoint().await;
    let plans = plans_in_read_order(&checkpoint, REPLICATED_DP2, ReadOrder::Request);
    let mut mesh =
        InProcTransport::mesh(2, TransportOptions::with_timeout(Duration::from_secs(10)));
    let rank1 = mesh.pop().unwrap();
    let rank0 = mesh.pop().unwrap();
    let plan1 = plans[1].clone();
    let real = tokio::spawn({
        let checkpoint = checkpoint.clone();
        async move { load_rank(&checkpoint, plan1, &rank1, &load_options()).await }
    });

    // The plans' agreement first, as a real rank 0 holding this plan does.
    rank0
        .send(
            1,
            PLAN_DIGEST_TAG,
            Bytes::copy_from_slice(&plans[0].peer_digests()[1].to_le_bytes()),
        )
        .await
        .unwrap();
    rank0.recv(1, PLAN_DIGEST_TAG).await.unwrap();
    let exposure = Exposure::new();
    rank0
        .send(1, HELLO_TAG, Bytes::from(exposure.hello()))
        .await
        .unwrap();
    rank0.recv(1, HELLO_TAG).await.unwrap();
    rank0
        .send(1, ANSWER_TAG, Bytes::from_static(&[0]))
        .await
        .unwrap();
    let answer = rank0.recv(1, ANSWER_TAG).await.unwrap();
    assert_eq!(&answer[..], &[1], "rank 1 can read this process");

    let messages = ExchangeMessages::of_plan(&plans[0]).unwrap();
    let message = &messages.outgoing[0];
    // Not the formula's bytes: whatever rank 1 copies from here must not load.
    let garbage = vec![0xABu8; message.bytes as usize];
    let descriptor = describe(&plans[0], &garbage);
    if end_exchange {
        drop(exposure);
    }
    rank0
        .send(
            1,
            descriptor_tag(message.tag),
            Bytes::from(descriptor.encode()),
        )
        .await
        .unwrap();
    let outcome = real.await.unwrap();
    drop(rank0);
    match outcome {
        Ok(_) => panic!("rank 1 loaded a share it should have refused"),
        Err(e @ LoaderError::Transport { peer: 0, .. }) => e.to_string(),
        Err(other) => panic!("rank 1 failed otherwise: {other}"),
    }
}

/// The pieces and bytes rank 0's first message to rank 1 lists, described as lying in `memory`.
fn first_share(plan: &RankPlan, memory: &[u8]) -> ShareDescriptor {
    let messages = ExchangeMessages::of_plan(plan).unwrap();
    ShareDescriptor {
        pieces: messages.outgoing[0]
            .pieces
            .iter()
            .map(|&i| (plan.pieces[i].id, plan.pieces[i].bytes))
            .collect(),
        spans: vec![(memory.as_ptr() as u64, memory.len() as u64)],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_whose_sender_ended_its_exchange_fails_the_receiver() {
    let err = against_a_hand_played_rank_0(first_share, true).await;
    assert!(err.contains("rank 1"), "{err}");
    assert!(err.contains("copying its share out of its memory"), "{err}");
    assert!(err.contains("no longer reads as announced"), "{err}");
    assert!(err.contains("TESSERA_CROSS_MEMORY=0"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_listing_other_pieces_than_the_plan_is_refused() {
    let err = against_a_hand_played_rank_0(
        |plan, memory| {
            let mut share = first_share(plan, memory);
            share.pieces[0].0 += 1;
            share
        },
        false,
    )
    .await;
    assert!(err.contains("the ranks run different plans"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_sent_in_parts_as_their_pieces_are_read_land_every_byte() {
    let (_dir, mut checkpoint) = checkpoint().await;
    // Reads trickle in (4 KiB requests, one at a time, behind a 2 MB/s link, no positioned
    // reads), so a part offered before its own pieces are read would be copied with bytes
    // missing.
    checkpoint.location.store = Arc::new(ThrottledStore::new(
        Arc::clone(&checkpoint.location.store),
        2_000_000,
    ));
    checkpoint.location.local_root = None;
    let mut options = load_options();
    options.read.part_size = 4096;
    options.read.max_in_flight = 1;
    // Part sizes that cut shares into parts of several pieces: a part offered before all of its
    // pieces are read would be copied with bytes missing.
    let mut cut = 0;
    for (layout, order, part_bytes) in [
        (REPLICATED_DP2, ReadOrder::Request, 64 * 1024),
        (DP2_TP2, ReadOrder::Request, 64 * 1024),
        (COLUMNS_TP3, ReadOrder::Storage, 24 * 1024),
    ] {
        let plans = plans_in_read_order(&checkpoint, layout, order);
        let mut several = 0;
        for plan in &plans {
            let parts = ExchangeMessages::of_plan_in_parts(plan, part_bytes).unwrap();
            cut += parts.outgoing.len() - ExchangeMessages::of_plan(plan).unwrap().outgoing.len();
            several += parts.outgoing.iter().filter(|m| m.pieces.len() > 1).count();
        }
        assert!(several > 0, "{layout}: no part of several pieces");
        let options = LoadOptions {
            share_part_bytes: Some(part_bytes),
            ..options.clone()
        };
        // load_every_rank checks every destination against the formula.
        for loaded in load_every_rank(&checkpoint, plans, &options).await {
            assert_eq!(
                loaded.report.bytes_received_direct, loaded.plan.summary.bytes_received,
                "rank {}",
                loaded.plan.rank
            );
        }
    }
    assert!(cut > 0, "no share was cut into parts");
}

//! The exchange protocol (`exchange::protocol`) driven the way the Python package drives it over
//! torch's point-to-point ops: messages matched only by (sender, receiver, pair tag), a framed
//! message's length sent first under pair tag + 1, completions delivered in any order. Every
//! rank's protocol runs against the others' to the end in one thread (no transport): the bytes
//! land (the formula's), direct copies are made where offered, and the counts match the plan.
#![allow(clippy::unwrap_used)]

mod support_read;

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use support_read::*;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::exchange::ExchangeMessages;
use tessera_loader::exchange::direct::Exposure;
use tessera_loader::exchange::protocol::{Action, ExchangeProtocol};
use tessera_loader::exchange::{place, relay};
use tessera_loader::load::LoadOptions;
use tessera_planner::{RankPlan, ReadOrder};

/// Every tensor on every rank of 3: with dedup each piece is read by one and sent to the others.
const REPLICATED_DP3: &str = r#"{"mesh": [{"name": "dp", "size": 3}],
    "rules": [{"match": "*", "placements": ["replicate"]}]}"#;

/// A message in flight between two ranks as a pair-tag driver sees it.
struct Wire {
    from: u32,
    to: u32,
    pair_tag: u32,
    data: Bytes,
}

/// A receive a rank posted: the protocol's tag to report back, and the length it expects
/// (`None`: framed, its length arrives first under pair tag + 1).
struct Posted {
    tag: u64,
    bytes: Option<u64>,
}

/// Runs every rank's protocol to the end, delivering messages by pair tag only, in an order
/// that `shuffle` stirs. Returns each rank's buffers and exchange stats.
async fn run_by_pair_tags(
    checkpoint: &Checkpoint,
    plans: &[RankPlan],
    direct: bool,
    shuffle: u64,
) -> Vec<(Vec<Vec<u8>>, tessera_loader::exchange::ExchangeStats)> {
    let world = plans.len();
    // Every rank reads its own pieces first (the Python path's order).
    let mut buffers: Vec<Vec<Vec<u8>>> = Vec::new();
    for plan in plans {
        let mut mine = place::allocate(plan);
        checkpoint
            .read_into(plan, &LoadOptions::default(), &mut mine)
            .await
            .unwrap();
        buffers.push(mine);
    }
    let exposures: Vec<Exposure> = (0..world).map(|_| Exposure::new()).collect();
    let mut protocols: Vec<ExchangeProtocol<&RankPlan>> = plans
        .iter()
        .enumerate()
        .map(|(r, plan)| {
            let hello = direct.then(|| Bytes::from(exposures[r].offer(true)));
            ExchangeProtocol::new(plan, ExchangeMessages::of_plan(plan).unwrap(), hello, true)
        })
        .collect();
    let mut wire: VecDeque<Wire> = VecDeque::new();
    // Receives posted, by (receiver, sender, pair tag).
    let mut posted: HashMap<(u32, u32, u32), Posted> = HashMap::new();
    // Sends whose completion is reported back to the sender: (rank, to, tag).
    let mut sent: VecDeque<(usize, u32, u64)> = VecDeque::new();
    let apply = |rank: usize,
                 actions: Vec<Action>,
                 wire: &mut VecDeque<Wire>,
                 posted: &mut HashMap<(u32, u32, u32), Posted>,
                 sent: &mut VecDeque<(usize, u32, u64)>| {
        for action in actions {
            match action {
                Action::Send {
                    to,
                    tag,
                    pair_tag,
                    data,
                    framed,
                } => {
                    if framed {
                        wire.push_back(Wire {
                            from: rank as u32,
                            to,
                            pair_tag: pair_tag + 1,
                            data: Bytes::copy_from_slice(&(data.len() as u64).to_le_bytes()),
                        });
                    }
                    wire.push_back(Wire {
                        from: rank as u32,
                        to,
                        pair_tag,
                        data,
                    });
                    sent.push_back((rank, to, tag));
                }
                Action::Recv {
                    from,
                    tag,
                    pair_tag,
                    bytes,
                } => {
                    let key = (rank as u32, from, pair_tag);
                    assert!(
                        posted.insert(key, Posted { tag, bytes }).is_none(),
                        "rank {rank}: two receives under pair tag {pair_tag} from {from}"
                    );
                }
            }
        }
    };
    for (rank, protocol) in protocols.iter_mut().enumerate() {
        let mut actions = protocol.start();
        actions.extend(protocol.all_read(&buffers[rank]).unwrap());
        protocol.reads_done().unwrap();
        apply(rank, actions, &mut wire, &mut posted, &mut sent);
    }
    let mut step = 0u64;
    let mut stalled = 0;
    while !(wire.is_empty() && sent.is_empty()) {
        step += 1;
        // Stir: take from the back now and then, so deliveries interleave across pairs.
        let from_back = (step.wrapping_mul(shuffle) >> 3).is_multiple_of(3);
        if let Some((rank, to, tag)) = if from_back {
            sent.pop_back()
        } else {
            sent.pop_front()
        } {
            let actions = protocols[rank].sent(to, tag);
            apply(rank, actions, &mut wire, &mut posted, &mut sent);
        }
        let Some(message) = (if from_back {
            wire.pop_back()
        } else {
            wire.pop_front()
        }) else {
            continue;
        };
        let rank = message.to as usize;
        // A framed message's length goes under pair tag + 1: the receiver learns it first.
        let length_key = (message.to, message.from, message.pair_tag.wrapping_sub(1));
        if message.pair_tag % 2 == 1
            && let Some(waiting) = posted.get(&length_key)
            && waiting.bytes.is_none()
        {
            let len = u64::from_le_bytes(message.data[..8].try_into().unwrap());
            posted.get_mut(&length_key).unwrap().bytes = Some(len);
            continue;
        }
        let key = (message.to, message.from, message.pair_tag);
        if posted.get(&key).is_none_or(|r| r.bytes.is_none()) {
            // Not posted yet, or a framed message before its length: try again later.
            wire.push_back(message);
            stalled += 1;
            assert!(stalled < 100_000, "the exchange makes no progress");
            continue;
        }
        let receive = posted.remove(&key).unwrap();
        assert_eq!(
            receive.bytes,
            Some(message.data.len() as u64),
            "rank {rank}: pair tag {} from {}: the length the protocol expects",
            message.pair_tag,
            message.from
        );
        let mut actions = protocols[rank]
            .received(message.from, receive.tag, message.data)
            .unwrap();
        actions.extend(protocols[rank].pump(&mut buffers[rank]).unwrap());
        apply(rank, actions, &mut wire, &mut posted, &mut sent);
    }
    assert!(
        posted.is_empty(),
        "receives never matched: {:?}",
        posted.keys()
    );
    protocols
        .iter()
        .zip(buffers)
        .map(|(protocol, buffers)| {
            assert!(
                protocol.is_done(),
                "rank {} unfinished, waiting on {:?}",
                protocol.plan().rank,
                protocol.waiting_on()
            );
            (buffers, protocol.stats().clone())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_tag_driver_lands_every_byte_with_and_without_direct_copies() {
    let (_dir, checkpoint) = local_checkpoint().await;
    for (layout, order) in [
        (REPLICATED_DP3, ReadOrder::Request),
        (DP2_TP2, ReadOrder::Request),
        (COLUMNS_TP3, ReadOrder::Storage),
    ] {
        let plans = plans_in_read_order(&checkpoint, layout, order);
        // Pieces read in storage order only to pass on get scratch buffers after the
        // destinations, as every driver gives them.
        let relaying: Vec<RankPlan> = plans
            .iter()
            .map(|p| relay::with_relay_buffers(p).unwrap_or_else(|| p.clone()))
            .collect();
        for direct in [false, true] {
            for shuffle in [1, 7, 13] {
                let outcome = run_by_pair_tags(&checkpoint, &relaying, direct, shuffle).await;
                let mut received_direct = 0;
                for (plan, (buffers, stats)) in plans.iter().zip(&outcome) {
                    for (d, buffer) in buffers.iter().enumerate().take(plan.destinations.len()) {
                        assert_eq!(
                            *buffer,
                            expected_destination(plan, d),
                            "{layout} direct={direct}: rank {} destination {d}",
                            plan.rank
                        );
                    }
                    assert_eq!(stats.bytes_sent, plan.summary.bytes_sent);
                    assert_eq!(stats.bytes_received, plan.summary.bytes_received);
                    received_direct += stats.bytes_received_direct;
                }
                let received: u64 = plans.iter().map(|p| p.summary.bytes_received).sum();
                assert!(received > 0, "{layout}: the plan exchanges nothing");
                // In one process every rank can read every other's memory.
                let want = if direct { received } else { 0 };
                assert_eq!(received_direct, want, "{layout} direct={direct}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pair_tags_and_framing_agree_between_sender_and_receiver() {
    // Every send's pair tag is a receive the peer posted with the same framing, whatever the
    // order the plan lists the pair's messages in (several groups and rounds per pair).
    let (_dir, checkpoint) = local_checkpoint().await;
    let plans = plans_in_read_order(&checkpoint, DP2_TP2, ReadOrder::Request);
    let (mut sends, mut receives) = (Vec::new(), Vec::new());
    for (rank, plan) in plans.iter().enumerate() {
        let mut buffers = place::allocate(plan);
        checkpoint
            .read_into(plan, &LoadOptions::default(), &mut buffers)
            .await
            .unwrap();
        let mut protocol =
            ExchangeProtocol::new(plan, ExchangeMessages::of_plan(plan).unwrap(), None, false);
        let mut actions = protocol.start();
        actions.extend(protocol.all_read(&buffers).unwrap());
        for action in actions {
            match action {
                Action::Send {
                    to,
                    pair_tag,
                    data,
                    framed,
                    ..
                } => sends.push((rank as u32, to, pair_tag, Some(data.len() as u64), framed)),
                Action::Recv {
                    from,
                    pair_tag,
                    bytes,
                    ..
                } => receives.push((from, rank as u32, pair_tag, bytes, bytes.is_none())),
            }
        }
    }
    assert!(!sends.is_empty());
    sends.sort_unstable();
    receives.sort_unstable();
    assert_eq!(sends, receives);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_or_answer_nobody_asked_for_fails_naming_the_peer() {
    let (_dir, checkpoint) = local_checkpoint().await;
    let plans = plans_in_read_order(&checkpoint, REPLICATED_DP3, ReadOrder::Request);
    let plan = &plans[0];
    let messages = ExchangeMessages::of_plan(plan).unwrap();
    let expect = messages.incoming[0].clone();
    let mut protocol = ExchangeProtocol::new(plan, messages, None, false);
    let _ = protocol.start();
    // Wrong length.
    let err = protocol
        .received(expect.from, expect.tag, Bytes::from(vec![0u8; 3]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("rank {}", expect.from)) && err.contains("expected"),
        "{err}"
    );
    // An answer without a hand-shake.
    let err = protocol
        .received(
            expect.from,
            tessera_loader::exchange::direct::ANSWER_TAG,
            Bytes::from_static(&[1]),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("did not send"), "{err}");
}

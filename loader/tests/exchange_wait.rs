//! The exchange's time is split into this rank's own work and its wait on peers: a rank whose
//! peers read slowly reports the time it spent waiting for their shares as
//! `exchange_wait_seconds`, part of `exchange_seconds`, and the bytes still land right.
#![allow(clippy::unwrap_used)]

mod support_read;

use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;
use support_read::{DP2_TP2, load_every_rank_from, memory_store, prefix, rank_plans};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::LoadOptions;
use tessera_storage::testing::{FaultConfig, FaultyStore};

/// Each storage request of the slow ranks waits this long before it is answered.
const LATENCY: Duration = Duration::from_millis(400);

async fn open(store: Arc<dyn ObjectStore>) -> Checkpoint {
    Checkpoint::open(tessera_storage::Location {
        store,
        prefix: prefix(),
        display: "memory".to_string(),
        local_root: None,
        shared_files: Default::default(),
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rank_reports_the_time_it_waited_for_its_slow_peers_shares() {
    let store = memory_store();
    support_read::write_checkpoint(&store).await;
    let fast = open(Arc::clone(&store)).await;
    let config = FaultConfig {
        latency: LATENCY,
        ..FaultConfig::default()
    };
    let slow = open(Arc::new(FaultyStore::new(store, config))).await;
    let plans = rank_plans(&fast.meta, DP2_TP2, true);
    // Rank 0 reads at memory speed; every other rank's reads wait LATENCY per request.
    let checkpoints: Vec<Checkpoint> = (0..plans.len())
        .map(|r| if r == 0 { fast.clone() } else { slow.clone() })
        .collect();
    let loaded = load_every_rank_from(&checkpoints, plans, &LoadOptions::default()).await;
    for rank in &loaded {
        let report = &rank.report;
        assert!(
            report.exchange_wait_seconds >= 0.0
                && report.exchange_wait_seconds <= report.exchange_seconds,
            "rank {}: waited {} s of an exchange of {} s",
            report.rank,
            report.exchange_wait_seconds,
            report.exchange_seconds
        );
    }
    let first = &loaded[0].report;
    assert!(first.bytes_received > 0, "rank 0 received nothing");
    // No share of a slow peer exists before LATENCY has passed since the loads began, and rank
    // 0 places nothing before its own reads end: all the time between is waiting.
    let floor = LATENCY.as_secs_f64() - first.read_seconds;
    assert!(
        first.exchange_wait_seconds >= floor - 0.05,
        "rank 0 read for {} s and waited {} s for shares that took at least {LATENCY:?} to read",
        first.read_seconds,
        first.exchange_wait_seconds
    );
}

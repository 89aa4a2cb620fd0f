//! The pinned staging pool over the host copy engine (copies on their own thread, like a CUDA
//! copy stream): every byte lands where it should, pinned memory stays bounded and is reused,
//! filling overlaps copying, and bad spans are errors, not panics.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use tessera_loader::LoaderError;
use tessera_loader::device::DeviceMemory;
use tessera_loader::device::staging::{StagingOptions, StagingPool, Upload};
use tessera_loader::testing::{HostCopyEngine, HostMemory};

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut z = seed;
    (0..len)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 56) as u8
        })
        .collect()
}

fn pool(delay: Duration, options: StagingOptions) -> StagingPool<HostCopyEngine> {
    StagingPool::new(HostCopyEngine::new(delay), options).unwrap()
}

/// Sources of awkward sizes (empty, smaller than a chunk, exact multiples, one byte over) into
/// two targets at offsets, with several lanes: every byte lands, nothing else is touched.
#[test]
fn every_byte_lands_where_asked() {
    let options = StagingOptions {
        chunk_bytes: 4096,
        buffers: 2,
        lanes: 3,
    };
    let mut pool = pool(Duration::ZERO, options);
    let sources: Vec<Vec<u8>> = [0usize, 1, 4095, 4096, 8192, 4097, 50_000]
        .iter()
        .enumerate()
        .map(|(i, &len)| bytes(i as u64 + 1, len))
        .collect();
    let total: usize = sources.iter().map(Vec::len).sum();
    let a = HostMemory::zeroed(total + 100);
    let b = HostMemory::zeroed(70_000);
    let mut at = 50u64;
    let mut uploads = Vec::new();
    let mut expected_a = vec![0u8; total + 100];
    for source in &sources[..6] {
        uploads.push(Upload {
            source,
            target: &a,
            offset: at,
        });
        expected_a[at as usize..at as usize + source.len()].copy_from_slice(source);
        at += source.len() as u64;
    }
    uploads.push(Upload {
        source: &sources[6],
        target: &b,
        offset: 17,
    });
    let stats = pool.upload(&uploads).unwrap();
    assert_eq!(stats.bytes, total as u64);
    // 0 + 1 + 1 + 1 + 2 + 2 + 13 chunks of 4 KiB.
    assert_eq!(stats.chunks, 20);
    assert_eq!(a.to_vec(), expected_a);
    let mut expected_b = vec![0u8; 70_000];
    expected_b[17..17 + 50_000].copy_from_slice(&sources[6]);
    assert_eq!(b.to_vec(), expected_b);
    assert_eq!(pool.engine().stats().uploads.load(Ordering::Relaxed), 20);
}

/// Pinned memory is allocated once (lanes × buffers × chunk) and reused by later uploads, however
/// much they move.
#[test]
fn pinned_memory_is_bounded_and_reused() {
    let options = StagingOptions {
        chunk_bytes: 1024,
        buffers: 2,
        lanes: 2,
    };
    let mut pool = pool(Duration::ZERO, options.clone());
    assert_eq!(pool.pinned_bytes(), 4096);
    let stats = pool.engine().stats();
    assert_eq!(stats.slots.load(Ordering::Relaxed), 4);
    assert_eq!(stats.slot_bytes.load(Ordering::Relaxed), 4096);
    for round in 0..3 {
        let source = bytes(round, 100_000);
        let target = HostMemory::zeroed(100_000);
        pool.upload(&[Upload {
            source: &source,
            target: &target,
            offset: 0,
        }])
        .unwrap();
        assert_eq!(target.to_vec(), source);
    }
    let stats = pool.engine().stats();
    assert_eq!(
        stats.slots.load(Ordering::Relaxed),
        4,
        "no buffer allocated after the pool"
    );
    assert_eq!(stats.slot_bytes.load(Ordering::Relaxed), 4096);
}

/// With copies slower than fills, a lane fills its next buffer while the previous one is still
/// being copied (ping-pong), and a buffer is never refilled before its copy is done (the bytes
/// would be wrong).
#[test]
fn filling_overlaps_copying() {
    let options = StagingOptions {
        chunk_bytes: 512,
        buffers: 2,
        lanes: 1,
    };
    let mut pool = pool(Duration::from_millis(2), options);
    let source = bytes(9, 512 * 20 + 3);
    let target = HostMemory::zeroed(source.len());
    pool.upload(&[Upload {
        source: &source,
        target: &target,
        offset: 0,
    }])
    .unwrap();
    assert_eq!(target.to_vec(), source);
    let stats = pool.engine().stats();
    assert_eq!(stats.fills.load(Ordering::Relaxed), 21);
    assert!(
        stats.fills_during_copy.load(Ordering::Relaxed) >= 10,
        "fills while a copy ran: {}",
        stats.fills_during_copy.load(Ordering::Relaxed)
    );
    // One lane with two buffers: at most two copies outstanding.
    assert!(stats.max_in_flight.load(Ordering::Relaxed) <= 2);
    assert!(stats.max_in_flight.load(Ordering::Relaxed) >= 2);
}

/// A span past the end of its target is refused before anything is copied; a pool without
/// buffers cannot be made.
#[test]
fn bad_spans_and_shapes_are_errors() {
    let mut pool = pool(
        Duration::ZERO,
        StagingOptions {
            chunk_bytes: 64,
            buffers: 2,
            lanes: 2,
        },
    );
    let source = bytes(1, 100);
    let small = HostMemory::zeroed(120);
    let err = pool
        .upload(&[Upload {
            source: &source,
            target: &small,
            offset: 21,
        }])
        .unwrap_err();
    assert!(
        matches!(&err, LoaderError::Device { detail, .. } if detail.contains("bytes 21..121") && detail.contains("120-byte")),
        "{err}"
    );
    assert_eq!(small.to_vec(), vec![0; 120], "nothing was copied");
    assert_eq!(small.len(), 120);
    let err = pool
        .upload(&[Upload {
            source: &source,
            target: &small,
            offset: u64::MAX - 5,
        }])
        .unwrap_err();
    assert!(matches!(err, LoaderError::Device { .. }), "{err}");
    for options in [
        StagingOptions {
            chunk_bytes: 0,
            buffers: 2,
            lanes: 1,
        },
        StagingOptions {
            chunk_bytes: 64,
            buffers: 0,
            lanes: 1,
        },
        StagingOptions {
            chunk_bytes: 64,
            buffers: 2,
            lanes: 0,
        },
    ] {
        let err = StagingPool::new(HostCopyEngine::new(Duration::ZERO), options).unwrap_err();
        assert!(matches!(err, LoaderError::Device { .. }), "{err}");
    }
}

#[test]
fn default_options_bound_pinned_memory() {
    let options = StagingOptions::default();
    assert_eq!(options.chunk_bytes, 8 << 20);
    assert_eq!(options.buffers, 2);
    assert!((1..=4).contains(&options.lanes));
    assert!(options.pinned_bytes() <= 64 << 20);
}

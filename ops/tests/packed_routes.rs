//! The job's messages have one packed form and two routes to it: the typed route that travels
//! ([`packed::to_wire`], [`packed::from_wire`]) and the definition over `serde_json::Value`
//! ([`packed::pack`], [`packed::unpack`]). On real plans from the planner (boxes and flat ranges,
//! with and without checksums, with and without memory-tier sources, several worlds) and real
//! hellos, the typed route writes the very text the value route writes, and each route reads
//! back what the other wrote.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tessera_loader::tier::Verified;
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta,
};
use tessera_ops::job::{Answer, Hello, packed};
use tessera_ops::load::agreement::JobTerms;
use tessera_ops::memory_tier::TierOffer;
use tessera_planner::{
    ExplicitRequests, PlanOptions, ReadSources, Request, RequestSet, SourceTier, Target,
    plan_with_sources,
};

const TENSORS: u64 = 24;
const ROWS: u64 = 64;
const COLS: u64 = 256;

/// 24 [64, 256] tensors (f32, but every fourth bf16) saved by rows over `world` files, with or
/// without crc32c checksums.
fn saved_by_rows(world: u64, checksums: bool) -> Arc<CheckpointMeta> {
    let dtype = |t: u64| if t % 4 == 3 { DType::Bf16 } else { DType::F32 };
    let tensors: Vec<TensorMeta> = (0..TENSORS)
        .map(|t| TensorMeta::new(format!("layers.{t}.weight"), dtype(t), vec![ROWS, COLS]))
        .collect();
    let rows = ROWS / world;
    let mut chunks = Vec::new();
    let mut offsets = vec![0u64; world as usize];
    for file in 0..world {
        for t in 0..TENSORS {
            let length = rows * COLS * dtype(t).size();
            chunks.push(SavedChunk {
                tensor: t as u32,
                region: TensorBox::new(vec![file * rows, 0], vec![rows, COLS]),
                bytes: ByteMeta {
                    file: file as u32,
                    offset: offsets[file as usize],
                    length,
                    strides: None,
                },
                crc32c: checksums.then_some(0x1234_5678 ^ (file * TENSORS + t) as u32),
                crc32: None,
            });
            offsets[file as usize] += length;
        }
    }
    let files = (0..world)
        .map(|f| DataFile {
            path: format!("__{f}_0.distcp"),
            size: Some(offsets[f as usize]),
            encoded: None,
        })
        .collect();
    Arc::new(CheckpointMeta::new(tensors, chunks, Vec::new(), files).unwrap())
}

/// Rank r's columns of the even tensors (boxes) and its share of the odd tensors' row-major
/// flattening (flat ranges): an all-to-all reshard of both kinds of target.
fn requests(world: u64) -> RequestSet {
    let cols = COLS / world;
    let flat = ROWS * COLS / world;
    RequestSet {
        ranks: (0..world)
            .map(|r| {
                (0..TENSORS)
                    .map(|t| Request {
                        tensor: t as u32,
                        target: if t % 2 == 0 {
                            Target::Box(TensorBox::new(vec![0, r * cols], vec![ROWS, cols]))
                        } else {
                            Target::Flat {
                                start: r * flat,
                                end: (r + 1) * flat,
                            }
                        },
                    })
                    .collect()
            })
            .collect(),
        disjoint: true,
    }
}

/// Half the files have a memory-tier copy that the ranks of their node (pairs of ranks) read.
fn tier_sources(world: u64) -> ReadSources {
    let mut sources = ReadSources::none();
    for file in (0..world as u32).step_by(2) {
        let node = file / 2 * 2;
        sources.add(file, SourceTier::NodeMemory, [node, node + 1]);
    }
    sources
}

/// What the value route writes for `value`: its packed JSON text, and the wire bytes around it.
fn value_route<T: Serialize>(value: &T) -> (Vec<u8>, Vec<u8>) {
    let text = serde_json::to_vec(&packed::pack(serde_json::to_value(value).unwrap())).unwrap();
    let mut wire = BytesMut::new();
    wire.put_u64_le(text.len() as u64);
    wire.extend_from_slice(&zstd::bulk::compress(&text, 3).unwrap());
    (text, wire.to_vec())
}

/// The packed JSON text inside wire bytes.
fn text_of(wire: &[u8]) -> Vec<u8> {
    let len = u64::from_le_bytes(wire[..8].try_into().unwrap()) as usize;
    zstd::bulk::decompress(&wire[8..], len).unwrap()
}

/// What the value route reads from packed JSON text.
fn value_read<T: DeserializeOwned>(text: &[u8]) -> T {
    let value = packed::unpack(serde_json::from_slice(text).unwrap()).unwrap();
    serde_json::from_value(value).unwrap()
}

/// Both routes agree on `value`: the same text, and each reads the other's (compared as the
/// values they serialize to: an answer has no `PartialEq`).
fn routes_agree<T: Serialize + DeserializeOwned>(value: &T, what: &str) {
    let typed_wire = packed::to_wire(value, what).unwrap();
    let typed_text = text_of(&typed_wire);
    let (value_text, value_wire) = value_route(value);
    assert!(
        typed_text == value_text,
        "{what}: the typed route wrote {} bytes of text where the value route wrote {}",
        typed_text.len(),
        value_text.len()
    );
    let expected = serde_json::to_value(value).unwrap();
    let by_value: T = value_read(&typed_text);
    assert_eq!(serde_json::to_value(&by_value).unwrap(), expected, "{what}");
    let typed: T = packed::from_wire(&value_wire, what).unwrap();
    assert_eq!(serde_json::to_value(&typed).unwrap(), expected, "{what}");
}

#[test]
fn every_ranks_answer_and_hello_is_one_text_by_either_route_and_reads_back_by_either() {
    for world in [2u64, 4, 8, 16] {
        for checksums in [false, true] {
            for tier in [false, true] {
                let meta = saved_by_rows(world, checksums);
                let requests = requests(world);
                let sources = if tier {
                    tier_sources(world)
                } else {
                    ReadSources::none()
                };
                let plan =
                    plan_with_sources(&meta, &requests, &PlanOptions::default(), &sources).unwrap();
                let explicit = ExplicitRequests::of(&requests, meta.tensors());
                for rank in 0..world as u32 {
                    let rank_plan = plan.rank_plan(rank).unwrap();
                    let what = format!(
                        "rank {rank} of {world} (checksums {checksums}, memory tier {tier})"
                    );
                    let node_verified = if tier {
                        vec![
                            Verified {
                                files: (0..world as u32).step_by(2).collect(),
                                ignored: vec!["/dev/shm/ckpt/__1_0.distcp: stale".to_string()],
                            },
                            Verified::default(),
                        ]
                    } else {
                        Vec::new()
                    };
                    let answer = Answer::Plan {
                        plan: Box::new(rank_plan.clone()),
                        node_verified,
                        joint_at_coordinator: rank % 2 == 0,
                        summary: Some(plan.summary().clone()),
                    };
                    routes_agree(&answer, &what);
                    // The plan read back is the plan made.
                    let bytes = answer.encode().unwrap();
                    match Answer::decode(rank, &bytes).unwrap() {
                        Answer::Plan { plan, .. } => assert_eq!(*plan, rank_plan, "{what}"),
                        other => panic!("{what}: decoded {other:?}"),
                    }
                    let hello = Hello {
                        requests: explicit.ranks[rank as usize].clone(),
                        tier: TierOffer {
                            node: if tier {
                                format!("node{}", rank / 2)
                            } else {
                                String::new()
                            },
                            files: if tier {
                                vec![rank, rank + 1]
                            } else {
                                Vec::new()
                            },
                        },
                        terms: JobTerms {
                            location: "s3://bucket/ckpt/step_100".to_string(),
                            checkpoint: format!("step_100@{world}"),
                            plan: vec![("dedup".to_string(), "true".to_string())],
                        },
                    };
                    routes_agree(&hello, &what);
                    assert_eq!(
                        packed::from_wire::<Hello>(&hello.encode().unwrap(), &what).unwrap(),
                        hello
                    );
                }
                // The coordinator's view of every joint check: the whole checkpoint's tensors.
                routes_agree(&plan.joint_checks_view(), &format!("joint view at {world}"));
            }
        }
    }
}

#[test]
fn the_other_answers_are_one_text_by_either_route() {
    routes_agree(&Answer::VerifyTier(vec![4, 5, 6, 7]), "verify tier");
    routes_agree(&Answer::VerifyTier(Vec::new()), "verify nothing");
    let meta = saved_by_rows(4, true);
    let plan = plan_with_sources(
        &meta,
        &requests(4),
        &PlanOptions::default(),
        &ReadSources::none(),
    )
    .unwrap();
    // A plan of rank 0 alone (one of everything: a record per array is written as it is).
    let mut single = plan.rank_plan(0).unwrap();
    single.pieces.truncate(1);
    single.destinations.truncate(1);
    single.exchanges.truncate(1);
    routes_agree(
        &Answer::Plan {
            plan: Box::new(single),
            node_verified: Vec::new(),
            joint_at_coordinator: false,
            summary: None,
        },
        "a plan of one piece",
    );
}

#[test]
fn a_message_that_is_not_packed_is_refused_by_the_typed_route_naming_it() {
    let text = br#"{"VerifyTier":{"\u0001d":[1,"x"]}}"#;
    let mut wire = BytesMut::new();
    wire.put_u64_le(text.len() as u64);
    wire.extend_from_slice(&zstd::bulk::compress(text, 3).unwrap());
    let error = packed::from_wire::<Answer>(&wire, "rank 3's answer")
        .unwrap_err()
        .to_string();
    assert!(error.contains("rank 3's answer"), "{error}");
    assert!(error.contains("not an integer"), "{error}");
    // Packed well but not an answer: serde's message, naming the message.
    let wire = packed::to_wire(&Value::from(vec![1, 2, 3]), "x").unwrap();
    let error = packed::from_wire::<Answer>(&wire, "rank 3's answer")
        .unwrap_err()
        .to_string();
    assert!(error.contains("decoding rank 3's answer"), "{error}");
}

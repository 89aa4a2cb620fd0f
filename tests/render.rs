//! Property ("fuzz-style") tests of the CLI's text rendering: whatever a checkpoint's metadata or
//! a plan holds (65,536-character or non-ASCII names, dims near u64::MAX, NaN ratios), the
//! inspect table, the plan summary, the dump's tensor names and box display render without
//! panicking and keep what they must show.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashSet;

use proptest::prelude::*;
use tessera::commands::inspect::tensor_table;
use tessera::commands::load::dump_names;
use tessera::commands::plan::summary_text;
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta,
};
use tessera_planner::PlanSummary;

fn meta(tensors: Vec<TensorMeta>) -> CheckpointMeta {
    let chunks = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| SavedChunk {
            tensor: i as u32,
            region: t.full_box(),
            bytes: ByteMeta {
                file: 0,
                offset: 0,
                length: 0,
                strides: None,
            },
            crc32c: None,
            crc32: None,
        })
        .collect();
    let files = vec![DataFile {
        path: "data".to_string(),
        size: None,
        encoded: None,
    }];
    CheckpointMeta::new(tensors, chunks, Vec::new(), files).unwrap()
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![
        Just(DType::Bool),
        Just(DType::U8),
        Just(DType::Bf16),
        Just(DType::F32),
        Just(DType::F64),
    ]
}

/// Names as they come from foreign metadata: empty, long, non-ASCII, control characters.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "\\PC{0,40}",
        ".{0,8}",
        (1usize..70_000).prop_map(|n| "x".repeat(n)),
        (1usize..3_000).prop_map(|n| "é\u{1F600}".repeat(n)),
    ]
}

fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..10,
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        any::<u64>()
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn inspect_table_renders_any_tensor(
        tensors in prop::collection::vec((name(), dtype(), prop::collection::vec(dim(), 0..4)), 0..6)
    ) {
        let tensors: Vec<TensorMeta> = tensors
            .into_iter()
            .map(|(n, d, shape)| TensorMeta::new(n, d, shape))
            .collect();
        let table = tensor_table(&meta(tensors.clone()));
        let lines: Vec<&str> = table.lines().collect();
        prop_assert!(lines[0].starts_with("FQN"));
        let rows = lines.len() - 1;
        // A name with a line break spans lines; every tensor still has its row.
        prop_assert!(rows >= tensors.len());
        for t in &tensors {
            prop_assert!(table.contains(t.fqn.as_str()));
        }
    }

    #[test]
    fn plan_summary_renders_any_numbers(
        ranks in any::<u32>(),
        counts in prop::array::uniform6(any::<u64>()),
        bytes in prop::array::uniform4(any::<u64>()),
        ratio in prop_oneof![any::<f64>(), Just(f64::NAN), Just(f64::INFINITY)],
        mean in any::<f64>(),
        seconds in any::<f64>(),
    ) {
        let s = PlanSummary {
            ranks,
            destinations: counts[0],
            pieces: counts[1],
            exchange_groups: counts[2],
            bytes_needed: bytes[0],
            unique_bytes_needed: bytes[1],
            bytes_read: bytes[2],
            read_amplification: ratio,
            bytes_exchanged: bytes[3],
            max_read_per_rank: counts[3],
            mean_read_per_rank: mean,
            max_rounds: counts[4],
            bytes_relayed: 0,
            slabs: 0,
            holder_read_pieces: 0,
            bytes_read_from_tier: 0,
            replayed: false,
        };
        let text = summary_text(&s, seconds);
        let first = text.lines().next().unwrap().to_string();
        prop_assert_eq!(first, format!("ranks                {ranks}"));
        prop_assert_eq!(text.lines().count(), 11);
    }

    #[test]
    fn dump_names_are_unique_and_keep_the_fqn(
        fqns in prop::collection::vec(prop_oneof!["[ab]{0,2}", "[ab]#[1-3]", "\\PC{0,6}"], 0..64)
    ) {
        let names = dump_names(fqns.iter().map(String::as_str));
        prop_assert_eq!(names.len(), fqns.len());
        let unique: HashSet<&String> = names.iter().collect();
        prop_assert_eq!(unique.len(), names.len(), "{:?} -> {:?}", fqns, names);
        for (fqn, name) in fqns.iter().zip(&names) {
            let numbered = format!("{}#", fqn);
            prop_assert!(name == fqn || name.starts_with(&numbered));
        }
    }

    #[test]
    fn boxes_display_their_true_end(
        dims in prop::collection::vec((any::<u64>(), any::<u64>()), 0..4)
    ) {
        let region = TensorBox::new(
            dims.iter().map(|d| d.0).collect::<Vec<_>>(),
            dims.iter().map(|d| d.1).collect::<Vec<_>>(),
        );
        let expected: Vec<String> = dims
            .iter()
            .map(|(o, l)| format!("{o}..{}", u128::from(*o) + u128::from(*l)))
            .collect();
        prop_assert_eq!(region.to_string(), format!("[{}]", expected.join(", ")));
    }
}

/// The name that panicked `tessera inspect` ("Formatting argument out of range").
#[test]
fn inspect_table_with_a_65536_character_name() {
    let long = "w".repeat(65_536);
    let table = tensor_table(&meta(vec![
        TensorMeta::new(long.clone(), DType::F32, vec![2, 3]),
        TensorMeta::new("b", DType::Bf16, vec![4]),
    ]));
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3);
    // Compared without the name, so that a failure does not print 65,536 characters.
    let rest = lines[1].strip_prefix(long.as_str()).unwrap();
    assert_eq!(
        rest,
        format!("  {:6}  {:18}  {:>6}  {:>12}", "f32", "[2, 3]", 1, "24 B")
    );
    // Short names are padded to the capped column, not to 65,536 characters.
    assert!(lines[2].len() < 200, "{}", lines[2]);
    assert!(lines[2].starts_with("b   "));
}

#[test]
fn dump_names_number_repeated_tensors_past_taken_names() {
    let names = dump_names(["a", "a#1", "a", "a", "b"].into_iter());
    assert_eq!(names, ["a", "a#1", "a#2", "a#3", "b"]);
}

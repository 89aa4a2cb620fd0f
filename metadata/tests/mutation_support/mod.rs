//! Byte mutations of real files for the parsers' never-panic suites (`*_fuzz.rs`): edits that
//! set bytes, write pickle opcodes or zip signature bytes, insert, delete and truncate, each at a
//! position drawn inside a chosen span of the file.
#![allow(dead_code)]

use proptest::prelude::*;
use proptest::sample::Index;

/// Bytes that are pickle opcodes (and zip signature bytes), to make mutations meaningful.
pub const INTERESTING: &[u8] = &[
    b'(', b'.', b'0', b'1', b'2', b'C', b'J', b'K', b'M', b'N', b'Q', b'R', b'X', b'a', b'b', b'c',
    b'e', b'h', b'j', b'q', b'r', b's', b't', b'u', b')', b']', b'}', 0x80, 0x81, 0x85, 0x86, 0x87,
    0x88, 0x89, 0x8a, 0x8b, 0x8c, 0x8d, 0x8e, 0x8f, 0x90, 0x91, 0x92, 0x93, 0x94, 0x95, 0x96, 0x97,
    0x98, 0xff, 0x00, b'P', b'K', 0x01, 0x02, 0x05, 0x06,
];

#[derive(Clone, Debug)]
pub enum Edit {
    Set(Index, u8),
    Opcode(Index, Index),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Truncate(Index),
}

pub fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        4 => (any::<Index>(), any::<Index>()).prop_map(|(i, o)| Edit::Opcode(i, o)),
        2 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| Edit::Insert(i, b)),
        2 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| Edit::Delete(i, n)),
        1 => any::<Index>().prop_map(Edit::Truncate),
    ]
}

/// `base` with `edits` applied, each at a position inside `within` (clamped to the bytes left).
pub fn mutate(base: &[u8], edits: &[Edit], within: std::ops::Range<usize>) -> Vec<u8> {
    let mut out = base.to_vec();
    for e in edits {
        let span = within.end.min(out.len()).saturating_sub(within.start);
        if span == 0 {
            break;
        }
        let at = |i: &Index| within.start + i.index(span);
        match e {
            Edit::Set(i, b) => {
                let k = at(i);
                out[k] = *b;
            }
            Edit::Opcode(i, o) => {
                let k = at(i);
                out[k] = INTERESTING[o.index(INTERESTING.len())];
            }
            Edit::Insert(i, bytes) => {
                let k = at(i);
                out.splice(k..k, bytes.iter().copied());
            }
            Edit::Delete(i, n) => {
                let k = at(i);
                let end = (k + n).min(out.len());
                out.drain(k..end);
            }
            Edit::Truncate(i) => {
                let k = at(i);
                out.truncate(k);
            }
        }
    }
    out
}

//! Property test: random single-threaded operation sequences on the allocator
//! against a brute-force model (a Vec stack of free ids + a state per block).
//!
//! Invariants checked after every operation:
//! * results agree exactly: same ids (the free list is LIFO, initially 0,1,2,..),
//!   same new counts, same error variants for bad ids / double frees / misuse;
//! * every block's refcount and free/parked status equal the model's;
//! * `num_free()` and the free-list contents equal the model's stack;
//! * `allocate_n` is all-or-nothing.

use hybridserve_core::{BlockAllocator, CoreError};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Allocate,
    AllocateN(usize),
    Incref(u32),
    Decref(u32),
    DecrefRetain(u32),
    Release(u32),
    Revive(u32),
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum St {
    Free,
    Parked,
    Ref(u32),
}

struct Model {
    stack: Vec<u32>, // top = last
    st: Vec<St>,
}

impl Model {
    fn new(n: u32) -> Self {
        Model { stack: (0..n).rev().collect(), st: vec![St::Free; n as usize] }
    }
    fn get(&self, b: u32) -> Option<St> {
        self.st.get(b as usize).copied()
    }
}

fn op_strategy(n: u32) -> impl Strategy<Value = Op> {
    let id = 0..n + 2; // includes out-of-range ids
    prop_oneof![
        3 => Just(Op::Allocate),
        1 => (0..(n as usize + 2)).prop_map(Op::AllocateN),
        2 => id.clone().prop_map(Op::Incref),
        3 => id.clone().prop_map(Op::Decref),
        1 => id.clone().prop_map(Op::DecrefRetain),
        1 => id.clone().prop_map(Op::Release),
        1 => id.prop_map(Op::Revive),
    ]
}

fn is_invalid_block<T: std::fmt::Debug>(r: &Result<T, CoreError>, b: u32) -> bool {
    matches!(r, Err(CoreError::InvalidBlock { block, .. }) if *block == b)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn allocator_matches_model(n in 1u32..12, ops in proptest::collection::vec(op_strategy(12), 1..120)) {
        let a = BlockAllocator::new(n);
        let mut m = Model::new(n);
        for op in ops {
            match op {
                Op::Allocate => {
                    let r = a.allocate();
                    match m.stack.pop() {
                        Some(b) => { prop_assert_eq!(r, Ok(b)); m.st[b as usize] = St::Ref(1); }
                        None => prop_assert_eq!(r, Err(CoreError::OutOfBlocks { needed: 1, free: 0 })),
                    }
                }
                Op::AllocateN(k) => {
                    let mut out = vec![999];
                    let r = a.allocate_n(k, &mut out);
                    if k <= m.stack.len() {
                        prop_assert!(r.is_ok());
                        let mut expect = vec![999];
                        for _ in 0..k { let b = m.stack.pop().unwrap(); m.st[b as usize] = St::Ref(1); expect.push(b); }
                        prop_assert_eq!(out, expect);
                    } else {
                        prop_assert_eq!(r, Err(CoreError::OutOfBlocks { needed: k as u32, free: m.stack.len() as u32 }));
                        prop_assert_eq!(out, vec![999]);
                    }
                }
                Op::Incref(b) => {
                    let r = a.incref(b);
                    match m.get(b) {
                        Some(St::Ref(c)) => { prop_assert_eq!(r, Ok(c + 1)); m.st[b as usize] = St::Ref(c + 1); }
                        _ => prop_assert!(is_invalid_block(&r, b)),
                    }
                }
                Op::Decref(b) | Op::DecrefRetain(b) => {
                    let retain = matches!(op, Op::DecrefRetain(_));
                    let r = if retain { a.decref_retain(b) } else { a.decref(b) };
                    match m.get(b) {
                        Some(St::Ref(c)) => {
                            prop_assert_eq!(r, Ok(c - 1));
                            m.st[b as usize] = match (c - 1, retain) {
                                (0, true) => St::Parked,
                                (0, false) => { m.stack.push(b); St::Free }
                                (k, _) => St::Ref(k),
                            };
                        }
                        _ => prop_assert!(is_invalid_block(&r, b)),
                    }
                }
                Op::Release(b) => {
                    let r = a.release(b);
                    if m.get(b) == Some(St::Parked) {
                        prop_assert_eq!(r, Ok(()));
                        m.st[b as usize] = St::Free;
                        m.stack.push(b);
                    } else {
                        prop_assert!(is_invalid_block(&r, b));
                    }
                }
                Op::Revive(b) => {
                    let r = a.revive(b);
                    if m.get(b) == Some(St::Parked) {
                        prop_assert_eq!(r, Ok(()));
                        m.st[b as usize] = St::Ref(1);
                    } else {
                        prop_assert!(is_invalid_block(&r, b));
                    }
                }
            }
            prop_assert_eq!(a.num_free() as usize, m.stack.len());
            let mut top_first = m.stack.clone();
            top_first.reverse();
            prop_assert_eq!(a.free_list_snapshot(), top_first);
            for b in 0..n {
                let (rc, free) = match m.st[b as usize] { St::Free => (0, true), St::Parked => (0, false), St::Ref(c) => (c, false) };
                prop_assert_eq!(a.refcount(b), rc, "block {}", b);
                prop_assert_eq!(a.is_free(b), free, "block {}", b);
            }
        }
    }
}

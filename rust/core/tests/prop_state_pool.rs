//! Property test: random StatePool operations against a brute-force model (a
//! LIFO stack of free slots plus a use per slot).
//!
//! Invariants after every operation: identical results (slot ids, error
//! variants), a slot is free xor used, `num_free + num_used == num_slots`,
//! `allocate_n` all-or-nothing, `fork` returns `(src, fresh slot)` and refuses a
//! free or unknown source; exhaustion is `OutOfSlots`, never a panic.

use hybridserve_core::{CoreError, SlotUse, StatePool};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Allocate,
    AllocateN(usize),
    Checkpoint(u64),
    Free(u32),
    Fork(u32),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn state_pool_matches_model(
        n in 0u32..8,
        ops in proptest::collection::vec(prop_oneof![
            3 => Just(Op::Allocate),
            1 => (0usize..10).prop_map(Op::AllocateN),
            1 => any::<u64>().prop_map(Op::Checkpoint),
            3 => (0u32..10).prop_map(Op::Free),
            2 => (0u32..10).prop_map(Op::Fork),
        ], 1..100)
    ) {
        let mut p = StatePool::new(n);
        let mut stack: Vec<u32> = (0..n).rev().collect();
        let mut uses = vec![SlotUse::Free; n as usize];
        for op in ops {
            match op {
                Op::Allocate | Op::Checkpoint(_) => {
                    let (r, u) = match op {
                        Op::Checkpoint(h) => (p.allocate_checkpoint(h), SlotUse::Checkpoint { block_hash: h }),
                        _ => (p.allocate(), SlotUse::Sequence),
                    };
                    match stack.pop() {
                        Some(s) => { prop_assert_eq!(r, Ok(s)); uses[s as usize] = u; }
                        None => prop_assert_eq!(r, Err(CoreError::OutOfSlots { needed: 1, free: 0 })),
                    }
                }
                Op::AllocateN(k) => {
                    let mut out = Vec::new();
                    let r = p.allocate_n(k, &mut out);
                    if k <= stack.len() {
                        prop_assert!(r.is_ok());
                        let expect: Vec<u32> = (0..k).map(|_| stack.pop().unwrap()).collect();
                        for &s in &expect { uses[s as usize] = SlotUse::Sequence; }
                        prop_assert_eq!(out, expect);
                    } else {
                        prop_assert_eq!(r, Err(CoreError::OutOfSlots { needed: k as u32, free: stack.len() as u32 }));
                        prop_assert!(out.is_empty());
                    }
                }
                Op::Free(s) => {
                    let r = p.free(s);
                    match uses.get(s as usize) {
                        Some(SlotUse::Free) | None => { let ok = matches!(r, Err(CoreError::InvalidSlot { slot, .. }) if slot == s); prop_assert!(ok, "{:?}", r) },
                        Some(_) => { prop_assert_eq!(r, Ok(())); uses[s as usize] = SlotUse::Free; stack.push(s); }
                    }
                }
                Op::Fork(s) => {
                    let r = p.fork(s);
                    match uses.get(s as usize) {
                        Some(SlotUse::Free) | None => { let ok = matches!(r, Err(CoreError::InvalidSlot { slot, .. }) if slot == s); prop_assert!(ok, "{:?}", r) },
                        Some(_) => match stack.pop() {
                            Some(d) => { prop_assert_eq!(r, Ok((s, d))); uses[d as usize] = SlotUse::Sequence; }
                            None => prop_assert_eq!(r, Err(CoreError::OutOfSlots { needed: 1, free: 0 })),
                        },
                    }
                }
            }
            prop_assert_eq!(p.num_free() as usize, stack.len());
            prop_assert_eq!(p.num_free() + p.num_used(), p.num_slots());
            for s in 0..n {
                prop_assert_eq!(p.slot_use(s), Some(uses[s as usize]));
            }
            prop_assert_eq!(p.slot_use(n), None);
        }
    }
}

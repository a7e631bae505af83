//! Exhaustive (bounded) model check of the lock-free allocator with loom: every
//! interleaving of a few operations on a tiny pool, under the C11 memory model.
//!
//! Checked in every explored execution:
//! * no block has two owners at once (an ownership flag per block, set with a
//!   swap that must observe `false` when a thread receives the block);
//! * no block is lost or duplicated: once all threads join, the free list holds
//!   every block exactly once and `num_free()` equals the pool size.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release
//! -p hybridserve-core --test loom_allocator`. Preemptions are bounded in code (3)
//! so the search takes about a second (release). Mutation-checked: dropping the
//! ABA tag or making the refcount decrement a load+store fails these tests.
#![cfg(loom)]

use hybridserve_core::{BlockAllocator, CoreError};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

struct Owners(Vec<AtomicBool>);
impl Owners {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Owners((0..n).map(|_| AtomicBool::new(false)).collect()))
    }
    fn take(&self, b: u32) {
        assert!(!self.0[b as usize].swap(true, Ordering::SeqCst), "block {b} handed to two owners");
    }
    fn give_back(&self, b: u32) {
        assert!(self.0[b as usize].swap(false, Ordering::SeqCst), "block {b} returned by a non-owner");
    }
}

fn assert_all_free(a: &BlockAllocator) {
    let mut list = a.free_list_snapshot();
    assert_eq!(a.num_free() as usize, list.len(), "free count disagrees with the free list");
    list.sort_unstable();
    let expect: Vec<u32> = (0..a.num_blocks()).collect();
    assert_eq!(list, expect, "a block was lost or pushed twice");
    for b in 0..a.num_blocks() {
        assert_eq!(a.refcount(b), 0);
    }
}

/// Two threads each allocate and free twice on a 2-block pool: both pops and
/// pushes race on the head, exercising the ABA tag.
#[test]
fn allocate_free_race() {
    model(|| {
        let a = Arc::new(BlockAllocator::new(2));
        let owners = Owners::new(2);
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (a, owners) = (a.clone(), owners.clone());
                thread::spawn(move || {
                    for _ in 0..2 {
                        let b = a.allocate().expect("2 blocks, at most 2 held at once");
                        owners.take(b);
                        owners.give_back(b);
                        assert_eq!(a.decref(b), Ok(0));
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_all_free(&a);
    });
}

/// One block, two threads competing: at most one wins each round and the loser
/// gets OutOfBlocks, never the same block.
#[test]
fn contended_single_block() {
    model(|| {
        let a = Arc::new(BlockAllocator::new(1));
        let owners = Owners::new(1);
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (a, owners) = (a.clone(), owners.clone());
                thread::spawn(move || match a.allocate() {
                    Ok(b) => {
                        owners.take(b);
                        owners.give_back(b);
                        a.decref(b).unwrap();
                    }
                    Err(e) => assert_eq!(e, CoreError::OutOfBlocks { needed: 1, free: 0 }),
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_all_free(&a);
    });
}

/// A block shared by two threads (count 2) is dropped by both concurrently
/// while one of them also allocates: exactly one decref sees 0 and frees it.
#[test]
fn shared_block_last_decref_frees_once() {
    model(|| {
        let a = Arc::new(BlockAllocator::new(3));
        let owners = Owners::new(3);
        let shared = a.allocate().unwrap();
        assert_eq!(a.incref(shared), Ok(2));
        let t = {
            let (a, owners) = (a.clone(), owners.clone());
            thread::spawn(move || {
                let b = a.allocate().unwrap();
                owners.take(b);
                let left = a.decref(shared).unwrap();
                owners.give_back(b);
                a.decref(b).unwrap();
                left
            })
        };
        let mine = a.decref(shared).unwrap();
        let theirs = t.join().unwrap();
        assert_eq!(mine.min(theirs), 0, "nobody saw the count reach 0");
        assert_eq!(mine.max(theirs), 1);
        assert_all_free(&a);
    });
}

/// allocate_n is all-or-nothing against a concurrent allocate; refcounts (incref
/// on an owned block) survive the race.
#[test]
fn allocate_n_all_or_nothing() {
    model(|| {
        let a = Arc::new(BlockAllocator::new(3));
        let owners = Owners::new(3);
        let t = {
            let (a, owners) = (a.clone(), owners.clone());
            thread::spawn(move || {
                let mut v = Vec::new();
                match a.allocate_n(2, &mut v) {
                    Ok(()) => {
                        assert_eq!(v.len(), 2);
                        for &b in &v {
                            owners.take(b);
                        }
                        for &b in &v {
                            owners.give_back(b);
                            a.decref(b).unwrap();
                        }
                    }
                    Err(CoreError::OutOfBlocks { .. }) => assert!(v.is_empty(), "partial allocate_n"),
                    Err(e) => panic!("{e}"),
                }
            })
        };
        if let Ok(b) = a.allocate() {
            owners.take(b);
            assert_eq!(a.incref(b), Ok(2));
            assert_eq!(a.decref(b), Ok(1));
            owners.give_back(b);
            assert_eq!(a.decref(b), Ok(0));
        }
        t.join().unwrap();
        assert_all_free(&a);
    });
}

//! Multi-thread stress test of the lock-free allocator: threads hammer
//! allocate / allocate_n / incref / decref / decref_retain + release|revive on a
//! small pool (so the free list is hot and often empty) and pass shared
//! references to each other, then everything is dropped and the pool must hold
//! every block exactly once.
//!
//! Oracle: an independent per-block reference counter kept by the test (bumped
//! before a reference exists, dropped before it is given back), so the
//! allocator handing out a block that someone still holds is caught at once.

use hybridserve_core::{BlockAllocator, CoreError};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex};

const BLOCKS: u32 = 48;
const THREADS: usize = 4;
const OPS: usize = 200_000;

struct Shared {
    a: BlockAllocator,
    held: Vec<AtomicU32>,    // references the test believes exist
    parked: Vec<AtomicBool>, // count-0 blocks some thread parked and must release/revive
    mailbox: Mutex<Vec<u32>>, // references in transit between threads
}

impl Shared {
    fn got_new(&self, b: u32) {
        assert!(!self.parked[b as usize].load(SeqCst), "allocate returned parked block {b}");
        let prev = self.held[b as usize].fetch_add(1, SeqCst);
        assert_eq!(prev, 0, "block {b} handed out while {prev} references exist");
    }
    fn drop_ref(&self, b: u32, retain: bool) -> bool {
        self.held[b as usize].fetch_sub(1, SeqCst);
        let left = if retain { self.a.decref_retain(b) } else { self.a.decref(b) }.expect("held block");
        if left == 0 && retain {
            self.parked[b as usize].store(true, SeqCst);
            return true;
        }
        false
    }
}

/// xorshift: deterministic per thread, no dependency.
fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn hammer_then_everything_free_exactly_once() {
    let s = Arc::new(Shared {
        a: BlockAllocator::new(BLOCKS),
        held: (0..BLOCKS).map(|_| AtomicU32::new(0)).collect(),
        parked: (0..BLOCKS).map(|_| AtomicBool::new(false)).collect(),
        mailbox: Mutex::new(Vec::new()),
    });
    // Start together so the threads really overlap instead of running one by one.
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let s = s.clone();
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ ((t as u64 + 1) * 0x1234_5678_9ABC);
                let mut mine: Vec<u32> = Vec::new(); // references this thread holds
                let mut parked: Vec<u32> = Vec::new();
                let mut buf = Vec::new();
                for _ in 0..OPS {
                    match rng(&mut seed) % 9 {
                        0 | 1 if mine.len() < 8 => match s.a.allocate() {
                            Ok(b) => {
                                s.got_new(b);
                                mine.push(b);
                            }
                            Err(CoreError::OutOfBlocks { .. }) => {}
                            Err(e) => panic!("{e}"),
                        },
                        2 if mine.len() < 8 => {
                            buf.clear();
                            let n = 1 + (rng(&mut seed) % 3) as usize;
                            match s.a.allocate_n(n, &mut buf) {
                                Ok(()) => {
                                    assert_eq!(buf.len(), n);
                                    for &b in &buf {
                                        s.got_new(b);
                                        mine.push(b);
                                    }
                                }
                                Err(_) => assert!(buf.is_empty(), "allocate_n left a partial result"),
                            }
                        }
                        3 if !mine.is_empty() => {
                            // share one reference with another thread via the mailbox
                            let b = mine[(rng(&mut seed) as usize) % mine.len()];
                            s.held[b as usize].fetch_add(1, SeqCst);
                            assert!(s.a.incref(b).unwrap() >= 2);
                            s.mailbox.lock().unwrap().push(b);
                        }
                        4 => {
                            if let Some(b) = s.mailbox.lock().unwrap().pop() {
                                mine.push(b);
                            }
                        }
                        5 | 6 if !mine.is_empty() => {
                            let i = (rng(&mut seed) as usize) % mine.len();
                            let b = mine.swap_remove(i);
                            s.drop_ref(b, false);
                        }
                        7 if !mine.is_empty() => {
                            let i = (rng(&mut seed) as usize) % mine.len();
                            let b = mine.swap_remove(i);
                            if s.drop_ref(b, true) {
                                parked.push(b);
                            }
                        }
                        8 if !parked.is_empty() => {
                            let b = parked.pop().unwrap();
                            s.parked[b as usize].store(false, SeqCst);
                            if rng(&mut seed) & 1 == 0 {
                                s.got_new(b);
                                s.a.revive(b).expect("our parked block");
                                mine.push(b);
                            } else {
                                s.a.release(b).expect("our parked block");
                            }
                        }
                        _ => {}
                    }
                }
                for b in mine {
                    s.drop_ref(b, false);
                }
                for b in parked {
                    s.parked[b as usize].store(false, SeqCst);
                    s.a.release(b).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for b in std::mem::take(&mut *s.mailbox.lock().unwrap()) {
        s.drop_ref(b, false);
    }
    let mut list = s.a.free_list_snapshot();
    assert_eq!(s.a.num_free() as usize, list.len());
    list.sort_unstable();
    assert_eq!(list, (0..BLOCKS).collect::<Vec<_>>(), "a block was lost or freed twice");
    for b in 0..BLOCKS {
        assert_eq!(s.a.refcount(b), 0);
        assert!(s.a.is_free(b));
        assert_eq!(s.held[b as usize].load(SeqCst), 0);
    }
}

//! DeltaNet state-slot pool: a fixed number of slots, each holding one
//! sequence's recurrent state (all DeltaNet layers) or a checkpoint of a state
//! at a block boundary, keyed by that block's chained hash, for prefix caching
//! on the hybrid model ([`SlotUse::Checkpoint`], managed by the scheduler's
//! `checkpoints` module).
//!
//! Invariants (checked by `tests/prop_state_pool.rs`): a slot is free xor in use;
//! `num_free() + num_used() == num_slots()`; exhaustion and misuse are
//! `CoreError` values, never panics. Every operation is O(1) (`allocate_n`: O(n)).
//! Allocation order: most recently freed first (a LIFO free stack), starting from
//! slot 0 upwards.

use crate::error::CoreError;
use crate::SlotId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotUse {
    Free,
    /// A live sequence's state.
    Sequence,
    /// The state after the block with this chained hash (prefix caching on
    /// the hybrid model).
    Checkpoint { block_hash: u64 },
}

#[derive(Debug, Clone)]
pub struct StatePool {
    uses: Vec<SlotUse>,
    free: Vec<SlotId>,
}

impl StatePool {
    pub fn new(num_slots: u32) -> Self {
        StatePool { uses: vec![SlotUse::Free; num_slots as usize], free: (0..num_slots).rev().collect() }
    }

    #[inline]
    pub fn num_slots(&self) -> u32 {
        self.uses.len() as u32
    }
    #[inline]
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }
    #[inline]
    pub fn num_used(&self) -> u32 {
        self.num_slots() - self.num_free()
    }

    /// What slot `s` holds, or `None` if out of range.
    pub fn slot_use(&self, s: SlotId) -> Option<SlotUse> {
        self.uses.get(s as usize).copied()
    }

    fn take(&mut self, u: SlotUse) -> Result<SlotId, CoreError> {
        let s = self.free.pop().ok_or(CoreError::OutOfSlots { needed: 1, free: 0 })?;
        self.uses[s as usize] = u;
        Ok(s)
    }

    pub fn allocate(&mut self) -> Result<SlotId, CoreError> {
        self.take(SlotUse::Sequence)
    }

    /// Appends `n` slots to `out`, or none (`OutOfSlots`).
    pub fn allocate_n(&mut self, n: usize, out: &mut Vec<SlotId>) -> Result<(), CoreError> {
        if n > self.free.len() {
            return Err(CoreError::OutOfSlots { needed: n.min(u32::MAX as usize) as u32, free: self.num_free() });
        }
        for _ in 0..n {
            let s = self.take(SlotUse::Sequence).expect("counted above");
            out.push(s);
        }
        Ok(())
    }

    /// A slot holding the state checkpointed after the block hashed `block_hash`.
    pub fn allocate_checkpoint(&mut self, block_hash: u64) -> Result<SlotId, CoreError> {
        self.take(SlotUse::Checkpoint { block_hash })
    }

    /// Hands a checkpoint's slot to a sequence that resumes from it (no copy).
    pub fn checkpoint_to_sequence(&mut self, slot: SlotId) -> Result<(), CoreError> {
        match self.uses.get(slot as usize) {
            Some(SlotUse::Checkpoint { .. }) => {
                self.uses[slot as usize] = SlotUse::Sequence;
                Ok(())
            }
            None => Err(CoreError::InvalidSlot { slot, reason: "id out of range" }),
            Some(_) => Err(CoreError::InvalidSlot { slot, reason: "not a checkpoint slot" }),
        }
    }

    /// Returns an in-use slot (sequence or checkpoint) to the pool.
    pub fn free(&mut self, slot: SlotId) -> Result<(), CoreError> {
        match self.uses.get(slot as usize) {
            None => Err(CoreError::InvalidSlot { slot, reason: "id out of range" }),
            Some(SlotUse::Free) => Err(CoreError::InvalidSlot { slot, reason: "slot is already free (double free?)" }),
            Some(_) => {
                self.uses[slot as usize] = SlotUse::Free;
                self.free.push(slot);
                Ok(())
            }
        }
    }

    /// A new sequence slot for a forked child of the sequence in `src`; returns
    /// `(src, dst)` for the runner to copy the state before the next step.
    pub fn fork(&mut self, src: SlotId) -> Result<(SlotId, SlotId), CoreError> {
        match self.uses.get(src as usize) {
            None => return Err(CoreError::InvalidSlot { slot: src, reason: "id out of range" }),
            Some(SlotUse::Free) => return Err(CoreError::InvalidSlot { slot: src, reason: "fork of a free slot" }),
            Some(_) => {}
        }
        let dst = self.allocate()?;
        Ok((src, dst))
    }
}

//! Prefixes a client asked to keep in the prefix cache for a while: Anthropic's prompt-caching
//! breakpoints (`cache_control`, a time to live of 5 minutes or an hour) and OpenAI's
//! `prompt_cache_key` (one prefix kept warm per key). A pin holds a reference on each of its
//! blocks, so the pool's least-recently-used eviction passes them by until the pin expires.
//!
//! Pins are bounded: together they hold at most [`PrefixPins::max_blocks`] distinct blocks (a
//! share of the pool, [`PIN_SHARE_DIVISOR`]); a new pin that would pass it displaces the pins
//! that expire soonest, and one larger than the share alone is refused. The scheduler gives pins
//! up, soonest to expire first, only when a request cannot run at all otherwise (nothing else is
//! running and the pool is short): see `plan::schedule`.
//!
//! This file keeps the pins' bookkeeping; the pool's references and the block contents' pins are
//! taken and given back by [`crate::kv_cache_manager::KvCacheManager`].

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use crate::block_pool::{BlockHash, BlockId};

/// Pins together hold at most the pool's blocks divided by this.
pub const PIN_SHARE_DIVISOR: usize = 4;

/// Pins in force at most (each client's key and each breakpoint's prefix is one).
pub const MAX_PINS: usize = 64;

/// What names a pin: asking again with the same key refreshes or replaces it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PinKey {
    /// A breakpoint: the prefix whose last block has this hash (the same prefix pinned again
    /// lives until the later of the two expiries).
    Prefix(BlockHash),
    /// A client's key (`prompt_cache_key`): its newest prefix replaces the one it pinned before.
    Client(String),
}

#[derive(Debug)]
struct Pin {
    blocks: Vec<BlockId>,
    /// Blocks whose bounded parts (sliding windows' KV, recurrent states) the pin keeps.
    bounded: Vec<BlockId>,
    expires: Instant,
}

/// A pin given up: the caller drops its pool references and its bounded parts' pins.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unpinned {
    pub blocks: Vec<BlockId>,
    pub bounded: Vec<BlockId>,
}

/// Why a prefix was not pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinRefused {
    /// Its blocks alone are more than the pins' share of the pool ([`PrefixPins::max_blocks`]).
    TooLarge { max_blocks: usize },
}

/// The pins in force.
#[derive(Debug)]
pub struct PrefixPins {
    /// In key order: pins expire, and their blocks go back to the pool, in the same order in
    /// every process (ranks of a divided batch must evict alike).
    pins: BTreeMap<PinKey, Pin>,
    /// Pins holding each block.
    refs: HashMap<BlockId, u32>,
    max_blocks: usize,
    /// No pin expires before this (`None`: no pin).
    next_expiry: Option<Instant>,
}

impl PrefixPins {
    /// Pins of a pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            pins: BTreeMap::new(),
            refs: HashMap::new(),
            max_blocks: num_blocks / PIN_SHARE_DIVISOR,
            next_expiry: None,
        }
    }

    /// The most distinct blocks pins hold together.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Distinct blocks pinned now.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Pins in force.
    pub fn len(&self) -> usize {
        self.pins.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }

    /// Extends the pin under `key` to `expires` (when later) if it holds exactly `blocks`;
    /// false, changing nothing, otherwise.
    pub fn refresh(&mut self, key: &PinKey, blocks: &[BlockId], expires: Instant) -> bool {
        match self.pins.get_mut(key) {
            Some(pin) if pin.blocks == blocks => {
                pin.expires = pin.expires.max(expires);
                self.next_expiry = self.pins.values().map(|p| p.expires).min();
                true
            }
            _ => false,
        }
    }

    /// Pins `blocks` (with `bounded`, the blocks whose bounded parts a hit on them reads) under
    /// `key` until `expires`. Returns the pins it displaced (the key's previous one, then those
    /// expiring soonest while the share is short or [`MAX_PINS`] are in force): the caller gives
    /// up their references and takes the new pin's. Refused, changing nothing, when `blocks`
    /// alone pass the share.
    pub fn insert(
        &mut self,
        key: PinKey,
        blocks: Vec<BlockId>,
        bounded: Vec<BlockId>,
        expires: Instant,
    ) -> Result<Vec<Unpinned>, PinRefused> {
        let mut distinct = blocks.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > self.max_blocks {
            return Err(PinRefused::TooLarge {
                max_blocks: self.max_blocks,
            });
        }
        let mut displaced: Vec<Unpinned> = self.remove(&key).into_iter().collect();
        loop {
            let added = distinct
                .iter()
                .filter(|id| !self.refs.contains_key(id))
                .count();
            if self.refs.len() + added <= self.max_blocks && self.pins.len() < MAX_PINS {
                break;
            }
            displaced.push(
                self.pop_soonest()
                    .expect("the share holds the new pin alone"),
            );
        }
        for &id in &blocks {
            *self.refs.entry(id).or_default() += 1;
        }
        self.pins.insert(
            key,
            Pin {
                blocks,
                bounded,
                expires,
            },
        );
        self.next_expiry = Some(self.next_expiry.map_or(expires, |next| next.min(expires)));
        Ok(displaced)
    }

    /// Removes the pins that expired by `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Unpinned> {
        if self.next_expiry.is_none_or(|next| now < next) {
            return Vec::new();
        }
        let keys: Vec<PinKey> = self
            .pins
            .iter()
            .filter(|(_, pin)| pin.expires <= now)
            .map(|(key, _)| key.clone())
            .collect();
        keys.iter().filter_map(|key| self.remove(key)).collect()
    }

    /// Removes the pin that expires soonest, if any.
    pub fn pop_soonest(&mut self) -> Option<Unpinned> {
        let key = self
            .pins
            .iter()
            .min_by_key(|(_, pin)| pin.expires)
            .map(|(key, _)| key.clone())?;
        self.remove(&key)
    }

    /// Removes every pin.
    pub fn clear(&mut self) -> Vec<Unpinned> {
        let keys: Vec<PinKey> = self.pins.keys().cloned().collect();
        keys.iter().filter_map(|key| self.remove(key)).collect()
    }

    fn remove(&mut self, key: &PinKey) -> Option<Unpinned> {
        let pin = self.pins.remove(key)?;
        if self.next_expiry == Some(pin.expires) {
            self.next_expiry = self.pins.values().map(|p| p.expires).min();
        }
        for id in &pin.blocks {
            if let Some(n) = self.refs.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    self.refs.remove(id);
                }
            }
        }
        Some(Unpinned {
            blocks: pin.blocks,
            bounded: pin.bounded,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ids(range: std::ops::Range<u32>) -> Vec<BlockId> {
        range.map(BlockId).collect()
    }

    #[test]
    fn pins_share_blocks_and_give_way_soonest_to_expire_first() {
        let now = Instant::now();
        let at = |s: u64| now + Duration::from_secs(s);
        let mut pins = PrefixPins::new(40); // 10 blocks at most
        assert_eq!(pins.max_blocks(), 10);
        let a = PinKey::Client("a".into());
        let b = PinKey::Client("b".into());
        assert!(pins
            .insert(a.clone(), ids(0..4), vec![], at(300))
            .unwrap()
            .is_empty());
        // Sharing a's first four blocks, b adds four more: eight distinct.
        assert!(pins
            .insert(b.clone(), ids(0..8), vec![], at(3600))
            .unwrap()
            .is_empty());
        assert_eq!(pins.num_blocks(), 8);
        // Two more fit the share exactly.
        let c = PinKey::Prefix(BlockHash(7));
        assert!(pins
            .insert(c.clone(), ids(20..22), vec![], at(600))
            .unwrap()
            .is_empty());
        // One more passes it: a, expiring first, gives way, but its blocks are b's too; then c.
        let d = PinKey::Client("d".into());
        let displaced = pins
            .insert(d.clone(), ids(30..31), vec![], at(1200))
            .unwrap();
        assert_eq!(
            displaced,
            vec![
                Unpinned {
                    blocks: ids(0..4),
                    bounded: vec![]
                },
                Unpinned {
                    blocks: ids(20..22),
                    bounded: vec![]
                },
            ]
        );
        assert_eq!(pins.num_blocks(), 9);
        // Larger than the share alone: refused, nothing displaced.
        assert_eq!(
            pins.insert(a.clone(), ids(40..51), vec![], at(9)),
            Err(PinRefused::TooLarge { max_blocks: 10 })
        );
        assert_eq!(pins.len(), 2);
        // A client's key replaces its previous pin; the same blocks again refresh to the later
        // expiry.
        let displaced = pins.insert(b.clone(), ids(0..9), vec![], at(60)).unwrap();
        assert_eq!(displaced[0].blocks, ids(0..8));
        assert!(pins.refresh(&d, &ids(30..31), at(5000)));
        assert!(!pins.refresh(&d, &ids(30..32), at(5000)));
        // b (60 s) expires, d (5,000 s) stays.
        let expired = pins.expire(at(61));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].blocks, ids(0..9));
        assert_eq!(pins.num_blocks(), 1);
        assert_eq!(pins.clear().len(), 1);
        assert!(pins.is_empty() && pins.num_blocks() == 0);
        // At most MAX_PINS: past them, the soonest to expire gives way.
        for k in 0..MAX_PINS + 1 {
            let key = PinKey::Client(format!("k{k}"));
            let expires = at(1000 + k as u64);
            let displaced = pins.insert(key, ids(0..1), vec![], expires).unwrap();
            assert_eq!(displaced.len(), usize::from(k == MAX_PINS));
        }
        assert_eq!(pins.len(), MAX_PINS);
        assert!(!pins.refresh(&PinKey::Client("k0".into()), &ids(0..1), at(1)));
        assert!(pins.expire(at(999)).is_empty());
        assert_eq!(pins.expire(at(1001)).len(), 1);
        assert_eq!(pins.clear().len(), MAX_PINS - 1);
        assert!(pins.is_empty() && pins.num_blocks() == 0);
    }
}

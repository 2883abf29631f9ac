//! Why a prompt read fewer tokens from the prefix cache than it could have: what a request's
//! stats, `perch serve`'s log and the `x-perch-prompt-cache` header report. A prompt of `n`
//! tokens can read at most its whole blocks before its last token (that one is always computed:
//! its logits start generation); anything less is a miss with a reason.

use std::collections::HashMap;
use std::time::Instant;

use crate::block_pool::EvictionCause;
use crate::kv_cache_manager::{KvCacheManager, RequestId};

/// Why a prompt's prefix-cache hit stopped where it did.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum CacheMiss {
    /// Prefix caching is off.
    CachingOff,
    /// The request's KV cache is its own (`max_kv_size`, `kv_bits`, a prompt-cache file's
    /// state): it neither reads nor leaves shared blocks.
    OwnCache,
    /// The block starting at `at_token` was in the cache and was evicted `seconds_ago`.
    Evicted {
        at_token: usize,
        seconds_ago: f64,
        cause: EvictionCause,
    },
    /// The prompt differs from the same client's previous prompt (and answer) from token
    /// `at_token` on. `tokens` and `previous_tokens`: a few of each side from there, for a log
    /// that shows prompts' text (never serialized).
    Diverged {
        at_token: usize,
        #[serde(skip)]
        tokens: Vec<u32>,
        #[serde(skip)]
        previous_tokens: Vec<u32>,
    },
    /// A hybrid model's blocks are cached up to `cached_to`, but its recurrent states (or a
    /// sliding-window model's window) only up to `at_token`: the blocks between are computed
    /// again.
    StateNotKept { at_token: usize, cached_to: usize },
    /// The client's previous request shares the prompt up to `shared_to` but had not computed
    /// it past `at_token` when this one started (they ran at the same time).
    NotCachedYet { at_token: usize, shared_to: usize },
    /// No earlier prompt in the cache goes on past `at_token` (a first request).
    NotSeen { at_token: usize },
    /// This engine has not seen the client, whose previous request went to another model
    /// (`model`), in the same process (the app, as its user switches models): a model's prefix
    /// cache holds only its own prompts. Told only where the engine has no prompt of the client
    /// (one that went back to a model it used before is compared with its prompt there), and by
    /// the order requests are admitted in.
    AnotherModel { at_token: usize, model: String },
}

/// Tokens of each side a [`CacheMiss::Diverged`] keeps.
pub const DIVERGED_TOKENS_KEPT: usize = 8;

impl CacheMiss {
    /// The reason's name, as serialized.
    pub fn name(&self) -> &'static str {
        match self {
            CacheMiss::CachingOff => "caching_off",
            CacheMiss::OwnCache => "own_cache",
            CacheMiss::Evicted { .. } => "evicted",
            CacheMiss::Diverged { .. } => "diverged",
            CacheMiss::StateNotKept { .. } => "state_not_kept",
            CacheMiss::NotCachedYet { .. } => "not_cached_yet",
            CacheMiss::NotSeen { .. } => "not_seen",
            CacheMiss::AnotherModel { .. } => "another_model",
        }
    }

    /// The token where the hit stopped, where there is one.
    pub fn at_token(&self) -> Option<usize> {
        match *self {
            CacheMiss::CachingOff | CacheMiss::OwnCache => None,
            CacheMiss::Evicted { at_token, .. }
            | CacheMiss::Diverged { at_token, .. }
            | CacheMiss::StateNotKept { at_token, .. }
            | CacheMiss::NotCachedYet { at_token, .. }
            | CacheMiss::NotSeen { at_token }
            | CacheMiss::AnotherModel { at_token, .. } => Some(at_token),
        }
    }
}

impl std::fmt::Display for CacheMiss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheMiss::CachingOff => write!(f, "prefix caching is off"),
            CacheMiss::OwnCache => write!(
                f,
                "the request's KV cache is its own (max_kv_size, kv_bits or a prompt-cache \
                 file): it shares no prefix"
            ),
            CacheMiss::Evicted {
                at_token,
                seconds_ago,
                cause,
            } => {
                let why = match cause {
                    EvictionCause::Reused => "to make room for other requests (KV budget full)",
                    EvictionCause::Reset => {
                        "with the whole prefix cache (memory pressure, or asked to clear it)"
                    }
                };
                write!(
                    f,
                    "the prefix from token {at_token} on was evicted {seconds_ago:.0} s ago {why}"
                )
            }
            CacheMiss::Diverged { at_token, .. } => write!(
                f,
                "the prompt differs from this client's previous one at token {at_token}"
            ),
            CacheMiss::StateNotKept {
                at_token,
                cached_to,
            } => write!(
                f,
                "the model's recurrent state (or sliding-window KV) was kept at token \
                 {at_token}, not at {cached_to}: the tokens between were computed again"
            ),
            CacheMiss::NotCachedYet {
                at_token,
                shared_to,
            } => write!(
                f,
                "this client's previous request shares the prompt up to token {shared_to} but \
                 had computed it only to token {at_token} when this one started"
            ),
            CacheMiss::NotSeen { at_token } => write!(
                f,
                "no earlier prompt in the cache goes on past token {at_token}"
            ),
            CacheMiss::AnotherModel { at_token, model } => write!(
                f,
                "this client's previous request went to another model ({model}), whose prefix \
                 cache this model does not share: nothing cached goes on past token {at_token}"
            ),
        }
    }
}

/// What a request admitted with a prefix-cache lookup read, for [`explain_miss`].
#[derive(Clone, Copy, Debug)]
pub struct Lookup<'a> {
    /// What its cache must hold (the prompt, or more after a preemption).
    pub tokens: &'a [u32],
    /// Cached blocks found from the first on.
    pub found_blocks: usize,
    /// Of those, the leading ones it loaded (fewer where a hybrid model's states were not kept).
    pub loaded_blocks: usize,
    /// Tokens it started with (the loaded blocks, and a kept partial block after them).
    pub loaded_tokens: usize,
    /// Its KV cache is its own (it did not look the cache up).
    pub own_cache: bool,
    /// The same client's previous prompt and the tokens generated after it, when known.
    pub previous: Option<&'a [u32]>,
    /// Without `previous`: the model the client's previous request went to, when it was another
    /// ([`ClientModels::switched`]).
    pub another_model: Option<&'a str>,
}

/// Why `lookup` read fewer tokens than it could have, or `None` when it read them all.
pub fn explain_miss(kv: &KvCacheManager, lookup: &Lookup, now: Instant) -> Option<CacheMiss> {
    let block_size = kv.block_size();
    let tokens = lookup.tokens;
    let cacheable = tokens.len().saturating_sub(1) / block_size * block_size;
    if lookup.loaded_tokens >= cacheable {
        return None;
    }
    if !kv.caching_enabled() {
        return Some(CacheMiss::CachingOff);
    }
    if lookup.own_cache {
        return Some(CacheMiss::OwnCache);
    }
    if lookup.loaded_blocks < lookup.found_blocks {
        return Some(CacheMiss::StateNotKept {
            at_token: lookup.loaded_blocks * block_size,
            cached_to: lookup.found_blocks * block_size,
        });
    }
    let missing = lookup.found_blocks;
    let at_token = missing * block_size;
    let hashes = kv.block_hashes(&tokens[..(missing + 1) * block_size]);
    if let Some(eviction) = kv.pool().eviction(hashes[missing]) {
        return Some(CacheMiss::Evicted {
            at_token,
            seconds_ago: now.saturating_duration_since(eviction.at).as_secs_f64(),
            cause: eviction.cause,
        });
    }
    let Some(previous) = lookup.previous else {
        return Some(match lookup.another_model {
            Some(model) => CacheMiss::AnotherModel {
                at_token,
                model: model.to_owned(),
            },
            None => CacheMiss::NotSeen { at_token },
        });
    };
    let shared = previous
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let from = |side: &[u32]| {
        side[shared.min(side.len())..]
            .iter()
            .take(DIVERGED_TOKENS_KEPT)
            .copied()
            .collect()
    };
    // What the previous request could have left in the cache for this prompt: the whole blocks
    // they share, of those it computed (all its tokens but the last one sampled).
    let could =
        shared.min(previous.len().saturating_sub(1)).min(cacheable) / block_size * block_size;
    if shared < at_token {
        // The hit came from another prompt: this client's previous one left earlier.
        Some(CacheMiss::NotSeen { at_token })
    } else if at_token < could {
        Some(CacheMiss::NotCachedYet {
            at_token,
            shared_to: could,
        })
    } else if shared < previous.len() {
        Some(CacheMiss::Diverged {
            at_token: shared,
            tokens: from(tokens),
            previous_tokens: from(previous),
        })
    } else {
        // The prompt goes on from the whole previous sequence (the next turn of a chat): the
        // previous request's last, partial block was never a whole block to keep.
        None
    }
}

/// What each of the most recent clients sent: its latest tokens (prompt, then answer), which
/// [`Lookup::previous`] compares its next prompt with, and its prefix-cache tally with the last
/// misses (the dashboard's per-client view). At most [`ClientHistory::CAPACITY`] clients, the
/// least recently seen forgotten first.
#[derive(Debug, Default)]
pub struct ClientHistory {
    by_client: HashMap<String, Client>,
    clock: u64,
}

#[derive(Debug)]
struct Client {
    request: RequestId,
    tokens: Vec<u32>,
    seen: u64,
    tally: ClientTally,
}

/// A client's prefix-cache lookups since it was first seen.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClientTally {
    pub client: String,
    pub requests: u64,
    pub prompt_tokens: u64,
    /// Of those, read from the prefix cache.
    pub cached_tokens: u64,
    /// The last misses, newest first (at most [`ClientHistory::MISSES_KEPT`]).
    pub last_misses: Vec<MissRecord>,
}

/// One request's miss, as the dashboard lists it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MissRecord {
    /// When, in milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub miss: CacheMiss,
    /// The miss as a sentence ([`CacheMiss`]'s `Display`).
    pub description: String,
}

impl ClientHistory {
    /// Clients remembered at most.
    pub const CAPACITY: usize = 64;
    /// Misses kept per client.
    pub const MISSES_KEPT: usize = 5;

    /// The client's latest tokens.
    pub fn previous(&self, client: &str) -> Option<&[u32]> {
        self.by_client.get(client).map(|c| &c.tokens[..])
    }

    /// The client's `request` started with `tokens`, `cached` of them read from the prefix
    /// cache (`miss`: why not more): its tokens are the client's latest from now on, and the
    /// lookup joins its tally.
    pub fn started(
        &mut self,
        client: &str,
        request: RequestId,
        tokens: &[u32],
        cached: usize,
        miss: Option<&CacheMiss>,
    ) {
        self.clock += 1;
        let seen = self.clock;
        let entry = self
            .by_client
            .entry(client.to_owned())
            .or_insert_with(|| Client {
                request,
                tokens: Vec::new(),
                seen,
                tally: ClientTally {
                    client: client.to_owned(),
                    ..ClientTally::default()
                },
            });
        entry.request = request;
        entry.tokens = tokens.to_vec();
        entry.seen = seen;
        let tally = &mut entry.tally;
        tally.requests += 1;
        tally.prompt_tokens += tokens.len() as u64;
        tally.cached_tokens += cached as u64;
        if let Some(miss) = miss {
            let at_unix_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            tally.last_misses.insert(
                0,
                MissRecord {
                    at_unix_ms,
                    prompt_tokens: tokens.len(),
                    cached_tokens: cached,
                    miss: miss.clone(),
                    description: miss.to_string(),
                },
            );
            tally.last_misses.truncate(Self::MISSES_KEPT);
        }
        forget_least_recent(&mut self.by_client, Self::CAPACITY, |c| c.seen);
    }

    /// The client's `request` ended holding `tokens` (its prompt and answer): they replace
    /// its prompt, unless a later request of the client started since.
    pub fn ended(&mut self, client: &str, request: RequestId, tokens: &[u32]) {
        if let Some(entry) = self.by_client.get_mut(client) {
            if entry.request == request {
                entry.tokens = tokens.to_vec();
            }
        }
    }

    /// Every client's tally, the most recently seen first.
    pub fn tallies(&self) -> Vec<ClientTally> {
        let mut clients: Vec<&Client> = self.by_client.values().collect();
        clients.sort_by_key(|c| std::cmp::Reverse(c.seen));
        clients.into_iter().map(|c| c.tally.clone()).collect()
    }
}

/// The model each recent client's latest request went to, shared by the engines of one process
/// (the app's, one after another as its user switches models): a client's first request to a
/// model after requests to another is told why nothing was cached ([`CacheMiss::AnotherModel`]).
/// At most [`ClientModels::CAPACITY`] clients, the least recently seen forgotten first.
#[derive(Debug, Default)]
pub struct ClientModels {
    latest: std::sync::Mutex<ClientModelsInner>,
}

#[derive(Debug, Default)]
struct ClientModelsInner {
    /// Client → (model, when last seen).
    by_client: HashMap<String, (String, u64)>,
    clock: u64,
}

impl ClientModels {
    /// Clients remembered at most.
    pub const CAPACITY: usize = 256;

    /// Records that `client`'s latest request goes to `model`; returns the model its previous
    /// request went to when that was another.
    pub fn switched(&self, client: &str, model: &str) -> Option<String> {
        let mut inner = self
            .latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.clock += 1;
        let seen = inner.clock;
        let previous = inner
            .by_client
            .insert(client.to_owned(), (model.to_owned(), seen))
            .map(|(previous, _)| previous)
            .filter(|previous| previous != model);
        forget_least_recent(&mut inner.by_client, Self::CAPACITY, |(_, seen)| *seen);
        previous
    }
}

/// Removes the entry of `clients` seen least recently (`seen`: its clock) while there are more
/// than `capacity`.
fn forget_least_recent<V>(
    clients: &mut HashMap<String, V>,
    capacity: usize,
    seen: impl Fn(&V) -> u64,
) {
    while clients.len() > capacity {
        let Some(oldest) = (clients.iter())
            .min_by_key(|(_, v)| seen(v))
            .map(|(client, _)| client.clone())
        else {
            return;
        };
        clients.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_pool::BlockPool;

    fn admit(kv: &mut KvCacheManager, id: RequestId, tokens: &[u32]) -> usize {
        let hit = kv.get_computed_blocks(tokens);
        kv.allocate_slots(
            id,
            hit.num_tokens,
            tokens.len() - hit.num_tokens,
            Some(&hit),
        )
        .expect("room");
        kv.cache_blocks(id, tokens, tokens.len());
        hit.blocks.len()
    }

    fn lookup<'a>(tokens: &'a [u32], found: usize, previous: Option<&'a [u32]>) -> Lookup<'a> {
        Lookup {
            tokens,
            found_blocks: found,
            loaded_blocks: found,
            loaded_tokens: found * 4,
            own_cache: false,
            previous,
            another_model: None,
        }
    }

    /// Each reason where it applies, on a pool of blocks of 4 tokens.
    #[test]
    fn each_miss_gets_its_reason() {
        let now = Instant::now();
        let mut kv = KvCacheManager::new(BlockPool::new(6, 4), "m");
        let first: Vec<u32> = (0..13).collect();
        // A first prompt: nothing cached.
        let miss = explain_miss(&kv, &lookup(&first, 0, None), now);
        assert_eq!(miss, Some(CacheMiss::NotSeen { at_token: 0 }));
        // The same, from a client whose previous request went to another model.
        let switched = Lookup {
            another_model: Some("other/model"),
            ..lookup(&first, 0, None)
        };
        let miss = explain_miss(&kv, &switched, now).unwrap();
        assert_eq!(
            miss,
            CacheMiss::AnotherModel {
                at_token: 0,
                model: "other/model".into()
            }
        );
        assert_eq!(miss.name(), "another_model");
        assert!(miss.to_string().contains("another model (other/model)"));
        assert_eq!(admit(&mut kv, 1, &first), 0);
        kv.free(1);
        // The same prompt again reads its three whole blocks before the last token: no miss.
        let found = kv.get_computed_blocks(&first).blocks.len();
        assert_eq!(found, 3);
        assert_eq!(explain_miss(&kv, &lookup(&first, 3, None), now), None);
        // Diverging inside the second block from the client's previous prompt.
        let mut second = first.clone();
        second[6] = 99;
        let found = kv.get_computed_blocks(&second).blocks.len();
        match explain_miss(&kv, &lookup(&second, found, Some(&first)), now) {
            Some(CacheMiss::Diverged {
                at_token: 6,
                tokens,
                previous_tokens,
            }) => {
                assert_eq!(tokens[0], 99);
                assert_eq!(previous_tokens[0], 6);
                assert!(tokens.len() <= DIVERGED_TOKENS_KEPT);
            }
            other => panic!("{other:?}"),
        }
        // The next turn goes on from the whole previous sequence: its partial last block was
        // never whole, so nothing was missed.
        let next_turn = [first.clone(), (50..60).collect()].concat();
        let found = kv.get_computed_blocks(&next_turn).blocks.len();
        assert_eq!(found, 3);
        assert_eq!(
            explain_miss(&kv, &lookup(&next_turn, 3, Some(&first)), now),
            None
        );
        // Shared with the previous request further than the cache holds: not cached yet.
        let mut longer = first.clone();
        longer.extend(20..40);
        let miss = explain_miss(&kv, &lookup(&longer[..25], 3, Some(&longer)), now);
        assert_eq!(
            miss,
            Some(CacheMiss::NotCachedYet {
                at_token: 12,
                shared_to: 24
            })
        );
        // Another prompt fills the pool: the first's blocks are reused, and say so.
        let other: Vec<u32> = (100..124).collect();
        admit(&mut kv, 2, &other);
        let found = kv.get_computed_blocks(&first).blocks.len();
        assert_eq!(found, 0);
        match explain_miss(&kv, &lookup(&first, found, Some(&first)), now) {
            Some(CacheMiss::Evicted {
                at_token: 0,
                cause: EvictionCause::Reused,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // A reset says so too.
        kv.free(2);
        kv.reset_prefix_cache();
        match explain_miss(&kv, &lookup(&other, 0, None), now) {
            Some(CacheMiss::Evicted {
                cause: EvictionCause::Reset,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // Hybrid states kept at an earlier block; an own cache; caching off.
        let states = Lookup {
            loaded_blocks: 1,
            loaded_tokens: 4,
            ..lookup(&first, 3, None)
        };
        let miss = explain_miss(&kv, &states, now);
        assert_eq!(
            miss,
            Some(CacheMiss::StateNotKept {
                at_token: 4,
                cached_to: 12
            })
        );
        let own = Lookup {
            own_cache: true,
            ..lookup(&first, 0, None)
        };
        assert_eq!(explain_miss(&kv, &own, now), Some(CacheMiss::OwnCache));
        let off = KvCacheManager::new(BlockPool::new(6, 4), "m").with_caching(false);
        assert_eq!(
            explain_miss(&off, &lookup(&first, 0, None), now),
            Some(CacheMiss::CachingOff)
        );
        // Shorter than a block: nothing to miss.
        assert_eq!(explain_miss(&kv, &lookup(&first[..4], 0, None), now), None);
    }

    /// A client's model is remembered across calls: a change is reported once, a repeat never,
    /// and the least recently seen client is forgotten past the capacity.
    #[test]
    fn client_models_report_a_switch_once() {
        let models = ClientModels::default();
        assert_eq!(models.switched("agent", "a"), None, "a first request");
        assert_eq!(models.switched("agent", "a"), None);
        assert_eq!(models.switched("agent", "b").as_deref(), Some("a"));
        assert_eq!(models.switched("agent", "b"), None);
        assert_eq!(models.switched("app", "a"), None, "clients are apart");
        for k in 0..ClientModels::CAPACITY {
            models.switched(&format!("client {k}"), "b");
        }
        // "agent" and "app" were seen first: forgotten, so a switch back is no longer known.
        assert_eq!(models.switched("agent", "a"), None);
    }

    /// A client's latest tokens: its newest request's prompt, then that request's whole
    /// sequence when it ends (not an older request's); its tally counts every lookup and keeps
    /// the last misses, newest first; the least recently seen client goes first past the
    /// capacity.
    #[test]
    fn client_history_keeps_each_clients_newest_and_tallies_its_lookups() {
        let mut history = ClientHistory::default();
        let miss = CacheMiss::NotSeen { at_token: 0 };
        history.started("a", 1, &[1, 2], 0, Some(&miss));
        history.started("a", 2, &[1, 2, 3], 2, None);
        history.ended("a", 1, &[1, 2, 9, 9]);
        assert_eq!(history.previous("a"), Some(&[1, 2, 3][..]));
        history.ended("a", 2, &[1, 2, 3, 4]);
        assert_eq!(history.previous("a"), Some(&[1, 2, 3, 4][..]));
        let tally = &history.tallies()[0];
        assert_eq!(
            (tally.requests, tally.prompt_tokens, tally.cached_tokens),
            (2, 5, 2)
        );
        assert_eq!(tally.last_misses.len(), 1);
        assert_eq!(tally.last_misses[0].description, miss.to_string());
        for k in 0..ClientHistory::MISSES_KEPT + 2 {
            let miss = CacheMiss::NotSeen { at_token: k };
            history.started("a", 3 + k as u64, &[7], 0, Some(&miss));
        }
        let misses = &history.tallies()[0].last_misses;
        assert_eq!(misses.len(), ClientHistory::MISSES_KEPT);
        assert_eq!(
            misses[0].miss.at_token(),
            Some(ClientHistory::MISSES_KEPT + 1)
        );
        for k in 0..ClientHistory::CAPACITY {
            history.started(&format!("c{k}"), 100 + k as u64, &[0], 0, None);
        }
        assert_eq!(history.previous("a"), None);
        assert!(history.previous("c0").is_some());
        assert_eq!(
            history.tallies()[0].client,
            format!("c{}", ClientHistory::CAPACITY - 1)
        );
    }
}

//! The batch's scheduling decisions, as plain functions of the sequences' progress (the
//! scheduler half of vLLM v1's scheduler / model-runner split): which waiting requests are
//! admitted, how many prompt tokens each prefilling sequence computes in a step, which sequences
//! decode, and what happens when a decoding sequence finds the block pool short.
//! the engine's `BatchGenerator` applies them: it owns the sequences, the block pool and the
//! model, and runs the forward passes these decisions ask for.
//!
//! Policy, as vLLM's and mlx-lm's: first come, first served (a request that does not fit is not
//! overtaken by a later one), prefill chunks within a per-step token budget while others decode
//! (so a long prompt delays running streams by one slice per step, never by the whole prompt),
//! and the newest request is the one preempted. Within that, priority lanes ([`Priority`], as
//! vLLM's `priority` scheduling policy): a request of a higher lane is admitted, takes a prefill
//! slot and computes its prompt ahead of lower lanes' (which pause their prefill while it runs),
//! and a lower lane's newest sequence is preempted first.

use crate::shapes::prefill_chunk_bucket;

/// A request's lane: what it is scheduled ahead of. The app's chat and API requests that ask
/// are [`Priority::High`]; background work may ask for [`Priority::Low`]. Ordered as scheduled:
/// `High < Normal < Low`.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    /// The lane of vLLM's integer `priority` (lower is scheduled first, 0 by default): below 0
    /// high, 0 normal, above 0 low.
    pub fn from_vllm(value: i64) -> Self {
        match value.signum() {
            -1 => Priority::High,
            0 => Priority::Normal,
            _ => Priority::Low,
        }
    }

    /// Its name as the API takes it (`high`, `normal`, `low`).
    pub fn name(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// The lane named `name` (`high`, `normal`, `low`; case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        [Priority::High, Priority::Normal, Priority::Low]
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name.trim()))
    }
}

/// A sequence's progress as the scheduler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Tokens its KV cache must hold up to the last one: the prompt, then generated tokens.
    pub num_tokens: usize,
    /// Tokens already computed into its KV cache.
    pub num_computed: usize,
    /// Its request's prefill chunk size (mlx-lm's `prefill_step_size`), at least 1 in effect.
    pub prefill_step_size: usize,
}

impl Progress {
    /// Whether its prompt is cached: the last token is fed by its first decode step.
    pub fn prefill_done(&self) -> bool {
        self.num_computed + 1 >= self.num_tokens
    }

    /// Prompt tokens still to prefill.
    pub fn prompt_left(&self) -> usize {
        self.num_tokens
            .saturating_sub(1)
            .saturating_sub(self.num_computed)
    }

    /// The next chunk's length within `limit` tokens.
    fn next_chunk(&self, limit: usize) -> usize {
        self.prompt_left()
            .min(self.prefill_step_size.max(1))
            .min(limit)
    }
}

/// Prompt tokens one step may prefill: `token_budget` while some running sequence is decoding
/// (it bounds their wait), unbounded otherwise.
pub fn prefill_budget(running: &[Progress], token_budget: usize) -> usize {
    if running.iter().any(Progress::prefill_done) {
        token_budget
    } else {
        usize::MAX
    }
}

/// Admits waiting requests front first while fewer than `max_running` run: `try_admit(k)` takes
/// the blocks for the `k`-th waiting request and says whether the pool had them. Stops at the
/// first that does not fit, so no later request overtakes it. Returns how many were admitted
/// (the first ones of the queue).
pub fn admit(
    num_waiting: usize,
    num_running: usize,
    max_running: usize,
    mut try_admit: impl FnMut(usize) -> bool,
) -> usize {
    let room = max_running.saturating_sub(num_running).min(num_waiting);
    (0..room).take_while(|&k| try_admit(k)).count()
}

/// A prefill chunk of `chunk` tokens after `num_computed`, shortened to end on the last block
/// boundary it crosses (a multiple of `block_size`), if it crosses one; else unchanged. For
/// hybrid models, whose recurrent state exists only after the last token computed: a chunk that
/// ends on a boundary leaves a state there for the prefix cache (see the engine's `kv::block_store`).
/// The rest of the prompt's last partial block is then a chunk of its own.
pub fn align_chunk_to_block(num_computed: usize, chunk: usize, block_size: usize) -> usize {
    let block_size = block_size.max(1);
    let boundary = (num_computed + chunk) / block_size * block_size;
    if boundary > num_computed {
        boundary - num_computed
    } else {
        chunk
    }
}

/// A prefill chunk of `chunk` tokens after `num_computed` that cuts none of the token spans
/// `whole` (`[start, end)`, in order, apart) in two (an image whose tokens attend to each other
/// both ways must be computed in one pass): a chunk that would end inside a span stops before it
/// when it starts before it, and runs to its end when it starts inside it (possibly wider than
/// asked). Else unchanged.
pub fn keep_whole(num_computed: usize, chunk: usize, whole: &[(usize, usize)]) -> usize {
    let stop = num_computed + chunk;
    match whole
        .iter()
        .find(|&&(start, end)| start < stop && stop < end)
    {
        None => chunk,
        Some(&(start, _)) if num_computed < start => start - num_computed,
        Some(&(_, end)) => end - num_computed,
    }
}

/// Which running sequences take a prefill slot this step:
/// those still prefilling and not in a slot (`has_slot`), higher lanes first (`priorities`, one
/// per sequence) and oldest first within a lane, while fewer than `batch_size` slots are taken
/// (`taken` now). With `fit_budget` (a CPU's prefill, see the engine's
/// `BatchConfig::prefill_fits_budget`) also only while the prompt tokens left of every sequence
/// in a slot of its lane or a higher one fit it, except for the first such slot: a long prompt
/// then prefills alone, a budget-wide chunk a pass, and is answered before the next one starts,
/// while short prompts still share a pass (a higher lane's prompt enters beside a lower lane's
/// long one, which pauses while it prefills: [`prefill_lane`]). No later sequence of a lane
/// overtakes one of it that does not fit. Returns their indices, in the order taken.
pub fn take_prefill_slots(
    running: &[Progress],
    priorities: &[Priority],
    has_slot: impl Fn(usize) -> bool,
    taken: usize,
    batch_size: usize,
    fit_budget: Option<usize>,
) -> Vec<usize> {
    let lane = |i: usize| priorities.get(i).copied().unwrap_or_default();
    let candidates = {
        let mut c: Vec<usize> = (0..running.len())
            .filter(|&i| !has_slot(i) && !running[i].prefill_done())
            .collect();
        c.sort_by_key(|&i| lane(i));
        c
    };
    // Sequences in prefill slots (a decode slot's has no prompt left).
    let prefilling: Vec<usize> = (0..running.len())
        .filter(|&i| has_slot(i) && !running[i].prefill_done())
        .collect();
    let mut entering: Vec<usize> = Vec::new();
    for i in candidates {
        if taken + entering.len() >= batch_size {
            break;
        }
        if let Some(budget) = fit_budget {
            // The prompts left in the slots of its lane and those above it, with its own.
            let ahead: Vec<usize> = prefilling
                .iter()
                .chain(&entering)
                .copied()
                .filter(|&e| lane(e) <= lane(i))
                .collect();
            let tokens: usize = ahead
                .iter()
                .chain([&i])
                .map(|&e| running[e].prompt_left())
                .sum();
            if !ahead.is_empty() && tokens > budget {
                // Sorted by lane: every later candidate is of this lane or a lower one.
                break;
            }
        }
        entering.push(i);
    }
    entering
}

/// The share of the prefill budget a lower lane's pass takes while a higher lane is active (one
/// of its sequences decodes, or one ran within [`ACTIVE_LANE_WINDOW`]): an eighth, so that a
/// chat's tokens come about eight times as often as budget-wide background passes would let
/// them, and a chat that arrives during such a pass waits for an eighth of one.
pub const LOWER_LANE_BUDGET_DIVISOR: usize = 8;

/// How long a lane stays active after its last sequence ran: a person reading an answer and
/// typing the next message.
pub const ACTIVE_LANE_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// The prompt tokens a pass of lane `pass` computes within `budget` ([`prefill_budget`]) while
/// the lanes `active` are (sequences decoding, lanes active recently): a
/// [`LOWER_LANE_BUDGET_DIVISOR`]th of it (at least one token) when one of them is above `pass`,
/// else all of it.
pub fn lane_budget(budget: usize, pass: Priority, active: &[Priority]) -> usize {
    match active.iter().any(|&d| d < pass) {
        true => (budget / LOWER_LANE_BUDGET_DIVISOR).max(1),
        false => budget,
    }
}

/// The lane whose sequences in prefill slots compute prompt tokens this step: the highest among
/// `members` (their lanes); lower lanes' prefill pauses until it has none left in a slot, so a
/// chat's prompt is not slowed by a background prompt's chunks. `None` without members.
pub fn prefill_lane(members: &[Priority]) -> Option<Priority> {
    members.iter().copied().min()
}

/// Chunk lengths for the rows of one batched prefill pass: each row its next chunk, within an
/// equal share of `budget` (at least one token each, so every row advances) and at most
/// `widest` tokens (the widest step the slot caches were made for: sliding layers' rings hold a
/// window plus one step, see the engine's `SlotKvCache::with_windows`).
pub fn plan_slot_chunks(rows: &[Progress], budget: usize, widest: usize) -> Vec<usize> {
    if rows.is_empty() {
        return Vec::new();
    }
    let share = (budget / rows.len()).clamp(1, widest.max(1));
    rows.iter().map(|row| row.next_chunk(share)).collect()
}

/// A batched prefill pass's shape: `rows` slots (a [`crate::shapes::row_bucket`]), each
/// chunk padded to `width` tokens ([`prefill_chunk_bucket`]), over rows that hold `computed`
/// positions before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillShape {
    pub rows: usize,
    pub width: usize,
    pub computed: usize,
}

/// The prefill shapes an idle engine meets ahead of requests (MLX's CUDA backend builds a
/// cuDNN attention plan and a CUDA graph for each new shape, tens of milliseconds the first
/// time), most common first: one row at every chunk width up to `widest` (a lone prompt's first
/// chunk); then, for bursts of up to `batch_size` prompts, each row bucket at the widths whose
/// padded tokens stay within `widest`; then a lone long prompt's next chunks (full width, after
/// 1, 2 and 3 full chunks) while their positions stay within `max_positions` (the context
/// length, or less to bound warm-up's memory). At most `widest` tokens a pass.
///
/// The set stays well under MLX's cuDNN attention plan cache (256 entries on CUDA, one plan per
/// distinct attention shape: 75 passes for a 2,048-token budget and 8 rows, each one shape, two
/// for models with sliding layers), or its later passes would evict the plans of its first.
pub fn prefill_warm_up_shapes(
    widest: usize,
    batch_size: usize,
    max_positions: usize,
) -> Vec<PrefillShape> {
    let widest = widest.max(1);
    let widths = buckets_up_to(1, widest, prefill_chunk_bucket);
    let mut rows: Vec<usize> = (1..=batch_size.max(1))
        .map(crate::shapes::row_bucket)
        .collect();
    rows.dedup();
    let mut shapes = Vec::new();
    for &r in &rows {
        for &width in &widths {
            if r == 1 || r * width <= widest {
                shapes.push(PrefillShape {
                    rows: r,
                    width,
                    computed: 0,
                });
            }
        }
    }
    let full = *widths.last().expect("at least one width");
    for chunks in 1..=3 {
        if (chunks + 1) * full <= max_positions {
            shapes.push(PrefillShape {
                rows: 1,
                width: full,
                computed: chunks * full,
            });
        }
    }
    shapes
}

/// Positions of a lone decoding sequence at which an idle engine steps it ahead of requests:
/// one per capacity bucket of the slot caches after the first (which load warms), up to
/// `max_positions` (each `C - 1`, whose step fills capacity `C`). A conversation's decode steps
/// meet each bucket as it grows; on CUDA the first step at a new capacity costs what a new
/// shape does.
pub fn decode_warm_up_positions(max_positions: usize) -> Vec<usize> {
    let first = crate::shapes::CAPACITY_STEP + 1;
    buckets_up_to(first, max_positions, crate::shapes::capacity_bucket)
        .into_iter()
        .filter(|&c| c <= max_positions)
        .map(|c| c - 1)
        .collect()
}

/// The distinct values of `bucket(n)` for `n` in `from..=to`, in order (`bucket` nondecreasing
/// with `bucket(n) >= n`): one call per bucket, not per `n`.
fn buckets_up_to(from: usize, to: usize, bucket: impl Fn(usize) -> usize) -> Vec<usize> {
    let mut buckets = Vec::new();
    let mut n = from;
    while n <= to {
        let b = bucket(n);
        buckets.push(b);
        n = b + 1;
    }
    buckets
}

/// What to do when a decoding sequence finds no free block for its next token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhenShort {
    /// Read the decode step in flight first: its tokens may finish sequences (freeing blocks),
    /// and a sequence about to be preempted must not lose its last token. Then try again.
    ReadInFlight,
    /// Preempt the running sequence at this index (the newest) and try again.
    Preempt(usize),
    /// The sequence is alone and still short (the insert-time capacity check makes this
    /// unreachable): it ends as if it reached its length.
    FinishAlone,
}

/// The decision when a decoding sequence is short of blocks, with the running sequences'
/// lanes (`running`, oldest first) and a decode step possibly in flight: the victim is the newest
/// sequence of the lowest lane ([`victim`]).
pub fn when_short(running: &[Priority], step_in_flight: bool) -> WhenShort {
    if step_in_flight {
        WhenShort::ReadInFlight
    } else if running.len() <= 1 {
        WhenShort::FinishAlone
    } else {
        WhenShort::Preempt(victim(running).expect("two or more run"))
    }
}

/// The sequence to preempt among `running` (their lanes, oldest first): the newest of the
/// lowest lane. `None` when nothing runs.
pub fn victim(running: &[Priority]) -> Option<usize> {
    let lowest = running.iter().copied().max()?;
    running.iter().rposition(|&p| p == lowest)
}

/// Whether a request of lane `waiting`, first in the queue of a batch that has no room for it
/// (`max_running` reached), takes the place of a running sequence: the one to preempt (the
/// newest of the lowest lane, [`victim`]) when that lane is below the request's. `None`: it
/// waits.
pub fn make_room_for(waiting: Priority, running: &[Priority]) -> Option<usize> {
    victim(running).filter(|&v| running[v] > waiting)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_chunks_end_on_the_last_block_boundary_they_cross() {
        // Block size 16: a chunk 0..19 stops at 16; the rest of the block follows alone.
        assert_eq!(align_chunk_to_block(0, 19, 16), 16);
        assert_eq!(align_chunk_to_block(16, 3, 16), 3);
        // Several boundaries: the last one.
        assert_eq!(align_chunk_to_block(5, 60, 16), 59);
        // Already on one, or crossing none.
        assert_eq!(align_chunk_to_block(0, 32, 16), 32);
        assert_eq!(align_chunk_to_block(17, 10, 16), 10);
        // After an unaligned start (a tail hit), the first boundary realigns it.
        assert_eq!(align_chunk_to_block(20, 512, 16), 508);
    }

    #[test]
    fn chunks_keep_a_whole_span_in_one_piece() {
        // A span 10..16: a chunk ending inside it stops before it, or runs to its end from its
        // start (wider than asked) or from inside it.
        let one = [(10, 16)];
        assert_eq!(keep_whole(0, 12, &one), 10);
        assert_eq!(keep_whole(10, 2, &one), 6);
        assert_eq!(keep_whole(12, 1, &one), 4);
        // A chunk ending at its start, at its end or past it, or before it, is kept.
        assert_eq!(keep_whole(0, 10, &one), 10);
        assert_eq!(keep_whole(5, 11, &one), 11);
        assert_eq!(keep_whole(5, 30, &one), 30);
        assert_eq!(keep_whole(0, 4, &one), 4);
        // Past a first span, into a second: it stops before the second.
        let two = [(3, 9), (13, 19)];
        assert_eq!(keep_whole(0, 16, &two), 13);
        assert_eq!(keep_whole(0, 30, &two), 30);
        assert_eq!(keep_whole(16, 1, &two), 3);
    }

    fn prefilling(num_tokens: usize, num_computed: usize, step: usize) -> Progress {
        Progress {
            num_tokens,
            num_computed,
            prefill_step_size: step,
        }
    }

    fn decoding(num_tokens: usize) -> Progress {
        prefilling(num_tokens, num_tokens - 1, 512)
    }

    #[test]
    fn prefill_is_done_when_all_but_the_last_token_is_cached() {
        assert!(!prefilling(10, 8, 4).prefill_done());
        assert_eq!(prefilling(10, 8, 4).prompt_left(), 1);
        assert!(prefilling(10, 9, 4).prefill_done());
        assert_eq!(prefilling(10, 9, 4).prompt_left(), 0);
        // A one-token prompt decodes at once.
        assert!(prefilling(1, 0, 4).prefill_done());
    }

    #[test]
    fn the_budget_binds_only_while_someone_decodes() {
        let alone = [prefilling(5000, 0, 512)];
        assert_eq!(prefill_budget(&alone, 256), usize::MAX);
        let mixed = [prefilling(5000, 0, 512), decoding(20)];
        assert_eq!(prefill_budget(&mixed, 256), 256);
        assert_eq!(prefill_budget(&[], 256), usize::MAX);
    }

    #[test]
    fn admission_is_first_come_first_served() {
        // Room for three, but the second request does not fit: the third must not overtake it.
        let fits = [true, false, true];
        let mut asked = Vec::new();
        let n = admit(3, 1, 4, |k| {
            asked.push(k);
            fits[k]
        });
        assert_eq!(n, 1);
        assert_eq!(asked, [0, 1]);
        // Room is the binding limit: two of five waiting, none asked beyond.
        let mut asked = Vec::new();
        let n = admit(5, 6, 8, |k| {
            asked.push(k);
            true
        });
        assert_eq!((n, asked), (2, vec![0, 1]));
        // A full batch admits nobody and asks nothing.
        assert_eq!(admit(5, 8, 8, |_| panic!("no room")), 0);
        assert_eq!(admit(5, 9, 8, |_| panic!("no room")), 0);
    }

    #[test]
    fn prefill_slots_go_to_the_oldest_sequences_still_prefilling() {
        let running = [
            prefilling(100, 0, 64),
            decoding(20),
            prefilling(100, 0, 64),
            prefilling(100, 0, 64),
            prefilling(100, 0, 64),
        ];
        // Sequence 0 already holds a slot; two free slots of four go to 2 and 3.
        assert_eq!(
            take_prefill_slots(&running, &[], |i| i == 0, 2, 4, None),
            [2, 3]
        );
        assert!(take_prefill_slots(&running, &[], |_| false, 4, 4, None).is_empty());
        assert_eq!(
            take_prefill_slots(&running, &[], |_| false, 0, 8, None),
            [0, 2, 3, 4]
        );
    }

    #[test]
    fn prefill_slots_fitted_to_the_budget_let_a_long_prompt_prefill_alone() {
        let fit = Some(256);
        // Short prompts (31 tokens left each) share a pass up to the budget: 8 of them.
        let short = [prefilling(32, 0, 512); 12];
        let entering = take_prefill_slots(&short, &[], |_| false, 0, 16, fit);
        assert_eq!(entering, (0..8).collect::<Vec<_>>());
        // The batch size still bounds them.
        assert_eq!(
            take_prefill_slots(&short, &[], |_| false, 0, 3, fit),
            [0, 1, 2]
        );
        // A long prompt takes the first slot alone; the next waits for it to finish.
        let long = [
            prefilling(2048, 0, 512),
            prefilling(2048, 0, 512),
            prefilling(32, 0, 512),
        ];
        assert_eq!(take_prefill_slots(&long, &[], |_| false, 0, 8, fit), [0]);
        assert!(take_prefill_slots(&long, &[], |i| i == 0, 1, 8, fit).is_empty());
        // Once the first is decoding the second long one goes alone, and the short one behind
        // it does not overtake it.
        let next = [
            decoding(2049),
            prefilling(2048, 0, 512),
            prefilling(32, 0, 512),
        ];
        assert_eq!(take_prefill_slots(&next, &[], |_| false, 0, 8, fit), [1]);
        // The last chunk of a long prompt leaves room for what follows.
        let tail = [prefilling(2048, 2000, 512), prefilling(32, 0, 512)];
        assert_eq!(take_prefill_slots(&tail, &[], |i| i == 0, 1, 8, fit), [1]);
        // Without a fit (a GPU), every free slot is taken.
        assert_eq!(
            take_prefill_slots(&long, &[], |_| false, 0, 8, None),
            [0, 1, 2]
        );
    }

    #[test]
    fn a_higher_lane_takes_a_prefill_slot_first_and_beside_a_long_lower_prompt() {
        use Priority::{High, Low, Normal};
        let fit = Some(256);
        // A background prompt (low) holds a slot with 4,000 tokens left; a normal request and a
        // chat (high) wait. The chat enters first (no slot of its lane or above is taken), then
        // the normal one (the low prompt is not ahead of it). With the long prompt in the normal
        // lane instead, the normal request waits for it.
        let running = [
            prefilling(4096, 96, 512),
            prefilling(100, 0, 512),
            prefilling(100, 0, 512),
        ];
        let lanes = [Low, Normal, High];
        assert_eq!(
            take_prefill_slots(&running, &lanes, |i| i == 0, 1, 8, fit),
            [2, 1]
        );
        let lanes = [Normal, Normal, High];
        assert_eq!(
            take_prefill_slots(&running, &lanes, |i| i == 0, 1, 8, fit),
            [2]
        );
        // One slot left: the newer high request takes it ahead of the older normal one.
        assert_eq!(
            take_prefill_slots(&running, &lanes, |i| i == 0, 7, 8, None),
            [2]
        );
        // Within a lane, the oldest first; a long high prompt enters alone in its lane.
        let long = [
            prefilling(4096, 0, 512),
            prefilling(4096, 0, 512),
            prefilling(8, 0, 512),
        ];
        let lanes = [High, High, Normal];
        assert_eq!(take_prefill_slots(&long, &lanes, |_| false, 0, 8, fit), [0]);
        // The lane whose prompts compute: the highest in a slot.
        assert_eq!(prefill_lane(&[Low, Normal, Low]), Some(Normal));
        assert_eq!(prefill_lane(&[]), None);
    }

    #[test]
    fn a_lower_lane_is_preempted_first_and_makes_room_for_a_higher_one() {
        use Priority::{High, Low, Normal};
        // The newest of the lowest lane.
        assert_eq!(victim(&[Low, Normal, Low, High]), Some(2));
        assert_eq!(victim(&[Normal, High]), Some(0));
        assert_eq!(victim(&[]), None);
        assert_eq!(when_short(&[Low, High, High], false), WhenShort::Preempt(0));
        // A high request finds a full batch: the newest low sequence leaves for it; a normal
        // one takes no normal sequence's place, and nothing is below a low one.
        assert_eq!(make_room_for(High, &[Normal, Low, Normal]), Some(1));
        assert_eq!(make_room_for(Normal, &[Normal, Normal]), None);
        assert_eq!(make_room_for(High, &[High, High]), None);
        assert_eq!(make_room_for(Low, &[Low]), None);
    }

    #[test]
    fn a_lower_lane_prefills_an_eighth_of_the_budget_while_a_higher_one_is_active() {
        use Priority::{High, Low, Normal};
        assert_eq!(lane_budget(256, Low, &[Low, High]), 32);
        assert_eq!(lane_budget(256, Normal, &[Normal, Low]), 256);
        assert_eq!(lane_budget(256, High, &[High]), 256);
        assert_eq!(lane_budget(4, Low, &[Normal]), 1);
    }

    #[test]
    fn lanes_parse_from_names_and_from_vllm_integers() {
        assert_eq!(Priority::from_name(" HIGH "), Some(Priority::High));
        assert_eq!(Priority::from_name("low"), Some(Priority::Low));
        assert_eq!(Priority::from_name("urgent"), None);
        assert_eq!(Priority::from_vllm(-3), Priority::High);
        assert_eq!(Priority::from_vllm(0), Priority::Normal);
        assert_eq!(Priority::from_vllm(7), Priority::Low);
        assert!(Priority::High < Priority::Normal && Priority::Normal < Priority::Low);
    }

    #[test]
    fn slot_chunks_share_the_budget_and_always_advance() {
        let rows = [
            prefilling(1000, 0, 512),
            prefilling(40, 0, 512),
            prefilling(1000, 100, 64),
        ];
        assert_eq!(plan_slot_chunks(&rows, usize::MAX, 2048), [512, 39, 64]);
        // 300 tokens over three rows: 100 each at most.
        assert_eq!(plan_slot_chunks(&rows, 300, 2048), [100, 39, 64]);
        // A budget smaller than the rows still moves each by one token.
        assert_eq!(plan_slot_chunks(&rows, 2, 2048), [1, 1, 1]);
        assert_eq!(plan_slot_chunks(&[], 100, 2048), Vec::<usize>::new());
        // Unbounded (nothing decoding), a row's chunk is still no wider than the caches' step,
        // whatever its request's step size.
        assert_eq!(plan_slot_chunks(&rows, usize::MAX, 48), [48, 39, 48]);
    }

    #[test]
    fn chunk_widths_fall_in_few_buckets_with_little_padding() {
        let widths: std::collections::BTreeSet<usize> =
            (1..=2048).map(prefill_chunk_bucket).collect();
        for n in 1..=2048 {
            let w = prefill_chunk_bucket(n);
            assert!(w >= n, "{n} -> {w}");
            assert!(n <= 64 || (w - n) * 4 <= w, "{n} -> {w}: over 25% padding");
        }
        assert_eq!(prefill_chunk_bucket(1), 16);
        assert!(widths.len() <= 32, "{} widths: {widths:?}", widths.len());
    }

    #[test]
    fn warm_up_meets_every_lone_chunk_width_and_bursts_within_the_budget() {
        let shapes = prefill_warm_up_shapes(2048, 8, 8192);
        // Every width a lone prompt's chunk can take, first.
        let lone: std::collections::BTreeSet<usize> =
            (1..=2048).map(prefill_chunk_bucket).collect();
        let first: Vec<usize> = shapes[..lone.len()].iter().map(|s| s.width).collect();
        assert_eq!(first, lone.iter().copied().collect::<Vec<_>>());
        assert!(shapes[..lone.len()]
            .iter()
            .all(|s| s.rows == 1 && s.computed == 0));
        // Bursts: 8 rows of 128-token prompts are met; no burst pass exceeds the budget.
        let burst = PrefillShape {
            rows: 8,
            width: 128,
            computed: 0,
        };
        assert!(shapes.contains(&burst));
        for s in &shapes {
            assert!(s.rows == 1 || s.rows * s.width <= 2048, "{s:?}");
            assert!([1, 2, 4, 8].contains(&s.rows), "{s:?}");
        }
        // Distinct shapes; a long prompt's chunks after 2,048, 4,096 and 6,144 positions.
        let distinct: std::collections::HashSet<_> = shapes
            .iter()
            .map(|s| (s.rows, s.width, s.computed))
            .collect();
        assert_eq!(distinct.len(), shapes.len());
        let long: Vec<usize> = shapes
            .iter()
            .map(|s| s.computed)
            .filter(|&c| c > 0)
            .collect();
        assert_eq!(long, [2048, 4096, 6144]);
        // A short context stops them; a budget of one token still warms one shape.
        assert!(prefill_warm_up_shapes(2048, 8, 4095)
            .iter()
            .all(|s| s.computed == 0));
        assert_eq!(
            prefill_warm_up_shapes(1, 1, 16),
            [PrefillShape {
                rows: 1,
                width: 16,
                computed: 0
            }]
        );
    }

    #[test]
    fn decode_warm_up_meets_every_capacity_bucket_after_the_first() {
        let positions = decode_warm_up_positions(2048);
        assert_eq!(
            positions,
            [511, 767, 1023, 1279, 1535, 1791, 2047],
            "one step filling each bucket"
        );
        for &p in &positions {
            assert_eq!(crate::shapes::capacity_bucket(p + 1), p + 1);
        }
        assert!(decode_warm_up_positions(256).is_empty());
        // Buckets past the bound are left out.
        assert_eq!(decode_warm_up_positions(600), [511]);
    }

    #[test]
    fn short_of_blocks_reads_first_then_preempts_the_newest() {
        let five = [Priority::Normal; 5];
        assert_eq!(when_short(&five, true), WhenShort::ReadInFlight);
        assert_eq!(when_short(&five, false), WhenShort::Preempt(4));
        assert_eq!(when_short(&five[..1], false), WhenShort::FinishAlone);
        assert_eq!(when_short(&five[..1], true), WhenShort::ReadInFlight);
    }
}

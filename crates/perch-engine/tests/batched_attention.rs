//! Batched attention over a slot cache (`Model::forward_slots`) computes, row for row, the logits
//! that per-sequence attention computes (`Model::forward` on the sequence's own cache), in float32
//! within 1e-4: decode steps while sequences of different lengths join and leave the slots (rows
//! move, the buffers change bucket), with float and 8-bit KV caches; and prefill steps of padded
//! prompt chunks at different offsets, handed on to a decode slot cache.

mod common;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array};
use perch_engine::models;
use perch_engine::models::Model;
use perch_engine::testing::KvCache;
use perch_engine::testing::{additive_mask, SlotRead};
use perch_engine::testing::{RowKv, SlotKvCache};
use perch_engine::KvQuantization;
use perch_engine::SlotAttention;

/// A sequence decoding both ways: its own cache, and the slot it holds in the slot cache.
struct Sequence {
    cache: Vec<KvCache>,
    slot: usize,
    next: u32,
}

fn largest_difference(a: &Array, b: &Array) -> f32 {
    let diff = ops::abs(ops::subtract(a, b).unwrap()).unwrap();
    ops::max(&diff, None).unwrap().item_exact::<f32>()
}

/// Prefills `prompt` but its last token into a fresh cache and puts the sequence in `slots`.
fn start(
    model: &dyn Model,
    slots: &mut SlotKvCache,
    prompt: &[u32],
    q: Option<KvQuantization>,
) -> Sequence {
    let mut cache = model.make_cache(q);
    let fed = &prompt[..prompt.len() - 1];
    if !fed.is_empty() {
        model
            .forward_sequence(&Array::from_slice(fed, &[1, fed.len() as i32]), &mut cache)
            .unwrap();
    }
    eval(cache.iter().flat_map(KvCache::state)).unwrap();
    let slot = slots.push(&cache, fed.len(), RowKv::Plain).unwrap();
    Sequence {
        cache,
        slot,
        next: *prompt.last().unwrap(),
    }
}

/// Runs the schedule and returns the largest logit difference between the two ways.
fn run(q: Option<KvQuantization>, attention: SlotAttention) -> f32 {
    let model = models::load(&common::model_dir()).unwrap();
    let model = model.as_ref();
    let cases = common::short_reference_cases();
    let mut slots = SlotKvCache::new(model.info().num_layers, q).with_attention(attention);
    // Different lengths, one of a single token (an empty cache when it joins).
    let mut running: Vec<Sequence> = vec![
        start(model, &mut slots, &cases[0].prompt_ids, q),
        start(model, &mut slots, &cases[1].prompt_ids, q),
        start(model, &mut slots, &cases[2].prompt_ids[..5], q),
        start(model, &mut slots, &cases[3].prompt_ids[..1], q),
    ];
    let mut worst = 0f32;
    let mut rows_seen = std::collections::BTreeSet::new();
    for step in 0..12 {
        if step == 3 {
            // The first sequence leaves a free slot; nobody moves.
            let gone = running.remove(0);
            assert_eq!(slots.remove(gone.slot).unwrap(), vec![]);
            assert!(!slots.is_occupied(gone.slot));
            assert_eq!(slots.slots(), 4);
        }
        if step == 5 {
            // The next one to join takes the free slot.
            let seq = start(model, &mut slots, &cases[4].prompt_ids, q);
            assert_eq!(seq.slot, 0);
            running.push(seq);
        }
        if step == 8 {
            // The newest leaves, then two more join (slots 0 and 4: eight rows).
            let gone = running.pop().unwrap();
            assert_eq!(slots.remove(gone.slot).unwrap(), vec![]);
            running.push(start(model, &mut slots, &cases[5].prompt_ids, q));
            running.push(start(model, &mut slots, &cases[0].prompt_ids[..9], q));
            assert_eq!(slots.rows(), 8);
        }
        if step == 10 {
            // Three of five leave: the rows are compacted whenever the sequences left fit a
            // bucket half as large, down to two rows, slots 0 and 1.
            let mut moved = 0;
            for _ in 0..3 {
                let gone = running.remove(0);
                let moves = slots.remove(gone.slot).unwrap();
                moved += moves.len();
                for (from, to) in moves {
                    running.iter_mut().find(|s| s.slot == from).unwrap().slot = to;
                }
            }
            assert_eq!(slots.rows(), 2);
            assert!(moved > 0, "some sequence moved");
            let mut held: Vec<usize> = running.iter().map(|s| s.slot).collect();
            held.sort_unstable();
            assert_eq!(held, vec![0, 1]);
        }
        rows_seen.insert(slots.rows());
        let mut inputs = vec![0u32; slots.rows()];
        for seq in &running {
            inputs[seq.slot] = seq.next;
        }
        let ids = Array::from_slice(&inputs, &[inputs.len() as i32, 1]);
        let one_each = vec![1; slots.slots()];
        let batched = model.forward_slots(&ids, &mut slots, &one_each).unwrap();
        for seq in &mut running {
            let alone = model
                .forward_sequence(&Array::from_slice(&[seq.next], &[1, 1]), &mut seq.cache)
                .unwrap();
            let row = seq.slot as i32;
            let row = batched.index((row..row + 1, .., ..));
            worst = worst.max(largest_difference(&row, &alone));
            let next = ops::indexing::argmax_axis(&alone, -1, None).unwrap();
            seq.next = next.item_exact::<u32>();
            assert_eq!(
                ops::indexing::argmax_axis(&row, -1, None)
                    .unwrap()
                    .item_exact::<u32>(),
                seq.next,
                "step {step}: the same greedy token"
            );
        }
        for seq in &running {
            assert_eq!(slots.slot_len(seq.slot), seq.cache[0].offset() as usize);
        }
    }
    assert!(
        rows_seen.len() >= 2,
        "the rows changed bucket: {rows_seen:?}"
    );
    worst
}

/// Prefill steps over a slot cache: rows at different offsets (one starting from a cached
/// prefix, one from nothing) feed chunks of different lengths padded to one width, over several
/// steps; every real position's logits equal a lone forward pass of the same chunk on the
/// sequence's own cache, and the sequences then decode from a second slot cache they moved into.
#[test]
fn prefill_chunks_in_slots_match_per_sequence_prefill() {
    prefill_chunks_in_slots(false);
}

/// The same with the additive masks CUDA's prompt chunks take (made once a step, see
/// `SlotRead::additive_mask`), forced on here.
#[test]
fn prefill_chunks_with_additive_masks_match_per_sequence_prefill() {
    prefill_chunks_in_slots(true);
}

fn prefill_chunks_in_slots(additive: bool) {
    let model = models::load(&common::model_dir()).unwrap();
    let model = model.as_ref();
    let cases = common::short_reference_cases();
    let mut prefill = SlotKvCache::new(model.info().num_layers, None);
    if additive {
        prefill = prefill.with_additive_masks();
        assert!(
            prefill
                .read(perch_engine::device::Backend::Cpu, 5)
                .additive_mask
        );
    }
    // (prompt, tokens cached before the first step, chunk length per step)
    let plans: [(&[u32], usize, usize); 3] = [
        (&cases[0].prompt_ids, 0, 5),
        (&cases[1].prompt_ids, 3, 2),
        (&cases[2].prompt_ids[..4], 0, 16),
    ];
    let mut seqs: Vec<(Vec<KvCache>, usize)> = Vec::new();
    for (slot, &(prompt, cached, _)) in plans.iter().enumerate() {
        let mut cache = model.make_cache(None);
        if cached > 0 {
            let ids = Array::from_slice(&prompt[..cached], &[1, cached as i32]);
            model.forward_sequence(&ids, &mut cache).unwrap();
        }
        eval(cache.iter().flat_map(KvCache::state)).unwrap();
        assert_eq!(prefill.push(&cache, cached, RowKv::Plain).unwrap(), slot);
        seqs.push((cache, cached));
    }
    let mut worst = 0f32;
    let mut padded_steps = 0;
    for step in 0.. {
        let chunks: Vec<usize> = plans
            .iter()
            .zip(&seqs)
            .map(|(&(prompt, _, chunk), &(_, done))| chunk.min(prompt.len() - 1 - done))
            .collect();
        if chunks.iter().all(|&n| n == 0) {
            break;
        }
        let width = chunks.iter().copied().max().unwrap().max(1) + 3;
        let mut ids = vec![7u32; prefill.rows() * width];
        for (row, ((&(prompt, _, _), &(_, done)), &n)) in
            plans.iter().zip(&seqs).zip(&chunks).enumerate()
        {
            ids[row * width..row * width + n].copy_from_slice(&prompt[done..done + n]);
        }
        let ids = Array::from_slice(&ids, &[prefill.rows() as i32, width as i32]);
        let batched = model.forward_slots(&ids, &mut prefill, &chunks).unwrap();
        padded_steps += usize::from(chunks.iter().any(|&n| n < width));
        for (row, ((&(prompt, _, _), (cache, done)), &n)) in
            plans.iter().zip(&mut seqs).zip(&chunks).enumerate()
        {
            if n > 0 {
                let chunk = Array::from_slice(&prompt[*done..*done + n], &[1, n as i32]);
                let alone = model.forward_sequence(&chunk, cache).unwrap();
                let (r, n) = (row as i32, n as i32);
                let mine = batched.index((r..r + 1, 0..n, ..));
                worst = worst.max(largest_difference(&mine, &alone));
            }
            *done += n;
            assert_eq!(prefill.slot_len(row), *done, "step {step}, row {row}");
        }
    }
    assert!(padded_steps > 0, "some rows were padded");
    assert!(worst < 1e-4, "prefill logits differ by up to {worst}");

    // Every prompt but its last token is cached: the rows move to a decode cache.
    let mut decode = SlotKvCache::new(model.info().num_layers, None);
    for (row, (&(prompt, _, _), (_, done))) in plans.iter().zip(&seqs).enumerate().rev() {
        assert_eq!(*done, prompt.len() - 1);
        let slot = decode.push_from(&prefill, row).unwrap();
        assert_eq!(
            prefill.remove(row).unwrap(),
            vec![],
            "the last row leaves first"
        );
        assert_eq!(decode.slot_len(slot), *done);
    }
    assert!(prefill.is_empty());
    // Decode slot `s` holds plan `2 - s`.
    let inputs: Vec<u32> = (0..decode.rows())
        .map(|s| {
            plans
                .get(2usize.wrapping_sub(s))
                .map_or(0, |p| *p.0.last().unwrap())
        })
        .collect();
    let ids = Array::from_slice(&inputs, &[inputs.len() as i32, 1]);
    let batched = model.forward_slots(&ids, &mut decode, &[1, 1, 1]).unwrap();
    for (slot, (&(prompt, _, _), (cache, _))) in plans.iter().zip(&mut seqs).rev().enumerate() {
        let last = Array::from_slice(&[*prompt.last().unwrap()], &[1, 1]);
        let alone = model.forward_sequence(&last, cache).unwrap();
        let s = slot as i32;
        let diff = largest_difference(&batched.index((s..s + 1, .., ..)), &alone);
        assert!(diff < 1e-4, "decode slot {slot}: {diff}");
    }
}

#[test]
fn float_slots_match_per_sequence_attention() {
    let worst = run(None, SlotAttention::Fused);
    assert!(worst < 1e-4, "logits differ by up to {worst}");
}

/// The explicit read (matmul, mask, precise softmax, matmul: CUDA's decode steps) of the same
/// schedule.
#[test]
fn float_slots_read_explicitly_match_per_sequence_attention() {
    let worst = run(None, SlotAttention::Explicit);
    assert!(worst < 1e-4, "logits differ by up to {worst}");
}

/// With a quantized cache the logits are not compared: a batch's projections differ from a lone
/// row's in the last bit, and a last-bit change can move a value across a quantization step
/// (measured: up to 0.2 in the logits at 8 bits; mlx_lm's own cache does the same, see
/// `kv_quantization.rs`). The greedy tokens stay equal here, and the attention over padded,
/// masked slots is compared with identical inputs below.
#[test]
fn quantized_slots_give_the_per_sequence_tokens() {
    run(
        Some(KvQuantization::new(8, 64, 64).unwrap()),
        SlotAttention::Fused,
    );
}

/// The masked quantized attention over a slot's whole buffer (stale values past the row's length,
/// as a moved or reused slot holds) equals the unmasked one over the row's own positions.
#[test]
fn masked_quantized_attention_over_padded_slots_is_exact() {
    use perch_engine::testing::{quantized_scaled_dot_product_attention, KvMask};
    let q = KvQuantization::new(8, 64, 64).unwrap();
    let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
    let (rows, kv_heads, heads, capacity) = (3, 2, 6, 256);
    let keys = ops::quantize(normal(&[rows, kv_heads, capacity, 64]), 64, 8).unwrap();
    let values = ops::quantize(normal(&[rows, kv_heads, capacity, 64]), 64, 8).unwrap();
    let queries = normal(&[rows, heads, 1, 64]);
    let lengths = [1, 37, 200];
    let positions = ops::arange::<_, i32>(0, capacity, None).unwrap();
    let lens = Array::from_slice(&lengths, &[rows, 1, 1, 1]);
    let mask = ops::lt(positions.reshape(&[1, 1, 1, -1]).unwrap(), &lens).unwrap();
    let parts = |p: &(Array, Array, Array)| [p.0.clone(), p.1.clone(), p.2.clone()];
    let batched = quantized_scaled_dot_product_attention(
        &queries,
        &parts(&keys),
        &parts(&values),
        0.125,
        q,
        KvMask::Array(&mask),
        None,
    )
    .unwrap();
    for (row, &len) in lengths.iter().enumerate() {
        let r = row as i32;
        let cut = |p: &(Array, Array, Array)| {
            [&p.0, &p.1, &p.2].map(|a| a.index((r..r + 1, .., ..len, ..)))
        };
        let alone = quantized_scaled_dot_product_attention(
            &queries.index((r..r + 1, .., .., ..)),
            &cut(&keys),
            &cut(&values),
            0.125,
            q,
            KvMask::None,
            None,
        )
        .unwrap();
        let worst = largest_difference(&batched.index((r..r + 1, .., .., ..)), &alone);
        assert!(worst < 1e-6, "row {row} ({len} positions): {worst}");
    }
}

/// The two ways a GPU may read a quantized slot cache (packed, or dequantized into the fused
/// attention, as CUDA does) agree, masked positions excluded, to float32 rounding.
#[test]
fn dequantized_and_packed_reads_of_quantized_slots_agree() {
    use perch_engine::testing::masked_attention;
    use perch_engine::testing::CachedKv;
    let q = KvQuantization::new(8, 64, 64).unwrap();
    let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
    let (rows, capacity) = (4, 256);
    let parts = |a: &Array| {
        let (w, s, b) = ops::quantize(a, 64, 8).unwrap();
        [w, s, b]
    };
    let keys = normal(&[rows, 2, capacity, 64]);
    let values = normal(&[rows, 2, capacity, 64]);
    let queries = normal(&[rows, 6, 1, 64]);
    let lens = Array::from_slice(&[1, 9, 130, 256], &[rows, 1, 1, 1]);
    let positions = ops::arange::<_, i32>(0, capacity, None).unwrap();
    let mask = ops::lt(positions.reshape(&[1, 1, 1, -1]).unwrap(), &lens).unwrap();
    // With attention sinks too (gpt-oss): one logit per query head.
    let sinks = normal(&[6]);
    for sinks in [None, Some(&sinks)] {
        let read = |dequantize| {
            let cached = CachedKv::Quantized {
                keys: parts(&keys),
                values: parts(&values),
                quantization: q,
            };
            let read = SlotRead {
                explicit: false,
                dequantize,
                additive_mask: false,
                decode_kernel: false,
            };
            masked_attention(&queries, cached, 0.125, &mask, read, sinks).unwrap()
        };
        let worst = largest_difference(&read(true), &read(false));
        assert!(worst < 1e-4, "{worst} (sinks: {})", sinks.is_some());
    }
}

/// The explicit read of dense slots equals MLX's fused masked attention over the same padded
/// buffers (stale values past each row's length), one query per row and prompt chunks alike, with
/// a key/value head shared by three query heads, with and without attention sinks (gpt-oss: a
/// logit per query head that joins the softmax without a value).
#[test]
fn explicit_and_fused_reads_of_dense_slots_agree() {
    use perch_engine::testing::masked_attention;
    use perch_engine::testing::CachedKv;
    let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
    let (rows, capacity) = (4, 256);
    let keys = normal(&[rows, 2, capacity, 64]);
    let values = normal(&[rows, 2, capacity, 64]);
    let lens = Array::from_slice(&[5, 9, 130, 250], &[rows, 1, 1, 1]);
    // Large enough to take a visible share of each softmax.
    let sinks = ops::multiply(normal(&[6]), Array::from_f32(4.0)).unwrap();
    let mut fused_by_sinks = Vec::new();
    for (seq, sinks) in [(1, None), (5, None), (1, Some(&sinks)), (5, Some(&sinks))] {
        let queries = normal(&[rows, 6, seq, 64]);
        // Row r's query i sits at position lens[r] + i - seq and sees positions up to it.
        let positions = ops::arange::<_, i32>(0, capacity, None).unwrap();
        let query_at = ops::add(
            ops::subtract(&lens, Array::from_int(seq)).unwrap(),
            ops::arange::<_, i32>(0, seq, None)
                .unwrap()
                .reshape(&[1, 1, -1, 1])
                .unwrap(),
        )
        .unwrap();
        let mask = ops::le(positions.reshape(&[1, 1, 1, -1]).unwrap(), &query_at).unwrap();
        let read = |explicit, additive_mask, mask: &Array| {
            let cached = CachedKv::Dense {
                keys: keys.clone(),
                values: values.clone(),
            };
            let read = SlotRead {
                explicit,
                dequantize: false,
                additive_mask,
                decode_kernel: false,
            };
            masked_attention(&queries, cached, 0.125, mask, read, sinks).unwrap()
        };
        let (explicit, fused) = (read(true, false, &mask), read(false, false, &mask));
        // Each position's heads side by side.
        assert_eq!(explicit.shape(), &[rows, seq, 6 * 64]);
        let worst = largest_difference(&explicit, &fused);
        assert!(
            worst < 1e-5,
            "{seq} queries per row: {worst} (sinks: {})",
            sinks.is_some()
        );
        // The mask as an additive one (CUDA's prompt chunks) reads the same.
        let additive = additive_mask(&mask, mlx_rs::Dtype::Float32).unwrap();
        let worst = largest_difference(&read(false, true, &additive), &fused);
        assert!(
            worst < 1e-5,
            "additive mask, {seq} queries per row: {worst} (sinks: {})",
            sinks.is_some()
        );
        // A row that may attend to nothing (a padding row) still reads finite values.
        let nothing = ops::logical_and(
            &mask,
            ops::gt(
                Array::from_slice(&[1, 1, 1, 0], &[rows, 1, 1, 1]),
                Array::from_int(0),
            )
            .unwrap(),
        )
        .unwrap();
        let nothing = additive_mask(&nothing, mlx_rs::Dtype::Float32).unwrap();
        let padded = read(false, true, &nothing);
        let bad =
            ops::logical_or(ops::is_nan(&padded).unwrap(), ops::is_inf(&padded).unwrap()).unwrap();
        let bad = ops::sum(bad.as_dtype(mlx_rs::Dtype::Float32).unwrap(), None)
            .unwrap()
            .item_exact::<f32>();
        assert_eq!(bad, 0.0, "a fully masked row read non-finite values");
        fused_by_sinks.push(fused);
    }
    // The sinks take their share: outputs with them differ from those without.
    for seq in 0..2 {
        let moved = largest_difference(&fused_by_sinks[seq], &fused_by_sinks[seq + 2]);
        assert!(moved > 1e-3, "sinks changed nothing ({moved})");
    }
}

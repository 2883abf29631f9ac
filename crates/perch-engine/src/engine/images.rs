//! A request's images in the batch: their features computed once at insertion (the model's
//! vision tower), their tokens in the sequence made unique to each image's content, and the
//! features of the tokens a prefill chunk feeds ([`crate::models::Spliced`]).
//!
//! The prompt holds each image as a run of the tower's image token. In the sequence's tokens
//! (what the prefix cache hashes) each of those places holds a placeholder instead: an id above
//! every vocabulary ([`PLACEHOLDER`] and 31 bits of SHA-256 over the image's digest and the
//! place's index), so that blocks holding an image's tokens are keyed by its content — a second
//! turn about the same image reuses them, another image never does — while the scheduler and the
//! prefix cache stay token-based. Placeholders are fed to the model as the image token, with the
//! image's features in their embeddings' place.

use mlx_rs::{ops, Array};
use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};
use crate::image_processor::ImageInput;
use crate::models::{Model, Spliced};

/// The bit every placeholder id has set (vocabularies are far smaller).
pub const PLACEHOLDER: u32 = 0x8000_0000;

/// An image of a sequence: where its tokens start in the sequence, and its features
/// `[tokens, hidden]` as the embedding layer holds them.
pub struct SequenceImage {
    pub start: usize,
    pub features: Array,
}

impl SequenceImage {
    fn end(&self) -> usize {
        self.start + self.features.shape()[0] as usize
    }
}

/// The placeholder id of place `index` of the image whose digest is `digest`.
fn placeholder(digest: &[u8; 32], index: usize) -> u32 {
    let mut hasher = Sha256::new();
    hasher.update(digest);
    hasher.update((index as u64).to_le_bytes());
    let out = hasher.finalize();
    PLACEHOLDER | (u32::from_le_bytes([out[0], out[1], out[2], out[3]]) & !PLACEHOLDER)
}

/// Checks `images` against the prompt in `tokens` and the model's vision tower, computes their
/// features (a pass of the tower each) and puts each image's placeholders in its tokens'
/// places. `Err` (a sentence, nothing changed) when the model takes no images, the
/// prompt's image tokens do not make one run of the tower's length per image, the prompt ends
/// inside an image, or an image has another shape than the tower's.
pub fn prepare(
    model: &dyn Model,
    tokens: &mut [u32],
    images: &[ImageInput],
) -> Result<Vec<SequenceImage>> {
    let Some(tower) = model.vision() else {
        return Err(EngineError::Request(format!(
            "this model ({}) takes no images: it has no vision tower Perch loads",
            model.info().model_type
        )));
    };
    if model.info().vocab_size > PLACEHOLDER as usize {
        return Err(EngineError::Request(
            "images need a vocabulary below 2^31 tokens".into(),
        ));
    }
    let (id, per_image) = (tower.image_token_id(), tower.tokens_per_image() as usize);
    // Each run of image tokens holds whole images, one after another.
    let mut starts = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] != id {
            i += 1;
            continue;
        }
        let run = tokens[i..].iter().take_while(|&&t| t == id).count();
        if run % per_image != 0 {
            return Err(EngineError::Request(format!(
                "the prompt has a run of {run} image tokens at position {i}; each image takes \
                 {per_image}"
            )));
        }
        starts.extend((0..run / per_image).map(|k| i + k * per_image));
        i += run;
    }
    if starts.len() != images.len() {
        return Err(EngineError::Request(format!(
            "the prompt holds {} image(s) ({per_image} image tokens each) but the request has {}",
            starts.len(),
            images.len()
        )));
    }
    if tokens.last() == Some(&id) {
        return Err(EngineError::Request(
            "the prompt ends inside an image: text must follow its image tokens".into(),
        ));
    }
    let side = tower.image_size() as usize;
    if let Some(image) = images.iter().find(|im| im.shape() != [side, side, 3]) {
        return Err(EngineError::Request(format!(
            "an image of shape {:?}; this model's vision tower takes [{side}, {side}, 3]",
            image.shape()
        )));
    }
    // One image a pass, each evaluated before the next: a tower's activations (on the CPU its
    // attention scores, heads × patches² floats) are one image's at a time.
    let mut out = Vec::with_capacity(images.len());
    for image in images {
        let pixels = Array::from_slice(image.pixels(), &[1, side as i32, side as i32, 3]);
        let features = tower.embed(&pixels)?.reshape(&[per_image as i32, -1])?;
        features.eval()?;
        out.push(features);
    }
    Ok(starts
        .iter()
        .zip(images)
        .zip(out)
        .map(|((&start, image), features)| {
            for (j, token) in tokens[start..start + per_image].iter_mut().enumerate() {
                *token = placeholder(image.digest(), j);
            }
            SequenceImage { start, features }
        })
        .collect())
}

/// Features of some of a chunk's tokens: (offset in the chunk, features `[n, hidden]`).
pub type Piece = (usize, Array);

/// What a prefill chunk feeds: `tokens` (the sequence's, from `from`) with placeholders turned
/// back into the image token, and the features of the image tokens among them.
pub fn chunk_inputs(
    model: &dyn Model,
    images: &[SequenceImage],
    tokens: &[u32],
    from: usize,
) -> Result<(Vec<u32>, Vec<Piece>)> {
    let id = model.vision().map_or(0, |t| t.image_token_id());
    let ids = tokens
        .iter()
        .map(|&t| if t & PLACEHOLDER != 0 { id } else { t })
        .collect();
    let to = from + tokens.len();
    let mut pieces = Vec::new();
    for image in images.iter().filter(|im| im.start < to && im.end() > from) {
        let (a, b) = (image.start.max(from), image.end().min(to));
        let rows = Array::from_iter(
            (a - image.start) as i32..(b - image.start) as i32,
            &[(b - a) as i32],
        );
        pieces.push((a - from, image.features.take_axis(&rows, 0)?));
    }
    Ok((ids, pieces))
}

/// One pass's [`Spliced`] from each row's pieces ([`chunk_inputs`]), rows `width` tokens apart;
/// `None` without any.
pub fn spliced(rows: &[Vec<Piece>], width: usize) -> Result<Option<Spliced>> {
    let mut positions = Vec::new();
    let mut features = Vec::new();
    for (row, pieces) in rows.iter().enumerate() {
        for (offset, piece) in pieces {
            let base = (row * width + offset) as i32;
            positions.extend(base..base + piece.shape()[0]);
            features.push(piece.clone());
        }
    }
    if features.is_empty() {
        return Ok(None);
    }
    Ok(Some(Spliced {
        positions: Array::from_slice(&positions, &[positions.len() as i32]),
        features: ops::concatenate(&features, 0)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::{placeholder, PLACEHOLDER};

    #[test]
    fn placeholders_are_above_vocabularies_and_keyed_by_content_and_place() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let ids: Vec<u32> = (0..256).map(|j| placeholder(&a, j)).collect();
        assert!(ids.iter().all(|&t| t & PLACEHOLDER != 0));
        assert_eq!(placeholder(&a, 7), ids[7], "the same image, the same ids");
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), 256, "each place its own id");
        assert!(
            (0..256).all(|j| placeholder(&b, j) != ids[j]),
            "another image, other ids"
        );
    }
}

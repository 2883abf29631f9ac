//! A request's images in the batch: their features computed once, by the first prefill chunk
//! that feeds one of their tokens (the model's vision tower), their tokens in the sequence made
//! unique to each image's content, and the features of the tokens a prefill chunk feeds
//! ([`crate::models::Spliced`]).
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
use crate::models::qwen_vision::{mrope_positions, ImagePlace};
use crate::models::{Model, Spliced};

/// The bit every placeholder id has set (vocabularies are far smaller).
pub const PLACEHOLDER: u32 = 0x8000_0000;

/// An image of a sequence: where its tokens start in the sequence and how many there are, its
/// token grid (rows, columns) where the model's positions follow it (Qwen's multimodal RoPE),
/// and its pixels until a prefill chunk first feeds one of its tokens, its features `[tokens,
/// hidden]` (as the embedding layer holds them) from then on: an image whose tokens all come
/// from the prefix cache (a later turn about it) never runs the tower.
pub struct SequenceImage {
    pub start: usize,
    pub tokens: usize,
    pub grid: Option<(usize, usize)>,
    content: Content,
}

enum Content {
    Pixels(ImageInput),
    Features(Array),
}

impl SequenceImage {
    /// The position after its last image token.
    pub fn end(&self) -> usize {
        self.start + self.tokens
    }

    /// Its features, computed now (a pass of the tower, evaluated) if they are not yet.
    fn features(&mut self, model: &dyn Model) -> Result<&Array> {
        if let Content::Pixels(image) = &self.content {
            let tower = model
                .vision()
                .ok_or_else(|| EngineError::Request("the model's vision tower is gone".into()))?;
            let [h, w, c] = image.shape().map(|d| d as i32);
            let features = tower.embed(&Array::from_slice(image.pixels(), &[h, w, c]))?;
            if features.shape()[0] as usize != self.tokens {
                return Err(EngineError::Request(format!(
                    "the vision tower made {} features of an image that takes {} tokens",
                    features.shape()[0],
                    self.tokens
                )));
            }
            features.eval()?;
            self.content = Content::Features(features);
        }
        match &self.content {
            Content::Features(features) => Ok(features),
            Content::Pixels(_) => unreachable!("computed above"),
        }
    }
}

/// A sequence's multimodal RoPE positions (Qwen's): per token of its prompt `[time, row,
/// column]` as three rows, and the delta every later token's position takes (its index plus
/// `delta`), from [`mrope_positions`].
pub struct RopePositions {
    pub positions: [Vec<i32>; 3],
    pub delta: i32,
}

impl RopePositions {
    /// Token `index`'s position on `axis`.
    pub fn at(&self, axis: usize, index: usize) -> i32 {
        match self.positions[axis].get(index) {
            Some(&p) => p,
            None => index as i32 + self.delta,
        }
    }
}

/// The multimodal RoPE positions of a prompt of `len` tokens holding `images`, when the model's
/// positions follow its images' grids; `None` otherwise.
pub fn rope_positions(images: &[SequenceImage], len: usize) -> Result<Option<RopePositions>> {
    let places: Option<Vec<ImagePlace>> = images
        .iter()
        .map(|im| {
            im.grid.map(|(rows, cols)| ImagePlace {
                start: im.start,
                rows,
                cols,
            })
        })
        .collect();
    match places {
        Some(places) if !places.is_empty() => {
            let (positions, delta) = mrope_positions(len, &places)?;
            Ok(Some(RopePositions { positions, delta }))
        }
        _ => Ok(None),
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

/// Checks `images` against the prompt in `tokens` and the model's vision tower and puts each
/// image's placeholders in its tokens' places (its features are computed when a prefill chunk
/// first needs them, [`chunk_inputs`]). The prompt holds each image, in order, as a run of the tower's image token as long
/// as that image's token count ([`crate::models::vision::VisionTower::tokens`]; adjacent images'
/// runs may touch). `Err` (a sentence, nothing changed) when the model takes no images, an
/// image has a shape the tower does not take, the prompt's image tokens do not make one run per
/// image, or the prompt ends inside an image.
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
    let id = tower.image_token_id();
    let sizes: Vec<(usize, Option<(usize, usize)>)> = images
        .iter()
        .map(|image| tower.tokens(image.shape()))
        .collect::<Result<_>>()?;
    // Each image's run, in order.
    let mut starts = Vec::with_capacity(images.len());
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] != id {
            i += 1;
            continue;
        }
        let Some(&(n, _)) = sizes.get(starts.len()) else {
            return Err(EngineError::Request(format!(
                "the prompt holds more image tokens than its {} image(s) take (from position {i})",
                images.len()
            )));
        };
        let run = tokens[i..].iter().take(n).take_while(|&&t| t == id).count();
        if run != n {
            return Err(EngineError::Request(format!(
                "the prompt has a run of {run} image tokens at position {i} where image {} takes \
                 {n}",
                starts.len() + 1
            )));
        }
        starts.push(i);
        i += n;
    }
    if starts.len() != images.len() {
        return Err(EngineError::Request(format!(
            "the prompt holds image tokens for {} image(s) but the request has {}",
            starts.len(),
            images.len()
        )));
    }
    if tokens.last() == Some(&id) {
        return Err(EngineError::Request(
            "the prompt ends inside an image: text must follow its image tokens".into(),
        ));
    }
    Ok(starts
        .iter()
        .zip(images)
        .zip(sizes)
        .map(|((&start, image), (n, grid))| {
            for (j, token) in tokens[start..start + n].iter_mut().enumerate() {
                *token = placeholder(image.digest(), j);
            }
            SequenceImage {
                start,
                tokens: n,
                grid,
                content: Content::Pixels(image.clone()),
            }
        })
        .collect())
}

/// Computes the features of the images among a sequence's tokens `from..to` that have none yet
/// (one image a pass of the tower, evaluated before the next, so a tower's activations are one
/// image's at a time). `Err`: the tower's failure on one of them.
pub fn compute_features(
    model: &dyn Model,
    images: &mut [SequenceImage],
    from: usize,
    to: usize,
) -> Result<()> {
    for image in images
        .iter_mut()
        .filter(|im| im.start < to && im.end() > from)
    {
        image.features(model)?;
    }
    Ok(())
}

/// Features of some of a chunk's tokens: (offset in the chunk, features `[n, hidden]`).
pub type Piece = (usize, Array);

/// What a prefill chunk feeds: `tokens` (the sequence's, from `from`) with placeholders turned
/// back into the image token, and the features of the image tokens among them (computed here
/// for an image that has none yet; the batch computes them first, [`compute_features`]).
pub fn chunk_inputs(
    model: &dyn Model,
    images: &mut [SequenceImage],
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
    for image in images
        .iter_mut()
        .filter(|im| im.start < to && im.end() > from)
    {
        let (a, b, start) = (image.start.max(from), image.end().min(to), image.start);
        let rows = Array::from_iter((a - start) as i32..(b - start) as i32, &[(b - a) as i32]);
        pieces.push((a - from, image.features(model)?.take_axis(&rows, 0)?));
    }
    Ok((ids, pieces))
}

/// One pass's [`Spliced`] from each row's pieces ([`chunk_inputs`]), rows `width` tokens apart;
/// `None` without any. With `both_ways` each piece's tokens attend to each other in both
/// directions ([`Spliced::both_ways`]: the batch keeps such an image whole in one pass).
pub fn spliced(rows: &[Vec<Piece>], width: usize, both_ways: bool) -> Result<Option<Spliced>> {
    let mut positions = Vec::new();
    let mut features = Vec::new();
    let mut spans = Vec::new();
    for (row, pieces) in rows.iter().enumerate() {
        for (offset, piece) in pieces {
            let base = (row * width + offset) as i32;
            let n = piece.shape()[0];
            positions.extend(base..base + n);
            features.push(piece.clone());
            if both_ways {
                spans.push((row, *offset, offset + n as usize));
            }
        }
    }
    if features.is_empty() {
        return Ok(None);
    }
    Ok(Some(Spliced {
        features: Some((
            Array::from_slice(&positions, &[positions.len() as i32]),
            ops::concatenate(&features, 0)?,
        )),
        rope_positions: None,
        both_ways: spans,
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

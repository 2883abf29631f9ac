//! Image files to what a vision tower takes, as the model's image processor does (transformers'
//! `Gemma3ImageProcessor` for Gemma 3, mlx-vlm's Qwen3-VL processor for Qwen3.5 and its
//! `Gemma4ImageProcessor` for Gemma 4): decoded with the `image` crate (PNG, JPEG, WebP, GIF's
//! first frame), converted to RGB (an alpha channel is dropped, as PIL's `convert("RGB")` does),
//! resized ([`Resize`]: Gemma 3 to the tower's square, Qwen to multiples of its merge block within
//! a pixel budget, [`smart_resize`], Gemma 4 to the largest size of its aspect ratio within its
//! soft-token budget, [`aspect_resize`]) with `preprocessor_config.json`'s filter (`resample`: 2
//! bilinear, 3 bicubic, 1 Lanczos, 0 nearest; Gemma 3's default bilinear, Qwen's bicubic; Gemma 4
//! always bicubic), rescaled by `rescale_factor` and normalized by `image_mean` / `image_std`
//! (unless `do_normalize` is false, Gemma 4's default), channels last. The `image` crate's filters are PIL's kinds with an
//! antialiasing support as wide as the downscale, run a pass per axis with 8-bit values between
//! them as PIL's are, computed in floating point where PIL uses fixed point: pixel values may
//! differ from the reference's by a step or two of 255 after resizing (an image already at its
//! size is not resampled by either). Pan-and-scan crops (`do_pan_and_scan`) are not made.
//!
//! Untrusted input: the encoded size, the decoded width, height and allocation are bounded before
//! anything is decoded ([`MAX_IMAGE_BYTES`], [`MAX_SIDE`], [`MAX_PIXELS`]); a request takes at
//! most [`MAX_IMAGES`]. Every refusal is an [`EngineError::Request`] sentence.
//!
//! Prompts: a chat template writes an image as the tokenizer's begin-of-image token (Gemma 3's
//! `<start_of_image>`) or as one image token between its own markers (Qwen's
//! `<|vision_start|><|image_pad|><|vision_end|>`); [`ImageProcessor::expand`] replaces each with
//! the run of image tokens the tower fills (Gemma 3: `\n\n<start_of_image>` +
//! `<image_soft_token>` × tokens per image + `<end_of_image>\n\n`, as `Gemma3Processor` does;
//! Qwen: `<|image_pad|>` × the image's tokens, one per merge block; Gemma 4: its template writes
//! the image token `<|image|>`, which becomes `<|image>` + `<|image|>` × the image's soft tokens +
//! `<image|>`, as `Gemma4Processor` does).

use std::io::Cursor;
use std::path::Path;

use base64::Engine as _;
use image::imageops::FilterType;
use image::{ImageFormat, ImageReader, Limits};
use serde_json::Value;

use crate::error::{EngineError, Result};

/// The largest encoded image accepted, in bytes (OpenAI's limit).
pub const MAX_IMAGE_BYTES: usize = 20 << 20;
/// The widest and tallest image decoded, in pixels.
pub const MAX_SIDE: u32 = 16_384;
/// The most pixels an image may have (about 8,000 × 6,000).
pub const MAX_PIXELS: u64 = 50_000_000;
/// The most images one request may carry.
pub const MAX_IMAGES: usize = 16;
/// The most tokens one image may take under [`Resize::Smart`]: its pixel bound is lowered to
/// this many merge blocks (mlx-vlm's default bound is 980 tokens of Qwen3.5's 32-pixel blocks;
/// Qwen3-VL's configs allow 16,384). The tower attends over all of an image's patches at once,
/// four a token: without a bound one photo could ask for scores of gigabytes (the CPU
/// materializes them).
pub const MAX_IMAGE_TOKENS: u64 = 1280;

fn refuse(message: impl Into<String>) -> EngineError {
    EngineError::Request(message.into())
}

/// How an image is sized for the tower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resize {
    /// To the tower's square side (Gemma 3's SigLIP), which `tokens` image tokens stand for.
    Square { side: u32, tokens: usize },
    /// To the size nearest its own whose sides are multiples of `factor` and whose area is within
    /// `[min_pixels, max_pixels]` (Qwen's `smart_resize`, [`smart_resize`]); a token for each
    /// `factor × factor` block.
    Smart {
        factor: u32,
        min_pixels: u64,
        max_pixels: u64,
    },
    /// To the largest size of the image's aspect ratio whose sides are multiples of `patch ·
    /// pool` and whose `patch`-pixel patches are at most `max_tokens · pool²` ([`aspect_resize`],
    /// Gemma 4); a token for each `pool × pool` patches.
    Aspect {
        patch: u32,
        pool: u32,
        max_tokens: u32,
    },
}

/// What a chat template writes for an image, and the run of image tokens it becomes.
#[derive(Clone, Debug)]
enum Placeholder {
    /// Gemma 3: the template writes `begin`; it becomes `\n\nbegin` + `token` × n + `end\n\n`.
    Wrapped {
        begin: String,
        token: String,
        end: String,
    },
    /// Qwen: the template writes `<|vision_start|>token<|vision_end|>`; each `token` becomes n.
    Repeated { token: String },
    /// Gemma 4: the template writes `token`; it becomes `begin` + `token` × n + `end`.
    Bracketed {
        begin: String,
        token: String,
        end: String,
    },
}

/// How a model's images are prepared and written into its prompts.
#[derive(Clone, Debug)]
pub struct ImageProcessor {
    resize: Resize,
    filter: FilterType,
    rescale: f32,
    mean: [f32; 3],
    std: [f32; 3],
    placeholder: Placeholder,
    /// Images prepared lately, by their URL ([`ImageProcessor::process_url`]).
    recent: std::sync::Arc<std::sync::Mutex<Recent>>,
}

/// The images an [`ImageProcessor`] prepared lately, keyed by SHA-256 of their URL, newest
/// last: a chat sends its earlier turns' images again with every turn, and decoding and resizing
/// a photo each time would add to every turn's time to first token. Bounded by
/// [`Recent::MAX_BYTES`] of pixel values.
#[derive(Debug, Default)]
struct Recent {
    images: std::collections::VecDeque<([u8; 32], ImageInput)>,
    bytes: usize,
}

impl Recent {
    /// Pixel values kept at most (8 of Qwen's largest images, 13 of Gemma 3's).
    const MAX_BYTES: usize = 128 << 20;

    fn get(&mut self, key: &[u8; 32]) -> Option<ImageInput> {
        let at = self.images.iter().position(|(k, _)| k == key)?;
        let entry = self.images.remove(at)?;
        let image = entry.1.clone();
        self.images.push_back(entry);
        Some(image)
    }

    fn put(&mut self, key: [u8; 32], image: ImageInput) {
        let size = image.pixels().len() * 4;
        if size > Self::MAX_BYTES {
            return;
        }
        while self.bytes + size > Self::MAX_BYTES {
            let Some((_, old)) = self.images.pop_front() else {
                break;
            };
            self.bytes -= old.pixels().len() * 4;
        }
        self.bytes += size;
        self.images.push_back((key, image));
    }
}

/// Qwen's `smart_resize` (transformers' `qwen2_vl`, as mlx-vlm 0.7.6 ports it): each side rounded
/// to the nearest multiple of `factor` (halves to even, as Python's `round`); if the area is
/// then above `max_pixels`, both sides scaled down by `sqrt(h · w / max_pixels)` and floored to
/// multiples (at least `factor`); below `min_pixels`, scaled up by `sqrt(min_pixels / (h · w))`
/// and ceiled. `Err` for an aspect ratio above 200.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32)> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if h.max(w) / h.min(w) > 200.0 {
        return Err(refuse(format!(
            "an image of {width} × {height} pixels; the longer side may be at most 200 times the \
             shorter"
        )));
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// Gemma 4's resize (mlx-vlm 0.7.6's `Gemma4ImageProcessor.aspect_ratio_preserving_resize`): the
/// sides scaled by `sqrt(max_tokens · pool² · patch² / (h · w))` (up or down) and floored to
/// multiples of `patch · pool`; a side that floors to nothing becomes one multiple and the other
/// `floor(long / short)` multiples, at most `max_tokens` of them.
pub fn aspect_resize(
    height: u32,
    width: u32,
    patch: u32,
    pool: u32,
    max_tokens: u32,
) -> (u32, u32) {
    let (h, w) = (f64::from(height), f64::from(width));
    let max_patches = f64::from(max_tokens) * f64::from(pool * pool);
    let factor = (max_patches * f64::from(patch * patch) / (h * w)).sqrt();
    let side = f64::from(patch * pool);
    let target_h = (factor * h / side).floor() * side;
    let target_w = (factor * w / side).floor() * side;
    let longest = f64::from(max_tokens) * side;
    let (target_h, target_w) = match (target_h == 0.0, target_w == 0.0) {
        // Both sides cannot floor to nothing: their product is the whole budget.
        (true, _) => (side, ((w / h).floor() * side).min(longest)),
        (false, true) => (((h / w).floor() * side).min(longest), side),
        (false, false) => (target_h, target_w),
    };
    (target_h as u32, target_w as u32)
}

impl ImageProcessor {
    /// The processor of the model in `model_dir` whose vision tower takes `side`-pixel squares
    /// and fills `tokens_per_image` image tokens: `preprocessor_config.json` where there is one
    /// (else Gemma 3's values: bilinear, `1/255`, mean and std 0.5), the image tokens from
    /// `tokenizer_config.json` (`boi_token`, `image_token`, `eoi_token`; else Gemma 3's).
    /// `Err` for a config that cannot describe these steps.
    pub fn load(model_dir: &Path, side: u32, tokens_per_image: usize) -> Result<Self> {
        Self::load_as(
            model_dir,
            Resize::Square {
                side,
                tokens: tokens_per_image,
            },
        )
    }

    /// The processor of a Qwen vision-language model in `model_dir` whose tower takes sides in
    /// multiples of `factor` (its patch times its merge size): `preprocessor_config.json`'s
    /// `size.shortest_edge` / `size.longest_edge` (or `min_pixels` / `max_pixels`) bound an
    /// image's area (else mlx-vlm's defaults, 56² and 14² · 4 · 1,280; `processor_config.json`'s
    /// `image_processor` settings take precedence, as mlx-vlm reads them; the area is lowered to
    /// [`MAX_IMAGE_TOKENS`] merge blocks at most), bicubic resampling, its mean, std and rescale
    /// factor; the image token from `tokenizer_config.json`'s `image_token` (else
    /// `<|image_pad|>`).
    pub fn load_qwen(model_dir: &Path, factor: u32) -> Result<Self> {
        Self::load_as(
            model_dir,
            Resize::Smart {
                factor,
                min_pixels: 56 * 56,
                max_pixels: 14 * 14 * 4 * 1280,
            },
        )
    }

    /// The processor of a Gemma 4 model in `model_dir` whose tower takes `patch`-pixel patches
    /// pooled `pool × pool` into a soft token, at most `max_tokens` an image (the tower's
    /// `default_output_length`): `processor_config.json`'s `image_processor` settings where there
    /// are some (`max_soft_tokens` replaces `max_tokens`, lowered to [`MAX_IMAGE_TOKENS`] at
    /// most; `rescale_factor`; `do_normalize`, default false, with `image_mean` / `image_std`),
    /// bicubic resampling; the image tokens from `tokenizer_config.json` (`boi_token`,
    /// `image_token`, `eoi_token`; else Gemma 4's `<|image>`, `<|image|>`, `<image|>`).
    pub fn load_gemma4(model_dir: &Path, patch: u32, pool: u32, max_tokens: u32) -> Result<Self> {
        Self::load_as(
            model_dir,
            Resize::Aspect {
                patch,
                pool,
                max_tokens,
            },
        )
    }

    /// [`ImageProcessor::load`], [`ImageProcessor::load_qwen`] and
    /// [`ImageProcessor::load_gemma4`]: `resize` with its bounds read from the config where it
    /// has them.
    fn load_as(model_dir: &Path, resize: Resize) -> Result<Self> {
        // Read as every config is: capped in size ([`crate::limits`]).
        let read = |name: &str| -> Result<Option<Value>> {
            let path = model_dir.join(name);
            if !path.is_file() {
                return Ok(None);
            }
            let text = crate::limits::read_text_capped(&path, crate::limits::MAX_CONFIG_BYTES)?;
            serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| EngineError::Config {
                    path,
                    message: e.to_string(),
                })
        };
        let mut config = read("preprocessor_config.json")?.unwrap_or(Value::Null);
        // Newer checkpoints keep the image processor's settings in `processor_config.json`
        // (`image_processor`), which take precedence (as mlx-vlm reads them).
        if let Some(Value::Object(settings)) = read("processor_config.json")?
            .and_then(|mut c| c.get_mut("image_processor").map(Value::take))
        {
            match &mut config {
                Value::Object(base) => {
                    // Its `size` bounds replace the base's, flat ones included.
                    if settings.contains_key("size") {
                        base.remove("min_pixels");
                        base.remove("max_pixels");
                    }
                    base.extend(settings);
                }
                _ => config = Value::Object(settings),
            }
        }
        let bad = |message: String| EngineError::Config {
            path: model_dir.join("preprocessor_config.json"),
            message,
        };
        let triple = |name: &str| -> Result<[f32; 3]> {
            match config.get(name) {
                None | Some(Value::Null) => Ok([0.5; 3]),
                Some(Value::Array(values)) if values.len() == 3 => {
                    let mut out = [0f32; 3];
                    for (o, v) in out.iter_mut().zip(values) {
                        *o = v
                            .as_f64()
                            .ok_or_else(|| bad(format!("{name} must hold numbers")))?
                            as f32;
                    }
                    Ok(out)
                }
                Some(Value::Number(n)) => Ok([n.as_f64().unwrap_or(0.5) as f32; 3]),
                Some(other) => Err(bad(format!("{name} must be three numbers, got {other}"))),
            }
        };
        let (mut mean, mut std) = (triple("image_mean")?, triple("image_std")?);
        if std.iter().any(|s| !(s.is_finite() && *s > 0.0)) || mean.iter().any(|m| !m.is_finite()) {
            return Err(bad(
                "image_std must be positive and image_mean finite".into()
            ));
        }
        // Gemma 4's processor leaves values in [0, 1] unless told (its tower maps them itself).
        let normalize = match config.get("do_normalize") {
            None | Some(Value::Null) => !matches!(resize, Resize::Aspect { .. }),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(format!("do_normalize must be true or false, got {v}")))?,
        };
        if !normalize {
            (mean, std) = ([0.0; 3], [1.0; 3]);
        }
        let rescale = match config.get("rescale_factor") {
            None | Some(Value::Null) => 1.0 / 255.0,
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or_else(|| bad(format!("rescale_factor must be a positive number, got {v}")))?
                as f32,
        };
        let resize = match resize {
            Resize::Smart {
                factor,
                min_pixels,
                max_pixels,
            } => {
                let bound = |names: [&str; 2], default: u64| -> Result<u64> {
                    let value = config
                        .get(names[0])
                        .or_else(|| config.get("size").and_then(|size| size.get(names[1])));
                    match value {
                        None | Some(Value::Null) => Ok(default),
                        Some(v) => v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                            bad(format!(
                                "{} must be a positive whole number, got {v}",
                                names[0]
                            ))
                        }),
                    }
                };
                let min_pixels = bound(["min_pixels", "shortest_edge"], min_pixels)?;
                let max_pixels = bound(["max_pixels", "longest_edge"], max_pixels)?;
                if min_pixels > max_pixels {
                    return Err(bad(format!(
                        "min_pixels ({min_pixels}) is above max_pixels ({max_pixels})"
                    )));
                }
                // At most MAX_IMAGE_TOKENS tokens an image, whatever the config allows (the
                // least area at half that, so that rounding up cannot pass it either).
                let most = MAX_IMAGE_TOKENS * u64::from(factor) * u64::from(factor);
                let (min_pixels, max_pixels) = (min_pixels.min(most / 2), max_pixels.min(most));
                Resize::Smart {
                    factor,
                    min_pixels,
                    max_pixels,
                }
            }
            Resize::Aspect {
                patch,
                pool,
                max_tokens,
            } => {
                let max_tokens = match config.get("max_soft_tokens") {
                    None | Some(Value::Null) => max_tokens,
                    Some(v) => v
                        .as_u64()
                        .filter(|&n| n > 0)
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| {
                            bad(format!(
                                "max_soft_tokens must be a positive whole number, got {v}"
                            ))
                        })?,
                };
                let max_tokens = max_tokens.min(MAX_IMAGE_TOKENS as u32);
                // The largest image it resizes to: `max_tokens · pool²` patches of `patch²`.
                let area = u64::from(max_tokens) * u64::from(pool).pow(2) * u64::from(patch).pow(2);
                if patch == 0 || pool == 0 || area > MAX_PIXELS {
                    return Err(bad(format!(
                        "{max_tokens} soft tokens of {pool} × {pool} patches of {patch} pixels: \
                         the tower's images would have {area} pixels (at most {MAX_PIXELS})"
                    )));
                }
                Resize::Aspect {
                    patch,
                    pool,
                    max_tokens,
                }
            }
            square => square,
        };
        let default_filter = match resize {
            Resize::Square { .. } => 2,
            Resize::Smart { .. } => 3,
            // mlx-vlm's Gemma 4 processor resizes bicubic whatever the config says.
            Resize::Aspect { .. } => 3,
        };
        let resample = match resize {
            Resize::Aspect { .. } => None,
            _ => config.get("resample").and_then(Value::as_i64),
        };
        let filter = match resample.unwrap_or(default_filter) {
            0 => FilterType::Nearest,
            1 => FilterType::Lanczos3,
            2 => FilterType::Triangle,
            3 => FilterType::CatmullRom,
            other => return Err(bad(format!("resample {other} is not a filter Perch has"))),
        };
        let tokens = read("tokenizer_config.json")?.unwrap_or(Value::Null);
        let token = |name: &str, default: &str| {
            tokens
                .get(name)
                .and_then(Value::as_str)
                .unwrap_or(default)
                .to_string()
        };
        let placeholder = match resize {
            Resize::Square { .. } => Placeholder::Wrapped {
                begin: token("boi_token", "<start_of_image>"),
                token: token("image_token", "<image_soft_token>"),
                end: token("eoi_token", "<end_of_image>"),
            },
            Resize::Smart { .. } => Placeholder::Repeated {
                token: token("image_token", "<|image_pad|>"),
            },
            Resize::Aspect { .. } => Placeholder::Bracketed {
                begin: token("boi_token", "<|image>"),
                token: token("image_token", "<|image|>"),
                end: token("eoi_token", "<image|>"),
            },
        };
        Ok(Self {
            resize,
            filter,
            rescale,
            mean,
            std,
            placeholder,
            recent: Default::default(),
        })
    }

    /// The image token as the tokenizer writes it.
    pub fn image_token(&self) -> &str {
        match &self.placeholder {
            Placeholder::Wrapped { token, .. }
            | Placeholder::Repeated { token }
            | Placeholder::Bracketed { token, .. } => token,
        }
    }

    /// How images are sized.
    pub fn resize(&self) -> Resize {
        self.resize
    }

    /// The most image tokens one prepared image takes in a prompt.
    pub fn max_tokens(&self) -> usize {
        match self.resize {
            Resize::Square { tokens, .. } => tokens,
            Resize::Smart {
                factor, max_pixels, ..
            } => usize::try_from(max_pixels / (u64::from(factor) * u64::from(factor)))
                .unwrap_or(usize::MAX),
            Resize::Aspect { max_tokens, .. } => max_tokens as usize,
        }
    }

    /// The image tokens a prepared image takes in a prompt.
    pub fn tokens(&self, image: &ImageInput) -> usize {
        match self.resize {
            Resize::Square { tokens, .. } => tokens,
            Resize::Smart { factor, .. } => {
                let [height, width, _] = image.shape();
                (height / factor as usize) * (width / factor as usize)
            }
            Resize::Aspect { patch, pool, .. } => {
                let [height, width, _] = image.shape();
                let side = (patch * pool) as usize;
                (height / side) * (width / side)
            }
        }
    }

    /// An encoded image (PNG, JPEG, WebP, GIF) as the tower takes it. `Err`: too large a file,
    /// an unknown or damaged format, too many pixels.
    pub fn process(&self, bytes: &[u8]) -> Result<ImageInput> {
        if bytes.len() > MAX_IMAGE_BYTES {
            return Err(refuse(format!(
                "an image of {} MB; the most accepted is {} MB",
                bytes.len() >> 20,
                MAX_IMAGE_BYTES >> 20
            )));
        }
        let open = || {
            ImageReader::new(Cursor::new(bytes))
                .with_guessed_format()
                .map_err(|e| refuse(format!("the image cannot be read: {e}")))
        };
        let reader = open()?;
        match reader.format() {
            Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {}
            Some(other) => {
                return Err(refuse(format!(
                    "images in {other:?} format are not supported: send PNG, JPEG, WebP or GIF"
                )))
            }
            None => {
                return Err(refuse(
                    "the data is not an image Perch reads: send PNG, JPEG, WebP or GIF",
                ))
            }
        }
        // The header only: nothing is decoded before the size is known.
        let (width, height) = reader
            .into_dimensions()
            .map_err(|e| refuse(format!("the image is damaged: {e}")))?;
        if width == 0 || height == 0 {
            return Err(refuse("the image is empty (0 pixels wide or tall)"));
        }
        if width > MAX_SIDE
            || height > MAX_SIDE
            || u64::from(width) * u64::from(height) > MAX_PIXELS
        {
            return Err(refuse(format!(
                "an image of {width} × {height} pixels; the most accepted is {MAX_SIDE} on a side \
                 and {} megapixels",
                MAX_PIXELS / 1_000_000
            )));
        }
        let mut reader = open()?;
        let mut limits = Limits::default();
        limits.max_image_width = Some(MAX_SIDE);
        limits.max_image_height = Some(MAX_SIDE);
        limits.max_alloc = Some(MAX_PIXELS * 4 + (64 << 20));
        reader.limits(limits);
        let decoded = reader
            .decode()
            .map_err(|e| refuse(format!("the image is damaged: {e}")))?
            .to_rgb8();
        let (height, width) = match self.resize {
            Resize::Square { side, .. } => (side, side),
            Resize::Smart {
                factor,
                min_pixels,
                max_pixels,
            } => {
                let (h, w) = smart_resize(height, width, factor, min_pixels, max_pixels)?;
                // Scaling up to the least area rounds each side up: an extreme aspect ratio can
                // pass the bound; such an image is scaled down to it instead.
                match u64::from(h) * u64::from(w) > max_pixels {
                    true => smart_resize(h, w, factor, 1, max_pixels)?,
                    false => (h, w),
                }
            }
            Resize::Aspect {
                patch,
                pool,
                max_tokens,
            } => aspect_resize(height, width, patch, pool, max_tokens),
        };
        let resized = resize_like_pil(decoded, width, height, self.filter);
        let mut pixels = Vec::with_capacity((width * height * 3) as usize);
        for pixel in resized.pixels() {
            for c in 0..3 {
                let v = f32::from(pixel.0[c]) * self.rescale;
                pixels.push((v - self.mean[c]) / self.std[c]);
            }
        }
        ImageInput::new(pixels, [height as usize, width as usize, 3])
    }

    /// [`ImageProcessor::process`] of an image URL: `data:image/…;base64,…` only (a remote URL
    /// is refused: Perch does not fetch them). An image prepared lately from the same URL is
    /// taken as it was (see `Recent`).
    pub fn process_url(&self, url: &str) -> Result<ImageInput> {
        use sha2::{Digest, Sha256};
        let key: [u8; 32] = Sha256::digest(url.as_bytes()).into();
        if let Some(image) = self.recent.lock().ok().and_then(|mut r| r.get(&key)) {
            return Ok(image);
        }
        let image = self.process_url_afresh(url)?;
        if let Ok(mut recent) = self.recent.lock() {
            recent.put(key, image.clone());
        }
        Ok(image)
    }

    /// Drops the images prepared lately (see `Recent`).
    pub fn forget_recent(&self) {
        if let Ok(mut recent) = self.recent.lock() {
            *recent = Recent::default();
        }
    }

    /// [`ImageProcessor::process_url`] without the recent images.
    fn process_url_afresh(&self, url: &str) -> Result<ImageInput> {
        let Some(rest) = url.strip_prefix("data:") else {
            let shown: String = url.chars().take(40).collect();
            return Err(refuse(format!(
                "image URLs must be data URLs (data:image/png;base64,…); Perch does not fetch \
                 remote images ({shown}…)"
            )));
        };
        let Some((kind, data)) = rest.split_once(',') else {
            return Err(refuse("a data URL without a comma before its data"));
        };
        if !kind.ends_with(";base64") {
            return Err(refuse(
                "image data URLs must be base64 (data:image/png;base64,…)",
            ));
        }
        if data.len() > MAX_IMAGE_BYTES / 3 * 4 + 4 {
            return Err(refuse(format!(
                "an image larger than {} MB; the most accepted is {} MB",
                MAX_IMAGE_BYTES >> 20,
                MAX_IMAGE_BYTES >> 20
            )));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| refuse(format!("the image's base64 data is damaged: {e}")))?;
        self.process(&bytes)
    }

    /// `text` (a rendered prompt) with each image the chat template wrote replaced by the run of
    /// image tokens of the image in `images` at its place ([`ImageProcessor::tokens`]); `Err`
    /// unless the template wrote exactly as many.
    pub fn expand(&self, text: &str, images: &[ImageInput]) -> Result<String> {
        let marker = match &self.placeholder {
            Placeholder::Wrapped { begin, .. } => begin,
            Placeholder::Repeated { token } | Placeholder::Bracketed { token, .. } => token,
        };
        let found = text.matches(marker.as_str()).count();
        if found != images.len() {
            return Err(refuse(format!(
                "the chat template wrote {found} image(s) ({marker}) for the {} the messages hold",
                images.len()
            )));
        }
        let mut out = String::with_capacity(text.len());
        let mut pieces = text.split(marker.as_str());
        out.push_str(pieces.next().unwrap_or(""));
        for (image, piece) in images.iter().zip(pieces) {
            let n = self.tokens(image);
            match &self.placeholder {
                Placeholder::Wrapped { begin, token, end } => {
                    out.push_str(&format!("\n\n{begin}{}{end}\n\n", token.repeat(n)));
                }
                Placeholder::Repeated { token } => out.push_str(&token.repeat(n)),
                Placeholder::Bracketed { begin, token, end } => {
                    out.push_str(&format!("{begin}{}{end}", token.repeat(n)));
                }
            }
            out.push_str(piece);
        }
        Ok(out)
    }
}

/// `image` resized to `width × height` as PIL's `Image.resize` does it: the horizontal pass
/// first, its result rounded to 8 bits, then the vertical pass (each a one-axis resize of the
/// `image` crate; a pass whose side does not change is skipped). With bicubic's negative lobes
/// the 8-bit clamp between the passes matters: one float pass differs from PIL's by up to 15
/// steps of 255 on noise-like pixels.
fn resize_like_pil(
    image: image::RgbImage,
    width: u32,
    height: u32,
    filter: FilterType,
) -> image::RgbImage {
    let image = match image.width() == width {
        true => image,
        false => image::imageops::resize(&image, width, image.height(), filter),
    };
    match image.height() == height {
        true => image,
        false => image::imageops::resize(&image, width, height, filter),
    }
}

/// An image as a vision tower takes it: pixel values `[height, width, channels]` (float32,
/// channels last), resized and normalized as the model's processor does. Its digest (SHA-256
/// of the values and shape) identifies it: the prefix cache keys its tokens' blocks by it, so
/// a second request about the same image reuses them and another image never does.
#[derive(Clone)]
pub struct ImageInput {
    pixels: std::sync::Arc<Vec<f32>>,
    shape: [usize; 3],
    digest: [u8; 32],
}

impl ImageInput {
    /// `Err` when `pixels` does not hold `shape`'s values or one is not finite.
    pub fn new(pixels: Vec<f32>, shape: [usize; 3]) -> Result<Self> {
        use sha2::{Digest, Sha256};
        let expected = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if expected != Some(pixels.len()) || pixels.is_empty() {
            return Err(EngineError::Request(format!(
                "an image of {} values cannot have the shape {shape:?}",
                pixels.len()
            )));
        }
        if pixels.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::Request(
                "an image's pixel values must be finite numbers".into(),
            ));
        }
        let mut hasher = Sha256::new();
        for d in shape {
            hasher.update((d as u64).to_le_bytes());
        }
        for v in &pixels {
            hasher.update(v.to_le_bytes());
        }
        Ok(Self {
            pixels: std::sync::Arc::new(pixels),
            shape,
            digest: hasher.finalize().into(),
        })
    }

    pub fn pixels(&self) -> &[f32] {
        &self.pixels
    }

    /// `[height, width, channels]`.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }
}

impl std::fmt::Debug for ImageInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let digest: String = self.digest[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        write!(f, "ImageInput({:?}, {digest}…)", self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::{ImageInput, Recent};

    fn image(values: usize, fill: f32) -> ImageInput {
        ImageInput::new(vec![fill; values], [values / 3, 1, 3]).unwrap()
    }

    /// The recent images are found by key, most recently used kept, the oldest dropped first
    /// once their pixel values pass the bound; one larger than the bound is not kept.
    #[test]
    fn recent_images_are_bounded_and_kept_by_use() {
        let mut recent = Recent::default();
        let quarter = Recent::MAX_BYTES / 4 / 4; // values of a quarter of the bound
        let quarter = quarter - quarter % 3;
        for k in 0..4u8 {
            recent.put([k; 32], image(quarter, f32::from(k)));
        }
        assert_eq!(recent.images.len(), 4);
        // Using the first makes the second the oldest.
        assert_eq!(recent.get(&[0; 32]).unwrap().pixels()[0], 0.0);
        recent.put([9; 32], image(quarter, 9.0));
        assert!(recent.get(&[1; 32]).is_none(), "the oldest was dropped");
        assert!(recent.get(&[0; 32]).is_some(), "the one just used was kept");
        assert!(recent.bytes <= Recent::MAX_BYTES);
        recent.put([7; 32], image((Recent::MAX_BYTES / 4 / 3 + 1) * 3, 7.0));
        assert!(
            recent.get(&[7; 32]).is_none(),
            "larger than the bound: not kept"
        );
        assert_eq!(recent.images.len(), 4);
    }
}

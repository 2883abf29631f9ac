//! Size caps on the text files a model directory brings (they come from the Hub: anyone's
//! files). A file is read through its cap, never past it, so a huge file, or a link to a device
//! such as `/dev/zero`, is an error before its size is allocated.

use std::io::Read;
use std::path::Path;

use crate::error::{EngineError, Result};

/// `tokenizer.json`: the largest real ones (262k-token vocabularies, Gemma 3) are about 35 MB.
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 128 << 20;
/// `config.json`, `tokenizer_config.json`, `generation_config.json`,
/// `model.safetensors.index.json`, `chat_template.jinja`: kilobytes to a few megabytes in real
/// models.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The bytes of `path`, at most `limit` of them. Errors: [`EngineError::Io`],
/// [`EngineError::FileTooLarge`].
pub fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let io = |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // A regular file says its size: refused unread. Anything else (a device, a pipe) is read
    // through the cap.
    let too_large = || EngineError::FileTooLarge {
        path: path.to_path_buf(),
        limit,
    };
    if file.metadata().map_err(io)?.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(path: &Path, limit: u64) -> Result<String> {
    String::from_utf8(read_capped(path, limit)?).map_err(|_| EngineError::Config {
        path: path.to_path_buf(),
        message: "it is not UTF-8 text".into(),
    })
}

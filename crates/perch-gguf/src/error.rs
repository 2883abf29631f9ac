//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while reading a GGUF file or importing it.
///
/// Every variant names what was being read (file, metadata key or tensor) so the message alone
/// tells a user what to fix; none of them is a panic in disguise.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Reading the input or writing the output failed at the operating-system level.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "read" or "create".
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error(
        "{} is not a GGUF file: it starts with bytes {found:02x?}, expected \"GGUF\" (47 47 55 46)",
        path.display()
    )]
    BadMagic { path: PathBuf, found: [u8; 4] },

    /// The file declares a GGUF version this reader does not parse.
    #[error(
        "GGUF version {version} is not supported (supported: 2 and 3); \
         re-convert the model with a current llama.cpp"
    )]
    UnsupportedVersion { version: u32 },

    /// The file was written big-endian (GGUF v3 allows it); only little-endian files are read.
    #[error("{} is a big-endian GGUF file; only little-endian GGUF files are supported", path.display())]
    BigEndian { path: PathBuf },

    /// The file ended in the middle of something the header said was there.
    #[error(
        "the file ends at byte {file_len} while reading {what} at byte {offset}: \
         it is truncated (an incomplete download?)"
    )]
    Truncated {
        what: String,
        offset: u64,
        file_len: u64,
    },

    /// A metadata value is malformed (bad type code, invalid UTF-8, nesting too deep, ...).
    #[error("metadata `{key}` is malformed: {reason}")]
    InvalidMetadata { key: String, reason: String },

    /// A metadata key the import needs is absent.
    #[error("required metadata key `{key}` is missing from the GGUF file")]
    MissingMetadata { key: String },

    /// A metadata key holds a value of the wrong type.
    #[error("metadata `{key}` should be {expected} but is {found}")]
    MetadataType {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// The model's architecture has no importer.
    #[error("architecture `{found}` is not supported (supported: {})", supported.join(", "))]
    UnsupportedArchitecture {
        found: String,
        supported: &'static [&'static str],
    },

    /// A tensor is stored in a type the import cannot convert (or the reader cannot size).
    #[error(
        "tensor `{tensor}` has type {ggml_type}, which is not supported (supported: {}); \
         use a GGUF file whose tensors all have supported types",
        supported.join(", ")
    )]
    UnsupportedTensorType {
        tensor: String,
        ggml_type: String,
        supported: &'static [&'static str],
    },

    /// A tensor's data lies (partly) outside the file.
    #[error(
        "tensor `{tensor}` occupies bytes {start}..{end} but the file has only {file_len} bytes: \
         the file is truncated or corrupt"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    /// A tensor's header is inconsistent (shape, size, block alignment, expected shape).
    #[error("tensor `{tensor}` is invalid: {reason}")]
    InvalidTensor { tensor: String, reason: String },

    /// A tensor name has no Hugging Face counterpart for the architecture.
    #[error(
        "tensor `{tensor}` is not part of a {architecture} model; the file may be a newer variant"
    )]
    UnexpectedTensor {
        tensor: String,
        architecture: String,
    },

    /// A tensor every model of the architecture has is absent.
    #[error("tensor `{tensor}` is missing from the GGUF file")]
    MissingTensor { tensor: String },

    /// A quantization scale cannot be represented after conversion (float16 overflow).
    #[error(
        "tensor `{tensor}` has a block scale of {scale} whose offset {bias} overflows float16; \
         this tensor cannot be converted losslessly"
    )]
    ScaleOverflow {
        tensor: String,
        scale: f32,
        bias: f32,
    },

    /// RoPE scaling that cannot be expressed in config.json.
    #[error("RoPE scaling is not supported: {reason}")]
    UnsupportedRopeScaling { reason: String },

    /// The tokenizer model (`tokenizer.ggml.model`) has no converter.
    #[error("tokenizer model `{found}` is not supported (supported: {})", supported.join(", "))]
    UnsupportedTokenizer {
        found: String,
        supported: &'static [&'static str],
    },

    /// The pre-tokenizer (`tokenizer.ggml.pre`) has no known split regex.
    #[error("pre-tokenizer `{found}` is not supported (supported: {})", supported.join(", "))]
    UnsupportedPreTokenizer {
        found: String,
        supported: &'static [&'static str],
    },

    /// The vocabulary in the GGUF is inconsistent (duplicate tokens, bad merges, ids out of range).
    #[error("the tokenizer vocabulary is invalid: {reason}")]
    InvalidVocabulary { reason: String },

    /// The `tokenizers` crate rejected the tokenizer we built or could not save it.
    #[error("cannot build tokenizer.json: {source}")]
    Tokenizer {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The output directory already holds files; nothing was written.
    #[error(
        "output path {} already exists and is not an empty directory; choose a new directory \
         or remove it first (nothing was written to it)",
        path.display()
    )]
    OutputExists { path: PathBuf },
}

impl GgufError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        GgufError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

//! The one error type of kdtree-formats. Every message names the file (and tensor, when there is one)
//! and shows expected vs found, so a bad checkpoint is diagnosed from the message alone.

use std::path::Path;

/// Error from reading or writing kdtree / safetensors bytes, or from planning a split.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{file}: {source}")]
    Io { file: String, source: std::io::Error },
    /// The file as a whole is malformed (header length, JSON, total size, ...).
    #[error("{file}: {msg}")]
    File { file: String, msg: String },
    /// One tensor of a file is malformed or does not match what was expected.
    #[error("{file}: tensor \"{tensor}\": {msg}")]
    Tensor { file: String, tensor: String, msg: String },
    /// A name appears twice in a safetensors header (serde would silently keep the last one).
    #[error("{file}: duplicate tensor name \"{tensor}\" in header")]
    Duplicate { file: String, tensor: String },
    /// The requested split cannot be done (divisibility, group-32 alignment).
    #[error("plan: tensor \"{tensor}\": {msg}")]
    Plan { tensor: String, msg: String },
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

impl FormatError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        FormatError::Io { file: path.display().to_string(), source }
    }
    pub fn file(file: impl ToString, msg: impl ToString) -> Self {
        FormatError::File { file: file.to_string(), msg: msg.to_string() }
    }
    pub fn tensor(file: impl ToString, tensor: impl ToString, msg: impl ToString) -> Self {
        FormatError::Tensor { file: file.to_string(), tensor: tensor.to_string(), msg: msg.to_string() }
    }
    pub fn plan(tensor: impl ToString, msg: impl ToString) -> Self {
        FormatError::Plan { tensor: tensor.to_string(), msg: msg.to_string() }
    }
}

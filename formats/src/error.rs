//! The one error type of kdtree-formats. Every message names the file (and tensor, when there is one)
//! and shows expected vs found, so a bad checkpoint is diagnosed from the message alone.
//! Each message is complete on its own, so no variant exposes its cause as `source()`: anyhow's `{:#}`
//! prints the chain, and a cause both in the message and in the chain was printed twice ("No such file
//! or directory (os error 2): No such file or directory (os error 2)", issue 16 item 13). The field that
//! holds the cause is therefore never named `source` (thiserror would make it one). Test: bottom of file.

use std::path::Path;

/// Error from reading or writing kdtree / safetensors bytes, or from planning a split.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{file}: {err}")]
    Io { file: String, err: std::io::Error },
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
    pub fn io(path: &Path, err: std::io::Error) -> Self {
        FormatError::Io {
            file: path.display().to_string(),
            err,
        }
    }
    pub fn file(file: impl ToString, msg: impl ToString) -> Self {
        FormatError::File {
            file: file.to_string(),
            msg: msg.to_string(),
        }
    }
    pub fn tensor(file: impl ToString, tensor: impl ToString, msg: impl ToString) -> Self {
        FormatError::Tensor {
            file: file.to_string(),
            tensor: tensor.to_string(),
            msg: msg.to_string(),
        }
    }
    pub fn plan(tensor: impl ToString, msg: impl ToString) -> Self {
        FormatError::Plan {
            tensor: tensor.to_string(),
            msg: msg.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn causes_are_in_the_message_not_the_chain() {
        let e = FormatError::io(
            Path::new("x.safetensors"),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        );
        assert!(e.source().is_none(), "a chain printer would repeat the cause of {e}");
        assert!(e.to_string().starts_with("x.safetensors: "), "{e}");
        let c = crate::config::parse_text_config("c.json", "{").unwrap_err();
        assert!(
            c.source().is_none() && c.to_string().contains("c.json: invalid JSON: "),
            "{c}"
        );
    }
}

//! Safetensors dtype names and element sizes (the byte-addressable subset; sub-byte F4/F6 are refused).
//! Names match the safetensors spec strings exactly ("BF16", "I32", ...). Tested in reader.rs tests.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor, spelled as in safetensors headers.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Dtype {
    BOOL,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            BOOL | U8 | I8 | F8_E5M2 | F8_E4M3 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            I64 | U64 | F64 => 8,
        }
    }
    /// Parse a safetensors dtype string; `None` for unknown or sub-byte types.
    pub fn parse(s: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match s {
            "BOOL" => BOOL,
            "U8" => U8,
            "I8" => I8,
            "F8_E5M2" => F8_E5M2,
            "F8_E4M3" => F8_E4M3,
            "I16" => I16,
            "U16" => U16,
            "F16" => F16,
            "BF16" => BF16,
            "I32" => I32,
            "U32" => U32,
            "F32" => F32,
            "I64" => I64,
            "U64" => U64,
            "F64" => F64,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            BOOL => "BOOL",
            U8 => "U8",
            I8 => "I8",
            F8_E5M2 => "F8_E5M2",
            F8_E4M3 => "F8_E4M3",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            I64 => "I64",
            U64 => "U64",
            F64 => "F64",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes of a tensor of `shape` and `dtype`, or `None` on overflow.
pub fn byte_len(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

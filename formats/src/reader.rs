//! Strict safetensors reader: parses and validates a header the way the reference crate does
//! (safetensors/src/tensor.rs, see shared ecosystem.md §5.1) and more: duplicate names are rejected
//! explicitly, the file length is checked against the header *before* mapping, and every error names
//! the file and tensor. Data is mapped read-only.
//! Tests: bottom of this file (each malformed-input class) and formats/tests/writer_compat.rs.

use crate::dtype::{byte_len, Dtype};
use crate::error::{FormatError, Result};
use memmap2::Mmap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Largest JSON header accepted (the reference crate's `MAX_HEADER_SIZE`).
pub const MAX_HEADER_SIZE: u64 = 100_000_000;

/// One tensor of a header. `begin..end` is relative to the start of the data buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn nbytes(&self) -> usize {
        self.end - self.begin
    }
}

/// A validated header: tensors sorted by offset, contiguous from 0, covering the whole buffer.
#[derive(Debug, Clone)]
pub struct ShardHeader {
    /// Length of the JSON header (the 8-byte prefix value).
    pub header_len: usize,
    pub metadata: BTreeMap<String, String>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

/// Header map that keeps every entry, so duplicates can be reported instead of silently dropped; each entry's
/// text is kept as written, so a duplicate key inside an entry is refused too (through `RawTensor`'s derive).
struct RawEntries(Vec<(String, Box<serde_json::value::RawValue>)>);

impl<'de> Deserialize<'de> for RawEntries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEntries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<RawEntries, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Box<serde_json::value::RawValue>>()? {
                    v.push((k, val));
                }
                Ok(RawEntries(v))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

impl ShardHeader {
    /// Parse and validate the JSON header bytes. `data_len` is the size of the data buffer that follows.
    pub fn parse(file: &str, json: &[u8], data_len: usize) -> Result<ShardHeader> {
        if json.first() != Some(&b'{') {
            return Err(FormatError::file(file, "header does not start with '{'"));
        }
        let text =
            std::str::from_utf8(json).map_err(|e| FormatError::file(file, format!("header is not UTF-8: {e}")))?;
        let raw: RawEntries = serde_json::from_str(text)
            .map_err(|e| FormatError::file(file, format!("header is not valid JSON: {e}")))?;
        let mut metadata = BTreeMap::new();
        let mut tensors = Vec::with_capacity(raw.0.len());
        let mut index = HashMap::with_capacity(raw.0.len());
        let mut seen_meta = false;
        for (name, val) in raw.0 {
            if name == "__metadata__" {
                if seen_meta {
                    return Err(FormatError::Duplicate {
                        file: file.into(),
                        tensor: name,
                    });
                }
                seen_meta = true;
                metadata = serde_json::from_str(val.get())
                    .map_err(|e| FormatError::file(file, format!("__metadata__ must map strings to strings: {e}")))?;
                continue;
            }
            if index.contains_key(&name) {
                return Err(FormatError::Duplicate {
                    file: file.into(),
                    tensor: name,
                });
            }
            let t: RawTensor = serde_json::from_str(val.get())
                .map_err(|e| FormatError::tensor(file, &name, format!("bad header entry: {e}")))?;
            let dtype = Dtype::parse(&t.dtype)
                .ok_or_else(|| FormatError::tensor(file, &name, format!("unsupported dtype {:?}", t.dtype)))?;
            let (begin, end) = t.data_offsets;
            if end < begin {
                return Err(FormatError::tensor(
                    file,
                    &name,
                    format!("data_offsets [{begin}, {end}] end before begin"),
                ));
            }
            let want = byte_len(dtype, &t.shape)
                .ok_or_else(|| FormatError::tensor(file, &name, format!("shape {:?} overflows", t.shape)))?;
            if end - begin != want {
                return Err(FormatError::tensor(
                    file,
                    &name,
                    format!(
                        "{dtype} {:?} needs {want} bytes but data_offsets [{begin}, {end}] hold {}",
                        t.shape,
                        end - begin
                    ),
                ));
            }
            index.insert(name.clone(), tensors.len());
            tensors.push(TensorInfo {
                name,
                dtype,
                shape: t.shape,
                begin,
                end,
            });
        }
        // Contiguous, non-overlapping, covering the whole buffer (the reference crate's rule).
        tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
        let mut pos = 0usize;
        for t in &tensors {
            if t.begin != pos {
                let what = if t.begin < pos {
                    "overlaps the previous tensor"
                } else {
                    "leaves a gap after the previous tensor"
                };
                return Err(FormatError::tensor(
                    file,
                    &t.name,
                    format!("data_offsets start at {} but previous ends at {pos}: {what}", t.begin),
                ));
            }
            pos = t.end;
        }
        if pos != data_len {
            let msg = if pos > data_len {
                format!("tensors need {pos} data bytes but the file holds {data_len} (truncated?)")
            } else {
                format!("tensors cover {pos} data bytes but the file holds {data_len} (trailing bytes)")
            };
            let last = tensors.iter().rev().find(|t| t.end > data_len).or(tensors.last());
            return Err(match last {
                Some(t) if pos > data_len => FormatError::tensor(file, &t.name, msg),
                _ => FormatError::file(file, msg),
            });
        }
        index.clear();
        for (i, t) in tensors.iter().enumerate() {
            index.insert(t.name.clone(), i);
        }
        Ok(ShardHeader {
            header_len: json.len(),
            metadata,
            tensors,
            index,
        })
    }

    /// Byte offset of the data buffer in the file.
    pub fn data_start(&self) -> usize {
        8 + self.header_len
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
}

/// Check the 8-byte length prefix against the file length: returns the header length and the length of
/// the data buffer after it. One rule for [`read_header`] (a file) and [`parse_bytes`] (bytes in memory).
fn check_prefix(name: &str, prefix: [u8; 8], file_len: u64) -> Result<(usize, usize)> {
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_SIZE {
        return Err(FormatError::file(
            name,
            format!("header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit"),
        ));
    }
    let end = 8u64.checked_add(n).filter(|&e| e <= file_len).ok_or_else(|| {
        FormatError::file(
            name,
            format!("header length {n} runs past the end of the {file_len}-byte file"),
        )
    })?;
    let data_len = usize::try_from(file_len - end).map_err(|_| FormatError::file(name, "file too large"))?;
    Ok((n as usize, data_len))
}

fn too_short(name: &str, file_len: u64) -> FormatError {
    FormatError::file(
        name,
        format!("file is {file_len} bytes, shorter than the 8-byte header length"),
    )
}

/// Read the 8-byte prefix and header of `path` and validate them against the file length.
/// Returns the header and the file length; nothing is mapped.
pub fn read_header(path: &Path) -> Result<(ShardHeader, u64)> {
    let name = path.display().to_string();
    let mut f = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let file_len = f.metadata().map_err(|e| FormatError::io(path, e))?.len();
    if file_len < 8 {
        return Err(too_short(&name, file_len));
    }
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix).map_err(|e| FormatError::io(path, e))?;
    let (n, data_len) = check_prefix(&name, prefix, file_len)?;
    let mut json = vec![0u8; n];
    f.read_exact(&mut json).map_err(|e| FormatError::io(path, e))?;
    let h = ShardHeader::parse(&name, &json, data_len)?;
    Ok((h, file_len))
}

/// The header of a whole safetensors file held in memory (`name` is for messages), validated exactly as
/// [`read_header`] validates a file on disk. Used by the fuzz target `safetensors` (fuzz/, docs/fuzzing.md).
pub fn parse_bytes(name: &str, bytes: &[u8]) -> Result<ShardHeader> {
    let file_len = bytes.len() as u64;
    let Some((prefix, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(too_short(name, file_len));
    };
    let (n, data_len) = check_prefix(name, *prefix, file_len)?;
    ShardHeader::parse(name, &rest[..n], data_len)
}

/// A validated safetensors file, mapped read-only.
pub struct SafeFile {
    pub path: PathBuf,
    pub header: ShardHeader,
    map: Option<Mmap>,
}

impl SafeFile {
    /// Validate the header against the file length, then map the file.
    pub fn open(path: &Path) -> Result<SafeFile> {
        let (header, file_len) = read_header(path)?;
        let map = if file_len == 0 {
            None
        } else {
            let f = File::open(path).map_err(|e| FormatError::io(path, e))?;
            // SAFETY: the map is read-only; the file must not be truncated or rewritten while mapped
            // (documented contract of ModelDir/repack: sources and outputs are never written in place).
            let m = unsafe { Mmap::map(&f) }.map_err(|e| FormatError::io(path, e))?;
            if m.len() as u64 != file_len {
                return Err(FormatError::file(path.display(), "file changed size while opening"));
            }
            Some(m)
        };
        Ok(SafeFile {
            path: path.to_path_buf(),
            header,
            map,
        })
    }

    pub fn name(&self) -> String {
        self.path.display().to_string()
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Header entry and data bytes of a tensor.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let t = self
            .header
            .get(name)
            .ok_or_else(|| FormatError::tensor(self.name(), name, "not in this file's header"))?;
        let s = self.header.data_start();
        Ok((t, &self.bytes()[s + t.begin..s + t.end]))
    }

    /// Map `len` bytes at absolute file offset `start` as a mapping of their own (None when `len` is 0).
    /// Page faults, including the kernel's fault-around, stay inside it, and dropping it releases every
    /// page it touched: this is how the converter streams huge files with bounded RSS.
    pub fn map_range(&self, start: usize, len: usize) -> Result<Option<Mmap>> {
        if len == 0 {
            return Ok(None);
        }
        if start.checked_add(len).is_none_or(|e| e > self.bytes().len()) {
            return Err(FormatError::file(
                self.name(),
                format!("range {start}+{len} is past the end of the file"),
            ));
        }
        let f = File::open(&self.path).map_err(|e| FormatError::io(&self.path, e))?;
        // SAFETY: read-only map of a range inside the validated file; same contract as `open`.
        let m = unsafe { memmap2::MmapOptions::new().offset(start as u64).len(len).map(&f) }
            .map_err(|e| FormatError::io(&self.path, e))?;
        Ok(Some(m))
    }

    /// Read `len` bytes at absolute offset `start` without mapping (small reads: no pages stay resident).
    pub fn read_at(&self, start: usize, len: usize) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let f = File::open(&self.path).map_err(|e| FormatError::io(&self.path, e))?;
        let mut v = vec![0u8; len];
        f.read_exact_at(&mut v, start as u64)
            .map_err(|e| FormatError::io(&self.path, e))?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_bytes(json: &str, data: &[u8]) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend_from_slice(data);
        v
    }

    fn check(json: &str, data_len: usize) -> Result<ShardHeader> {
        ShardHeader::parse("f.safetensors", json.as_bytes(), data_len)
    }

    #[test]
    fn accepts_valid_header_in_any_key_order() {
        let h = check(
            concat!(
                r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"a":{"dtype":"U8","shape":[4],"#,
                r#""data_offsets":[0,4]}}"#,
            ),
            12,
        )
        .unwrap();
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.get("b").unwrap().begin, 4);
    }

    #[test]
    fn rejects_duplicate_names_by_name() {
        let e = check(
            concat!(
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],"#,
                r#""data_offsets":[0,4]}}"#,
            ),
            4,
        )
        .unwrap_err();
        assert!(
            matches!(&e, FormatError::Duplicate { tensor, .. } if tensor == "a"),
            "{e}"
        );
    }

    /// A key twice inside one entry (fuzz finding 2026-12-02: the first `data_offsets` was `[1]`, the second
    /// `[16, 20]`): the reference crate refuses it, and so must we, rather than keep the last value.
    #[test]
    fn rejects_a_duplicate_key_inside_an_entry() {
        let e = check(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[1],"data_offsets":[0,4]}}"#,
            4,
        )
        .unwrap_err();
        assert!(e.to_string().contains("tensor \"a\": bad header entry"), "{e}");
        let e = check(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"data_offsets":[0,4]}}"#,
            4,
        )
        .unwrap_err();
        assert!(e.to_string().contains("duplicate field `data_offsets`"), "{e}");
        let e = check(
            r#"{"a":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        )
        .unwrap_err();
        assert!(e.to_string().contains("duplicate field `dtype`"), "{e}");
    }

    #[test]
    fn rejects_overlap_gap_and_length_mismatch_naming_tensor() {
        let e = check(
            concat!(
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"#,
                r#""data_offsets":[2,6]}}"#,
            ),
            6,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("\"b\"") && e.to_string().contains("overlaps"),
            "{e}"
        );
        let e = check(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}}"#, 5).unwrap_err();
        assert!(e.to_string().contains("gap"), "{e}");
        let e = check(r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}}"#, 4).unwrap_err();
        assert!(
            e.to_string().contains("\"a\"") && e.to_string().contains("needs 16 bytes"),
            "{e}"
        );
        let e = check(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 3).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let e = check(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 5).unwrap_err();
        assert!(e.to_string().contains("trailing"), "{e}");
        let e = check(
            r#"{"a":{"dtype":"U8","shape":[18446744073709551615, 2],"data_offsets":[0,4]}}"#,
            4,
        )
        .unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        let e = check(r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}"#, 2).unwrap_err();
        assert!(e.to_string().contains("unsupported dtype"), "{e}");
    }

    #[test]
    fn rejects_header_length_overflow_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        let mut b = u64::MAX.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        std::fs::write(&p, &b).unwrap();
        assert!(read_header(&p).unwrap_err().to_string().contains("exceeds"));
        let mut b = 1000u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        std::fs::write(&p, &b).unwrap();
        assert!(read_header(&p).unwrap_err().to_string().contains("runs past the end"));
        let json = r#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
        std::fs::write(&p, file_bytes(json, &[1, 2, 3])).unwrap();
        let e = SafeFile::open(&p).err().unwrap().to_string();
        assert!(
            e.contains("x.safetensors") && e.contains("\"w\"") && e.contains("truncated"),
            "{e}"
        );
        std::fs::write(&p, file_bytes(json, &[7; 8])).unwrap();
        let f = SafeFile::open(&p).unwrap();
        assert_eq!(f.tensor("w").unwrap().1, &[7; 8]);
    }

    #[test]
    fn parse_bytes_agrees_with_read_header() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        let json = r#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        let mut past = 1000u64.to_le_bytes().to_vec();
        past.extend_from_slice(b"{}");
        for bytes in [
            vec![],
            vec![1, 0, 0],
            huge,
            past,
            file_bytes(json, &[1, 2, 3]),
            file_bytes(json, &[7; 9]),
            file_bytes(json, &[7; 8]),
            file_bytes("{}", &[]),
            file_bytes("[]", &[]),
        ] {
            std::fs::write(&p, &bytes).unwrap();
            let on_disk = read_header(&p).map(|(h, _)| h.tensors).map_err(|e| e.to_string());
            let in_memory = parse_bytes(&p.display().to_string(), &bytes)
                .map(|h| h.tensors)
                .map_err(|e| e.to_string());
            assert_eq!(in_memory, on_disk, "{bytes:?}");
        }
    }
}

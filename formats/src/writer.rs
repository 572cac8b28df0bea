//! Deterministic safetensors shard writer. The header is ours (not the safetensors crate's): tensors
//! sorted by name, data laid out in the same order, `__metadata__` = {"format":"pt"} so HF tooling
//! loads the file, header padded with spaces so the data starts 8-byte aligned. The file is written
//! to `<name>.partial`, checksummed as bytes go out (SHA-256 of the whole file for SHA256SUMS, xxh3-64 of
//! each tensor's data for the manifest: each byte goes through SHA-256 once; format v2), fsynced, renamed.
//! Tests: bottom of this file and formats/tests/writer_compat.rs (the safetensors crate opens it).

use crate::dtype::{byte_len, Dtype};
use crate::error::{FormatError, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::Xxh3;

/// Size of the write buffer: bounded, whatever the tensor size.
const WRITE_BUF: usize = 4 << 20;

/// A tensor to be written: name, dtype and shape (its byte length follows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// Where a tensor landed in the finished file, with the xxh3-64 of its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub nbytes: u64,
    /// xxh3-64 of the data, 16 lowercase hex digits (`manifest::xxh3_hex`).
    pub xxh3: String,
}

/// A finished file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenFile {
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
    pub tensors: Vec<WrittenTensor>,
}

/// Relative `[begin, end)` data offsets of the tensors of one file, in order.
pub type DataOffsets = Vec<(usize, usize)>;

/// Header bytes (length prefix excluded) for `specs` sorted by name; the header length is a multiple of 8.
/// Returns the header and the relative data offsets in the same (sorted) order.
pub fn header_bytes(file: &str, specs: &[TensorSpec]) -> Result<(Vec<u8>, DataOffsets)> {
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offs = Vec::with_capacity(specs.len());
    let mut pos = 0usize;
    for (i, s) in specs.iter().enumerate() {
        if i > 0 && specs[i - 1].name >= s.name {
            return Err(FormatError::tensor(
                file,
                &s.name,
                "tensors must be sorted by name and unique",
            ));
        }
        if s.name == "__metadata__" {
            return Err(FormatError::tensor(file, &s.name, "reserved name"));
        }
        let n = byte_len(s.dtype, &s.shape).ok_or_else(|| FormatError::tensor(file, &s.name, "shape overflows"))?;
        let shape: Vec<String> = s.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            r#",{}:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}}"#,
            serde_json::to_string(&s.name).expect("string serializes"),
            s.dtype,
            shape.join(","),
            pos,
            pos + n
        ));
        offs.push((pos, pos + n));
        pos += n;
    }
    json.push('}');
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    Ok((json.into_bytes(), offs))
}

/// Streams one safetensors file: create, `write` the data of each tensor in name order, `finish`.
pub struct ShardWriter {
    final_path: PathBuf,
    partial: PathBuf,
    out: BufWriter<File>,
    file_hash: Sha256,
    tensors: Vec<WrittenTensor>,
    /// Index of the tensor being written and bytes of it written so far.
    cur: usize,
    cur_done: u64,
    cur_hash: Xxh3,
    pos: u64,
}

/// `<path>.partial`: where a file is written before it is complete.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

impl ShardWriter {
    /// Start `path` (written as `path.partial`) holding `specs` (any order; sorted by name here).
    pub fn create(path: &Path, mut specs: Vec<TensorSpec>) -> Result<ShardWriter> {
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        let name = path.display().to_string();
        let (header, offs) = header_bytes(&name, &specs)?;
        let partial = partial_path(path);
        let f = File::create(&partial).map_err(|e| FormatError::io(&partial, e))?;
        let mut w = ShardWriter {
            final_path: path.to_path_buf(),
            partial,
            out: BufWriter::with_capacity(WRITE_BUF, f),
            file_hash: Sha256::new(),
            tensors: Vec::with_capacity(specs.len()),
            cur: 0,
            cur_done: 0,
            cur_hash: Xxh3::new(),
            pos: 0,
        };
        let data_start = 8 + header.len() as u64;
        for (s, (b, e)) in specs.into_iter().zip(offs) {
            w.tensors.push(WrittenTensor {
                name: s.name,
                dtype: s.dtype,
                shape: s.shape,
                offset: data_start + b as u64,
                nbytes: (e - b) as u64,
                xxh3: String::new(),
            });
        }
        w.raw(&(header.len() as u64).to_le_bytes())?;
        w.raw(&header)?;
        w.skip_empty();
        Ok(w)
    }

    /// The tensors in write order with their offsets (xxh3 filled in as each completes).
    pub fn layout(&self) -> &[WrittenTensor] {
        &self.tensors
    }

    /// Name of the tensor the next `write` goes to, or `None` when all are complete.
    pub fn current(&self) -> Option<&str> {
        self.tensors.get(self.cur).map(|t| t.name.as_str())
    }

    fn raw(&mut self, b: &[u8]) -> Result<()> {
        self.out.write_all(b).map_err(|e| FormatError::io(&self.partial, e))?;
        self.file_hash.update(b);
        self.pos += b.len() as u64;
        Ok(())
    }

    fn skip_empty(&mut self) {
        while let Some(t) = self.tensors.get_mut(self.cur) {
            if self.cur_done < t.nbytes {
                break;
            }
            t.xxh3 = crate::manifest::xxh3_hex(self.cur_hash.digest());
            self.cur_hash.reset();
            self.cur += 1;
            self.cur_done = 0;
        }
    }

    /// Append data bytes; they may span tensor boundaries. Writing past the last tensor is an error.
    pub fn write(&mut self, mut b: &[u8]) -> Result<()> {
        while !b.is_empty() {
            let Some(t) = self.tensors.get(self.cur) else {
                return Err(FormatError::file(
                    self.final_path.display(),
                    "more data written than the header declares",
                ));
            };
            let take = ((t.nbytes - self.cur_done) as usize).min(b.len());
            self.cur_hash.update(&b[..take]);
            self.raw(&b[..take])?;
            self.cur_done += take as u64;
            b = &b[take..];
            self.skip_empty();
        }
        Ok(())
    }

    /// Flush, fsync and rename `*.partial` to the final name. Every tensor must be complete.
    pub fn finish(mut self) -> Result<WrittenFile> {
        if let Some(t) = self.tensors.get(self.cur) {
            return Err(FormatError::tensor(
                self.final_path.display(),
                &t.name,
                format!("incomplete: {} of {} bytes written", self.cur_done, t.nbytes),
            ));
        }
        self.out.flush().map_err(|e| FormatError::io(&self.partial, e))?;
        let f = self
            .out
            .into_inner()
            .map_err(|e| FormatError::io(&self.partial, e.into_error()))?;
        f.sync_all().map_err(|e| FormatError::io(&self.partial, e))?;
        drop(f);
        std::fs::rename(&self.partial, &self.final_path).map_err(|e| FormatError::io(&self.final_path, e))?;
        Ok(WrittenFile {
            path: self.final_path,
            size: self.pos,
            sha256: hex::encode(self.file_hash.finalize()),
            tensors: self.tensors,
        })
    }
}

/// Write `bytes` to `path` atomically (temp file + fsync + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = partial_path(path);
    let mut f = File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| FormatError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| FormatError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::SafeFile;

    #[test]
    fn writes_sorted_aligned_file_with_hashes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        let specs = vec![
            TensorSpec {
                name: "z".into(),
                dtype: Dtype::U8,
                shape: vec![3],
            },
            TensorSpec {
                name: "a".into(),
                dtype: Dtype::BF16,
                shape: vec![2, 2],
            },
            TensorSpec {
                name: "m".into(),
                dtype: Dtype::F32,
                shape: vec![0],
            },
        ];
        let mut w = ShardWriter::create(&p, specs).unwrap();
        assert_eq!(w.current(), Some("a"));
        w.write(&[1, 2, 3, 4, 5]).unwrap();
        w.write(&[6, 7, 8, 9, 10, 11]).unwrap();
        assert!(w.write(&[0]).is_err());
        let done = w.finish().unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert!(!partial_path(&p).exists());
        assert_eq!(done.size, bytes.len() as u64);
        assert_eq!(done.sha256, hex::encode(Sha256::digest(&bytes)));
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + n) % 8, 0);
        assert!(bytes[8..8 + n].starts_with(br#"{"__metadata__":{"format":"pt"},"a":"#));
        let names: Vec<_> = done.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "m", "z"]);
        let z = &done.tensors[2];
        assert_eq!(&bytes[z.offset as usize..][..3], &[9, 10, 11]);
        assert_eq!(z.xxh3, format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&[9u8, 10, 11])));
        assert_eq!(
            done.tensors[1].xxh3,
            format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&[]))
        );
        let f = SafeFile::open(&p).unwrap();
        assert_eq!(f.tensor("a").unwrap().1, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(f.header.metadata.get("format").map(String::as_str), Some("pt"));
    }

    #[test]
    fn finish_refuses_incomplete_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.safetensors");
        let mut w = ShardWriter::create(
            &p,
            vec![TensorSpec {
                name: "t".into(),
                dtype: Dtype::U8,
                shape: vec![4],
            }],
        )
        .unwrap();
        w.write(&[1]).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("\"t\"") && e.contains("1 of 4"), "{e}");
        assert!(!p.exists());
    }
}

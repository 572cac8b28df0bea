//! Producing the bytes of one output tensor from the mapped source, streamed into a ShardWriter.
//! INT4 sources are carried bit-exactly: the I32 `weight_packed` bytes ARE the `[N, K/2]` u8 nibble layout
//! (low nibble = even k, offset 8; shared k26-format.md §3.4), so slicing rows or whole 16-byte groups of
//! columns is a byte copy; nothing is dequantized. BF16 sources of routed experts are quantized per row
//! slice with formats::int4::quantize_row (compressed-tensors' symmetric group-32 rule; a slice of whole
//! groups quantizes exactly like the full row). Each source slice is mapped on its own and unmapped when
//! done (pages inside released every 8 MiB), so RSS stays bounded whatever
//! the tensor or file size. Tests: tools/kdtree-convert/tests/repack.rs, tests/memory.rs (peak RSS).

use crate::progress::Progress;
use crate::source::Checkpoint;
use anyhow::{bail, Result};
use half::bf16;
use kdtree_formats::int4::{quantize_row, GROUP};
use kdtree_formats::plan::{ExpertPart, OutTensor, SourceSpec};
use kdtree_formats::reader::SafeFile;
use kdtree_formats::writer::ShardWriter;

/// Source bytes consumed between two page releases inside one mapped tensor.
const RELEASE_EVERY: usize = 8 << 20;
/// Largest piece handed to the writer at once.
const CHUNK: usize = 4 << 20;
/// Source bytes asked for ahead of the copy (MADV_WILLNEED): page faults on a cold page cache are
/// synchronous, so without it each writer thread waits on the disk between its hashing bursts.
const READ_AHEAD: usize = 64 << 20;

/// A source byte range mapped on its own, with the consumed part released as copying goes. Dropping it
/// unmaps it, which releases every page it touched (fault-around included, as that stays inside the map).
struct Region {
    map: Option<memmap2::Mmap>,
    released_to: usize,
    since_release: usize,
}

impl Region {
    /// Map `file[abs .. abs+len]`.
    fn new(file: &SafeFile, abs: usize, len: usize) -> Result<Region> {
        let reg = Region {
            map: file.map_range(abs, len)?,
            released_to: 0,
            since_release: 0,
        };
        if let Some(m) = &reg.map {
            // Advice only: a failure changes speed, never bytes.
            let _ = m.advise(memmap2::Advice::Sequential);
        }
        reg.read_ahead(0);
        Ok(reg)
    }
    /// Ask the kernel to start reading `[from, from + READ_AHEAD)` of the region now.
    fn read_ahead(&self, from: usize) {
        if let Some(m) = &self.map {
            let from = from / 4096 * 4096;
            if from < m.len() {
                let _ = m.advise_range(memmap2::Advice::WillNeed, from, READ_AHEAD.min(m.len() - from));
            }
        }
    }
    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
    /// Write `self[off .. off+len]` in bounded pieces.
    fn copy(&mut self, w: &mut ShardWriter, off: usize, len: usize, prog: &Progress) -> Result<()> {
        let mut at = off;
        while at < off + len {
            let n = CHUNK.min(off + len - at);
            w.write(&self.bytes()[at..at + n])?;
            prog.inc(n as u64);
            at += n;
            self.consumed(at, n);
        }
        Ok(())
    }
    /// `n` more bytes were used, the last ending at `upto`; every RELEASE_EVERY bytes drop the pages before it.
    fn consumed(&mut self, upto: usize, n: usize) {
        self.since_release += n;
        if self.since_release < RELEASE_EVERY {
            return;
        }
        self.read_ahead(upto);
        if let Some(m) = &self.map {
            let end = upto / 4096 * 4096;
            if end > self.released_to {
                // SAFETY: DONTNEED on a read-only file-backed mapping only drops this process's page table
                // entries; the data is re-read from the unchanged file on the next access.
                let _ = unsafe {
                    m.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        self.released_to,
                        end - self.released_to,
                    )
                };
                self.released_to = end;
            }
        }
        self.since_release = 0;
    }
}

/// Rows `r0..r1`, byte columns `c0..c1` of a row-major matrix with `row_bytes` per row at `abs`.
/// Only the rows needed are mapped.
fn copy_2d(
    w: &mut ShardWriter,
    f: &SafeFile,
    abs: usize,
    row_bytes: usize,
    rows: (usize, usize),
    cols: (usize, usize),
    prog: &Progress,
) -> Result<()> {
    let mut reg = Region::new(f, abs + rows.0 * row_bytes, (rows.1 - rows.0) * row_bytes)?;
    if cols == (0, row_bytes) {
        reg.copy(w, 0, (rows.1 - rows.0) * row_bytes, prog)?;
    } else {
        for r in 0..rows.1 - rows.0 {
            reg.copy(w, r * row_bytes + cols.0, cols.1 - cols.0, prog)?;
        }
    }
    Ok(())
}

/// Write tensor `t` (the writer's current tensor) from the checkpoint.
pub fn emit(ck: &Checkpoint, t: &OutTensor, w: &mut ShardWriter, prog: &Progress) -> Result<()> {
    if w.current() != Some(t.name.as_str()) {
        bail!("internal: writer expects {:?}, plan gives \"{}\"", w.current(), t.name);
    }
    match &t.source {
        SourceSpec::Dense { src, axis, start, len } => {
            let (f, info) = ck.get(src)?;
            let abs = f.header.data_start() + info.begin;
            let es = info.dtype.size();
            let (rows, row_bytes) = match info.shape.as_slice() {
                [] => (1, es),
                [r, rest @ ..] => (*r, es * rest.iter().product::<usize>()),
            };
            match axis {
                None => copy_2d(w, f, abs, row_bytes, (0, rows), (0, row_bytes), prog),
                Some(0) => copy_2d(w, f, abs, row_bytes, (*start, start + len), (0, row_bytes), prog),
                Some(1) if info.shape.len() == 2 => {
                    copy_2d(w, f, abs, row_bytes, (0, rows), (start * es, (start + len) * es), prog)
                }
                Some(a) => bail!("internal: cannot split \"{src}\" {:?} on axis {a}", info.shape),
            }
        }
        SourceSpec::Experts {
            stem,
            proj,
            part,
            first,
            count,
            n,
            k,
            axis,
            start,
            len,
        } => {
            let (rows, cols) = match axis {
                None => ((0, *n), (0, *k)),
                Some(0) => ((*start, start + len), (0, *k)),
                Some(_) => ((0, *n), (*start, start + len)),
            };
            for e in *first..first + count {
                let base = format!("{stem}.{e}.{proj}");
                match ck.quant {
                    kdtree_formats::plan::SourceQuant::Int4 => {
                        let (suffix, per_byte, bytes_per) = match part {
                            ExpertPart::Packed => ("weight_packed", 2, 1),
                            ExpertPart::Scale => ("weight_scale", GROUP, 2),
                        };
                        let (f, info) = ck.get(&format!("{base}.{suffix}"))?;
                        let abs = f.header.data_start() + info.begin;
                        let rb = k / per_byte * bytes_per;
                        copy_2d(
                            w,
                            f,
                            abs,
                            rb,
                            rows,
                            (cols.0 / per_byte * bytes_per, cols.1 / per_byte * bytes_per),
                            prog,
                        )?;
                    }
                    kdtree_formats::plan::SourceQuant::Bf16 => {
                        quantize_slice(ck, &format!("{base}.weight"), *k, rows, cols, *part, w, prog)?
                    }
                }
            }
            Ok(())
        }
    }
}

/// Quantize rows × cols of a BF16 `[n, k]` weight and write its packed or scale part.
#[allow(clippy::too_many_arguments)]
fn quantize_slice(
    ck: &Checkpoint,
    name: &str,
    k: usize,
    rows: (usize, usize),
    cols: (usize, usize),
    part: ExpertPart,
    w: &mut ShardWriter,
    prog: &Progress,
) -> Result<()> {
    let (f, info) = ck.get(name)?;
    let abs = f.header.data_start() + info.begin;
    let kc = cols.1 - cols.0;
    let mut vals = vec![bf16::ZERO; kc];
    let mut scales = vec![bf16::ZERO; kc / GROUP];
    let mut packed = vec![0u8; kc / 2];
    let mut out = Vec::with_capacity(kc);
    let mut reg = Region::new(f, abs + rows.0 * k * 2, (rows.1 - rows.0) * k * 2)?;
    for r in 0..rows.1 - rows.0 {
        let off = (r * k + cols.0) * 2;
        let src = &reg.bytes()[off..off + kc * 2];
        for (v, b) in vals.iter_mut().zip(src.chunks_exact(2)) {
            *v = bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
        quantize_row(&vals, &mut scales, &mut packed);
        out.clear();
        match part {
            ExpertPart::Packed => out.extend_from_slice(&packed),
            ExpertPart::Scale => scales
                .iter()
                .for_each(|s| out.extend_from_slice(&s.to_bits().to_le_bytes())),
        }
        w.write(&out)?;
        prog.inc(out.len() as u64);
        reg.consumed(off + kc * 2, kc * 2);
    }
    Ok(())
}

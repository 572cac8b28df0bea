//! Weight loading onto the GPU through pinned staging buffers (issue 8, loading): a large host slice (a
//! zero-copy view of an mmapped shard) is copied in chunks into one of two page-locked buffers while the
//! other one's DMA runs, so the shard is never copied whole on the host and the copy engine streams from
//! pinned memory. Progress (GB, GB/s, ETA) goes to stderr about once a second when asked.
//!
//! The host may refill a staging buffer only once the DMA out of it has finished: each buffer has its own
//! event, recorded on the stream right after the copy out of it and waited for before the host writes it
//! again. (cudarc's `PinnedHostSlice` keeps such an event, but records it only while the context tracks
//! events, and [`super::Gpu::new`] turns event tracking off: without events of its own the host overwrote a
//! buffer whose DMA had not run yet, corrupting every weight tensor of more than two chunks whenever the
//! host copy outran the DMA, issue 24.)
//! Used by [`super::Gpu::upload`] between `begin_load` and `end_load` (engine model/open.rs `open_cuda_on`).
//! Test: engine/tests/cuda_ops.rs (`staged_uploads_equal_the_host_bytes`: many chunks through each buffer).

use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

use super::{drv, Gpu, Result};
use crate::xxh3;

/// Bytes of one staging buffer; copies smaller than this go straight from the host slice.
pub(crate) const CHUNK: usize = 32 << 20;

pub(crate) struct Load {
    stage: [PinnedHostSlice<u8>; 2],
    /// Recorded on the stream after the DMA out of `stage[i]`; the host waits for it before refilling.
    copied: [Option<CudaEvent>; 2],
    next: usize,
    total: u64,
    done: u64,
    start: Instant,
    last_print: Instant,
    progress: bool,
    name: String,
}

impl Load {
    pub(crate) fn new(gpu: &Gpu, total: u64, progress: bool) -> Result<Load> {
        // SAFETY: the staging buffers are written by the host before every copy out of them.
        let alloc = || unsafe { gpu.ctx.alloc_pinned::<u8>(CHUNK) }.map_err(drv("pinned staging buffer"));
        let now = Instant::now();
        Ok(Load {
            stage: [alloc()?, alloc()?],
            copied: [None, None],
            next: 0,
            total,
            done: 0,
            start: now,
            last_print: now,
            progress,
            name: gpu.describe(),
        })
    }

    pub(crate) fn upload<T: DeviceRepr + bytemuck::Pod + ValidAsZeroBits>(
        &mut self,
        gpu: &Gpu,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        let bytes: &[u8] = bytemuck::cast_slice(host);
        if bytes.len() < CHUNK {
            self.count(bytes.len());
            return gpu.stream.clone_htod(host).map_err(drv("upload"));
        }
        self.staged(gpu, host, None)
    }

    /// [`Load::upload`] that also returns the xxh3-64 of `host`'s bytes (the load check's host form): from
    /// [`xxh3::PAR_MIN`] bytes on, every byte goes through the staging buffers and is hashed there right after
    /// its copy, in cache (no second read of the mapped shard), each chunk's scramble chain walked beside the
    /// next chunk's copy.
    pub(crate) fn upload_hashed<T: DeviceRepr + bytemuck::Pod + ValidAsZeroBits>(
        &mut self,
        gpu: &Gpu,
        host: &[T],
    ) -> Result<(CudaSlice<T>, u64)> {
        let bytes: &[u8] = bytemuck::cast_slice(host);
        if bytes.len() < xxh3::PAR_MIN {
            // A small tensor: hashed whole, then the plain upload (straight from the host slice).
            let h = kdtree_formats::manifest::xxh3_64(bytes);
            return Ok((self.upload(gpu, host)?, h));
        }
        let mut chain = xxh3::Chain::default();
        let dev = self.staged(gpu, host, Some(&mut chain))?;
        Ok((dev, chain.finish(bytes)))
    }

    /// `host` into a new device buffer through the staging buffers, chunk by chunk; with `chain`, every chunk
    /// (the last, shorter one too) is copied and hashed in one pass ([`xxh3::block_parts`]) and the chain takes
    /// each chunk's parts while the next chunk is copied; without, a last chunk shorter than [`CHUNK`] goes
    /// straight from the host slice.
    fn staged<T: DeviceRepr + bytemuck::Pod + ValidAsZeroBits>(
        &mut self,
        gpu: &Gpu,
        host: &[T],
        mut chain: Option<&mut xxh3::Chain>,
    ) -> Result<CudaSlice<T>> {
        use rayon::prelude::*;
        let bytes: &[u8] = bytemuck::cast_slice(host);
        let s = &gpu.stream;
        let n = bytes.len();
        let blocks = xxh3::chain_blocks(n);
        // SAFETY: every byte is written below before the buffer is read.
        let mut dev = unsafe { s.alloc::<T>(host.len()) }.map_err(drv("upload"))?;
        {
            // SAFETY: T is plain data (Pod), so its device buffer is n bytes of u8 as well.
            let mut view = dev.as_view_mut();
            let mut dst = unsafe { view.transmute_mut::<u8>(n) }.expect("a Pod buffer of n bytes");
            // The parts of the chunk being copied and of the one before it (absorbed meanwhile).
            let (mut cur, mut prev): (Vec<xxh3::Lanes>, Vec<xxh3::Lanes>) = (Vec::new(), Vec::new());
            let mut off = 0;
            while off < n {
                let len = CHUNK.min(n - off);
                if len < CHUNK && chain.is_none() {
                    s.memcpy_htod(&bytes[off..], &mut dst.slice_mut(off..))
                        .map_err(drv("upload"))?;
                    self.count(len);
                    break;
                }
                let i = self.next;
                self.next ^= 1;
                // Waits for this buffer's previous DMA, then fills it from the mmapped shard.
                if let Some(e) = &self.copied[i] {
                    e.synchronize().map_err(drv("staging buffer"))?;
                }
                let buf = &mut self.stage[i];
                let stage = &mut buf.as_mut_slice().map_err(drv("staging buffer"))?[..len];
                let src = &bytes[off..off + len];
                match chain.as_deref_mut() {
                    // Several threads: the copy out of a cold mmap is page-fault bound.
                    None => stage
                        .par_chunks_mut(1 << 20)
                        .zip(src.par_chunks(1 << 20))
                        .for_each(|(d, s)| d.copy_from_slice(s)),
                    Some(c) => {
                        rayon::join(
                            || c.absorb(&prev),
                            || xxh3::block_parts(src, Some(stage), off / xxh3::BLOCK, blocks, &mut cur),
                        );
                        std::mem::swap(&mut cur, &mut prev);
                    }
                }
                // A page-locked buffer: the driver copies from it asynchronously whatever slice of it is passed.
                let stage = &buf.as_slice().map_err(drv("staging buffer"))?[..len];
                s.memcpy_htod(stage, &mut dst.slice_mut(off..off + len))
                    .map_err(drv("upload"))?;
                match &self.copied[i] {
                    Some(e) => e.record(s).map_err(drv("staging event"))?,
                    None => self.copied[i] = Some(s.record_event(None).map_err(drv("staging event"))?),
                }
                off += len;
                self.count(len);
            }
            if let Some(c) = chain {
                c.absorb(&prev);
            }
        }
        Ok(dev)
    }

    fn count(&mut self, n: usize) {
        self.done += n as u64;
        if self.progress && self.last_print.elapsed().as_secs_f64() >= 1.0 {
            self.last_print = Instant::now();
            let t = self.start.elapsed().as_secs_f64();
            let rate = self.done as f64 / t.max(1e-9);
            let eta = self.total.saturating_sub(self.done) as f64 / rate.max(1.0);
            eprintln!(
                "kdtree: loading weights onto {}: {:.1} of {:.1} GB, {:.2} GB/s, ETA {:.0} s",
                self.name,
                gb(self.done),
                gb(self.total),
                rate / 1e9,
                eta
            );
        }
    }

    pub(crate) fn finish(self, gpu: &Gpu) -> Result<(u64, f64)> {
        gpu.sync()?;
        let t = self.start.elapsed().as_secs_f64();
        if self.progress {
            eprintln!(
                "kdtree: loaded {:.2} GB of weights onto {} in {:.2} s ({:.2} GB/s)",
                gb(self.done),
                self.name,
                t,
                self.done as f64 / t.max(1e-9) / 1e9
            );
        }
        Ok((self.done, t))
    }
}

impl Drop for Load {
    /// The pinned buffers are freed after this: no DMA may still read them (an error path that never reached
    /// [`Load::finish`]).
    fn drop(&mut self) {
        for e in self.copied.iter().flatten() {
            let _ = e.synchronize();
        }
    }
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

//! XXH3-64 of device bytes, wrapper for kernels/cuda/xxh3.cu: the manifest's per-tensor checksum computed on
//! the GPU after a weight upload (the load check, `Backend::weight_xxh3`). CPU twin: `xxhash_rust::xxh3::xxh3_64`.
//! Test: engine/tests/cuda_ops.rs (`xxh3_of_device_bytes_equals_the_cpu`).
//!
//! Cost: the 1024-byte blocks' additive parts are computed in parallel, a segment at a time, but the
//! scramble between blocks is a chain of `len / 1024` dependent steps per accumulator lane (about 1 µs per
//! 64 KB on the H200), so one tensor hashes at tens of GB/s; a load check of a whole model adds a few
//! percent to its load time.

use cudarc::driver::{CudaView, DeviceRepr, PushKernelArg};

use super::launch_cfg;
use crate::cuda::{drv, Gpu, Result};

const OP: &str = "xxh3";
/// Bytes of one xxh3 block (16 stripes of 64 bytes with the default secret).
const BLOCK: usize = 1024;
/// Blocks whose deltas one segment computes before the chain walks them (64 MiB of data, 4 MiB of deltas).
const SEGMENT: usize = 1 << 16;

/// XXH3-64 (seed 0) of the `n` bytes of `data`. Synchronises the stream (one read back); allocates.
pub fn xxh3_64(gpu: &Gpu, data: &CudaView<'_, u8>) -> Result<u64> {
    let len = data.len();
    let mut out = gpu.out::<u64>(1)?;
    let mut acc = gpu.out::<u64>(8)?;
    {
        let mut b = gpu.stream.launch_builder(gpu.func("kdtree_xxh3_init"));
        b.arg(&mut acc);
        // SAFETY: the kernel writes acc[0..8).
        unsafe { b.launch(launch_cfg((1, 1, 1), 32, 0)) }.map_err(drv(OP))?;
    }
    if len > 240 {
        let blocks = (len - 1) / BLOCK;
        if blocks > 0 {
            let seg = blocks.min(SEGMENT);
            let mut deltas = gpu.out::<u64>(8 * seg)?;
            let mut b0 = 0usize;
            while b0 < blocks {
                let nb = (blocks - b0).min(seg);
                let (first, count) = (b0 as u64, nb as u64);
                let mut b = gpu.stream.launch_builder(gpu.func("kdtree_xxh3_deltas"));
                b.arg(data).arg(&first).arg(&count).arg(&mut deltas);
                // SAFETY: the kernel reads bytes [b0 * 1024, (b0 + nb) * 1024) < len of `data` and writes
                // deltas[0 .. 8 nb) <= 8 seg.
                unsafe { b.launch(launch_cfg(((8 * nb).div_ceil(256) as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
                let mut c = gpu.stream.launch_builder(gpu.func("kdtree_xxh3_chain"));
                c.arg(&mut acc).arg(&deltas).arg(&count);
                // SAFETY: reads deltas[0 .. 8 nb), reads and writes acc[0..8).
                unsafe { c.launch(launch_cfg((1, 1, 1), 32, 0)) }.map_err(drv(OP))?;
                b0 += nb;
            }
        }
    }
    let len64 = len as u64;
    let mut f = gpu.stream.launch_builder(gpu.func("kdtree_xxh3_finish"));
    f.arg(data).arg(&len64).arg(&acc).arg(&mut out);
    // SAFETY: reads data[0, len) and acc[0..8), writes out[0].
    unsafe { f.launch(launch_cfg((1, 1, 1), 32, 0)) }.map_err(drv(OP))?;
    Ok(gpu.download(&out)?[0])
}

/// [`xxh3_64`] of every byte of a typed device buffer (or view of one).
pub fn xxh3_of<T: DeviceRepr>(gpu: &Gpu, buf: &CudaView<'_, T>) -> Result<u64> {
    let n = buf.len() * std::mem::size_of::<T>();
    // SAFETY: any bytes are valid u8; the view covers exactly the buffer's n bytes.
    let view = unsafe { buf.transmute::<u8>(n) }.expect("a buffer of n bytes");
    xxh3_64(gpu, &view)
}

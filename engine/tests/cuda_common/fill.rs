//! Random device data for the CUDA benches (engine/tests/cuda_bench*.rs): pools of random bytes (INT4
//! nibbles), group scales and bf16 weights uploaded once, and buffers of any size filled from them by
//! device copies (gigabytes in milliseconds; every address distinct, the contents repeat).

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use kdtree_engine::cuda::Gpu;
use rand::RngCore;
use rand_chacha::ChaCha8Rng;

/// Random device data the large buffers are filled from by device copies: bytes (INT4 nibbles), group
/// scales in ±[1/512, 1/64), bf16 weights in ±[2^-7, 2^-5).
pub struct Pools {
    pub bytes: CudaSlice<u8>,
    pub scales: CudaSlice<bf16>,
    pub weights: CudaSlice<bf16>,
}

impl Pools {
    pub fn new(g: &Gpu, r: &mut ChaCha8Rng) -> Pools {
        let mut bytes = vec![0u8; 256 << 20];
        r.fill_bytes(&mut bytes);
        let scales = super::rand_bf16(r, 16 << 20, 1.0 / 512.0, 1.0 / 64.0);
        let weights: Vec<bf16> = (0..64usize << 20)
            .map(|_| bf16::from_bits(0x3c00 | (r.next_u32() as u16 & 0x80ff)))
            .collect();
        Pools {
            bytes: g.upload(&bytes).unwrap(),
            scales: g.upload(&scales).unwrap(),
            weights: g.upload(&weights).unwrap(),
        }
    }
}

/// A new device buffer of `n` elements, copied from `pool` in chunks of half the pool at shifting offsets
/// (every address distinct; the contents repeat, which no kernel here can exploit).
pub fn fill<T: DeviceRepr + ValidAsZeroBits>(g: &Gpu, pool: &CudaSlice<T>, n: usize) -> CudaSlice<T> {
    let mut d = g.zeros::<T>(n).unwrap();
    let chunk = pool.len() / 2;
    let (mut at, mut i) = (0usize, 0usize);
    while at < n {
        let len = chunk.min(n - at);
        let off = (i * 7919 * 16) % (pool.len() - chunk);
        g.stream
            .memcpy_dtod(&pool.slice(off..off + len), &mut d.slice_mut(at..at + len))
            .unwrap();
        at += len;
        i += 1;
    }
    d
}

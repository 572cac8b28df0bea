//! XXH3-64 (seed 0, the default secret: the manifest's per-tensor checksum) of a large buffer on many threads,
//! for the host form of the load check: one thread hashes a page-cache tensor at ~3 GB/s (the first touch of
//! each mapped page is most of it; bench/GPU-RESULTS.md run 56), so a 2.8 GB expert stack alone took longer than
//! the whole 15.5 GB upload.
//!
//! The long form keeps 8 u64 lanes. Each 1024-byte block adds to lane i the sum of its 16 stripes' parts
//! (additive mod 2^64), then scrambles every lane, which is not additive. So the blocks' additive parts are
//! computed in parallel (a window of segments at a time, so the parts held stay small), then one thread walks
//! them in order: `acc = scramble(acc + part)`; the last partial block, the last stripe and the merge follow the
//! reference. The GPU twin is kernels/cuda/xxh3.cu; the reference (and what inputs under [`PAR_MIN`] bytes use)
//! is `xxhash_rust::xxh3::xxh3_64` (formats' `manifest::xxh3_64`). Tests: below, equality with it at every boundary.

use rayon::prelude::*;

const STRIPE: usize = 64;
const BLOCK: usize = 1024;
/// Blocks of one parallel task, and tasks of one window (64 MiB of input: 4 MiB of block parts held).
const SEG_BLOCKS: usize = 1024;
const WINDOW_SEGS: usize = 64;
/// Inputs shorter than this go to the reference in one piece.
pub const PAR_MIN: usize = 4 << 20;

/// XXH3's default 192-byte secret (kSecret).
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d,
    0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0,
    0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0,
    0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,
    0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51,
    0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34,
    0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49,
    0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,
    0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b,
    0x40, 0x7e,
];
const P32_1: u64 = 0x9E37_79B1;
const P32_2: u64 = 0x85EB_CA77;
const P32_3: u64 = 0xC2B2_AE3D;
const P64_1: u64 = 0x9E37_79B1_85EB_CA87;
const P64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P64_3: u64 = 0x1656_67B1_9E37_79F9;
const P64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const P64_5: u64 = 0x27D4_EB2F_1656_67C5;
/// Where the scramble's, the last stripe's and the merge's keys start in the secret.
const SCRAMBLE_AT: usize = 192 - STRIPE;
const LAST_STRIPE_AT: usize = 192 - STRIPE - 7;
const MERGE_AT: usize = 11;

type Lanes = [u64; 8];

fn rd64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// One 64-byte stripe's parts into `acc`, keyed from the secret at `key_at`.
fn accumulate(acc: &mut Lanes, stripe: &[u8], key_at: usize) {
    for i in 0..8 {
        let v = rd64(stripe, 8 * i);
        let k = v ^ rd64(&SECRET, key_at + 8 * i);
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(v);
        acc[i] = acc[i].wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32));
    }
}

/// The additive part of one whole 1024-byte block.
fn block_part(block: &[u8]) -> Lanes {
    let mut d = [0u64; 8];
    for (s, stripe) in block.chunks_exact(STRIPE).enumerate() {
        let key: &[u8; STRIPE] = SECRET[8 * s..8 * s + STRIPE].try_into().expect("64 key bytes");
        for i in 0..8 {
            let v = u64::from_le_bytes(stripe[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            let k = v ^ u64::from_le_bytes(key[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            d[i ^ 1] = d[i ^ 1].wrapping_add(v);
            d[i] = d[i].wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32));
        }
    }
    d
}

fn scramble(acc: &mut Lanes) {
    for (i, a) in acc.iter_mut().enumerate() {
        let x = (*a ^ (*a >> 47)) ^ rd64(&SECRET, SCRAMBLE_AT + 8 * i);
        *a = x.wrapping_mul(P32_1);
    }
}

fn mul_fold(a: u64, b: u64) -> u64 {
    let p = (a as u128) * (b as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

/// XXH3-64 of `data`, equal to `kdtree_formats::manifest::xxh3_64(data)`: at [`PAR_MIN`] bytes and more its whole
/// blocks' parts are computed on the current rayon pool.
pub fn xxh3_64_par(data: &[u8]) -> u64 {
    if data.len() < PAR_MIN {
        return kdtree_formats::manifest::xxh3_64(data);
    }
    let len = data.len();
    let mut acc: Lanes = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1];
    let blocks = (len - 1) / BLOCK;
    let window = SEG_BLOCKS * WINDOW_SEGS;
    let mut parts: Vec<Lanes> = Vec::with_capacity(window.min(blocks));
    for w0 in (0..blocks).step_by(window) {
        let w1 = (w0 + window).min(blocks);
        parts.clear();
        parts.resize(w1 - w0, [0; 8]);
        parts.par_chunks_mut(SEG_BLOCKS).enumerate().for_each(|(s, out)| {
            let b0 = w0 + s * SEG_BLOCKS;
            for (j, p) in out.iter_mut().enumerate() {
                *p = block_part(&data[(b0 + j) * BLOCK..(b0 + j + 1) * BLOCK]);
            }
        });
        for p in &parts {
            for (a, d) in acc.iter_mut().zip(p) {
                *a = a.wrapping_add(*d);
            }
            scramble(&mut acc);
        }
    }
    // The last partial block (its whole stripes), then the last 64 bytes with their own key.
    let tail = blocks * BLOCK;
    for s in 0..((len - 1) - tail) / STRIPE {
        accumulate(&mut acc, &data[tail + s * STRIPE..tail + (s + 1) * STRIPE], 8 * s);
    }
    accumulate(&mut acc, &data[len - STRIPE..], LAST_STRIPE_AT);
    let mut h = (len as u64).wrapping_mul(P64_1);
    for i in 0..4 {
        let at = MERGE_AT + 16 * i;
        h = h.wrapping_add(mul_fold(
            acc[2 * i] ^ rd64(&SECRET, at),
            acc[2 * i + 1] ^ rd64(&SECRET, at + 8),
        ));
    }
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    /// Every path of the long form against the reference: lengths around the threshold, whole blocks, a
    /// window's end, partial blocks with 0 to 15 whole stripes, and a last stripe across the block boundary.
    #[test]
    fn equals_the_reference_at_every_boundary() {
        let big = bytes(PAR_MIN + 3 * SEG_BLOCKS * WINDOW_SEGS * BLOCK / 2, 7);
        let win = SEG_BLOCKS * WINDOW_SEGS * BLOCK;
        let mut lens = vec![
            PAR_MIN,
            PAR_MIN + 1,
            PAR_MIN + 63,
            PAR_MIN + 64,
            PAR_MIN + 65,
            PAR_MIN + 1023,
        ];
        lens.extend([
            PAR_MIN + 1024,
            PAR_MIN + 1025,
            win,
            win + 1,
            win + 1024,
            win + 1025,
            big.len(),
        ]);
        lens.extend((0..=16).map(|s| PAR_MIN + 1 + 64 * s));
        for n in lens {
            let d = &big[..n];
            assert_eq!(xxh3_64_par(d), kdtree_formats::manifest::xxh3_64(d), "{n} bytes");
        }
        // Short inputs take the reference itself; an unaligned view hashes its own bytes.
        for n in [0, 1, 240, 241, 4096] {
            assert_eq!(
                xxh3_64_par(&big[3..3 + n]),
                kdtree_formats::manifest::xxh3_64(&big[3..3 + n])
            );
        }
        let d = &big[5..5 + PAR_MIN + 777];
        assert_eq!(xxh3_64_par(d), kdtree_formats::manifest::xxh3_64(d), "unaligned");
    }

    #[test]
    fn the_same_on_one_thread_and_many() {
        let d = bytes(PAR_MIN + 12_345, 3);
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let four = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        assert_eq!(one.install(|| xxh3_64_par(&d)), four.install(|| xxh3_64_par(&d)));
    }
}

//! XXH3-64 (seed 0, the default secret: the manifest's per-tensor checksum) of a large buffer on many threads,
//! for the host form of the load check: one thread hashes a page-cache tensor at ~3 GB/s (the first touch of
//! each mapped page is most of it; bench/GPU-RESULTS.md run 56), so a 2.8 GB expert stack alone took longer than
//! the whole 15.5 GB upload.
//!
//! The long form keeps 8 u64 lanes. Each 1024-byte block adds to lane i the sum of its 16 stripes' parts
//! (additive mod 2^64), then scrambles every lane, which is not additive. So the blocks' additive parts are
//! computed in parallel ([`block_parts`]), then one thread walks them in order ([`Chain`]:
//! `acc = scramble(acc + part)`); the last partial block, the last stripe and the merge follow the reference.
//! Two users: [`xxh3_64_par`] (a tensor the loader reads on the host: a window of parts at a time) and the GPU
//! loader's staging copy (cuda/load.rs: each staging chunk copied and hashed in one pass, its chain walked beside
//! the next chunk's copy). The GPU twin is kernels/cuda/xxh3.cu; the reference (and what inputs under
//! [`PAR_MIN`] bytes use) is `xxhash_rust::xxh3::xxh3_64` (formats' `manifest::xxh3_64`). Tests: below, equality
//! with it at every boundary, whole and fed in chunks.

use rayon::prelude::*;

const STRIPE: usize = 64;
pub const BLOCK: usize = 1024;
/// Blocks of one window of [`xxh3_64_par`] (64 MiB of input: 4 MiB of block parts held).
const WINDOW_BLOCKS: usize = 65536;
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

/// The long form's 8 accumulator lanes (and a block's additive part of them).
pub type Lanes = [u64; 8];

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

/// [`block_part`] of `src` (one block) while copying it into `dst`: each stripe read once, for both (from DRAM,
/// about the speed of the copy alone; copying and then hashing is ~35 % slower).
#[inline(always)]
fn copy_block_part(dst: &mut [u8], src: &[u8]) -> Lanes {
    let mut d = [0u64; 8];
    for (s, (stripe, out)) in src.chunks_exact(STRIPE).zip(dst.chunks_exact_mut(STRIPE)).enumerate() {
        let key: &[u8; STRIPE] = SECRET[8 * s..8 * s + STRIPE].try_into().expect("64 key bytes");
        let stripe: &[u8; STRIPE] = stripe.try_into().expect("64 bytes");
        let out: &mut [u8; STRIPE] = out.try_into().expect("64 bytes");
        *out = *stripe;
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

/// Whole 1024-byte blocks the long form takes through its scramble chain before the tail: every block but a
/// last one that ends the input (that one is the tail's).
pub fn chain_blocks(len: usize) -> usize {
    len.saturating_sub(1) / BLOCK
}

/// Additive parts of the chain's blocks among `data` (input bytes from block `first` on, `first` counted in
/// blocks of the whole input, whose chain has `chain` blocks: [`chain_blocks`]) into `parts`, on the current
/// rayon pool, 64 KiB a task; with `dst` (as long as `data`) the bytes are copied there too, in the same pass
/// (each stripe read once for its copy and its hash).
pub fn block_parts(data: &[u8], dst: Option<&mut [u8]>, first: usize, chain: usize, parts: &mut Vec<Lanes>) {
    const PIECE: usize = 64; // blocks: 64 KiB
    let step = PIECE * BLOCK;
    // One part per block begun (a partial last block's stays zero), then cut to the chain's.
    parts.clear();
    parts.resize(data.len().div_ceil(BLOCK), [0; 8]);
    let hash = |out: &mut [Lanes], d: &[u8]| {
        for (p, b) in out.iter_mut().zip(d.chunks_exact(BLOCK)) {
            *p = block_part(b);
        }
    };
    match dst {
        None => parts
            .par_chunks_mut(PIECE)
            .zip(data.par_chunks(step))
            .for_each(|(out, s)| hash(out, s)),
        Some(dst) => {
            assert_eq!(
                dst.len(),
                data.len(),
                "block_parts: a copy into a buffer of another length"
            );
            parts
                .par_chunks_mut(PIECE)
                .zip(dst.par_chunks_mut(step).zip(data.par_chunks(step)))
                .for_each(|(out, (d, s))| {
                    let whole = s.len() / BLOCK * BLOCK;
                    for ((p, db), sb) in out.iter_mut().zip(d.chunks_exact_mut(BLOCK)).zip(s.chunks_exact(BLOCK)) {
                        *p = copy_block_part(db, sb);
                    }
                    d[whole..].copy_from_slice(&s[whole..]);
                });
        }
    }
    parts.truncate((data.len() / BLOCK).min(chain.saturating_sub(first)));
}

/// The long form of XXH3-64 fed in order: [`Chain::absorb`] the parts of its [`chain_blocks`] blocks (from
/// [`block_parts`], as many calls as wanted), then [`Chain::finish`] with the whole input (its tail).
pub struct Chain {
    acc: Lanes,
    done: usize,
}

impl Default for Chain {
    fn default() -> Chain {
        Chain {
            acc: [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1],
            done: 0,
        }
    }
}

impl Chain {
    /// Blocks absorbed so far (the next part's block).
    pub fn done(&self) -> usize {
        self.done
    }
    /// The next blocks' parts, in order.
    pub fn absorb(&mut self, parts: &[Lanes]) {
        for p in parts {
            for (a, d) in self.acc.iter_mut().zip(p) {
                *a = a.wrapping_add(*d);
            }
            scramble(&mut self.acc);
        }
        self.done += parts.len();
    }
    /// The hash of `data` (the whole input, more than 240 bytes, every chain block absorbed): its last partial
    /// block, its last stripe and the merge.
    pub fn finish(self, data: &[u8]) -> u64 {
        let len = data.len();
        assert!(
            len > 240 && self.done == chain_blocks(len),
            "xxh3 Chain::finish: {} of {} blocks absorbed ({len} bytes)",
            self.done,
            chain_blocks(len)
        );
        let mut acc = self.acc;
        // The last partial block (its whole stripes), then the last 64 bytes with their own key.
        let tail = self.done * BLOCK;
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
}

/// XXH3-64 of `data`, equal to `kdtree_formats::manifest::xxh3_64(data)`: at [`PAR_MIN`] bytes and more its
/// chain's parts are computed on the current rayon pool, a window at a time.
pub fn xxh3_64_par(data: &[u8]) -> u64 {
    if data.len() < PAR_MIN {
        return kdtree_formats::manifest::xxh3_64(data);
    }
    let chain = chain_blocks(data.len());
    let window = WINDOW_BLOCKS * BLOCK;
    let mut c = Chain::default();
    let mut parts = Vec::with_capacity(WINDOW_BLOCKS.min(chain));
    for (w, d) in data.chunks(window).enumerate() {
        block_parts(d, None, w * WINDOW_BLOCKS, chain, &mut parts);
        c.absorb(&parts);
    }
    c.finish(data)
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
        let big = bytes(PAR_MIN + 3 * WINDOW_BLOCKS * BLOCK / 2, 7);
        let win = WINDOW_BLOCKS * BLOCK;
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

    /// The staging form: the input copied and hashed chunk by chunk (chunks of whole blocks, the last one
    /// shorter, as cuda/load.rs feeds them) equals the reference, and the copy equals the input.
    #[test]
    fn copied_in_chunks_equals_the_reference() {
        let big = bytes(PAR_MIN + 5 * 64 * BLOCK + 333, 11);
        for chunk in [BLOCK, 3 * BLOCK, 64 * BLOCK, 65 * BLOCK, PAR_MIN] {
            for n in [
                PAR_MIN,
                PAR_MIN + 1,
                PAR_MIN + 64,
                PAR_MIN + 1024,
                PAR_MIN + 1025,
                big.len(),
            ] {
                let data = &big[..n];
                let mut copy = vec![0u8; n];
                let mut c = Chain::default();
                let mut parts = Vec::new();
                for (i, (d, s)) in copy.chunks_mut(chunk).zip(data.chunks(chunk)).enumerate() {
                    assert_eq!(c.done(), (i * chunk / BLOCK).min(chain_blocks(n)));
                    block_parts(s, Some(d), i * chunk / BLOCK, chain_blocks(n), &mut parts);
                    c.absorb(&parts);
                }
                assert_eq!(copy, data, "chunk {chunk}, {n} bytes: the copy");
                assert_eq!(
                    c.finish(data),
                    kdtree_formats::manifest::xxh3_64(data),
                    "chunk {chunk}, {n} bytes"
                );
            }
        }
    }

    /// A chain finished with blocks missing is a bug of the caller, not a wrong hash.
    #[test]
    #[should_panic(expected = "blocks absorbed")]
    fn finishing_an_incomplete_chain_panics() {
        Chain::default().finish(&bytes(PAR_MIN, 1));
    }
}

//! Bit-exactness of formats::int4 against the real compressed-tensors library.
//!
//! Fixture: tools/kdtree-convert/fixtures/ct_int4/ (made by fixtures/make_ct_fixture.py; versions in its README).
//! Checks, for every weight in it: (1) decoding the library's `weight_packed`/`weight_scale` with our code gives the
//! library's own `decompress()` output bit for bit; (2) our `quantize` of the BF16 source gives the library's packed
//! bytes and scales bit for bit; (3) `weight_shape` is the logical [N, K].

use half::bf16;
use kdtree_formats::int4;
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/ct_int4")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect()
}

const NAMES: [&str; 3] = ["a", "b", "edge"];

#[test]
fn library_packed_decodes_to_library_dequantized_bitwise() {
    let (c, d) = (fixture("compressed.safetensors"), fixture("decompressed.safetensors"));
    let (comp, dec) = (
        SafeTensors::deserialize(&c).unwrap(),
        SafeTensors::deserialize(&d).unwrap(),
    );
    for name in NAMES {
        let packed = comp.tensor(&format!("{name}.weight_packed")).unwrap();
        let scale = comp.tensor(&format!("{name}.weight_scale")).unwrap();
        let shape = comp.tensor(&format!("{name}.weight_shape")).unwrap();
        let want = dec.tensor(&format!("{name}.weight")).unwrap();
        assert_eq!(packed.dtype(), Dtype::I32);
        assert_eq!(scale.dtype(), Dtype::BF16);
        assert_eq!(want.dtype(), Dtype::BF16);
        let (n, k) = (want.shape()[0], want.shape()[1]);
        assert_eq!(packed.shape(), &[n, k / 8]);
        assert_eq!(scale.shape(), &[n, k / 32]);
        let logical: Vec<i64> = match shape.dtype() {
            Dtype::I64 => shape
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            Dtype::I32 => shape
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
            other => panic!("weight_shape dtype {other:?}"),
        };
        assert_eq!(logical, vec![n as i64, k as i64]);
        let scales = bf16s(scale.data());
        let want = bf16s(want.data());
        let mut row = vec![bf16::ZERO; k];
        let mut mismatches = 0;
        for r in 0..n {
            int4::dequant_row_bf16(
                &packed.data()[r * k / 2..(r + 1) * k / 2],
                &scales[r * k / 32..(r + 1) * k / 32],
                &mut row,
            );
            for c in 0..k {
                if row[c].to_bits() != want[r * k + c].to_bits() {
                    mismatches += 1;
                    if mismatches < 5 {
                        eprintln!("{name}[{r},{c}]: ours {} library {}", row[c], want[r * k + c]);
                    }
                }
            }
        }
        assert_eq!(
            mismatches, 0,
            "{name}: {mismatches} values differ from the library's dequantization"
        );
    }
}

#[test]
fn our_quantize_matches_library_packed_and_scales_bitwise() {
    let (s, c) = (fixture("source.safetensors"), fixture("compressed.safetensors"));
    let (src, comp) = (
        SafeTensors::deserialize(&s).unwrap(),
        SafeTensors::deserialize(&c).unwrap(),
    );
    for name in NAMES {
        let w = src.tensor(&format!("{name}.weight")).unwrap();
        assert_eq!(w.dtype(), Dtype::BF16);
        let (n, k) = (w.shape()[0], w.shape()[1]);
        let ours = int4::quantize(&bf16s(w.data()), n, k);
        let lib_scale = bf16s(comp.tensor(&format!("{name}.weight_scale")).unwrap().data());
        let lib_packed = comp.tensor(&format!("{name}.weight_packed")).unwrap().data().to_vec();
        let bad_scales = ours
            .scale
            .iter()
            .zip(&lib_scale)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(bad_scales, 0, "{name}: {bad_scales} scales differ");
        assert_eq!(ours.packed.len(), lib_packed.len());
        let bad_bytes = ours.packed.iter().zip(&lib_packed).filter(|(a, b)| a != b).count();
        assert_eq!(bad_bytes, 0, "{name}: {bad_bytes} packed bytes differ");
    }
}

#[test]
fn fixture_exercises_edge_cases() {
    // Guards against a regenerated fixture silently losing the cases the bit-exact tests rely on.
    let c = fixture("compressed.safetensors");
    let comp = SafeTensors::deserialize(&c).unwrap();
    let scales = bf16s(comp.tensor("edge.weight_scale").unwrap().data());
    assert_eq!(
        scales[0],
        bf16::from_f32(int4::ZERO_SCALE_EPS),
        "zero group keeps the eps scale"
    );
    let packed = comp.tensor("edge.weight_packed").unwrap().data();
    assert!(packed[..16].iter().all(|&b| b == 0x88), "zero group packs to q = 0");
    let all: Vec<u8> = packed.iter().flat_map(|&b| [b & 0xF, b >> 4]).collect();
    assert!(all.contains(&0) && all.contains(&15), "both extremes -8 and +7 occur");
}

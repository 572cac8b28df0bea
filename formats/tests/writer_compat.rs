//! Our shard writer's files open with the reference safetensors crate (header layout, alignment,
//! `__metadata__`), and files the reference crate writes pass our strict reader with the same bytes.

use kdtree_formats::reader::SafeFile;
use kdtree_formats::writer::{ShardWriter, TensorSpec};
use kdtree_formats::Dtype;

#[test]
fn reference_crate_reads_our_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rank-00-of-01.part-0000.safetensors");
    let specs = vec![
        TensorSpec {
            name: "b.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![3, 5],
        },
        TensorSpec {
            name: "a.bias".into(),
            dtype: Dtype::F32,
            shape: vec![3],
        },
        TensorSpec {
            name: "c.packed".into(),
            dtype: Dtype::U8,
            shape: vec![2, 3, 7],
        },
    ];
    let mut w = ShardWriter::create(&p, specs).unwrap();
    let data: Vec<u8> = (0..(12 + 30 + 42)).map(|i| (i * 7 % 251) as u8).collect();
    w.write(&data).unwrap();
    let done = w.finish().unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!((8 + n) % 8, 0);
    assert_eq!(
        meta.metadata().as_ref().unwrap().get("format").map(String::as_str),
        Some("pt")
    );
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let b = st.tensor("b.weight").unwrap();
    assert_eq!((b.dtype(), b.shape()), (safetensors::Dtype::BF16, &[3usize, 5][..]));
    assert_eq!(b.data(), &data[12..42]);
    assert_eq!(st.tensor("c.packed").unwrap().data(), &data[42..]);
    assert_eq!(
        done.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["a.bias", "b.weight", "c.packed"]
    );
}

#[test]
fn our_reader_reads_reference_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ref.safetensors");
    let a: Vec<u8> = (0..24).collect();
    let b: Vec<u8> = (0..6).map(|i| 100 + i).collect();
    let views = vec![
        (
            "x",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![2, 3], &a).unwrap(),
        ),
        (
            "y",
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![3], &b).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &p).unwrap();
    let f = SafeFile::open(&p).unwrap();
    let (t, d) = f.tensor("x").unwrap();
    assert_eq!((t.dtype, t.shape.as_slice(), d), (Dtype::I32, &[2usize, 3][..], &a[..]));
    assert_eq!(f.tensor("y").unwrap().1, &b[..]);
}

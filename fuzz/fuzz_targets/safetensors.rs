//! Fuzz target `safetensors`: the bytes of a whole .safetensors file through
//! `kdtree_formats::reader::parse_bytes` (the checks `read_header` / `SafeFile::open` run on a shard).
//! Contract (docs/fuzzing.md): never a panic, never an unbounded allocation; an accepted header is
//! exactly the file (sorted, contiguous, sizes = dtype x shape, names unique and found by `get`); the
//! reference `safetensors` crate accepts it too with the same dtype, shape and bytes per tensor (ours is
//! the stricter reader); and our writer's header for those tensors reads back to the same tensors.
#![no_main]

use kdtree_formats::dtype::byte_len;
use kdtree_formats::reader::parse_bytes;
use kdtree_formats::writer::{header_bytes, TensorSpec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = parse_bytes("fuzz.safetensors", data) else {
        return;
    };
    let start = h.data_start();
    assert!(start <= data.len());
    let buf = &data[start..];
    let mut pos = 0;
    for t in &h.tensors {
        assert_eq!(t.begin, pos, "{}: not contiguous", t.name);
        assert_eq!(Some(t.nbytes()), byte_len(t.dtype, &t.shape), "{}", t.name);
        assert_ne!(t.name, "__metadata__");
        assert_eq!(h.get(&t.name), Some(t), "{}: get", t.name);
        pos = t.end;
    }
    assert_eq!(pos, buf.len(), "tensors do not cover the data buffer");

    // Differential: the reference parser accepts what we accept, with the same tensors.
    let st = match safetensors::SafeTensors::deserialize(data) {
        Ok(st) => st,
        Err(e) => panic!("we accept a file the reference crate refuses: {e}"),
    };
    assert_eq!(st.len(), h.tensors.len());
    for t in &h.tensors {
        let r = st.tensor(&t.name).expect("reference crate has the tensor");
        assert_eq!(format!("{:?}", r.dtype()), t.dtype.name(), "{}", t.name);
        assert_eq!(r.shape(), &t.shape[..], "{}", t.name);
        assert_eq!(r.data(), &buf[t.begin..t.end], "{}", t.name);
    }

    // Round trip through our writer's header: the same tensors, data in name order, read back the same.
    let mut specs: Vec<TensorSpec> = h
        .tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    let (json, offs) = header_bytes("fuzz.safetensors", &specs).expect("writer takes what the reader accepted");
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    for s in &specs {
        let t = h.get(&s.name).unwrap();
        file.extend_from_slice(&buf[t.begin..t.end]);
    }
    let back = parse_bytes("written.safetensors", &file).expect("the reader reads what the writer wrote");
    assert_eq!(back.data_start() % 8, 0, "writer pads the header to 8 bytes");
    assert_eq!(back.tensors.len(), specs.len());
    for (s, (b, e)) in specs.iter().zip(offs) {
        let t = back.get(&s.name).expect("written tensor is there");
        assert_eq!(
            (t.dtype, &t.shape, t.begin, t.end),
            (s.dtype, &s.shape, b, e),
            "{}",
            s.name
        );
        let orig = h.get(&s.name).unwrap();
        let wb = &file[back.data_start()..];
        assert_eq!(&wb[t.begin..t.end], &buf[orig.begin..orig.end], "{}", s.name);
    }
});

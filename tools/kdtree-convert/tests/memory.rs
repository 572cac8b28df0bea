//! Peak RSS of `repack` stays bounded by its buffers, not by tensor size: a 256 MiB embedding (sparse
//! file, so the test writes little) is converted by a child whose max RSS must stay far below 256 MiB.
//! Without the page release in emit.rs the mapped source pages alone would exceed it.
//! Own test binary: getrusage(RUSAGE_CHILDREN) then sees only this test's children.

mod common;
use common::*;
use kdtree_formats::writer::{header_bytes, TensorSpec};
use kdtree_formats::Dtype;

const VOCAB: usize = 2 << 20; // × hidden 64 × 2 bytes = 256 MiB
/// Bound asserted on the child's max RSS (measured 47 MiB; 269 MiB before pages were released per chunk).
const MAX_RSS_MIB: i64 = 160;

#[test]
fn repack_peak_rss_is_bounded() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny { shards: 2, ..Tiny::default() };
    let mut all = tensors(&t);
    all.remove("language_model.model.embed_tokens.weight");
    all.remove("language_model.lm_head.weight");
    let mut cfg = config(&t);
    cfg["text_config"]["vocab_size"] = serde_json::json!(VOCAB);
    cfg["text_config"]["tie_word_embeddings"] = serde_json::json!(true);
    let src = d.path().join("src");
    write_checkpoint_with(&src, &t, &cfg, &all);
    // A sparse safetensors file holding only the embedding: header, then 256 MiB of holes (zeros).
    let name = "language_model.model.embed_tokens.weight";
    let spec = TensorSpec { name: name.into(), dtype: Dtype::BF16, shape: vec![VOCAB, 64] };
    let (h, offs) = header_bytes("embed", &[spec]).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    let p = src.join("embed.safetensors");
    std::fs::write(&p, &bytes).unwrap();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len((bytes.len() + offs[0].1) as u64).unwrap();
    let ip = src.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
    v["weight_map"][name] = serde_json::json!("embed.safetensors");
    std::fs::write(&ip, v.to_string()).unwrap();

    let out = d.path().join("out");
    let (code, _, err) = run(&["repack", s(&src), s(&out), "--ranks", "1", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes into the struct we pass.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) }, 0);
    let rss_mib = ru.ru_maxrss / 1024;
    eprintln!("repack of a 256 MiB tensor: max RSS {rss_mib} MiB");
    assert!(rss_mib < MAX_RSS_MIB, "max RSS {rss_mib} MiB >= {MAX_RSS_MIB} MiB");
    let m = kdtree_formats::ModelDir::open(&out).unwrap();
    assert_eq!(m.tensor(name, 0).unwrap().data.len(), 256 << 20);
}

//! Fuzz target `manifest`: bytes as `manifest.toml` through `Manifest::parse`, then the configs it carries
//! through the checks `ModelDir::open` runs on them (`parse_text_config`, `parse_drafter_config`,
//! `check_model`). Contract (docs/fuzzing.md): never a panic or an unbounded allocation; an accepted
//! manifest has a readable format_version, plain unique file names, tensors in listed files with ranks in
//! range and the version's checksum; it serializes (`to_toml`), and what we write parses back to a manifest
//! that writes the same bytes (write -> parse -> write is a fixed point).
#![no_main]

use kdtree_formats::config::{parse_drafter_config, parse_text_config};
use kdtree_formats::manifest::{is_plain_file_name, parse_xxh3_hex, Manifest, MANIFEST, READ_VERSIONS, SHA256SUMS};
use kdtree_formats::validate::check_model;
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(m) = Manifest::parse("manifest.toml", text) else {
        return;
    };
    assert!(
        READ_VERSIONS.contains(&m.format_version),
        "accepted format_version {}",
        m.format_version
    );
    let mut shards = HashSet::new();
    for f in &m.files {
        assert!(
            is_plain_file_name(&f.name) && f.name != MANIFEST && f.name != SHA256SUMS,
            "{:?}",
            f.name
        );
        assert!(f.rank < m.plan.ranks && shards.insert(f.name.as_str()), "{:?}", f.name);
    }
    let mut all = shards.clone();
    for a in &m.aux_files {
        assert!(
            is_plain_file_name(&a.name) && all.insert(a.name.as_str()),
            "{:?}",
            a.name
        );
    }
    let mut seen = HashSet::new();
    for t in &m.tensors {
        assert!(shards.contains(t.file.as_str()) && t.rank < m.plan.ranks, "{}", t.name);
        assert!(seen.insert((t.name.as_str(), t.rank)), "{} twice", t.name);
        match m.format_version {
            1 => assert!(t.sha256.len() == 64 && t.xxh3.is_empty(), "{}", t.name),
            _ => assert!(parse_xxh3_hex(&t.xxh3).is_some() && t.sha256.is_empty(), "{}", t.name),
        }
    }

    // Write -> parse -> write.
    let written = m.to_toml().expect("an accepted manifest serializes");
    let back = match Manifest::parse("written.toml", &written) {
        Ok(b) => b,
        Err(e) => panic!("our own output does not parse: {e}\n{written}"),
    };
    assert_eq!(
        back.to_toml().expect("serializes"),
        written,
        "write -> parse -> write differs"
    );

    // What ModelDir::open does next with the configs: a result, never a panic.
    let Ok(tc) = parse_text_config("text_config_json", &m.model.text_config_json) else {
        return;
    };
    let dc = match &m.model.drafter_config_json {
        Some(j) => match parse_drafter_config("drafter_config_json", j) {
            Ok(d) => Some(d),
            Err(_) => return,
        },
        None => None,
    };
    let _ = check_model("text_config_json", &tc, dc.as_ref().map(|d| ("drafter_config_json", d)));
});

//! Synthetic Kimi-style tokenizer: `tiktoken.model` (base64 token bytes + rank per line), `tokenizer_config.json`
//! (added_tokens_decoder for the 256 reserved specials with Kimi's names at Kimi's offsets, k26-format §6.3) and
//! the K2.6-style `chat_template.jinja` of kdtree-text.
//!
//! Ranks 0..256 are the single bytes; then byte-level BPE merges learned by a small deterministic trainer on the
//! embedded corpus.txt (English, code, digits, CJK), pre-split roughly like Kimi's regex so merges stay inside
//! words; if the corpus runs out of pairs seen twice, the rest of the ranks are deterministic "filler" merges
//! (concatenations of two existing tokens, at most 16 bytes). Every token is thus reachable by BPE merges and
//! all token byte strings are distinct (tiktoken requires both). Independent of the synth seed.
//! Tested below and, through kdtree-text's loader, in tools/kdtree-convert/tests/synth.rs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::OnceLock;

const CORPUS: &str = include_str!("corpus.txt");
/// The K2.6-style chat template (owned by kdtree-text).
pub const CHAT_TEMPLATE: &str = include_str!("../../../kdtree-text/assets/chat_template.jinja");
/// Longest filler token.
const FILLER_MAX_LEN: usize = 16;

/// Named specials by offset from the first special id (Kimi: 163584 + offset); others are reserved.
pub const SPECIAL_NAMES: [(usize, &str); 23] = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|im_end|>"),
    (3, "<|im_user|>"),
    (4, "<|im_assistant|>"),
    (6, "<|start_header_id|>"),
    (7, "<|end_header_id|>"),
    (9, "[EOT]"),
    (10, "<|im_system|>"),
    (11, "<|tool_calls_section_begin|>"),
    (12, "<|tool_calls_section_end|>"),
    (13, "<|tool_call_begin|>"),
    (14, "<|tool_call_argument_begin|>"),
    (15, "<|tool_call_end|>"),
    (17, "<|im_middle|>"),
    (18, "<|media_begin|>"),
    (19, "<|media_content|>"),
    (20, "<|media_end|>"),
    (21, "<|media_pad|>"),
    (22, "<think>"),
    (23, "</think>"),
    (254, "[UNK]"),
    (255, "[PAD]"),
];

/// Offsets of well-known ids.
pub const BOS: usize = 0;
pub const IM_END: usize = 2;
pub const MEDIA_PAD: usize = 21;
pub const UNK: usize = 254;
pub const PAD: usize = 255;

/// Name of special `offset` (0..256) when the first special id is `base`.
pub fn special_name(base: usize, offset: usize) -> String {
    SPECIAL_NAMES
        .iter()
        .find(|(o, _)| *o == offset)
        .map(|(_, n)| n.to_string())
        .unwrap_or_else(|| format!("<|reserved_token_{}|>", base + offset))
}

/// Pre-tokens of `text`: Kimi's own pre-tokeniser regex (kdtree_text's, the one the runtime tokenizer
/// uses), so the synthetic merges follow the real model's splits.
fn pretokenize(text: &str) -> Vec<&str> {
    kdtree_text::tokenizer::pretokenize(text)
}

/// Merges learned from the corpus (token byte strings in rank order after the 256 single bytes), cached.
fn trained_tokens() -> &'static [Vec<u8>] {
    static TRAINED: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    TRAINED.get_or_init(|| {
        let mut counts: BTreeMap<&[u8], u64> = BTreeMap::new();
        for w in pretokenize(CORPUS) {
            *counts.entry(w.as_bytes()).or_default() += 1;
        }
        let mut words: Vec<(Vec<u32>, u64)> = counts
            .into_iter()
            .map(|(w, c)| (w.iter().map(|&b| b as u32).collect(), c))
            .collect();
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let mut index: HashMap<Vec<u8>, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        loop {
            let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
            for (w, c) in &words {
                for p in w.windows(2) {
                    *pairs.entry((p[0], p[1])).or_default() += c;
                }
            }
            // Most frequent pair; ties broken by the smaller concatenated bytes (deterministic).
            let best = pairs.into_iter().filter(|&(_, c)| c >= 2).max_by(|a, b| {
                a.1.cmp(&b.1).then_with(|| {
                    let ka = [&tokens[a.0 .0 as usize][..], &tokens[a.0 .1 as usize][..]].concat();
                    let kb = [&tokens[b.0 .0 as usize][..], &tokens[b.0 .1 as usize][..]].concat();
                    kb.cmp(&ka)
                })
            });
            let Some(((a, b), _)) = best else { break };
            let bytes = [&tokens[a as usize][..], &tokens[b as usize][..]].concat();
            let id = *index.entry(bytes.clone()).or_insert_with(|| {
                tokens.push(bytes);
                (tokens.len() - 1) as u32
            });
            for (w, _) in words.iter_mut() {
                let mut k = 0;
                while k + 1 < w.len() {
                    if w[k] == a && w[k + 1] == b {
                        w[k] = id;
                        w.remove(k + 1);
                    }
                    k += 1;
                }
            }
        }
        tokens.split_off(256)
    })
}

/// The `n` mergeable tokens (rank = index): single bytes, trained merges, then filler merges.
pub fn mergeable_tokens(n: usize) -> Vec<Vec<u8>> {
    assert!(n >= 256, "need at least the 256 single bytes");
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    tokens.extend(trained_tokens().iter().take(n - 256).cloned());
    let trained = tokens.len();
    let mut seen: HashSet<Vec<u8>> = tokens.iter().cloned().collect();
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b64_7472_6565); // fixed: the tokenizer does not depend on --seed
    while tokens.len() < n {
        let a = rng.random_range(0..tokens.len());
        let b = rng.random_range(0..trained);
        if tokens[a].len() + tokens[b].len() > FILLER_MAX_LEN {
            continue;
        }
        let t = [&tokens[a][..], &tokens[b][..]].concat();
        if seen.insert(t.clone()) {
            tokens.push(t);
        }
    }
    tokens
}

/// `tiktoken.model` text for `n` mergeable ranks.
pub fn tiktoken_model(n: usize) -> String {
    let mut s = String::with_capacity(n * 16);
    for (rank, t) in mergeable_tokens(n).iter().enumerate() {
        base64_encode(t, &mut s);
        s.push(' ');
        s.push_str(&rank.to_string());
        s.push('\n');
    }
    s
}

/// Standard base64 (RFC 4648, padded), appended to `out`.
fn base64_encode(bytes: &[u8], out: &mut String) {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for c in bytes.chunks(3) {
        let v = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for k in 0..4 {
            if k <= c.len() {
                out.push(A[(v >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
}

/// `tokenizer_config.json` in Kimi's shape, for `n` mergeable ranks (specials are ids n..n+256).
pub fn tokenizer_config(n: usize, model_max_length: usize) -> Value {
    let mut decoder = Map::new();
    for off in 0..256 {
        decoder.insert(
            (n + off).to_string(),
            json!({"content": special_name(n, off), "lstrip": false, "normalized": false, "rstrip": false,
                   "single_word": false, "special": true}),
        );
    }
    let additional: Vec<String> = [2, 3, 4, 6, 7, 9, 10, 17].iter().map(|&o| special_name(n, o)).collect();
    json!({
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": model_max_length,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (raw, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            let mut s = String::new();
            base64_encode(raw.as_bytes(), &mut s);
            assert_eq!(s, enc);
        }
        assert!(tiktoken_model(300).starts_with("AA== 0\nAQ== 1\n"));
    }

    #[test]
    fn specials_sit_at_kimi_offsets() {
        let base = 163584;
        assert_eq!(special_name(base, IM_END), "<|im_end|>");
        assert_eq!(special_name(base, 22), "<think>");
        assert_eq!(special_name(base, MEDIA_PAD), "<|media_pad|>");
        assert_eq!(special_name(base, UNK), "[UNK]");
        assert_eq!(special_name(base, PAD), "[PAD]");
        assert_eq!(special_name(base, 5), "<|reserved_token_163589|>");
        assert_eq!(special_name(base, 100), "<|reserved_token_163684|>");
        let cfg = tokenizer_config(base, 262144);
        assert_eq!(cfg["added_tokens_decoder"]["163838"]["content"], "[UNK]");
        assert_eq!(cfg["added_tokens_decoder"].as_object().unwrap().len(), 256);
    }

    #[test]
    fn pretokenizer_keeps_words_digits_and_han_apart() {
        assert_eq!(
            pretokenize("Hello world 12345 人工智能!"),
            kdtree_text::tokenizer::pretokenize("Hello world 12345 人工智能!")
        );
    }

    #[test]
    fn vocab_is_meaningful_unique_and_deterministic() {
        let toks = mergeable_tokens(768);
        assert_eq!(toks.len(), 768);
        assert_eq!(toks, mergeable_tokens(768));
        let set: HashSet<&Vec<u8>> = toks.iter().collect();
        assert_eq!(set.len(), 768, "token bytes must be distinct");
        for w in [&b" the"[..], b"ing", "的".as_bytes(), b" model"] {
            assert!(
                toks.iter().any(|t| t == w),
                "{:?} should be a learned token",
                String::from_utf8_lossy(w)
            );
        }
        // A larger vocab extends a smaller one (same prefix), and filler stays within 16 bytes.
        let big = mergeable_tokens(5000);
        assert_eq!(&big[..768], &toks[..]);
        assert!(big.iter().all(|t| !t.is_empty() && t.len() <= FILLER_MAX_LEN));
        assert_eq!(big.iter().collect::<HashSet<_>>().len(), 5000);
    }
}

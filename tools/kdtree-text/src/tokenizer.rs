//! Kimi's tiktoken tokenizer: `tiktoken.model` (one `base64(token_bytes) rank` per line) plus 256
//! reserved special ids right after the mergeable ranks, Kimi's pre-tokenisation pattern and input
//! chunking, encoded with tiktoken-rs `CoreBPE` with every special token allowed in text.
//!
//! Must match `tokenization_kimi.py` (k26-format.md §6.1–6.3). Tests: bottom of this file (a tiny
//! tiktoken.model built in the test, and the real split pattern on hand-derived cases).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use tiktoken_rs::CoreBPE;

/// Kimi's split pattern, alternatives joined with `|` exactly as `tokenization_kimi.py` does (a long alternative
/// spans two pieces)
/// (note the `&&` class intersections and the `(?!\S)` lookahead, both supported by fancy-regex).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*",
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+",
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Reserved special ids after the mergeable ranks (`num_reserved_special_tokens` in Kimi's tokenizer).
pub const NUM_RESERVED_SPECIAL_TOKENS: u32 = 256;
/// Kimi encodes text in slices of at most this many characters (`TIKTOKEN_MAX_ENCODE_CHARS`).
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// ... and within them, runs of at most this many consecutive whitespace or non-whitespace characters
/// (`MAX_NO_WHITESPACES_CHARS`), so the regex never sees a pathological run.
pub const MAX_NO_WHITESPACE_CHARS: usize = 25_000;

/// A loaded tokenizer. Ids `0..n_mergeable` are BPE ranks; `n_mergeable..n_mergeable+256` specials.
pub struct Tokenizer {
    bpe: CoreBPE,
    n_mergeable: u32,
    /// Special names, index = id - n_mergeable.
    specials: Vec<String>,
    special_ids: HashMap<String, u32>,
}

impl Tokenizer {
    /// Load `dir/tiktoken.model`, naming specials from `dir/tokenizer_config.json` when present.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config = dir.join("tokenizer_config.json");
        Self::from_files(&dir.join("tiktoken.model"), config.exists().then_some(config.as_path()))
    }

    /// Load a tiktoken.model file and optionally a tokenizer_config.json (for special names).
    pub fn from_files(model: &Path, config: Option<&Path>) -> Result<Self> {
        let text = std::fs::read_to_string(model).with_context(|| format!("reading tokenizer {}", model.display()))?;
        let ranks = parse_tiktoken_model(&text).with_context(|| format!("{}", model.display()))?;
        let names = match config {
            Some(path) => {
                let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                special_names_from_config(&raw).with_context(|| format!("{}", path.display()))?
            }
            None => HashMap::new(),
        };
        Self::from_ranks(ranks, &names)
    }

    /// Build from mergeable `(token_bytes, rank)` pairs (ranks must be exactly `0..n`) and special
    /// names by id (ids outside the reserved range are ignored; missing ones get
    /// `<|reserved_token_{id}|>`).
    pub fn from_ranks(ranks: Vec<(Vec<u8>, u32)>, names: &HashMap<u32, String>) -> Result<Self> {
        let n = ranks.len() as u32;
        let mut seen_rank = vec![false; ranks.len()];
        let mut seen_bytes = HashSet::with_capacity(ranks.len());
        for (bytes, rank) in &ranks {
            if *rank >= n || std::mem::replace(&mut seen_rank[*rank as usize], true) {
                bail!("ranks must be 0..{n} each exactly once; rank {rank} is out of range or repeated");
            }
            if !seen_bytes.insert(bytes.as_slice()) {
                bail!("token bytes {bytes:?} appear twice");
            }
        }
        let specials: Vec<String> = (n..n + NUM_RESERVED_SPECIAL_TOKENS)
            .map(|id| {
                names
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| format!("<|reserved_token_{id}|>"))
            })
            .collect();
        let mut special_ids = HashMap::new();
        for (i, name) in specials.iter().enumerate() {
            if special_ids.insert(name.clone(), n + i as u32).is_some() {
                bail!("special token name {name:?} is used twice");
            }
        }
        let bpe = CoreBPE::new(
            ranks.into_iter().collect(),
            special_ids.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            KIMI_PATTERN,
        )
        .map_err(|e| anyhow!("building the BPE: {e}"))?;
        Ok(Self {
            bpe,
            n_mergeable: n,
            specials,
            special_ids,
        })
    }

    /// Total ids: mergeable ranks + reserved specials.
    pub fn vocab_size(&self) -> usize {
        (self.n_mergeable + NUM_RESERVED_SPECIAL_TOKENS) as usize
    }

    /// Number of mergeable (BPE) ranks; the first special id.
    pub fn n_mergeable(&self) -> u32 {
        self.n_mergeable
    }

    /// Id of a special token by name (`<|im_end|>`, `[EOS]`, ...).
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    /// Name of special id `id`, if it is one.
    pub fn special_name(&self, id: u32) -> Option<&str> {
        id.checked_sub(self.n_mergeable)
            .and_then(|i| self.specials.get(i as usize))
            .map(String::as_str)
    }

    /// Encode text the way Kimi does: chunk, then BPE each chunk with all specials allowed.
    ///
    /// # Panics
    /// When fancy-regex gives up (backtrack limit), which the chunking is there to prevent; use
    /// [`Tokenizer::try_encode`] to get that as an error.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text).expect("tokenizing a bounded chunk")
    }

    /// [`Tokenizer::encode`] returning the regex failure as an error.
    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        let all = self.bpe.special_tokens();
        let mut out = Vec::new();
        for piece in split_for_encoding(text, MAX_ENCODE_CHARS, MAX_NO_WHITESPACE_CHARS) {
            let (ids, _) = self
                .bpe
                .encode(piece, &all)
                .map_err(|e| anyhow!("tokenizing: {}", e.message))?;
            out.extend(ids);
        }
        Ok(out)
    }

    /// The bytes of a sequence of ids (specials decode to their names).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let bad = ids.iter().find(|&&id| id as usize >= self.vocab_size());
        if let Some(id) = bad {
            bail!("token id {id} is outside the vocabulary (size {})", self.vocab_size());
        }
        self.bpe
            .decode_bytes(ids)
            .map_err(|e| anyhow!("decoding token {}", e.token))
    }

    /// Decode to a string, replacing invalid UTF-8 with U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

/// Parse `tiktoken.model` text into `(token_bytes, rank)`; errors name the 1-based line.
pub fn parse_tiktoken_model(text: &str) -> Result<Vec<(Vec<u8>, u32)>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(tok), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            bail!("line {line_no}: expected `base64_token rank`, found {line:?}");
        };
        let bytes = b64
            .decode(tok)
            .with_context(|| format!("line {line_no}: token {tok:?} is not valid base64"))?;
        let rank: u32 = rank
            .parse()
            .with_context(|| format!("line {line_no}: rank {rank:?} is not an integer"))?;
        out.push((bytes, rank));
    }
    if out.is_empty() {
        bail!("no tokens found");
    }
    Ok(out)
}

/// Special names by id from tokenizer_config.json's `added_tokens_decoder` (absent → empty).
pub fn special_names_from_config(json: &str) -> Result<HashMap<u32, String>> {
    let v: serde_json::Value = serde_json::from_str(json).context("not valid JSON")?;
    let mut out = HashMap::new();
    let Some(map) = v.get("added_tokens_decoder").and_then(|d| d.as_object()) else {
        return Ok(out);
    };
    for (id, entry) in map {
        let id: u32 = id
            .parse()
            .with_context(|| format!("added_tokens_decoder key {id:?} is not an id"))?;
        let name = entry
            .get("content")
            .and_then(|c| c.as_str())
            .with_context(|| format!("added_tokens_decoder[{id}] has no string \"content\""))?;
        out.insert(id, name.to_string());
    }
    Ok(out)
}

/// The pieces Kimi's pre-tokeniser regex cuts `text` into (no chunking, no specials).
pub fn pretokenize(text: &str) -> Vec<&str> {
    let re = fancy_regex::Regex::new(KIMI_PATTERN).expect("KIMI_PATTERN compiles");
    re.find_iter(text).map(|m| m.expect("regex match").as_str()).collect()
}

/// Python's `str.isspace`: Unicode White_Space plus the information separators U+001C..U+001F.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Kimi's input chunking: slices of at most `max_chars` characters, each cut further so no run of
/// consecutive whitespace / non-whitespace characters exceeds `max_run` (tiktoken's
/// `_split_whitespaces_or_nonwhitespaces`). Concatenating the pieces gives back `text`.
pub fn split_for_encoding(text: &str, max_chars: usize, max_run: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let cut = rest.char_indices().nth(max_chars).map_or(rest.len(), |(i, _)| i);
        let (chunk, tail) = rest.split_at(cut);
        split_runs(chunk, max_run, &mut out);
        rest = tail;
    }
    if out.is_empty() {
        out.push(text);
    }
    out
}

fn split_runs<'a>(s: &'a str, max_run: usize, out: &mut Vec<&'a str>) {
    let mut run_len = 0usize;
    let mut run_is_space = s.chars().next().is_some_and(py_isspace);
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let is_space = py_isspace(c);
        if is_space != run_is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&s[start..i]);
                start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 256 byte tokens (rank = byte) plus merges "he", "ll", "hell", "hello", " w", "你".
    pub(crate) fn tiny_model_text() -> String {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut lines: Vec<String> = (0u32..256).map(|b| format!("{} {b}", b64.encode([b as u8]))).collect();
        let merges: [&[u8]; 6] = [b"he", b"ll", b"hell", b"hello", b" w", "你".as_bytes()];
        for (i, m) in merges.iter().enumerate() {
            lines.push(format!("{} {}", b64.encode(m), 256 + i));
        }
        lines.join("\n") + "\n"
    }

    fn tiny() -> Tokenizer {
        let mut names = HashMap::new();
        names.insert(262, "[BOS]".to_string());
        names.insert(264, "<|im_end|>".to_string());
        names.insert(5, "not-a-special".to_string()); // below the reserved range: ignored
        Tokenizer::from_ranks(parse_tiktoken_model(&tiny_model_text()).unwrap(), &names).unwrap()
    }

    #[test]
    fn tiny_model_encodes_with_merges_and_specials() {
        let t = tiny();
        assert_eq!(t.vocab_size(), 262 + 256);
        assert_eq!(t.special_id("<|im_end|>"), Some(264));
        assert_eq!(t.special_name(263), Some("<|reserved_token_263|>"));
        assert_eq!(t.special_name(261), None);
        // "hello" is one piece → rank 259; " world" → " w" + o r l d bytes.
        let ids = t.encode("hello world<|im_end|>");
        assert_eq!(
            ids,
            vec![259, 260, b'o' as u32, b'r' as u32, b'l' as u32, b'd' as u32, 264]
        );
        assert_eq!(t.decode_lossy(&ids).unwrap(), "hello world<|im_end|>");
        // A reserved name typed in text is a special too (allowed_special = all).
        assert_eq!(t.encode("<|reserved_token_300|>"), vec![300]);
        // Long whitespace runs go through the chunking and come back intact.
        let long = format!("a{}x", " ".repeat(30_000));
        let ids = t.try_encode(&long).unwrap();
        assert_eq!(ids.len(), 30_002);
        assert_eq!(t.decode_lossy(&ids).unwrap(), long);
        assert!(t.decode_bytes(&[518]).is_err());
    }

    #[test]
    fn tiktoken_model_errors_name_the_line() {
        let err = parse_tiktoken_model("aGk= 0\n!!!! 1\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
        let err = parse_tiktoken_model("aGk= 0\naGk=\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
        let err = parse_tiktoken_model("aGk= x\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 1"), "{err:#}");
        let dup = vec![(b"a".to_vec(), 0), (b"b".to_vec(), 0)];
        assert!(Tokenizer::from_ranks(dup, &HashMap::new()).is_err());
        let gap = vec![(b"a".to_vec(), 0), (b"b".to_vec(), 2)];
        assert!(Tokenizer::from_ranks(gap, &HashMap::new()).is_err());
    }

    #[test]
    fn loads_from_dir_with_config_names() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tiktoken.model"), tiny_model_text()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"added_tokens_decoder":{"263":{"content":"[EOS]","special":true}}}"#,
        )
        .unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.special_id("[EOS]"), Some(263));
        std::fs::write(dir.path().join("tiktoken.model"), "aGk= 0\nnot base64 at all\n").unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(dir.path()).err().unwrap());
        assert!(err.contains("tiktoken.model") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn kimi_pattern_splits_tricky_text() {
        let cases: &[(&str, &[&str])] = &[
            ("Hello world", &["Hello", " world"]),
            // Contractions attach to the word, case-insensitively.
            ("I'm they'RE don't", &["I'm", " they'RE", " don't"]),
            // Digits in groups of at most three; a sign is its own punctuation piece.
            ("12345 -7", &["123", "45", " -", "7"]),
            // Han runs stand alone; letters after Han are a new piece.
            ("你好世界abc", &["你好世界", "abc"]),
            ("東京タワー", &["東京", "タワー"]),
            // CamelCase: an uppercase run then lowercase letters form one piece (alternative 2).
            ("HTTPServer", &["HTTPServer"]),
            // Whitespace before newlines goes with them; a space run keeps its last space for the word.
            ("a  \n\n  b", &["a", "  \n\n", " ", " b"]),
            ("x   y", &["x", "  ", " y"]),
            // Punctuation absorbs following newlines.
            ("end.\n\nNext", &["end", ".\n\n", "Next"]),
            // Trailing whitespace at end of text: one piece.
            ("tab\t\t", &["tab", "\t\t"]),
            // Accented letters are letters; a leading punctuation char joins the word.
            ("(café)", &["(café", ")"]),
        ];
        for (text, want) in cases {
            assert_eq!(pretokenize(text), *want, "splitting {text:?}");
        }
    }

    #[test]
    fn chunking_bounds_runs_and_chunks() {
        // Runs longer than 3 are cut; a change of kind resets the count.
        assert_eq!(split_for_encoding("aaaaaaa  bb", 100, 3), vec!["aaa", "aaa", "a  bb"]);
        assert_eq!(split_for_encoding("     x", 100, 2), vec!["  ", "  ", " x"]);
        // Chunks count characters, not bytes.
        assert_eq!(split_for_encoding("你好世界", 3, 100), vec!["你好世", "界"]);
        assert_eq!(split_for_encoding("", 3, 3), vec![""]);
        // U+001F counts as whitespace, as in Python.
        assert_eq!(
            split_for_encoding("\u{1f}\u{1f}\u{1f}", 100, 2),
            vec!["\u{1f}\u{1f}", "\u{1f}"]
        );
    }
}

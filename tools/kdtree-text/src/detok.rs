//! Incremental detokenisation that never splits a UTF-8 character, and stop-string matching on top.
//!
//! [`Detokenizer`] buffers token bytes and releases only complete UTF-8 (invalid bytes become
//! U+FFFD as soon as they are known to be invalid); [`StopMatcher`] accumulates the released text
//! and reports the first stop string, so the run loop can cut the text there (OpenAI `stop`
//! semantics: the stop string itself is not part of the output). Tests: bottom of this file.

/// Bytes in, complete UTF-8 text out.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append one token's bytes; return the text that became complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 just said this prefix is valid.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Bytes held back because they do not yet form a complete character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// End of stream: release what is left (an incomplete sequence becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Accumulates decoded text and finds the earliest stop string.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    hit: Option<usize>,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any output).
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self {
            stops,
            text: String::new(),
            hit: None,
        }
    }

    /// Append newly decoded text; returns true once a stop string has appeared.
    pub fn push(&mut self, s: &str) -> bool {
        if self.hit.is_some() {
            return true;
        }
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A new match must end inside `s`, so it starts at most `longest - 1` bytes before it.
        let mut from = self.text.len().saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(s);
        self.hit = self
            .stops
            .iter()
            .filter_map(|stop| self.text[from..].find(stop.as_str()).map(|i| from + i))
            .min();
        self.hit.is_some()
    }

    /// The text so far, cut before the stop string when one was found.
    pub fn text(&self) -> &str {
        &self.text[..self.hit.unwrap_or(self.text.len())]
    }

    pub fn stopped(&self) -> bool {
        self.hit.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multibyte_characters_are_never_split() {
        let mut d = Detokenizer::new();
        let bytes = "a你b".as_bytes(); // 你 = e4 bd a0
        assert_eq!(d.push(&bytes[..2]), "a");
        assert_eq!(d.pending(), &[0xe4]);
        assert_eq!(d.push(&bytes[2..3]), "");
        assert_eq!(d.push(&bytes[3..]), "你b");
        assert!(d.pending().is_empty());
        // Invalid bytes are replaced once known invalid; a trailing partial becomes U+FFFD at finish.
        assert_eq!(d.push(&[0xff, b'x', 0xe4, 0xbd]), "\u{fffd}x");
        assert_eq!(d.finish(), "\u{fffd}");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn stop_strings_cut_text_even_across_pushes() {
        let mut m = StopMatcher::new(&["END".to_string(), String::new()]);
        assert!(!m.push("abc E"));
        assert!(!m.push("N"));
        assert!(m.push("Dxyz"));
        assert_eq!(m.text(), "abc ");
        // Earliest of several stops wins; multibyte text before a stop.
        let mut m = StopMatcher::new(&["世界".to_string(), "界!".to_string()]);
        assert!(!m.push("你好世"));
        assert!(m.push("界!"));
        assert_eq!(m.text(), "你好");
        let mut m = StopMatcher::new(&[]);
        assert!(!m.push("anything"));
        assert_eq!(m.text(), "anything");
    }
}

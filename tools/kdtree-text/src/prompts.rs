//! Prompt files: JSONL, one request per line, its kind detected per line:
//!
//! * `{"id", "prompt": "..."}`: raw text, tokenised as is;
//! * `{"id", "messages": [...]}`: rendered with the chat template (`thinking`, `preserve_thinking`,
//!   `tools` per line, else the run's defaults);
//! * `{"id", "prompt_token_ids": [...]}`: bypasses the tokenizer;
//! * OpenAI batch lines `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`
//!   with `body.messages` and optional model, max_tokens | max_completion_tokens, temperature, top_p,
//!   top_k, seed, stop, tools, chat_template_kwargs {thinking, preserve_thinking}.
//!
//! Plain lines take the same optional max_tokens, temperature, top_p, top_k, seed, stop (string or
//! list) and override the run's defaults. The whole file is validated before any work: every
//! non-blank line becomes one [`PromptLine`] whose `request` is `Ok` or a [`LineError`] (bytes that are
//! not UTF-8, malformed JSON, unknown field, wrong type, non-finite or out-of-range number, empty
//! prompt, duplicate id), so bad lines get error records while the others still run.
//!
//! Ids: a line without an id we can read gets the synthetic id `line-N` (N = its line number), or
//! `line-N~2`, `line-N~3`, ... when the file uses that id itself: a synthetic id never equals any id of
//! the file, so no two records share an id except a `duplicate_id` error, which repeats the user's id on
//! purpose. Tests: bottom of this file.

use serde_json::{Map, Value as Json};

#[cfg(test)]
mod limits_tests;
mod messages;
mod read;

use messages::chat_input;
pub use read::read_prompt_file;

/// One non-blank line of a prompt file.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLine {
    /// 1-based line number in the file.
    pub line_no: usize,
    /// `id` / `custom_id`; synthetic (`line-N`, see the module doc) when the line has none we can read.
    pub id: String,
    /// `id` was made up by [`parse_prompts`] (the line has no readable id).
    pub synthetic: bool,
    /// The line as read (bytes that are not UTF-8 replaced by U+FFFD), for fingerprints of the request.
    pub raw: String,
    /// The line is an OpenAI batch request (its output uses the batch output envelope).
    pub openai: bool,
    pub request: Result<Request, LineError>,
}

/// What to feed the model.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Text(String),
    Chat {
        messages: Json,
        tools: Option<Json>,
        thinking: Option<bool>,
        preserve_thinking: Option<bool>,
    },
    TokenIds(Vec<u32>),
}

/// Per-line settings; `None` = the run's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
}

/// A valid request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub input: Input,
    pub overrides: Overrides,
    /// OpenAI `body.model`, echoed in the output.
    pub model: Option<String>,
}

/// Why a line cannot run; becomes that line's error record.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line_no}: {message}")]
pub struct LineError {
    pub line_no: usize,
    /// Machine-readable: `invalid_utf8`, `invalid_json`, `invalid_request`, `empty_prompt`, `duplicate_id`.
    pub code: &'static str,
    pub message: String,
}

/// Largest prompt line: 16 MiB (a 256k-token context is ~1 MiB of text, ~2 MiB as token ids).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Largest prompt file: 256 MiB (OpenAI's batch API takes 200 MB).
pub const MAX_FILE_BYTES: usize = 256 << 20;

/// Largest `max_tokens` a flag or a line may ask for: 2^20, beyond every context a model of this project
/// holds (K2.6: 262,144 positions; a run stops at the context anyway).
pub const MAX_TOKENS_LIMIT: u64 = 1 << 20;

/// Largest `top_k` a flag or a line may ask for: 2^20, beyond every vocabulary (K2.6: 163,840).
pub const MAX_TOP_K: u64 = 1 << 20;

/// Largest number of `stop` strings a line may give.
pub const MAX_STOP_STRINGS: usize = 64;

/// [`parse_prompt_bytes`] of text.
pub fn parse_prompts(text: &str) -> Vec<PromptLine> {
    parse_prompt_bytes(text.as_bytes())
}

/// Validate every non-blank line (`\n` or `\r\n` ends a line); a line that is not UTF-8 is that line's
/// `invalid_utf8` error. Ids must be unique (a repeat is an error on the later line); synthetic ids are
/// then chosen so that they collide with no id of the file.
pub fn parse_prompt_bytes(bytes: &[u8]) -> Vec<PromptLine> {
    let mut out = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let line_no = i + 1;
        match std::str::from_utf8(raw) {
            Ok(text) if text.trim().is_empty() => {}
            Ok(text) => out.push(parse_line(line_no, text)),
            Err(e) => {
                let at = e.valid_up_to();
                let message = format!("not valid UTF-8: byte 0x{:02x} at column {}", raw[at], at + 1);
                out.push(PromptLine {
                    line_no,
                    id: synthetic_id(line_no),
                    synthetic: true,
                    openai: false,
                    raw: String::from_utf8_lossy(raw).into_owned(),
                    request: Err(LineError {
                        line_no,
                        code: "invalid_utf8",
                        message,
                    }),
                });
            }
        }
    }
    let mut seen = std::collections::HashMap::<String, usize>::new();
    for line in out.iter_mut().filter(|l| !l.synthetic) {
        if let Some(first) = seen.get(&line.id) {
            let message = format!("id {:?} repeats line {first}", line.id);
            line.request = Err(LineError {
                line_no: line.line_no,
                code: "duplicate_id",
                message,
            });
        } else {
            seen.insert(line.id.clone(), line.line_no);
        }
    }
    for line in out.iter_mut().filter(|l| l.synthetic) {
        let base = synthetic_id(line.line_no);
        let id = std::iter::once(base.clone())
            .chain((2..).map(|k| format!("{base}~{k}")))
            .find(|id| !seen.contains_key(id))
            .expect("an unused suffix exists");
        seen.insert(id.clone(), line.line_no);
        line.id = id;
    }
    out
}

fn synthetic_id(line_no: usize) -> String {
    format!("line-{line_no}")
}

/// The range a temperature must lie in, for flags and lines alike (Err: the range, for a message that
/// also shows the value as the user gave it: 1e308 is inf as an f32).
pub fn check_temperature(t: f32) -> Result<(), String> {
    if t.is_finite() && (0.0..=100.0).contains(&t) {
        Ok(())
    } else {
        Err("must be a finite number in [0, 100]".into())
    }
}

/// The range a nucleus mass must lie in, for flags and lines alike (Err: the range, as
/// [`check_temperature`]).
pub fn check_top_p(p: f32) -> Result<(), String> {
    if p.is_finite() && p > 0.0 && p <= 1.0 {
        Ok(())
    } else {
        Err("must be a finite number in (0, 1]".into())
    }
}

/// Parse one line; never fails as a whole. A line without a readable id gets `line-N` here;
/// [`parse_prompt_bytes`] makes such ids unique within the file.
pub fn parse_line(line_no: usize, raw: &str) -> PromptLine {
    let fail = |id: Option<String>, openai: bool, code: &'static str, message: String| PromptLine {
        line_no,
        synthetic: id.is_none(),
        id: id.unwrap_or_else(|| synthetic_id(line_no)),
        openai,
        raw: raw.to_string(),
        request: Err(LineError { line_no, code, message }),
    };
    if line_no == 1 && raw.starts_with('\u{feff}') {
        // Not JSON (so no readable id): named as what it is rather than "expected value at column 1".
        let msg = "starts with a UTF-8 byte order mark (BOM, bytes EF BB BF): save the file as UTF-8 without a BOM";
        return fail(None, false, "invalid_json", msg.into());
    }
    let obj = match serde_json::from_str::<Json>(raw) {
        Ok(Json::Object(o)) => o,
        Ok(_) => return fail(None, false, "invalid_json", "expected a JSON object".into()),
        Err(e) => return fail(None, false, "invalid_json", format!("not valid JSON: {e}")),
    };
    let openai = obj.contains_key("custom_id");
    let id_key = if openai { "custom_id" } else { "id" };
    let id = match obj.get(id_key) {
        Some(Json::String(s)) if !s.is_empty() => s.clone(),
        Some(Json::Number(n)) => n.to_string(),
        _ => {
            let msg = format!("missing or empty \"{id_key}\" (a string)");
            return fail(None, openai, "invalid_request", msg);
        }
    };
    let parsed = if openai { parse_openai(&obj) } else { parse_plain(&obj) };
    match parsed {
        Ok(request) => PromptLine {
            line_no,
            id,
            synthetic: false,
            openai,
            raw: raw.to_string(),
            request: Ok(request),
        },
        Err((code, message)) => fail(Some(id), openai, code, message),
    }
}

type Fail = (&'static str, String);

fn invalid(msg: impl Into<String>) -> Fail {
    ("invalid_request", msg.into())
}

fn parse_plain(obj: &Map<String, Json>) -> Result<Request, Fail> {
    const KNOWN: &[&str] = &[
        "id",
        "prompt",
        "messages",
        "prompt_token_ids",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "thinking",
        "preserve_thinking",
        "tools",
    ];
    reject_unknown(obj, KNOWN, "")?;
    let kinds: Vec<&str> = ["prompt", "messages", "prompt_token_ids"]
        .into_iter()
        .filter(|k| obj.contains_key(*k))
        .collect();
    let input = match kinds.as_slice() {
        ["prompt"] => match &obj["prompt"] {
            Json::String(s) if s.is_empty() => return Err(("empty_prompt", "\"prompt\" is empty".into())),
            Json::String(s) => Input::Text(s.clone()),
            _ => return Err(invalid("\"prompt\" must be a string")),
        },
        ["messages"] => chat_input(obj, obj.get("thinking"), obj.get("preserve_thinking"), "")?,
        ["prompt_token_ids"] => {
            let Json::Array(ids) = &obj["prompt_token_ids"] else {
                return Err(invalid("\"prompt_token_ids\" must be an array of token ids"));
            };
            if ids.is_empty() {
                return Err(("empty_prompt", "\"prompt_token_ids\" is empty".into()));
            }
            let ids: Option<Vec<u32>> = ids
                .iter()
                .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect();
            Input::TokenIds(ids.ok_or_else(|| invalid("\"prompt_token_ids\" must hold integers in 0..2^32"))?)
        }
        [] => return Err(invalid("needs one of \"prompt\", \"messages\", \"prompt_token_ids\"")),
        more => return Err(invalid(format!("has more than one prompt kind: {more:?}"))),
    };
    let overrides = overrides(obj, "max_tokens", "")?;
    Ok(Request {
        input,
        overrides,
        model: None,
    })
}

fn parse_openai(obj: &Map<String, Json>) -> Result<Request, Fail> {
    reject_unknown(obj, &["custom_id", "method", "url", "body"], "")?;
    match obj.get("method") {
        Some(Json::String(m)) if m == "POST" => {}
        other => return Err(invalid(format!("\"method\" must be \"POST\", found {}", show(other)))),
    }
    match obj.get("url") {
        Some(Json::String(u)) if u == "/v1/chat/completions" => {}
        other => {
            return Err(invalid(format!(
                "\"url\" must be \"/v1/chat/completions\", found {}",
                show(other)
            )))
        }
    }
    let Some(Json::Object(body)) = obj.get("body") else {
        return Err(invalid("\"body\" must be an object"));
    };
    const KNOWN: &[&str] = &[
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "tools",
        "chat_template_kwargs",
        "n",
        "stream",
    ];
    reject_unknown(body, KNOWN, "body.")?;
    if body.get("n").is_some_and(|n| n.as_u64() != Some(1)) {
        return Err(invalid("body.n must be 1"));
    }
    if body.get("stream").is_some_and(|s| s.as_bool() != Some(false)) {
        return Err(invalid("body.stream must be false"));
    }
    let kwargs = match body.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Json::Object(m)) => m.clone(),
        Some(_) => return Err(invalid("body.chat_template_kwargs must be an object")),
    };
    if !body.contains_key("messages") {
        return Err(invalid("body.messages is required"));
    }
    let input = chat_input(body, kwargs.get("thinking"), kwargs.get("preserve_thinking"), "body.")?;
    let max_key = if body.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    if body.contains_key("max_completion_tokens") && body.contains_key("max_tokens") {
        return Err(invalid("give body.max_tokens or body.max_completion_tokens, not both"));
    }
    let overrides = overrides(body, max_key, "body.")?;
    let model = match body.get("model") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(_) => return Err(invalid("body.model must be a string")),
    };
    Ok(Request {
        input,
        overrides,
        model,
    })
}

fn show(v: Option<&Json>) -> String {
    v.map_or("nothing".to_string(), Json::to_string)
}

fn reject_unknown(obj: &Map<String, Json>, known: &[&str], prefix: &str) -> Result<(), Fail> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(invalid(format!("unknown field \"{prefix}{k}\""))),
        None => Ok(()),
    }
}

fn overrides(obj: &Map<String, Json>, max_key: &str, prefix: &str) -> Result<Overrides, Fail> {
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let uint = |k: &str| -> Result<Option<u64>, Fail> {
        get(k)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| invalid(format!("\"{prefix}{k}\" must be a non-negative integer")))
            })
            .transpose()
    };
    // Checked after the cast to f32, so a finite JSON number beyond f32 (1e39 -> inf) is refused too.
    let float = |k: &str, check: fn(f32) -> Result<(), String>| -> Result<Option<f32>, Fail> {
        let Some(v) = get(k) else { return Ok(None) };
        let x = v
            .as_f64()
            .ok_or_else(|| invalid(format!("\"{prefix}{k}\" must be a number")))? as f32;
        check(x).map_err(|e| invalid(format!("\"{prefix}{k}\" {e}, got {v}")))?;
        Ok(Some(x))
    };
    // Sizes are bounded here, before anything is allocated for them.
    let bounded = |k: &str, max: u64| -> Result<Option<usize>, Fail> {
        match uint(k)? {
            Some(x) if x > max => Err(invalid(format!("\"{prefix}{k}\" is {x}; at most {max}"))),
            x => Ok(x.map(|x| x as usize)),
        }
    };
    let max_tokens = bounded(max_key, MAX_TOKENS_LIMIT)?;
    if max_tokens == Some(0) {
        return Err(invalid(format!("\"{prefix}{max_key}\" must be at least 1")));
    }
    let temperature = float("temperature", check_temperature)?;
    let top_p = float("top_p", check_top_p)?;
    let stop = match get("stop") {
        None => None,
        Some(Json::String(s)) => Some(vec![s.clone()]),
        Some(Json::Array(a)) => Some(
            a.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| invalid(format!("\"{prefix}stop\" must be a string or a list of strings")))?,
        ),
        Some(_) => {
            return Err(invalid(format!(
                "\"{prefix}stop\" must be a string or a list of strings"
            )))
        }
    };
    if let Some(n) = stop.as_ref().map(Vec::len).filter(|&n| n > MAX_STOP_STRINGS) {
        return Err(invalid(format!(
            "\"{prefix}stop\" has {n} strings; at most {MAX_STOP_STRINGS}"
        )));
    }
    Ok(Overrides {
        max_tokens,
        temperature,
        top_p,
        top_k: bounded("top_k", MAX_TOP_K)?,
        seed: uint("seed")?,
        stop,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_each_kind_and_overrides() {
        let text = concat!(
            r#"{"id":"a","prompt":"Hi","max_tokens":5,"temperature":0,"seed":7,"stop":"x"}"#,
            "\n",
            "\n",
            r#"{"id":"b","messages":[{"role":"user","content":"Hi"}],"thinking":false}"#,
            "\n",
            r#"{"id":"c","prompt_token_ids":[1,2,3],"top_k":4,"top_p":0.5}"#,
            "\n",
            r#"{"custom_id":"d","method":"POST","url":"/v1/chat/completions","body":{"model":"m","#,
            r#""messages":[{"role":"user","content":"Yo"}],"max_completion_tokens":9,"stop":["s","t"],"#,
            r#""chat_template_kwargs":{"thinking":true}}}"#,
            "\n",
        );
        let lines = parse_prompts(text);
        assert_eq!(lines.len(), 4);
        assert_eq!(lines.iter().map(|l| l.line_no).collect::<Vec<_>>(), vec![1, 3, 4, 5]);
        let a = lines[0].request.as_ref().unwrap();
        assert_eq!(a.input, Input::Text("Hi".into()));
        assert_eq!(
            a.overrides,
            Overrides {
                max_tokens: Some(5),
                temperature: Some(0.0),
                seed: Some(7),
                stop: Some(vec!["x".into()]),
                ..Default::default()
            }
        );
        let Input::Chat { thinking, .. } = &lines[1].request.as_ref().unwrap().input else {
            panic!()
        };
        assert_eq!(*thinking, Some(false));
        let c = lines[2].request.as_ref().unwrap();
        assert_eq!(c.input, Input::TokenIds(vec![1, 2, 3]));
        assert_eq!((c.overrides.top_k, c.overrides.top_p), (Some(4), Some(0.5)));
        let d = &lines[3];
        assert!(d.openai);
        assert_eq!(d.id, "d");
        let d = d.request.as_ref().unwrap();
        assert_eq!(d.model.as_deref(), Some("m"));
        assert_eq!(d.overrides.max_tokens, Some(9));
        assert_eq!(d.overrides.stop, Some(vec!["s".into(), "t".into()]));
        let Input::Chat { thinking, messages, .. } = &d.input else {
            panic!()
        };
        assert_eq!(
            (*thinking, messages),
            (Some(true), &json!([{"role":"user","content":"Yo"}]))
        );
    }

    #[test]
    fn bad_lines_become_per_line_errors() {
        let text = concat!(
            "{not json\n",
            r#"{"id":"e","prompt":""}"#,
            "\n",
            r#"{"id":"f","prompt":"x","max_tokens":"ten"}"#,
            "\n",
            r#"{"id":"g","prompt":"x","max_token":3}"#,
            "\n",
            r#"{"id":"ok","prompt":"fine"}"#,
            "\n",
            r#"{"id":"ok","prompt":"again"}"#,
            "\n",
            r#"{"prompt":"no id"}"#,
            "\n",
            r#"{"id":"h","prompt":"x","messages":[]}"#,
            "\n",
            r#"{"id":"i","messages":[]}"#,
            "\n",
            r#"{"id":"j","prompt_token_ids":[1,-2]}"#,
            "\n",
            r#"{"custom_id":"k","method":"POST","url":"/v1/embeddings","body":{"messages":[{"role":"user"}]}}"#,
            "\n",
            r#"{"custom_id":"l","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","#,
            r#""content":"x"}],"n":2}}"#,
            "\n",
            "[1,2]\n",
        );
        let lines = parse_prompts(text);
        let summary: Vec<(usize, &str, &str)> = lines
            .iter()
            .map(|l| {
                (
                    l.line_no,
                    l.id.as_str(),
                    l.request.as_ref().err().map_or("ok", |e| e.code),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (1, "line-1", "invalid_json"),
                (2, "e", "empty_prompt"),
                (3, "f", "invalid_request"),
                (4, "g", "invalid_request"),
                (5, "ok", "ok"),
                (6, "ok", "duplicate_id"),
                (7, "line-7", "invalid_request"),
                (8, "h", "invalid_request"),
                (9, "i", "empty_prompt"),
                (10, "j", "invalid_request"),
                (11, "k", "invalid_request"),
                (12, "l", "invalid_request"),
                (13, "line-13", "invalid_json"),
            ]
        );
        let e = lines[3].request.as_ref().unwrap_err();
        assert_eq!(e.to_string(), "line 4: unknown field \"max_token\"");
        assert!(lines[10].openai && lines[11].openai && !lines[0].openai);
    }

    #[test]
    fn a_non_utf8_byte_fails_only_its_line() {
        let mut bytes = b"{\"id\":\"a\",\"prompt\":\"x\"}\r\n".to_vec();
        bytes.extend_from_slice(b"{\"id\":\"b\",\"prompt\":\"caf\xe9\"}\n");
        bytes.extend_from_slice(b"{\"id\":\"c\",\"prompt\":\"y\"}");
        let lines = parse_prompt_bytes(&bytes);
        let ids: Vec<&str> = lines.iter().map(|l| l.id.as_str()).collect();
        assert_eq!(ids, ["a", "line-2", "c"]);
        assert!(lines[0].request.is_ok() && lines[2].request.is_ok());
        let e = lines[1].request.as_ref().unwrap_err();
        assert_eq!((e.code, e.line_no), ("invalid_utf8", 2));
        assert_eq!(e.to_string(), "line 2: not valid UTF-8: byte 0xe9 at column 24");
        assert!(lines[1].raw.contains('\u{fffd}'));
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_ids_stay_unique_apart_from_duplicates() {
        // Seeded LCG: lines of random bytes mixed with JSON fragments and colliding ids.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as usize
        };
        let pieces: [&[u8]; 8] = [
            b"{\"id\":\"line-",
            b"\"}",
            b"\xff",
            b"\xe2\x82",
            b"\n",
            b"\r\n",
            b"{\"prompt\":\"x\"}",
            b"3",
        ];
        for _ in 0..300 {
            let mut bytes = Vec::new();
            for _ in 0..next() % 40 {
                if next() % 3 == 0 {
                    bytes.push((next() % 256) as u8);
                } else {
                    bytes.extend_from_slice(pieces[next() % pieces.len()]);
                }
            }
            let lines = parse_prompt_bytes(&bytes);
            let mut ids = std::collections::HashSet::new();
            for l in &lines {
                let dup = l.request.as_ref().is_err_and(|e| e.code == "duplicate_id");
                assert!(ids.insert(l.id.clone()) || dup, "id {:?} twice in {bytes:?}", l.id);
            }
        }
    }

    #[test]
    fn synthetic_ids_never_collide_with_the_files_ids() {
        let text = concat!(
            "not json\n",
            r#"{"id":"line-1","prompt":"x"}"#,
            "\n",
            r#"{"id":"line-1~2","prompt":"x"}"#,
            "\n",
            r#"{"prompt":"no id"}"#,
            "\n",
            r#"{"id":"line-4","prompt":"x"}"#,
            "\n",
            r#"{"id":"line-6","prompt":"x"}"#,
            "\n",
        );
        let lines = parse_prompts(text);
        let ids: Vec<&str> = lines.iter().map(|l| l.id.as_str()).collect();
        assert_eq!(ids, ["line-1~3", "line-1", "line-1~2", "line-4~2", "line-4", "line-6"]);
        assert!(lines[1].request.is_ok() && lines[4].request.is_ok() && lines[5].request.is_ok());
        assert!(lines[0].synthetic && lines[3].synthetic && !lines[1].synthetic);
        // Deterministic: the same file gives the same ids.
        assert_eq!(parse_prompts(text), lines);
    }

    #[test]
    fn non_finite_and_out_of_range_numbers_are_refused() {
        for (field, value) in [
            ("temperature", "1e39"),
            ("temperature", "-1"),
            ("temperature", "101"),
            ("top_p", "1e39"),
            ("top_p", "0"),
            ("top_p", "-1e39"),
        ] {
            let line = parse_line(1, &format!(r#"{{"id":"a","prompt":"x","{field}":{value}}}"#));
            let e = line.request.unwrap_err();
            assert_eq!(e.code, "invalid_request", "{field}={value}");
            assert!(
                e.message.contains(field) && e.message.contains("finite"),
                "{field}={value}: {e}"
            );
        }
        // JSON has no inf/nan literals: such a line is not JSON.
        assert_eq!(
            parse_line(1, r#"{"id":"a","prompt":"x","temperature":NaN}"#)
                .request
                .unwrap_err()
                .code,
            "invalid_json"
        );
        assert!(check_temperature(f32::INFINITY).is_err() && check_temperature(f32::NAN).is_err());
        assert!(check_top_p(f32::NAN).is_err() && check_top_p(1.0).is_ok() && check_temperature(0.0).is_ok());
    }
}

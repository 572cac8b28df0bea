//! Fuzz target `prompts`: bytes as a prompt file through `parse_prompt_bytes` (plain, chat, token-id and
//! OpenAI batch lines). Contract (docs/fuzzing.md): never a panic; one entry per non-blank line, in order,
//! with the line's bytes as `raw`; ids unique except a `duplicate_id` error; each line parses alone to
//! the same request; every accepted request obeys the documented bounds; and an accepted request written
//! back as a line (plain or OpenAI form) parses to the same request, id and kind (round trip).
#![no_main]

use kdtree_text::prompts::{check_temperature, check_top_p, parse_line, parse_prompt_bytes, Input, Request};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value as Json};
use std::collections::HashSet;

fuzz_target!(|data: &[u8]| {
    let lines = parse_prompt_bytes(data);
    let raws: Vec<&[u8]> = data
        .split(|&b| b == b'\n')
        .map(|r| r.strip_suffix(b"\r").unwrap_or(r))
        .collect();
    let non_blank: Vec<usize> = raws
        .iter()
        .enumerate()
        .filter(|(_, r)| std::str::from_utf8(r).map_or(true, |t| !t.trim().is_empty()))
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(lines.iter().map(|l| l.line_no).collect::<Vec<_>>(), non_blank);
    let mut ids = HashSet::new();
    for l in &lines {
        let raw = raws[l.line_no - 1];
        assert_eq!(l.raw, String::from_utf8_lossy(raw), "line {}", l.line_no);
        let dup = l.request.as_ref().is_err_and(|e| e.code == "duplicate_id");
        assert!(ids.insert(l.id.clone()) || dup, "id {:?} twice", l.id);
        if let Err(e) = &l.request {
            assert_eq!(e.line_no, l.line_no);
        }
        let Ok(text) = std::str::from_utf8(raw) else {
            assert!(l.synthetic && l.request.as_ref().is_err_and(|e| e.code == "invalid_utf8"));
            continue;
        };
        // The line alone: the same request (ids may differ: synthetic suffixes, duplicates).
        let alone = parse_line(l.line_no, text);
        assert_eq!((alone.openai, &alone.raw), (l.openai, &l.raw));
        if !dup {
            assert_eq!(alone.request, l.request, "line {}", l.line_no);
            if !l.synthetic {
                assert_eq!(alone.id, l.id);
            }
        }
        if let Ok(r) = &l.request {
            assert!(!l.synthetic);
            check_bounds(r);
            let line = write_line(&l.id, l.openai, r);
            let back = parse_line(l.line_no, &line);
            assert_eq!(back.request.as_ref(), Ok(r), "round trip of line {}: {line}", l.line_no);
            assert_eq!((back.id.as_str(), back.openai), (l.id.as_str(), l.openai), "{line}");
        }
    }
});

fn check_bounds(r: &Request) {
    match &r.input {
        Input::Text(s) => assert!(!s.is_empty()),
        Input::TokenIds(ids) => assert!(!ids.is_empty()),
        Input::Chat { messages, tools, .. } => {
            let msgs = messages.as_array().expect("messages is an array");
            assert!(!msgs.is_empty());
            assert!(msgs.iter().all(|m| m.get("role").is_some_and(Json::is_string)));
            assert!(tools.as_ref().is_none_or(Json::is_array));
        }
    }
    let o = &r.overrides;
    assert_ne!(o.max_tokens, Some(0));
    assert!(o.temperature.is_none_or(|t| check_temperature(t).is_ok()));
    assert!(o.top_p.is_none_or(|p| check_top_p(p).is_ok()));
}

/// The request as a prompt-file line: the plain form, or the OpenAI batch form for an OpenAI line.
fn write_line(id: &str, openai: bool, r: &Request) -> String {
    let mut o = Map::new();
    match &r.input {
        Input::Text(s) => {
            o.insert("prompt".into(), json!(s));
        }
        Input::TokenIds(ids) => {
            o.insert("prompt_token_ids".into(), json!(ids));
        }
        Input::Chat {
            messages,
            tools,
            thinking,
            preserve_thinking,
        } => {
            o.insert("messages".into(), messages.clone());
            if let Some(t) = tools {
                o.insert("tools".into(), t.clone());
            }
            let mut flags = Map::new();
            if let Some(t) = thinking {
                flags.insert("thinking".into(), json!(t));
            }
            if let Some(p) = preserve_thinking {
                flags.insert("preserve_thinking".into(), json!(p));
            }
            if openai {
                o.insert("chat_template_kwargs".into(), Json::Object(flags));
            } else {
                o.extend(flags);
            }
        }
    }
    let v = &r.overrides;
    let put = |o: &mut Map<String, Json>, k: &str, x: Option<Json>| {
        if let Some(x) = x {
            o.insert(k.into(), x);
        }
    };
    put(&mut o, "max_tokens", v.max_tokens.map(|x| json!(x)));
    put(&mut o, "temperature", v.temperature.map(|x| json!(x)));
    put(&mut o, "top_p", v.top_p.map(|x| json!(x)));
    put(&mut o, "top_k", v.top_k.map(|x| json!(x)));
    put(&mut o, "seed", v.seed.map(|x| json!(x)));
    put(&mut o, "stop", v.stop.as_ref().map(|x| json!(x)));
    let line = if openai {
        put(&mut o, "model", r.model.as_ref().map(|x| json!(x)));
        json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions", "body": o})
    } else {
        assert!(r.model.is_none());
        o.insert("id".into(), json!(id));
        Json::Object(o)
    };
    line.to_string()
}

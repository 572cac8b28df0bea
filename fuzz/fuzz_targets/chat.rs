//! Fuzz target `chat`: a prompt line (or a bare JSON array of messages) through `parse_line`, then the
//! chat request rendered with our K2.6-style template (`ChatTemplate::builtin`, the template synthetic
//! checkpoints and models/kdtree-tiny ship), as kdtree-run does. Contract (docs/fuzzing.md): never a
//! panic, `Ok` or `Err`; the same input renders the same text; with a generation prompt the text is the
//! text without one followed by exactly `<|im_assistant|>assistant<|im_middle|><think>` (thinking) or
//! `...<think></think>` (instant); every string content of a user or system message appears verbatim.
#![no_main]

use kdtree_text::chat::{ChatOptions, ChatTemplate};
use kdtree_text::prompts::{parse_line, Input};
use libfuzzer_sys::fuzz_target;
use serde_json::Value as Json;
use std::sync::OnceLock;

static TEMPLATE: OnceLock<ChatTemplate> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (messages, tools, thinking, preserve) = if text.trim_start().starts_with('[') {
        match serde_json::from_str::<Json>(text) {
            Ok(m @ Json::Array(_)) => (m, None, None, None),
            _ => return,
        }
    } else {
        let Ok(r) = parse_line(1, text).request else {
            return;
        };
        match r.input {
            Input::Chat {
                messages,
                tools,
                thinking,
                preserve_thinking,
            } => (messages, tools, thinking, preserve_thinking),
            _ => return,
        }
    };
    let t = TEMPLATE.get_or_init(ChatTemplate::builtin);
    let opts = ChatOptions {
        add_generation_prompt: true,
        thinking: thinking.unwrap_or(true),
        preserve_thinking: preserve.unwrap_or(false),
        tools,
    };
    let with = t.render(&messages, &opts);
    let again = t.render(&messages, &opts);
    assert_eq!(
        with.as_ref().map_err(|e| e.to_string()),
        again.as_ref().map_err(|e| e.to_string()),
        "not deterministic"
    );
    let without = t.render(
        &messages,
        &ChatOptions {
            add_generation_prompt: false,
            ..opts.clone()
        },
    );
    let (with, without) = match (with, without) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(_), Err(_)) => return,
        (a, b) => panic!("the generation prompt changes success: {a:?} vs {b:?}"),
    };
    let tail = if opts.thinking { "<think>" } else { "<think></think>" };
    assert_eq!(
        with,
        format!("{without}<|im_assistant|>assistant<|im_middle|>{tail}"),
        "generation prompt"
    );
    for m in messages.as_array().into_iter().flatten() {
        if let (Some("user" | "system"), Some(Json::String(c))) =
            (m.get("role").and_then(Json::as_str), m.get("content"))
        {
            assert!(with.contains(c.as_str()), "content {c:?} missing from {with:?}");
        }
    }
});

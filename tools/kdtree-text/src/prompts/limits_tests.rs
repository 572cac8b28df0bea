//! The bounds a line's sizes are held to, numbers shown as given, a byte order mark named (issue 29).

use super::*;

#[test]
fn sizes_a_line_asks_for_are_bounded() {
    let err = |extra: &str| {
        let line = format!(r#"{{"id":"a","prompt_token_ids":[1],{extra}}}"#);
        parse_line(3, &line)
            .request
            .map_or_else(|e| e.to_string(), |_| "ok".into())
    };
    assert_eq!(
        err(r#""max_tokens":1048577"#),
        "line 3: \"max_tokens\" is 1048577; at most 1048576"
    );
    assert_eq!(err(r#""max_tokens":1048576"#), "ok");
    assert_eq!(
        err(r#""top_k":1048577"#),
        "line 3: \"top_k\" is 1048577; at most 1048576"
    );
    assert_eq!(
        err(r#""top_k":18446744073709551615"#),
        "line 3: \"top_k\" is 18446744073709551615; at most 1048576"
    );
    let stops = |n: usize| (0..n).map(|i| format!("\"s{i}\"")).collect::<Vec<_>>().join(",");
    assert_eq!(err(&format!(r#""stop":[{}]"#, stops(64))), "ok");
    assert_eq!(
        err(&format!(r#""stop":[{}]"#, stops(65))),
        "line 3: \"stop\" has 65 strings; at most 64"
    );
    let openai = concat!(
        r#"{"custom_id":"o","method":"POST","url":"/v1/chat/completions","#,
        r#""body":{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":2000000}}"#
    );
    let e = parse_line(1, openai).request.unwrap_err();
    assert_eq!(e.message, "\"body.max_completion_tokens\" is 2000000; at most 1048576");
}

#[test]
fn numbers_are_shown_as_given_and_a_bom_is_named() {
    let e = parse_line(1, r#"{"id":"a","prompt":"x","temperature":1e308}"#)
        .request
        .unwrap_err();
    assert_eq!(
        e.message,
        "\"temperature\" must be a finite number in [0, 100], got 1e+308"
    );
    let lines = parse_prompt_bytes(b"\xef\xbb\xbf{\"id\":\"a\",\"prompt\":\"x\"}\n{\"id\":\"b\",\"prompt\":\"y\"}\n");
    let e = lines[0].request.as_ref().unwrap_err();
    assert_eq!((e.code, lines[0].id.as_str()), ("invalid_json", "line-1"));
    assert!(
        e.to_string()
            .starts_with("line 1: starts with a UTF-8 byte order mark (BOM"),
        "{e}"
    );
    assert!(lines[1].request.is_ok());
}

/// Each line parses alone as it does in its file (the fuzz target's contract), the BOM line too: the
/// BOM was once named only by the file parser, so line 1 alone read as "not valid JSON"
/// (now the seed fuzz/seeds/prompts/bom-line-alone-d8fac667).
#[test]
fn a_bom_line_parses_alone_as_in_its_file() {
    let text = "\u{feff}t json\r\u{2}{\"id\":\"e\",\"prompt\":\"\"}";
    let in_file = parse_prompt_bytes(format!("{text}\n{{\"id\":\"b\",\"prompt\":\"y\"}}\n").as_bytes());
    let alone = parse_line(1, text);
    assert_eq!(alone, in_file[0]);
    assert!(alone
        .request
        .unwrap_err()
        .message
        .starts_with("starts with a UTF-8 byte order mark"));
    // Past line 1 a BOM is just a character that is not JSON.
    let later = parse_line(2, text).request.unwrap_err();
    assert!(later.message.starts_with("not valid JSON"), "{}", later.message);
}

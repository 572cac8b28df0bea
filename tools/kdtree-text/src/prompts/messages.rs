//! The `messages` of a chat line: each an object with a string `role`, its `content` a string, null or a list
//! of text parts ([`check_content`]); the line's `tools`, `thinking` and `preserve_thinking`. Tests: bottom of
//! this file; tests/limits_cli.rs in kdtree-run.

use serde_json::{Map, Value as Json};

use super::{invalid, Fail, Input};

pub(super) fn chat_input(
    obj: &Map<String, Json>,
    thinking: Option<&Json>,
    preserve: Option<&Json>,
    prefix: &str,
) -> Result<Input, Fail> {
    let Some(Json::Array(msgs)) = obj.get("messages") else {
        return Err(invalid(format!("\"{prefix}messages\" must be an array")));
    };
    if msgs.is_empty() {
        return Err(("empty_prompt", format!("\"{prefix}messages\" is empty")));
    }
    for (i, m) in msgs.iter().enumerate() {
        if !m.get("role").is_some_and(Json::is_string) {
            return Err(invalid(format!("{prefix}messages[{i}] needs a string \"role\"")));
        }
        check_content(m.get("content"), &format!("{prefix}messages[{i}].content"))?;
    }
    let flag = |v: Option<&Json>, name: &str| match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(format!("\"{name}\" must be true or false"))),
    };
    let tools = match obj.get("tools") {
        None | Some(Json::Null) => None,
        Some(t @ Json::Array(_)) => Some(t.clone()),
        Some(_) => return Err(invalid(format!("\"{prefix}tools\" must be an array"))),
    };
    Ok(Input::Chat {
        messages: Json::Array(msgs.clone()),
        tools,
        thinking: flag(thinking, "thinking")?,
        preserve_thinking: flag(preserve, "preserve_thinking")?,
    })
}

/// A message's `content`: absent or null (an assistant turn with tool calls), a string, or a list of
/// `{"type": "text", "text": "..."}` parts. Anything else is refused rather than rendered as nothing (the
/// template skips what it cannot print); image, audio and file parts too: the runner has no encoder for
/// them, and the template's media placeholder alone would make the model answer about an image it never saw.
fn check_content(content: Option<&Json>, what: &str) -> Result<(), Fail> {
    let parts = match content {
        None | Some(Json::Null) | Some(Json::String(_)) => return Ok(()),
        Some(Json::Array(parts)) => parts,
        Some(other) => {
            return Err(invalid(format!(
                "{what} must be a string or a list of text parts, found {}",
                json_type(other)
            )))
        }
    };
    for (j, part) in parts.iter().enumerate() {
        match (part.get("type").and_then(Json::as_str), part.get("text")) {
            (Some("text"), Some(Json::String(_))) => {}
            (Some("text"), _) => return Err(invalid(format!("{what}[{j}] needs a string \"text\""))),
            (Some(t @ ("image_url" | "image" | "input_audio" | "audio" | "video" | "video_url" | "file")), _) => {
                return Err(invalid(format!(
                    "{what}[{j}] is an \"{t}\" part: only text parts are supported (kdtree-run has no image, audio \
                     or video encoder)"
                )))
            }
            (Some(t), _) => {
                return Err(invalid(format!(
                    "{what}[{j}] has unknown part type \"{t}\" (only \"text\")"
                )))
            }
            (None, _) => {
                return Err(invalid(format!(
                    "{what}[{j}] must be an object {{\"type\": \"text\", \"text\": ...}}, found {}",
                    json_type(part)
                )))
            }
        }
    }
    Ok(())
}

/// What a JSON value is, for messages ("the number 5", "an object").
fn json_type(v: &Json) -> String {
    match v {
        Json::Null => "null".into(),
        Json::Bool(b) => format!("the boolean {b}"),
        Json::Number(n) => format!("the number {n}"),
        Json::String(_) => "a string".into(),
        Json::Array(_) => "an array".into(),
        Json::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_line;

    fn error(content: &str) -> String {
        let line = format!(r#"{{"id":"a","messages":[{{"role":"user","content":{content}}}]}}"#);
        parse_line(7, &line)
            .request
            .map_or_else(|e| e.to_string(), |_| "ok".into())
    }

    #[test]
    fn content_of_another_type_and_media_parts_are_refused_naming_the_line() {
        assert_eq!(
            error("5"),
            "line 7: messages[0].content must be a string or a list of text parts, found the number 5"
        );
        assert!(error("true").contains("found the boolean true"));
        assert!(error(r#"{"text":"x"}"#).contains("found an object"));
        assert!(error(r#"["x"]"#)
            .contains("content[0] must be an object {\"type\": \"text\", \"text\": ...}, found a string"));
        assert!(error(r#"[{"type":"text"}]"#).contains("content[0] needs a string \"text\""));
        assert!(error(r#"[{"type":"image_url","image_url":{"url":"u"}}]"#)
            .starts_with("line 7: messages[0].content[0] is an \"image_url\" part: only text parts are supported"));
        assert!(error(r#"[{"type":"text","text":"a"},{"type":"input_audio"}]"#)
            .contains("content[1] is an \"input_audio\""));
        assert!(error(r#"[{"type":"thought","text":"a"}]"#).contains("unknown part type \"thought\""));
        for ok in ["\"hi\"", "null", r#"[{"type":"text","text":"a"}]"#, "[]"] {
            assert_eq!(error(ok), "ok", "{ok}");
        }
        // OpenAI lines name the body's field.
        let line = concat!(
            r#"{"custom_id":"b","method":"POST","url":"/v1/chat/completions","#,
            r#""body":{"messages":[{"role":"user","content":5}]}}"#
        );
        let e = parse_line(2, line).request.unwrap_err();
        assert!(e.message.starts_with("body.messages[0].content must be"), "{e}");
    }
}

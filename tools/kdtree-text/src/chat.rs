//! Chat template rendering: the model dir's `chat_template.jinja` (or tokenizer_config.json's
//! `chat_template`) rendered with minijinja under HF transformers' conventions: trim/lstrip blocks,
//! `raise_exception`, `tojson` as Python's `json.dumps` (", " / ": " separators, no ASCII escaping),
//! the common Python methods (`.get`, `.items`, `.startswith`, ...) and lists inside `namespace(...)`
//! that support `.append` / `.pop` (Kimi's templates queue tool-call ids that way).
//!
//! Kwargs passed to every template: messages, tools, add_generation_prompt, thinking,
//! preserve_thinking, and the tokenizer's bos/eos/unk/pad token strings when configured.
//! Tests: bottom of this file (exact instant-mode string of k26-format §6.4).

use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde_json::Value as Json;

const TEMPLATE_NAME: &str = "chat_template";

/// Options of one rendering (the HF `apply_chat_template` kwargs we support).
#[derive(Debug, Clone)]
pub struct ChatOptions {
    pub add_generation_prompt: bool,
    /// Kimi: `<think>` (true, default) or `<think></think>` (false) after the generation prompt.
    pub thinking: bool,
    /// K2.6: keep every earlier assistant turn's reasoning.
    pub preserve_thinking: bool,
    /// OpenAI-style tool declarations, if any.
    pub tools: Option<Json>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            thinking: true,
            preserve_thinking: false,
            tools: None,
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Special-token strings exposed to the template (`bos_token`, `eos_token`, ...).
    token_vars: serde_json::Map<String, Json>,
}

impl ChatTemplate {
    /// `dir/chat_template.jinja`, else `chat_template` of `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<Json> = if config_path.exists() {
            let raw =
                std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
            Some(serde_json::from_str(&raw).with_context(|| format!("parsing {}", config_path.display()))?)
        } else {
            None
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            std::fs::read_to_string(&jinja).with_context(|| format!("reading {}", jinja.display()))?
        } else {
            match config.as_ref().and_then(|c| c.get("chat_template")) {
                Some(Json::String(s)) => s.clone(),
                // HF also allows a list of named templates; take "default".
                Some(Json::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(str::to_string)
                    .with_context(|| format!("{}: no \"default\" chat template", config_path.display()))?,
                _ => bail!(
                    "{}: no chat_template.jinja and no chat_template in tokenizer_config.json",
                    dir.display()
                ),
            }
        };
        let mut t = Self::from_source(source).with_context(|| format!("chat template of {}", dir.display()))?;
        if let Some(config) = &config {
            for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
                let s = match config.get(key) {
                    Some(Json::String(s)) => Some(s.clone()),
                    Some(obj) => obj.get("content").and_then(Json::as_str).map(str::to_string),
                    None => None,
                };
                if let Some(s) = s {
                    t.token_vars.insert(key.to_string(), Json::String(s));
                }
            }
        }
        Ok(t)
    }

    /// Compile a template source.
    pub fn from_source(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("namespace", py_namespace);
        env.set_unknown_method_callback(py_method);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        Ok(Self {
            env,
            token_vars: serde_json::Map::new(),
        })
    }

    /// Our own K2.6-style template (assets/chat_template.jinja).
    pub fn builtin() -> Self {
        Self::from_source(crate::CHAT_TEMPLATE_JINJA.to_string()).expect("builtin template compiles")
    }

    /// Render `messages` (a JSON array of `{role, content, ...}`).
    pub fn render(&self, messages: &Json, opts: &ChatOptions) -> Result<String> {
        if !messages.is_array() {
            bail!("messages must be an array");
        }
        let mut ctx = self.token_vars.clone();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), opts.add_generation_prompt.into());
        ctx.insert("thinking".into(), opts.thinking.into());
        ctx.insert("preserve_thinking".into(), opts.preserve_thinking.into());
        if let Some(tools) = &opts.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).expect("added in from_source");
        tmpl.render(Json::Object(ctx))
            .map_err(|e| anyhow::anyhow!("rendering the chat template: {e:#}"))
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = indent.or(kwargs.get::<Option<usize>>("indent")?);
    kwargs.assert_all_used()?;
    let json =
        serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` layout: `, ` and `: ` without indent; `,` + newline and `: ` with one.
fn write_py_json(v: &Json, indent: Option<usize>, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                write_py_json(item, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(item, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A list with Python's mutating methods; `namespace(...)` turns its list arguments into these.
#[derive(Debug, Default)]
struct PyList(Mutex<Vec<Value>>);

impl Object for PyList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.0.lock().unwrap();
        let i = key.as_i64()?;
        let i = if i < 0 { items.len() as i64 + i } else { i };
        items.get(usize::try_from(i).ok()?).cloned()
    }
    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Iter(Box::new(self.0.lock().unwrap().clone().into_iter()))
    }
    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.lock().unwrap().len())
    }
    fn call_method(self: &Arc<Self>, _: &State<'_, '_>, method: &str, args: &[Value]) -> Result<Value, Error> {
        let mut items = self.0.lock().unwrap();
        match (method, args) {
            ("append", [v]) => {
                items.push(v.clone());
                Ok(Value::from(()))
            }
            ("pop", []) => items
                .pop()
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "pop from empty list")),
            ("pop", [i]) => {
                let i = i
                    .as_i64()
                    .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "pop index"))?;
                let i = if i < 0 { items.len() as i64 + i } else { i };
                match usize::try_from(i) {
                    Ok(i) if i < items.len() => Ok(items.remove(i)),
                    _ => Err(Error::new(ErrorKind::InvalidOperation, "pop index out of range")),
                }
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        }
    }
}

fn py_namespace(kwargs: Kwargs) -> Result<Value, Error> {
    let mut pairs = Vec::new();
    for key in kwargs.args() {
        let v: Value = kwargs.get(key)?;
        let v = match v.kind() {
            minijinja::value::ValueKind::Seq => Value::from_object(PyList(Mutex::new(v.try_iter()?.collect()))),
            _ => v,
        };
        pairs.push((key.to_string(), v));
    }
    kwargs.assert_all_used()?;
    minijinja::functions::namespace(Some(Value::from_iter(pairs)))
}

/// Python methods on plain values that HF templates call.
fn py_method(_: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    use minijinja::value::ValueKind;
    let bad = || Error::new(ErrorKind::InvalidOperation, format!("bad arguments to .{method}()"));
    match (value.kind(), method) {
        (ValueKind::Map, "get") => {
            let key = args.first().ok_or_else(bad)?;
            let v = value.get_item(key)?;
            Ok(if v.is_undefined() {
                args.get(1).cloned().unwrap_or(Value::from(()))
            } else {
                v
            })
        }
        (ValueKind::Map, "keys") => Ok(Value::from_iter(value.try_iter()?)),
        (ValueKind::Map, "values") => {
            let vals: Result<Vec<_>, _> = value.try_iter()?.map(|k| value.get_item(&k)).collect();
            Ok(Value::from(vals?))
        }
        (ValueKind::Map, "items") => {
            let pairs: Result<Vec<_>, Error> = value
                .try_iter()?
                .map(|k| Ok(Value::from(vec![k.clone(), value.get_item(&k)?])))
                .collect();
            Ok(Value::from(pairs?))
        }
        (ValueKind::String, _) => {
            let s = value.as_str().unwrap_or_default();
            let arg = |i: usize| args.get(i).and_then(|a| a.as_str());
            match method {
                "startswith" => Ok(Value::from(s.starts_with(arg(0).ok_or_else(bad)?))),
                "endswith" => Ok(Value::from(s.ends_with(arg(0).ok_or_else(bad)?))),
                "strip" => Ok(Value::from(match arg(0) {
                    Some(cs) => s.trim_matches(|c| cs.contains(c)),
                    None => s.trim(),
                })),
                "lstrip" => Ok(Value::from(match arg(0) {
                    Some(cs) => s.trim_start_matches(|c| cs.contains(c)),
                    None => s.trim_start(),
                })),
                "rstrip" => Ok(Value::from(match arg(0) {
                    Some(cs) => s.trim_end_matches(|c| cs.contains(c)),
                    None => s.trim_end(),
                })),
                "split" => Ok(match arg(0) {
                    Some(sep) => Value::from_iter(s.split(sep).map(Value::from)),
                    None => Value::from_iter(s.split_whitespace().map(Value::from)),
                }),
                "lower" => Ok(Value::from(s.to_lowercase())),
                "upper" => Ok(Value::from(s.to_uppercase())),
                "replace" => Ok(Value::from(s.replace(arg(0).ok_or_else(bad)?, arg(1).ok_or_else(bad)?))),
                _ => Err(Error::from(ErrorKind::UnknownMethod)),
            }
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn instant() -> ChatOptions {
        ChatOptions {
            thinking: false,
            ..ChatOptions::default()
        }
    }

    #[test]
    fn instant_mode_matches_k26_example() {
        let msgs = json!([
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello"}
        ]);
        let out = ChatTemplate::builtin().render(&msgs, &instant()).unwrap();
        assert_eq!(
            out,
            "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>\
             <|im_user|>user<|im_middle|>Hello<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
        );
        let thinking = ChatTemplate::builtin().render(&msgs, &ChatOptions::default()).unwrap();
        assert!(
            thinking.ends_with("<|im_assistant|>assistant<|im_middle|><think>"),
            "{thinking}"
        );
        let no_gen = ChatOptions {
            add_generation_prompt: false,
            ..instant()
        };
        assert!(ChatTemplate::builtin()
            .render(&msgs, &no_gen)
            .unwrap()
            .ends_with("Hello<|im_end|>"));
    }

    #[test]
    fn tools_history_and_results() {
        let msgs = json!([
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "need tool",
             "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny.", "reasoning_content": "easy"},
            {"role": "user", "name": "bob", "content": [{"type": "text", "text": "Thanks"}]}
        ]);
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]);
        let opts = ChatOptions {
            tools: Some(tools),
            ..ChatOptions::default()
        };
        let out = ChatTemplate::builtin().render(&msgs, &opts).unwrap();
        let want = concat!(
            r#"<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "get_weather","#,
            r#" "parameters": {}}}]<|im_end|>"#,
            "<|im_user|>user<|im_middle|>Weather?<|im_end|>",
            "<|im_assistant|>assistant<|im_middle|><think></think>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>",
            r#"{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"#,
            "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>",
            "<|im_assistant|>assistant<|im_middle|><think></think>It is sunny.<|im_end|>",
            "<|im_user|>bob<|im_middle|>Thanks<|im_end|>",
            "<|im_assistant|>assistant<|im_middle|><think>",
        );
        assert_eq!(out, want);
        // preserve_thinking keeps earlier reasoning.
        let keep = ChatOptions {
            preserve_thinking: true,
            ..opts
        };
        let out = ChatTemplate::builtin().render(&msgs, &keep).unwrap();
        assert!(
            out.contains("<think>need tool</think><|tool_calls_section_begin|>"),
            "{out}"
        );
        assert!(out.contains("<think>easy</think>It is sunny."), "{out}");
    }

    #[test]
    fn hf_conventions_python_methods_mutable_namespace_lists_and_raise() {
        let src = concat!(
            r#"{%- set q = namespace(ids=[]) -%}
{%- for m in messages -%}{{ m.get('role') }}={{ m.get('missing', 'dflt') }};"#,
            r#"{% set _ = q.ids.append(m['role']) %}{%- endfor -%}
{{ q.ids.pop(0) }}|{{ q.ids | length }}|{{ 'abc'.startswith('a') }}|{{ {'k': [1, 'é']} | tojson }}
{%- if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}"#
        );
        let t = ChatTemplate::from_source(src.to_string()).unwrap();
        let two = json!([{"role": "user"}, {"role": "assistant"}]);
        let out = t.render(&two, &ChatOptions::default()).unwrap();
        assert_eq!(out, r#"user=dflt;assistant=dflt;user|1|True|{"k": [1, "é"]}"#);
        let three = json!([{"role": "a"}, {"role": "b"}, {"role": "c"}]);
        let err = format!("{:#}", t.render(&three, &ChatOptions::default()).unwrap_err());
        assert!(err.contains("too many"), "{err}");
    }

    #[test]
    fn from_dir_prefers_jinja_file_then_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = r#"{"chat_template": "{{ bos_token }}{{ messages[0].content }}", "bos_token": {"content": "[BOS]"}}"#;
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg).unwrap();
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let t = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(t.render(&msgs, &ChatOptions::default()).unwrap(), "[BOS]hi");
        std::fs::write(dir.path().join("chat_template.jinja"), "J{{ messages | length }}").unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(t.render(&msgs, &ChatOptions::default()).unwrap(), "J1");
        let empty = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(empty.path()).is_err());
    }
}

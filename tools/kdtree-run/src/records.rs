//! Output records: one JSON object per input line, as one line of the output JSONL.
//!
//! Plain lines (`id` input) give
//! `{id, status, finish_reason, text, token_ids, usage, sampling, spec, timing}` or
//! `{id, status: "error", error: {code, message}}`. OpenAI batch lines (`custom_id`) give the batch output
//! envelope `{id, custom_id, response: {status_code, request_id, body}, error: null, timing}`, where
//! `body` is a `chat.completion` (`choices[0].message.content` = text) carrying our `token_ids`,
//! `sampling` and `spec` as extension fields; a failed line gets `status_code` 400 (bad request) or 500
//! (engine failure) and `body.error {message, type, code}` as the OpenAI API does.
//!
//! Every run-dependent value (times, `created`) sits in the top-level `timing` object of either shape;
//! the one exception is `body.created` of OpenAI successes, which the `chat.completion` object requires
//! (the official `openai` package refuses a body without it; tests/openai_types.rs checks with its own
//! types) and which equals `timing.created`. Ids are derived from the line's id, so
//! `jq -c 'del(.timing, .response.body.created)'` gives byte-identical files across runs. Every record
//! carries the `fingerprint` of the request it answers (fingerprint.rs), which `--resume` compares. Spec counters
//! (`spec`, DDTree only): `verify_steps` (target verify forwards), `drafted` (tree nodes drafted, root excluded),
//! `accepted` (drafted nodes accepted), `accepted_per_depth[d-1]` (rounds whose accepted path reached depth d),
//! `acceptance_histogram[k]` (rounds accepting exactly k), `acceptance_length` = (accepted + verify_steps) /
//! verify_steps = tokens committed per verify step including the bonus token (SGLang's definition when every token
//! comes from a verify step), `acceptance_rate` = accepted / drafted; `budget` = the fixed budget or "auto" (then
//! `budget_max`), `budgets` = the rounds' budgets summed (auto: the buckets chosen, 0 for a feed round),
//! `mean_budget` = budgets / verify_steps, `feed_rounds` = the rounds of budget 0. Tests: bottom of this file;
//! shapes end to end in tests/run_cli.rs.

use std::path::Path;

use kdtree_engine::generate::{Mode, SpecStats};
use kdtree_text::prompts::{Input, PromptLine, Request};
use serde_json::{json, Value as Json};

use crate::runner::Defaults;

/// Sampling settings a line actually ran with (defaults merged with its overrides).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingUsed {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Chat lines only: the thinking mode of the template.
    pub thinking: Option<bool>,
}

impl SamplingUsed {
    /// The settings `req` runs with: the run's defaults `d` merged with the line's overrides (chat
    /// lines: `thinking` too). The runner and the fingerprint both take them from here.
    pub fn resolve(d: &Defaults, req: &Request) -> Self {
        let o = &req.overrides;
        SamplingUsed {
            temperature: o.temperature.unwrap_or(d.sampling.temperature),
            top_p: o.top_p.unwrap_or(d.sampling.top_p),
            top_k: o.top_k.unwrap_or(d.sampling.top_k),
            seed: o.seed.unwrap_or(d.sampling.seed),
            max_tokens: o.max_tokens.unwrap_or(d.max_tokens),
            stop: o.stop.clone().unwrap_or_default(),
            thinking: match &req.input {
                Input::Chat { thinking, .. } => Some(thinking.unwrap_or(d.thinking)),
                _ => None,
            },
        }
    }

    /// As JSON (the record's `sampling` object).
    pub fn to_json(&self) -> Json {
        sampling(self)
    }
}

/// The model's name in OpenAI bodies whose line gave none: the directory's name.
pub fn model_name(dir: &Path) -> String {
    dir.file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// Wall-clock facts of one request; the only run-dependent part of a record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timing {
    pub ttft_ms: f64,
    pub decode_ms: f64,
    pub e2e_ms: f64,
    /// Completion tokens after the first, per second of decode (SGLang `decode_throughput`).
    pub decode_tok_s: f64,
    /// Unix seconds at the end of the request (OpenAI `created`).
    pub created: u64,
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Decoded text (cut at a stop string; the final stop token is not rendered); None without a tokenizer.
    pub text: Option<String>,
    /// Every generated token, lossless (a final stop token included).
    pub token_ids: Vec<u32>,
    /// "stop" (stop token or stop string) or "length".
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub sampling: SamplingUsed,
    pub mode: Mode,
    pub spec: SpecStats,
    pub timing: Timing,
}

/// What happened to one line (one per line, so the size difference of the variants does not matter).
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Outcome {
    Done(Completion),
    /// `code` is machine-readable (`invalid_request`, `context_length_exceeded`, `engine_error`, ...).
    Failed {
        code: String,
        message: String,
    },
}

/// Codes that mean "the request was bad" (HTTP 400) rather than "we failed" (500).
fn is_client_error(code: &str) -> bool {
    code != "engine_error"
}

/// The record of `line`; `model` names the model in OpenAI bodies when the line gave none;
/// `fingerprint` is the line's request fingerprint (fingerprint.rs).
pub fn record(line: &PromptLine, outcome: &Outcome, model: &str, fingerprint: &str) -> Json {
    let mut r = record_body_of(line, outcome, model);
    let timing = r.as_object_mut().and_then(|o| o.remove("timing"));
    r["fingerprint"] = fingerprint.into();
    if let Some(t) = timing {
        r["timing"] = t;
    }
    r
}

/// The model (the line's `body.model`, else `model`) an OpenAI body names.
pub fn body_model(line: &PromptLine, model: &str) -> String {
    line.request
        .as_ref()
        .ok()
        .and_then(|r| r.model.clone())
        .unwrap_or_else(|| model.to_string())
}

fn record_body_of(line: &PromptLine, outcome: &Outcome, model: &str) -> Json {
    let model = body_model(line, model);
    match (line.openai, outcome) {
        (false, Outcome::Done(c)) => {
            let mut r = json!({
                "id": line.id,
                "status": "ok",
                "finish_reason": c.finish_reason,
                "text": c.text,
                "token_ids": c.token_ids,
                "usage": usage(c),
                "sampling": sampling(&c.sampling),
                "spec": spec(c.mode, &c.spec),
            });
            r["timing"] = timing(&c.timing);
            r
        }
        (false, Outcome::Failed { code, message }) => json!({
            "id": line.id,
            "status": "error",
            "error": {"code": code, "message": message},
        }),
        (true, Outcome::Done(c)) => json!({
            "id": format!("batch_req_{}", line.id),
            "custom_id": line.id,
            "response": {
                "status_code": 200,
                "request_id": format!("req_{}", line.id),
                "body": {
                    "id": format!("chatcmpl-{}", line.id),
                    "object": "chat.completion",
                    "created": c.timing.created,
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish_reason,
                    }],
                    "usage": usage(c),
                    "token_ids": c.token_ids,
                    "sampling": sampling(&c.sampling),
                    "spec": spec(c.mode, &c.spec),
                },
            },
            "error": null,
            "timing": timing(&c.timing),
        }),
        (true, Outcome::Failed { code, message }) => json!({
            "id": format!("batch_req_{}", line.id),
            "custom_id": line.id,
            "response": {
                "status_code": if is_client_error(code) { 400 } else { 500 },
                "request_id": format!("req_{}", line.id),
                "body": {"error": {
                    "message": message,
                    "type": if is_client_error(code) { "invalid_request_error" } else { "server_error" },
                    "code": code,
                }},
            },
            "error": null,
        }),
    }
}

fn usage(c: &Completion) -> Json {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.token_ids.len(),
        "total_tokens": c.prompt_tokens + c.token_ids.len(),
    })
}

fn sampling(s: &SamplingUsed) -> Json {
    let mut j = json!({
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": s.seed,
        "max_tokens": s.max_tokens,
        "stop": s.stop,
    });
    if let Some(t) = s.thinking {
        j["thinking"] = t.into();
    }
    j
}

/// The mode as records, the summary and fingerprints name it: ("ar" | "ddtree" | "chain", the budget: a
/// number, "auto" or null, and `--budget-max` under auto).
pub fn mode_fields(mode: Mode) -> (&'static str, Json, Option<usize>) {
    match mode {
        Mode::Ar => ("ar", Json::Null, None),
        Mode::DDTree { budget } => ("ddtree", budget.into(), None),
        Mode::DDTreeAuto { max } => ("ddtree", "auto".into(), Some(max)),
        Mode::Chain => ("chain", Json::Null, None),
    }
}

/// `spec` object: `{mode: "ar"}` or the DDTree counters and derived rates.
pub fn spec(mode: Mode, s: &SpecStats) -> Json {
    let (name, budget, max) = mode_fields(mode);
    match mode {
        Mode::Ar => json!({"mode": "ar"}),
        Mode::DDTree { .. } | Mode::DDTreeAuto { .. } | Mode::Chain => {
            let mut j = json!({"mode": name, "budget": budget});
            j.as_object_mut().expect("an object").extend(spec_counters(s));
            if let Some(m) = max {
                j["budget_max"] = m.into();
            }
            j
        }
    }
}

/// The counters of `s` and the rates derived from them, as a record's `spec` and the run summary give them.
pub fn spec_counters(s: &SpecStats) -> serde_json::Map<String, Json> {
    let j = json!({
        "verify_steps": s.verify_steps,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "accepted_per_depth": s.accepted_per_depth,
        "acceptance_histogram": s.acceptance_histogram,
        "acceptance_length": round6(s.acceptance_length()),
        "acceptance_rate": round6(s.acceptance_rate()),
        "budgets": s.budgets,
        "mean_budget": round6(s.mean_budget()),
        "feed_rounds": s.feed_rounds,
    });
    let Json::Object(m) = j else {
        unreachable!("json! of an object")
    };
    m
}

fn timing(t: &Timing) -> Json {
    json!({
        "ttft_ms": round3(t.ttft_ms),
        "decode_ms": round3(t.decode_ms),
        "e2e_ms": round3(t.e2e_ms),
        "decode_tok_s": round3(t.decode_tok_s),
        "created": t.created,
    })
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

pub fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// The id a record answers (`id` of plain records, `custom_id` of OpenAI ones).
pub fn record_id(r: &Json) -> Option<&str> {
    r.get("custom_id").or_else(|| r.get("id")).and_then(Json::as_str)
}

/// Whether a record is a success.
pub fn record_ok(r: &Json) -> bool {
    match r.get("response") {
        Some(resp) => resp.get("status_code").and_then(Json::as_u64) == Some(200),
        None => r.get("status").and_then(Json::as_str) == Some("ok"),
    }
}

/// The object holding `usage` / `spec` of a record (the record itself, or the OpenAI body).
pub fn record_body(r: &Json) -> &Json {
    r.pointer("/response/body").unwrap_or(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kdtree_text::prompts::parse_line;

    fn completion() -> Completion {
        Completion {
            text: Some("hi".into()),
            token_ids: vec![5, 6, 7],
            finish_reason: "stop",
            prompt_tokens: 4,
            sampling: SamplingUsed {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                seed: 3,
                max_tokens: 8,
                stop: vec![],
                thinking: None,
            },
            mode: Mode::DDTree { budget: 4 },
            spec: SpecStats {
                verify_steps: 2,
                drafted: 8,
                budgets: 8,
                feed_rounds: 0,
                accepted: 3,
                accepted_per_depth: vec![2, 1, 0],
                acceptance_histogram: vec![0, 1, 1, 0],
            },
            timing: Timing {
                ttft_ms: 1.23456,
                decode_ms: 2.0,
                e2e_ms: 3.5,
                decode_tok_s: 1000.0,
                created: 17,
            },
        }
    }

    #[test]
    fn plain_record_shape_and_timing_isolation() {
        let line = parse_line(1, r#"{"id":"a","prompt":"x"}"#);
        let r = record(&line, &Outcome::Done(completion()), "tiny", "fp");
        let keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "id",
                "status",
                "finish_reason",
                "text",
                "token_ids",
                "usage",
                "sampling",
                "spec",
                "fingerprint",
                "timing"
            ]
        );
        assert_eq!(r["fingerprint"], "fp");
        assert_eq!(
            r["usage"],
            json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7})
        );
        assert_eq!(r["spec"]["acceptance_length"], json!(2.5));
        assert_eq!(r["spec"]["acceptance_rate"], json!(0.375));
        assert_eq!(
            (
                &r["spec"]["budget"],
                &r["spec"]["mean_budget"],
                r["spec"].get("budget_max")
            ),
            (&json!(4), &json!(4.0), None)
        );
        let auto = Completion {
            mode: Mode::DDTreeAuto { max: 32 },
            spec: SpecStats {
                budgets: 12,
                feed_rounds: 1,
                ..completion().spec
            },
            ..completion()
        };
        let s = spec(auto.mode, &auto.spec);
        assert_eq!(
            (
                &s["mode"],
                &s["budget"],
                &s["budget_max"],
                &s["mean_budget"],
                &s["feed_rounds"]
            ),
            (&json!("ddtree"), &json!("auto"), &json!(32), &json!(6.0), &json!(1))
        );
        assert_eq!(r["timing"]["ttft_ms"], json!(1.235));
        // Changing only timings changes only `timing`.
        let mut c2 = completion();
        c2.timing = Timing {
            created: 99,
            e2e_ms: 7.0,
            ..Timing::default()
        };
        let mut r2 = record(&line, &Outcome::Done(c2), "tiny", "fp");
        let mut r1 = r.clone();
        r1.as_object_mut().unwrap().remove("timing");
        r2.as_object_mut().unwrap().remove("timing");
        assert_eq!(r1, r2);
        assert!(record_ok(&r));
        assert_eq!(record_id(&r), Some("a"));
    }

    #[test]
    fn openai_envelope_shape() {
        let line = parse_line(
            1,
            concat!(
                r#"{"custom_id":"q4","method":"POST","url":"/v1/chat/completions","body":{"model":"kimi","#,
                r#""messages":[{"role":"user","content":"Hi"}]}}"#,
            ),
        );
        let r = record(&line, &Outcome::Done(completion()), "tiny", "fp");
        assert_eq!(r["id"], "batch_req_q4");
        assert_eq!(r["custom_id"], "q4");
        assert_eq!(r["error"], Json::Null);
        assert_eq!(r["response"]["status_code"], 200);
        let body = &r["response"]["body"];
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["model"], "kimi");
        assert_eq!(
            body["choices"][0]["message"],
            json!({"role": "assistant", "content": "hi"})
        );
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        assert_eq!(body["usage"]["total_tokens"], 7);
        assert_eq!(r["timing"]["created"], 17);
        assert_eq!(body["created"], 17, "chat.completion requires created");
        let keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["id", "custom_id", "response", "error", "fingerprint", "timing"]);
        assert_eq!(record_body(&r)["spec"]["verify_steps"], 2);
        let bad = record(
            &line,
            &Outcome::Failed {
                code: "context_length_exceeded".into(),
                message: "too long".into(),
            },
            "tiny",
            "fp",
        );
        assert_eq!(bad["response"]["status_code"], 400);
        assert_eq!(bad["response"]["body"]["error"]["code"], "context_length_exceeded");
        assert!(!record_ok(&bad));
        let bad = record(
            &line,
            &Outcome::Failed {
                code: "engine_error".into(),
                message: "boom".into(),
            },
            "tiny",
            "fp",
        );
        assert_eq!(bad["response"]["status_code"], 500);
    }

    #[test]
    fn error_record_and_ar_spec() {
        let line = parse_line(2, r#"{"id":"e","prompt":""}"#);
        let err = line.request.clone().unwrap_err();
        let r = record(
            &line,
            &Outcome::Failed {
                code: err.code.into(),
                message: err.to_string(),
            },
            "m",
            "fp",
        );
        assert_eq!(
            r,
            json!({"id": "e", "status": "error", "error": {"code": "empty_prompt",
                "message": "line 2: \"prompt\" is empty"},
                "fingerprint": "fp"})
        );
        assert_eq!(spec(Mode::Ar, &SpecStats::default()), json!({"mode": "ar"}));
    }
}

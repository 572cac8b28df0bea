//! The per-line work: prompt → token ids (raw text, chat template, or given ids), checks against the
//! model (context length, vocabulary), one `engine::generate` call on the run's Session with stop
//! strings matched on complete UTF-8 text, and the [`Outcome`] its record is made from.
//!
//! Stop handling: stop token ids (the model's eos) end generation inside the engine and stay in
//! `token_ids` but are not rendered into `text`; a stop string ends it from the per-token callback and
//! `text` is cut before it (`token_ids` keep every generated token, up to the one that completed it).
//! Tests: bottom of this file (a scripted mock target), end to end in tests/run_cli.rs.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kdtree_engine::generate::{FinishReason, GenOutput, GenRequest, Mode, Sampling};
#[cfg(test)]
use kdtree_engine::{generate::generate, Session};
use kdtree_text::chat::{ChatOptions, ChatTemplate};
use kdtree_text::detok::{Detokenizer, StopMatcher};
use kdtree_text::prompts::{Input, PromptLine, Request};
use kdtree_text::Tokenizer;

use crate::records::{Completion, Outcome, SamplingUsed, Timing};

/// Run-wide settings a line may override.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub mode: Mode,
    pub thinking: bool,
}

/// Everything needed to answer lines (the session or batch that generates them is the caller's).
pub struct Runner<'a> {
    /// The model's static facts (vocabulary, context) the lines are checked against.
    pub info: kdtree_engine::api::TargetInfo,
    /// None: the model dir has no tokenizer; only `prompt_token_ids` lines can run and `text` is null.
    pub tokenizer: Option<&'a Tokenizer>,
    pub chat: Option<&'a ChatTemplate>,
    pub stop_token_ids: Vec<u32>,
    pub defaults: Defaults,
}

/// A line ready to generate: its engine request, the text state its per-token callback feeds (stop
/// strings), and what its record needs afterwards.
pub struct Prepared {
    t0: Instant,
    pre_ms: f64,
    prompt_tokens: usize,
    used: SamplingUsed,
    pub req: GenRequest,
    text: Rc<RefCell<TextState>>,
}

/// The incremental detokenizer and stop matcher of one line.
struct TextState {
    detok: Detokenizer,
    matcher: StopMatcher,
    seen: usize,
}

/// A line's failure before generation: (code, message).
type Refusal = (&'static str, String);

fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>, Refusal> {
    tok.try_encode(text)
        .map_err(|e| ("tokenizer_error", kdtree_text::console::error_chain(&e)))
}

/// [`failed`], boxed (a line refused before generation).
fn refused(code: &str, message: impl Into<String>) -> Box<Outcome> {
    Box::new(failed(code, message))
}

fn failed(code: &str, message: impl Into<String>) -> Outcome {
    Outcome::Failed {
        code: code.to_string(),
        message: message.into(),
    }
}

impl<'a> Runner<'a> {
    /// Answer one prompt line on `session` (a line that failed validation just reports its error): the
    /// three steps kdtree-run's batch takes per line (main.rs `answer`), on one session.
    #[cfg(test)]
    pub fn run_line(&self, session: &mut Session<'_>, line: &PromptLine) -> Outcome {
        let p = match self.prepare_line(line) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let mut on_tokens = self.on_tokens(&p);
        let out = generate(session, &p.req, &mut on_tokens);
        self.finish(p, out)
    }

    /// The line's request, ready to generate; Err = the record of a line that fails before generation.
    pub fn prepare_line(&self, line: &PromptLine) -> Result<Prepared, Box<Outcome>> {
        match &line.request {
            Err(e) => Err(Box::new(failed(e.code, e.to_string()))),
            Ok(req) => self.prepare(req),
        }
    }

    /// The prompt's token ids and, for chat lines, the thinking mode used; Err = (code, message).
    pub fn prompt_ids(&self, req: &Request) -> Result<(Vec<u32>, Option<bool>), Refusal> {
        let need_tok = || {
            let msg = "the model has no tokenizer (tiktoken.model); use prompt_token_ids";
            self.tokenizer.ok_or(("invalid_request", msg.to_string()))
        };
        match &req.input {
            Input::TokenIds(ids) => Ok((ids.clone(), None)),
            Input::Text(s) => Ok((encode(need_tok()?, s)?, None)),
            Input::Chat {
                messages,
                tools,
                thinking,
                preserve_thinking,
            } => {
                let tok = need_tok()?;
                let chat = self
                    .chat
                    .ok_or(("invalid_request", "the model has no chat template".to_string()))?;
                let thinking = thinking.unwrap_or(self.defaults.thinking);
                let opts = ChatOptions {
                    add_generation_prompt: true,
                    thinking,
                    preserve_thinking: preserve_thinking.unwrap_or(false),
                    tools: tools.clone(),
                };
                let text = chat
                    .render(messages, &opts)
                    .map_err(|e| ("invalid_request", kdtree_text::console::error_chain(&e)))?;
                Ok((encode(tok, &text)?, Some(thinking)))
            }
        }
    }

    fn prepare(&self, req: &Request) -> Result<Prepared, Box<Outcome>> {
        let t0 = Instant::now();
        let (prompt, _) = self.prompt_ids(req).map_err(|(code, message)| refused(code, message))?;
        let info = &self.info;
        if prompt.is_empty() {
            return Err(refused("empty_prompt", "the prompt encodes to no tokens"));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(refused(
                "invalid_request",
                format!(
                    "token id {bad} is outside the model's vocabulary of {}",
                    info.vocab_size
                ),
            ));
        }
        if prompt.len() >= info.max_positions {
            return Err(refused(
                "context_length_exceeded",
                format!(
                    "the prompt has {} tokens; the model's context holds {} positions",
                    prompt.len(),
                    info.max_positions
                ),
            ));
        }
        let d = &self.defaults;
        let used = SamplingUsed::resolve(d, req);
        if self.tokenizer.is_none() && !used.stop.is_empty() {
            return Err(refused(
                "invalid_request",
                "stop strings need a tokenizer (tiktoken.model) in the model directory",
            ));
        }
        let gen_req = GenRequest {
            prompt: prompt.clone(),
            max_tokens: used.max_tokens,
            stop_token_ids: self.stop_token_ids.clone(),
            sampling: Sampling {
                temperature: used.temperature,
                top_p: used.top_p,
                top_k: used.top_k,
                seed: used.seed,
            },
            mode: d.mode,
        };
        let text = Rc::new(RefCell::new(TextState {
            detok: Detokenizer::new(),
            matcher: StopMatcher::new(&used.stop),
            seen: 0,
        }));
        Ok(Prepared {
            t0,
            pre_ms: t0.elapsed().as_secs_f64() * 1e3,
            prompt_tokens: prompt.len(),
            used,
            req: gen_req,
            text,
        })
    }

    /// The per-token callback of a prepared line: renders new tokens and reports a completed stop string.
    pub fn on_tokens(&self, p: &Prepared) -> impl FnMut(&[u32]) -> bool + 'a {
        let (tokenizer, stop_ids, text) = (self.tokenizer, self.stop_token_ids.clone(), p.text.clone());
        move |toks: &[u32]| -> bool {
            let Some(tok) = tokenizer else { return false };
            let mut st = text.borrow_mut();
            let TextState { detok, matcher, seen } = &mut *st;
            for &t in &toks[*seen..] {
                *seen += 1;
                if stop_ids.contains(&t) {
                    continue;
                }
                // Ids the tokenizer does not know (padded model vocab) render as nothing.
                let bytes = tok.decode_bytes(&[t]).unwrap_or_default();
                if matcher.push(&detok.push(&bytes)) {
                    return true;
                }
            }
            false
        }
    }

    /// The record's outcome of a prepared line from its generation.
    pub fn finish(&self, p: Prepared, out: anyhow::Result<GenOutput>) -> Outcome {
        let out = match out {
            Ok(out) => out,
            Err(e) if e.is::<kdtree_engine::KvTooLarge>() => {
                return failed("kv_cache_exceeded", kdtree_text::console::error_chain(&e))
            }
            Err(e) => return failed("engine_error", kdtree_text::console::error_chain(&e)),
        };
        let text = self.tokenizer.map(|_| {
            let mut st = p.text.borrow_mut();
            let TextState { detok, matcher, .. } = &mut *st;
            if !matcher.stopped() {
                matcher.push(&detok.finish());
            }
            matcher.text().to_string()
        });
        let n = out.tokens.len();
        let timing = Timing {
            ttft_ms: p.pre_ms + out.ttft_ms,
            decode_ms: out.decode_ms,
            e2e_ms: p.t0.elapsed().as_secs_f64() * 1e3,
            decode_tok_s: if n > 1 && out.decode_ms > 0.0 {
                (n - 1) as f64 * 1e3 / out.decode_ms
            } else {
                0.0
            },
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        };
        Outcome::Done(Completion {
            text,
            token_ids: out.tokens,
            finish_reason: match out.finish_reason {
                FinishReason::Stop | FinishReason::Callback => "stop",
                FinishReason::Length => "length",
            },
            prompt_tokens: p.prompt_tokens,
            sampling: p.used,
            mode: self.defaults.mode,
            spec: out.spec,
            timing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kdtree_engine::api::{LogitRows, StepOut, Target, TargetInfo};
    use kdtree_text::prompts::parse_line;

    /// A chain-only target over 256 byte ids + 2 specials that emits a fixed script: the token predicted
    /// after position p is `script[p + 1 - prompt_len]`, then 257 (`<|im_end|>`) once the script ends.
    struct ScriptTarget {
        info: TargetInfo,
        script: Vec<u32>,
        prompt_len: usize,
        committed: usize,
        last: Vec<u32>,
    }

    impl ScriptTarget {
        fn new(script: &[u8], max_positions: usize) -> Self {
            let info = TargetInfo {
                vocab_size: 258,
                hidden_size: 1,
                num_layers: 1,
                max_positions,
                tap_layers: vec![],
            };
            Self {
                info,
                script: script.iter().map(|&b| b as u32).collect(),
                prompt_len: 0,
                committed: 0,
                last: vec![],
            }
        }
    }

    impl Target for ScriptTarget {
        fn info(&self) -> &TargetInfo {
            &self.info
        }
        fn committed(&self) -> usize {
            self.committed
        }
        fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> anyhow::Result<StepOut> {
            assert_eq!(tokens.len(), parents.len());
            if self.committed == 0 {
                self.prompt_len = tokens.len();
            }
            let v = self.info.vocab_size;
            let mut logits = vec![0.0; tokens.len() * v];
            for i in 0..tokens.len() {
                // Chains only: node i sits at position committed + i.
                let generated = (self.committed + i + 1).saturating_sub(self.prompt_len);
                let next = self.script.get(generated).copied().unwrap_or(257);
                logits[i * v + next as usize] = 1.0;
            }
            self.last = tokens.to_vec();
            let logits = match rows {
                LogitRows::All => logits,
                LogitRows::Last => logits[(tokens.len() - 1) * v..].to_vec(),
                LogitRows::None => vec![],
            };
            Ok(StepOut { logits, taps: vec![] })
        }
        fn commit(&mut self, path: &[usize]) -> anyhow::Result<()> {
            self.committed += path.len();
            Ok(())
        }
        fn truncate(&mut self, len: usize) -> anyhow::Result<()> {
            self.committed = len;
            Ok(())
        }
        fn reset(&mut self) {
            self.committed = 0;
        }
    }

    fn byte_tokenizer() -> Tokenizer {
        let ranks = (0u32..256).map(|b| (vec![b as u8], b)).collect();
        let names = [(257, "<|im_end|>".to_string())].into_iter().collect();
        Tokenizer::from_ranks(ranks, &names).unwrap()
    }

    fn run(line: &str, script: &str, max_positions: usize) -> Outcome {
        let tok = byte_tokenizer();
        let chat = ChatTemplate::builtin();
        let mut target = ScriptTarget::new(script.as_bytes(), max_positions);
        let runner = Runner {
            info: target.info.clone(),
            tokenizer: Some(&tok),
            chat: Some(&chat),
            stop_token_ids: vec![257],
            defaults: Defaults {
                max_tokens: 64,
                sampling: Sampling::greedy(),
                mode: Mode::Ar,
                thinking: true,
            },
        };
        let mut session = Session::new(Box::new(&mut target), None, Mode::Ar).unwrap();
        runner.run_line(&mut session, &parse_line(1, line))
    }

    fn done(o: Outcome) -> Completion {
        match o {
            Outcome::Done(c) => c,
            Outcome::Failed { code, message } => panic!("{code}: {message}"),
        }
    }

    #[test]
    fn without_a_tokenizer_only_plain_token_id_lines_run() {
        let mut target = ScriptTarget::new(b"ab", 100);
        let runner = Runner {
            info: target.info.clone(),
            tokenizer: None,
            chat: None,
            stop_token_ids: vec![257],
            defaults: Defaults {
                max_tokens: 8,
                sampling: Sampling::greedy(),
                mode: Mode::Ar,
                thinking: true,
            },
        };
        let mut session = Session::new(Box::new(&mut target), None, Mode::Ar).unwrap();
        let c = done(runner.run_line(&mut session, &parse_line(1, r#"{"id":"a","prompt_token_ids":[1,2]}"#)));
        assert_eq!((c.text, c.token_ids), (None, vec![b'a' as u32, b'b' as u32, 257]));
        for line in [
            r#"{"id":"a","prompt":"x"}"#,
            r#"{"id":"a","prompt_token_ids":[1],"stop":"b"}"#,
        ] {
            let Outcome::Failed { code, message } = runner.run_line(&mut session, &parse_line(1, line)) else {
                panic!("{line}")
            };
            assert_eq!(code, "invalid_request", "{line}");
            assert!(message.contains("tokenizer"), "{message}");
        }
    }

    #[test]
    fn stop_token_ends_and_is_not_rendered() {
        let c = done(run(r#"{"id":"a","prompt":"hi"}"#, "héllo", 100));
        assert_eq!(c.text.as_deref(), Some("héllo"));
        assert_eq!(c.token_ids.len(), "héllo".len() + 1);
        assert_eq!(*c.token_ids.last().unwrap(), 257);
        assert_eq!((c.finish_reason, c.prompt_tokens), ("stop", 2));
    }

    #[test]
    fn stop_string_cuts_text_and_max_tokens_gives_length() {
        let c = done(run(r#"{"id":"a","prompt":"hi","stop":["l"]}"#, "héllo", 100));
        assert_eq!((c.text.as_deref(), c.finish_reason), (Some("hé"), "stop"));
        assert_eq!(c.token_ids.len(), 4); // h, two bytes of é, l
        let c = done(run(r#"{"id":"a","prompt":"hi","max_tokens":2}"#, "héllo", 100));
        // The second byte of é is not generated: the partial character becomes U+FFFD.
        assert_eq!((c.text.as_deref(), c.finish_reason), (Some("h\u{fffd}"), "length"));
        assert_eq!(c.sampling.max_tokens, 2);
    }

    #[test]
    fn chat_lines_use_the_template_and_prompt_checks_fail_per_line() {
        let c = done(run(
            r#"{"id":"a","messages":[{"role":"user","content":"x"}],"thinking":false}"#,
            "ok",
            1000,
        ));
        let rendered = "<|im_user|>user<|im_middle|>x<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>";
        // Specials of the template are not in this byte tokenizer's names except <|im_end|>, so
        // every other character is a byte token: prompt length = bytes - len("<|im_end|>") + 1.
        assert_eq!(c.prompt_tokens, rendered.len() - "<|im_end|>".len() + 1);
        assert_eq!(c.sampling.thinking, Some(false));
        let Outcome::Failed { code, .. } = run(r#"{"id":"a","prompt":"0123456789"}"#, "x", 10) else {
            panic!()
        };
        assert_eq!(code, "context_length_exceeded");
        let Outcome::Failed { code, .. } = run(r#"{"id":"a","prompt_token_ids":[999]}"#, "x", 10) else {
            panic!()
        };
        assert_eq!(code, "invalid_request");
        let Outcome::Failed { code, .. } = run(r#"{"id":"a","prompt":""}"#, "x", 10) else {
            panic!()
        };
        assert_eq!(code, "empty_prompt");
    }
}

//! kdtree-text: text in and out of the model.
//!
//! * [`tokenizer`]: Kimi's tiktoken BPE (`tiktoken.model` + 256 reserved specials, Kimi's split
//!   pattern and input chunking), and [`detok::Detokenizer`], an incremental decoder that only
//!   emits complete UTF-8 (what stop strings are matched against).
//! * [`chat`]: the chat template (the model dir's `chat_template.jinja`, rendered with minijinja);
//!   `assets/chat_template.jinja` is our K2.6-style template that synthetic checkpoints ship.
//! * [`prompts`]: prompt files (JSONL: plain prompts, chat messages, token ids, OpenAI batch lines),
//!   validated up front into one `Ok`/`Err` entry per line.
//! * [`console`]: the tools' messages to people: stderr lines that never panic, errors printed once.
//! * [`files`]: file identity, for the tools' "an output must not be an input" checks, and reads with a
//!   size limit.
//! * [`lock`]: the exclusive lock a tool holds on its output (flock(2) on a lock file naming the pid).
//!
//! Must not know: model math, devices, output formats.

pub mod chat;
pub mod console;
pub mod detok;
pub mod files;
pub mod lock;
pub mod prompts;
pub mod tokenizer;

pub use chat::ChatTemplate;
pub use detok::Detokenizer;
pub use tokenizer::Tokenizer;

/// Our K2.6-style chat template (k26-format §6.4), for checkpoints that need one (synthetic models).
pub const CHAT_TEMPLATE_JINJA: &str = include_str!("../assets/chat_template.jinja");

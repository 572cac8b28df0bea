"""Byte-level BPE tokenizer for the trained tiny pair, in Kimi's tiktoken format.

* Pre-tokenisation: Kimi's split pattern (the same string as tools/kdtree-text/src/tokenizer.rs KIMI_PATTERN,
  k26-format.md §6.2), compiled with the `regex` module in V1 mode (for the `&&` class intersections).
  Training only counts pieces with it; encoding is done by tiktoken (fancy-regex, like tiktoken-rs at run time).
* Training: ranks 0..255 are the single bytes; then merges of the most frequent adjacent pair (ties: the
  smaller (left id, right id)), counted over the distinct pieces weighted by frequency, updated incrementally.
  A merge whose bytes already exist as a token adds no rank, so all token byte strings stay distinct.
* Files: `tiktoken.model` (base64 bytes + rank per line) and `tokenizer_config.json` with the 256 reserved
  specials at Kimi's offsets (names as tools/kdtree-convert/src/synth/vocab.rs SPECIAL_NAMES).
Tested by tools/train/test_train.py (split pattern on kdtree-text's cases, trainer, files).
"""
import base64
import heapq
import json
from collections import Counter

import regex

KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
_SPLIT = regex.compile(KIMI_PATTERN, flags=regex.V1)

NUM_SPECIALS = 256
# offset from the first special id -> name (Kimi: 163584 + offset), k26-format.md §6.3
SPECIAL_NAMES = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
BOS, EOS, IM_END, MEDIA_PAD, UNK, PAD = 0, 1, 2, 21, 254, 255


def pretokenize(text):
    """Kimi's split of `text` into pieces (str)."""
    return _SPLIT.findall(text)


def count_pieces(texts):
    """Counter of UTF-8 piece bytes over an iterable of texts."""
    c = Counter()
    for t in texts:
        c.update(p.encode("utf-8") for p in _SPLIT.findall(t))
    return c


def train(counts, n_mergeable, log=None):
    """Learn merges until there are `n_mergeable` ranks (or no pair is seen twice).

    counts: {piece bytes: count}. Returns the token byte strings in rank order.
    """
    tokens = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(tokens)}
    words = []  # list of [ids], parallel to freq
    freq = []
    for w in sorted(counts):  # sorted: deterministic word order
        if len(w) > 1:
            words.append(list(w))
            freq.append(counts[w])
    pair_count = Counter()
    where = {}
    for wi, (w, f) in enumerate(zip(words, freq)):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += f
            where.setdefault((a, b), set()).add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    while len(tokens) < n_mergeable and heap:
        negc, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc:
            continue  # stale entry
        if -negc < 2:
            break
        a, b = pair
        merged = tokens[a] + tokens[b]
        if merged in index:
            new = index[merged]
        else:
            new = len(tokens)
            tokens.append(merged)
            index[merged] = new
        changed = set()
        for wi in sorted(where.pop(pair, ())):
            w, f = words[wi], freq[wi]
            for x, y in zip(w, w[1:]):
                pair_count[(x, y)] -= f
                changed.add((x, y))
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for x, y in zip(out, out[1:]):
                pair_count[(x, y)] += f
                where.setdefault((x, y), set()).add(wi)
                changed.add((x, y))
        pair_count.pop(pair, None)
        for p in changed:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
        if log and len(tokens) % 1000 == 0:
            log(f"bpe: {len(tokens)} ranks")
    return tokens


def tiktoken_model_text(tokens):
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens))


def special_name(base, off):
    return SPECIAL_NAMES.get(off, f"<|reserved_token_{base + off}|>")


def special_tokens(n_mergeable):
    """{name: id} for the 256 reserved specials after the mergeable ranks."""
    return {special_name(n_mergeable, o): n_mergeable + o for o in range(NUM_SPECIALS)}


def tokenizer_config(n_mergeable, model_max_length):
    """tokenizer_config.json body in Kimi's shape (as kdtree-convert synth writes it)."""
    dec = {}
    for o in range(NUM_SPECIALS):
        dec[str(n_mergeable + o)] = {"content": special_name(n_mergeable, o), "lstrip": False, "normalized": False,
                                     "rstrip": False, "single_word": False, "special": True}
    return {
        "added_tokens_decoder": dec,
        "additional_special_tokens": [special_name(n_mergeable, o) for o in (2, 3, 4, 6, 7, 9, 10, 17)],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": model_max_length,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def tiktoken_encoding(tokens):
    """A tiktoken Encoding with Kimi's pattern, these ranks and the 256 specials."""
    import tiktoken
    n = len(tokens)
    return tiktoken.Encoding(name="kdtree-tiny", pat_str=KIMI_PATTERN,
                             mergeable_ranks={t: r for r, t in enumerate(tokens)},
                             special_tokens=special_tokens(n))


def write_files(out_dir, tokens, model_max_length):
    import os
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        f.write(tiktoken_model_text(tokens))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(len(tokens), model_max_length), f, indent=2)
        f.write("\n")

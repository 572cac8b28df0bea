#!/usr/bin/env python3
"""Write the committed seed corpus fuzz/seeds/<target>/ from the repository's own fixtures (standard
library only; deterministic). Small inputs only: a real shard becomes a valid file of the same header with
every dimension cut to <= 2 (at most 24 tensors); a converted manifest keeps its first 4 [[tensors]].

    python3 fuzz/make_seeds.py [CONVERTED_MODEL_DIR ...]

CONVERTED_MODEL_DIR: outputs of `kdtree-convert repack` whose manifest.toml becomes a manifest seed (none
are committed: docs/fuzzing.md says which were used). Seeds found by fuzzing (crashes, fixed) are added by
hand as seeds/<target>/crash-<what> and are kept: this script never deletes a file.
"""
import glob
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "fuzz", "seeds")
SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
         "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def put(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def rel(p):
    return os.path.relpath(p, ROOT).replace("/", "_").replace(".", "_")


def shrink_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__", None)
    names = sorted(header, key=lambda k: header[k]["data_offsets"][0])[:24]
    out = {} if meta is None else {"__metadata__": meta}
    buf = b""
    for k in names:
        t = header[k]
        shape = [min(d, 2) for d in t["shape"]]
        nb = SIZES[t["dtype"]]
        for d in shape:
            nb *= d
        b0 = t["data_offsets"][0]
        out[k] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [len(buf), len(buf) + nb]}
        buf += data[b0:b0 + nb]
    js = json.dumps(out, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js + buf, raw[:8 + n]


def safetensors_seeds():
    files = sorted(glob.glob(os.path.join(ROOT, "golden", "**", "*.safetensors"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "models", "kdtree-tiny", "**", "*.safetensors"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "tools", "*", "fixtures", "**", "*.safetensors"), recursive=True))
    for p in files:
        small, header_only = shrink_safetensors(p)
        put("safetensors", rel(p), small)
        if len(header_only) <= 4096:
            put("safetensors", rel(p) + "_header_only", header_only)


def jsonl_files():
    return sorted(p for p in glob.glob(os.path.join(ROOT, "**", "*.jsonl"), recursive=True)
                  if "/target" not in p and "/fuzz/" not in p and "/out/" not in p and os.path.getsize(p) < 16384)


README_LINES = [
    '{"id":"q1","prompt":"Explain MLA.","max_tokens":64,"temperature":0,"seed":7,"stop":["\\n\\n"]}',
    '{"id":"q2","messages":[{"role":"user","content":"Hi"}],"thinking":false}',
    '{"id":"q3","prompt_token_ids":[1,2,3]}',
    '{"custom_id":"q4","method":"POST","url":"/v1/chat/completions","body":{"model":"kimi-k2.6","messages":'
    '[{"role":"user","content":"Hi"}],"max_tokens":64,"chat_template_kwargs":{"thinking":false}}}',
    '{"id":"t","messages":[{"role":"user","content":"Weather?"},{"role":"assistant","content":"",'
    '"reasoning_content":"need tool","tool_calls":[{"id":"functions.get_weather:0","type":"function",'
    '"function":{"name":"get_weather","arguments":{"city":"Paris"}}}]},{"role":"tool","content":"sunny"},'
    '{"role":"assistant","content":"It is sunny.","reasoning_content":"easy"},{"role":"user","name":"bob",'
    '"content":[{"type":"text","text":"Thanks"}]}],"tools":[{"type":"function","function":{"name":"get_weather",'
    '"parameters":{}}}],"preserve_thinking":true}',
    '{"custom_id":"b","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"system",'
    '"content":"Be brief."},{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},'
    '{"type":"text","text":"What?"}]}],"max_completion_tokens":9,"stop":["s","t"],"top_p":0.5,"top_k":4,'
    '"seed":1,"n":1,"stream":false,"chat_template_kwargs":{"thinking":true,"preserve_thinking":false}}}',
]


def prompt_seeds():
    for p in jsonl_files():
        put("prompts", rel(p), open(p, "rb").read())
    put("prompts", "readme_lines", "\n".join(README_LINES) + "\n")
    put("prompts", "mixed_bad", b'{not json\r\n{"id":"e","prompt":""}\n{"prompt":"no id"}\n{"id":"line-1",'
        b'"prompt":"x"}\n{"id":"b","prompt":"caf\xe9"}\n[1,2]\n{"id":"j","prompt_token_ids":[1,-2]}\n')
    n = 0
    for p in jsonl_files():
        for line in open(p, encoding="utf-8"):
            if '"messages"' in line and len(line) < 4096:
                put("chat", "%s_%d" % (rel(p), n), line.strip())
                n += 1
    for i, line in enumerate(README_LINES):
        if "messages" in line:
            put("chat", "readme_%d" % i, line)
    put("chat", "bare_messages", '[{"role":"system","content":"You are a helpful assistant."},'
        '{"role":"user","content":"Hello"}]')


def trim_manifest(text, keep=4):
    parts = text.split("\n[[tensors]]\n")
    return "\n[[tensors]]\n".join(parts[:keep + 1]).rstrip("\n") + "\n"


MINIMAL_MANIFEST = """format_version = 2
generator = "test"
skipped = ["vision_tower.x"]

[source]
config_sha256 = "00"

[[source.files]]
name = "model.safetensors"
size = 9

[model]
text_config_json = '{"a":null,"b":1}'

[model.text_config]
b = 1

[plan]
ranks = 1
experts = "tp"
group_size = 32
max_file_size = 10
experts_source = "int4"
splits = []

[[files]]
name = "rank-00-of-01.part-0000.safetensors"
rank = 0
part = 0
size = 1
sha256 = "ab"

[[aux_files]]
name = "tiktoken.model"
size = 3
sha256 = "ef"

[[tensors]]
name = "w"
rank = 0
dtype = "BF16"
shape = [2]
logical_shape = [2]
layout = "plain"
split_offset = 0
file = "rank-00-of-01.part-0000.safetensors"
offset = 64
nbytes = 4
xxh3 = "00000000000000cd"
"""


def manifest_seeds(dirs):
    put("manifest", "minimal", MINIMAL_MANIFEST)
    for d in dirs:
        text = open(os.path.join(d, "manifest.toml"), encoding="utf-8").read()
        name = os.path.basename(os.path.normpath(d))
        small = trim_manifest(text)
        put("manifest", name, small)
        # The same as format 1: a per-tensor sha256 instead of the xxh3.
        v1 = small.replace("format_version = 2\n", "format_version = 1\n", 1)
        v1 = "\n".join('sha256 = "%s"' % ((l.split('"')[1] * 4)) if l.startswith("xxh3 = ") else l
                       for l in v1.split("\n"))
        put("manifest", name + "_v1", v1)


if __name__ == "__main__":
    safetensors_seeds()
    prompt_seeds()
    manifest_seeds(sys.argv[1:])

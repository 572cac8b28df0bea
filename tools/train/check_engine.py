"""Check that the PyTorch twins (tools/train/model.py) and the kdtree CPU engine compute the same model.

    python3 tools/train/check_engine.py --hf models/kdtree-tiny --golden DIR --prompts FILE [--report FILE]

DIR is a kdtree-golden bundle directory made from the repacked checkpoint with the same prompt file
(`kdtree-golden MODEL --prompts FILE --out DIR --max-tokens N --full-logits-steps S`). The checkpoint is loaded
here straight from the HF files (bf16 weights widened to f32, routed experts dequantised exactly from the
compressed-tensors INT4 triplets) and run in f32 on the CPU. Per prompt it compares:
  * prompt token ids: tiktoken (this side) vs the engine's tiktoken-rs encoding in the bundle;
  * greedy tokens for every bundle step, exactly;
  * full logits of the first S steps (max |diff|);
  * the drafter's block logits of the bundle's DDTree round (context = the prompt's taps, block =
    [first generated token, mask x (B-1)]) (max |diff|).
Exit 0 when all greedy tokens and prompt ids agree, 1 otherwise. Needs torch, safetensors, tiktoken.
"""
import argparse
import json
import os
import sys

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402
import data  # noqa: E402
import export  # noqa: E402
from model import Drafter, MoE, Target  # noqa: E402


def tensors_of(dirpath):
    out = {}
    for f in sorted(os.listdir(dirpath)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(dirpath, f), "pt") as s:
                for k in s.keys():
                    out[k] = s.get_tensor(k)
    return out


@torch.no_grad()
def load_target(hf):
    tc = json.load(open(os.path.join(hf, "config.json")))["text_config"]
    m = Target(tc)
    ts = tensors_of(hf)
    sd = m.state_dict()
    for name in sd:
        if ".mlp.w_" in name:
            continue
        if name.endswith("mlp.e_score_correction_bias"):
            src = "language_model.model." + name.replace("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias")
        elif name == "lm_head.weight":
            src = "language_model.lm_head.weight"
        else:
            src = "language_model.model." + name
        sd[name].copy_(ts[src].float())
    for l, layer in enumerate(m.layers):
        if isinstance(layer.mlp, MoE):
            for e in range(layer.mlp.w_gate.shape[0]):
                for proj, w in [("gate_proj", layer.mlp.w_gate), ("up_proj", layer.mlp.w_up), ("down_proj", layer.mlp.w_down)]:
                    p = f"language_model.model.layers.{l}.mlp.experts.{e}.{proj}."
                    n, k = ts[p + "weight_shape"].tolist()
                    w[e].copy_(export.dequantize_int4(ts[p + "weight_packed"], ts[p + "weight_scale"], k).view(n, k))
            layer.mlp.sparse = True
    m.load_state_dict(sd)
    return m.eval(), tc


@torch.no_grad()
def load_drafter(hf):
    d = os.path.join(hf, "drafter")
    dc = json.load(open(os.path.join(d, "config.json")))
    dr = Drafter(dc)
    ts = tensors_of(d)
    sd = dr.state_dict()
    for name in sd:
        sd[name].copy_(ts[name.replace(".q_proj", ".self_attn.q_proj").replace(".k_proj", ".self_attn.k_proj")
                          .replace(".v_proj", ".self_attn.v_proj").replace(".o_proj", ".self_attn.o_proj")
                          .replace(".q_norm", ".self_attn.q_norm").replace(".k_norm", ".self_attn.k_norm")].float())
    dr.load_state_dict(sd)
    return dr.eval(), dc


def encode(enc, line):
    if "prompt_token_ids" in line:
        return line["prompt_token_ids"]
    if "prompt" in line:
        return enc.encode(line["prompt"], allowed_special="all")
    msgs = line["messages"]
    if len(msgs) != 1 or msgs[0]["role"] != "user" or line.get("thinking", True) is not False:
        raise SystemExit(f"{line['id']}: only a single user message with thinking=false is rendered here")
    return enc.encode(data.chat_prompt(msgs[0]["content"]), allowed_special="all")


@torch.no_grad()
def main():
    a = argparse.ArgumentParser()
    a.add_argument("--hf", required=True)
    a.add_argument("--golden", required=True)
    a.add_argument("--prompts", required=True)
    a.add_argument("--report")
    args = a.parse_args()
    torch.set_grad_enabled(False)
    target, tc = load_target(args.hf)
    drafter, dc = load_drafter(args.hf)
    taps_ids = dc["dflash_config"]["target_layer_ids"]
    mask_id, bs = dc["dflash_config"]["mask_token_id"], dc["dflash_config"]["block_size"]
    tokens = [t for t, _ in sorted(((bytes(__import__("base64").b64decode(l.split()[0])), int(l.split()[1]))
                                    for l in open(os.path.join(args.hf, "tiktoken.model")) if l.strip()),
                                   key=lambda x: x[1])]
    enc = bpe.tiktoken_encoding(tokens)
    index = json.load(open(os.path.join(args.golden, "index.json")))
    files = {p["id"]: p["file"] for p in index["prompts"]}
    rows, ok = [], True
    for raw in open(args.prompts):
        line = json.loads(raw)
        pid = line.get("id") or line.get("custom_id")
        with safe_open(os.path.join(args.golden, files[pid]), "pt") as s:
            b = {k: s.get_tensor(k) for k in s.keys() if not k.startswith("trace")}
        ids = encode(enc, line)
        ids_ok = ids == b["prompt_ids"].tolist()
        want = b["ar.tokens"].tolist()
        full = b["ar.full_logits"]
        seq = list(b["prompt_ids"].tolist())
        got, max_full = [], 0.0
        for step in range(len(want)):
            logits, taps = target(torch.tensor([seq]), taps=taps_ids)
            last = logits[0, -1]
            if step < full.shape[0]:
                max_full = max(max_full, (last - full[step]).abs().max().item())
            if step == 0:
                prompt_taps = taps
            tok = int(torch.argmax(last))
            got.append(tok)
            seq.append(want[step])  # teacher-force the engine's token so later steps stay comparable
        n = len(b["prompt_ids"])
        start, root = b["ddtree.meta"][0].item(), b["ddtree.meta"][1].item()
        blk = torch.tensor([[root] + [mask_id] * (bs - 1)])
        dl = drafter(target.embed_tokens(blk), torch.arange(start, start + bs)[None], prompt_taps[:, :n],
                     torch.arange(n), torch.ones(1, 1, bs, n + bs, dtype=torch.bool), target.lm_head)[0, 1:]
        max_draft = (dl - b["ddtree.draft_logits"]).abs().max().item()
        draft_top1 = (dl.argmax(-1) == b["ddtree.draft_logits"].argmax(-1)).all().item()
        same = sum(1 for x, y in zip(got, want) if x == y)
        ok &= ids_ok and got == want
        rows.append({"id": pid, "prompt_tokens": n, "prompt_ids_equal": ids_ok, "greedy_equal": f"{same}/{len(want)}",
                     "max_abs_logit_diff": max_full, "draft_max_abs_logit_diff": max_draft,
                     "draft_argmax_equal": bool(draft_top1)})
        print(f"{pid:12s} prompt {n:4d} ids {'=' if ids_ok else 'DIFF'} greedy {same}/{len(want)} "
              f"max|dlogit| {max_full:.2e} draft max|dlogit| {max_draft:.2e} draft argmax {'=' if draft_top1 else 'DIFF'}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"torch": torch.__version__, "prompts": rows, "ok": bool(ok)}, f, indent=1)
            f.write("\n")
    print("check_engine:", "OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

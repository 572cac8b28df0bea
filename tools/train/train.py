"""Train the tiny K2.6-architecture target + DFlash drafter pair and export both in the exact HF layouts.

    python3 tools/train/train.py --out DIR [--seed 0] [--toy]

Steps (one process, fixed seeds; see tools/train/README.md):
 1. data.py: Python stdlib .py files, sorted, ~2% held out by path hash; chat samples from docstrings.
 2. bpe.py: byte-level BPE (Kimi split pattern) -> tiktoken.model; all text encoded with tiktoken.
 3. model.Target (MLA + YaRN, layer 0 dense, noaux_tc sigmoid MoE + shared expert) trained on random windows
    (AdamW, bf16 autocast, aux-loss-free bias balancing, INT4 fake-quant of the routed experts for the last 20%).
 4. Experts quantised (compressed-tensors int4 g32, export.quantize_int4) and loaded back, target frozen.
 5. model.Drafter trained on the frozen target's taps (DFlash: random anchors, [anchor, mask*(B-1)] blocks,
    context K/V injection of the taps before the anchor, non-causal block), soft labels = the target's
    next-token distributions, position-decayed CE (gamma 4).
 6. export.write_pair -> DIR/kdtree-tiny (+ drafter/), eval.json, heldout_prompts.jsonl.
The step counts are fixed after a 10-step timing probe so the phase fits its time budget; they are logged,
and `--target-steps N --drafter-steps M` reruns with exactly those counts.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402
import data  # noqa: E402
import export  # noqa: E402
from model import Drafter, MoE, Target  # noqa: E402

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


TARGET = dict(hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
              v_head_dim=32, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4,
              first_k_dense_replace=1, max_position_embeddings=4096)
DRAFTER = dict(num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=32,
               intermediate_size=768, block_size=8)
TAP_IDS = [0, 2, 3]  # z-lab build_target_layer_ids(4, 3) fallback (tools/kdtree-convert/src/synth/preset.rs)


def parse():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--out", required=True)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--mergeable", type=int, default=4096)
    a.add_argument("--seq", type=int, default=512)
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--target-seconds", type=float, default=240)
    a.add_argument("--drafter-seconds", type=float, default=150)
    a.add_argument("--target-steps", type=int, default=0, help="fixed step count (0: from the time budget)")
    a.add_argument("--drafter-steps", type=int, default=0)
    a.add_argument("--target-lr", type=float, default=2e-3)
    a.add_argument("--drafter-lr", type=float, default=2e-3)
    a.add_argument("--anchors", type=int, default=32, help="DFlash anchors per training window")
    a.add_argument("--toy", action="store_true", help="tiny sizes and few files (CPU smoke test)")
    a.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    a.add_argument("--chat-template", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                           "kdtree-text", "assets", "chat_template.jinja"))
    return a.parse_args()


# ---------------------------------------------------------------------------------------------- data

def load_corpus(args):
    root, files = data.stdlib_files()
    if args.toy:
        files = files[::40]
    train_docs, held_docs = [], []
    for rel in files:
        (held_docs if data.held_out(rel) else train_docs).append((rel, data.read(root, rel)))
    log(f"data: {root}: {len(files)} files, train {len(train_docs)} ({sum(len(t) for _, t in train_docs) / 1e6:.1f} M chars), "
        f"held out {len(held_docs)} ({sum(len(t) for _, t in held_docs) / 1e6:.2f} M chars)")
    return root, train_docs, held_docs


def _count(texts):
    return bpe.count_pieces(texts)


def pmap(fn, items, workers):
    if workers > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(workers) as pool:
            return pool.map(fn, items)
    return [fn(x) for x in items]


def build_tokenizer(args, train_docs):
    texts = [t for _, t in train_docs]
    parts = pmap(_count, [texts[i::args.workers] for i in range(args.workers)], args.workers)
    counts = parts[0]
    for p in parts[1:]:
        counts.update(p)
    log(f"bpe: {len(counts)} distinct pieces")
    tokens = bpe.train(counts, args.mergeable, log)
    assert len(tokens) == args.mergeable, f"only {len(tokens)} ranks learned"
    log(f"bpe: {len(tokens)} ranks, longest token {max(map(len, tokens))} bytes")
    return tokens


def encode_stream(enc, docs, rng, n_threads):
    """Documents and chat samples in a seeded order, each followed by <|im_end|> (chat texts carry their own)."""
    im_end = enc.n_vocab - bpe.NUM_SPECIALS + bpe.IM_END
    items = [("doc", t) for _, t in docs]
    for qa in pmap(data.functions_with_docstrings, [t for _, t in docs], n_threads):
        items += [("chat", data.chat_text(q, a)) for q, a in qa]
    rng.shuffle(items)
    n_chat = sum(1 for k, _ in items if k == "chat")
    plain = [t for k, t in items if k == "doc"]
    plain_ids = iter(enc.encode_ordinary_batch(plain, num_threads=n_threads))
    out = []
    for kind, t in items:
        if kind == "doc":
            out.extend(next(plain_ids))
            out.append(im_end)
        else:
            out.extend(enc.encode(t, allowed_special="all"))
    return torch.tensor(out, dtype=torch.int32), n_chat


def windows(stream, batch, seq, gen, device):
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)[None]
    return stream[idx].to(device=device, dtype=torch.long, non_blocking=True)


# ---------------------------------------------------------------------------------------------- training

def lr_at(step, total, peak, warm):
    if step < warm:
        return peak * (step + 1) / warm
    p = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def make_opt(params, lr, device):
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def calibrate(step_fn, seconds, fixed, name):
    """Run 10 probe steps (not counted) and return the step count that fits `seconds` (or `fixed`)."""
    if fixed:
        return fixed
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step_fn(0, 10, probe=True)
    sync()
    t = time.time()
    for i in range(10):
        step_fn(i, 10, probe=True)
    sync()
    per = (time.time() - t) / 10
    n = max(20, int(seconds / per))
    log(f"{name}: {per * 1000:.1f} ms/step -> {n} steps for {seconds:.0f} s")
    return n


@torch.no_grad()
def eval_target(model, stream, args, device, n_batches=16):
    gen = torch.Generator().manual_seed(1234)
    tot, cnt = 0.0, 0
    for _ in range(n_batches):
        x = windows(stream, args.batch, args.seq, gen, device)
        with autocast(device):
            logits, _ = model(x[:, :-1])
        tot += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        cnt += x[:, 1:].numel()
    return tot / cnt


def train_target(args, t, train_ids, held_ids, device):
    torch.manual_seed(args.seed)
    model = Target(t).to(device)
    model.init_weights(torch.Generator(device=device).manual_seed(args.seed))
    opt = make_opt(list(model.parameters()), args.target_lr, device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    moes = model.moe_layers()
    state = {"total": 1}

    def step(i, total, probe=False):
        x = windows(train_ids, args.batch, args.seq, gen, device)
        for m in moes:
            m.fake_quant = not probe and i >= int(0.8 * total)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, total, args.target_lr, 100)
        with autocast(device):
            logits, _ = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # aux-loss-free balancing (DeepSeek-V3 §2.1.2): bias += u * sign(mean load - load)
            for m in moes:
                load = m.last_load.float()
                m.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
        return loss, gn

    if not args.target_steps:
        # probe on a throwaway copy of the optimiser state: re-init afterwards for a clean, seeded run
        state["total"] = calibrate(step, args.target_seconds, 0, "target")
        model = Target(t).to(device)
        model.init_weights(torch.Generator(device=device).manual_seed(args.seed))
        opt = make_opt(list(model.parameters()), args.target_lr, device)
        gen.manual_seed(args.seed + 1)
        moes[:] = model.moe_layers()
    else:
        state["total"] = args.target_steps
    total = state["total"]
    t1 = time.time()
    for i in range(total):
        loss, gn = step(i, total)
        if i % 100 == 0 or i == total - 1:
            msg = f"target step {i}/{total} loss {loss.item():.4f} gnorm {gn.item():.2f} lr {opt.param_groups[0]['lr']:.2e}"
            if i % 500 == 0 or i == total - 1:
                msg += f" | held-out {eval_target(model, held_ids, args, device):.4f}"
                loads = torch.stack([m.last_load.float() for m in moes])
                msg += f" | expert load max/mean {(loads.max(1).values / loads.mean(1)).max().item():.2f}"
            log(msg + f" | {(time.time() - t1):.0f}s")
    return model, total


@torch.no_grad()
def quantised_copy(model, t, device):
    """The model as exported: bf16-rounded weights, routed experts INT4-dequantised (values exact in f32)."""
    q = Target(t).to(device)
    q.load_state_dict(model.state_dict())
    for n, p in q.named_parameters():
        p.copy_(p.to(torch.bfloat16).float())
    for m in q.moe_layers():
        for w in (m.w_gate, m.w_up, m.w_down):
            for e in range(w.shape[0]):
                packed, scale = export.quantize_int4(w[e].float().cpu())
                w[e].copy_(export.dequantize_int4(packed, scale, w.shape[-1]).to(device))
        m.e_score_correction_bias.copy_(m.e_score_correction_bias.float())
    q.requires_grad_(False)
    q.eval()
    return q


def drafter_batch(target, x, args, bs, mask_id, gen, device):
    """Taps, soft labels and the block layout for windows x [B, T+1] (uses x[:, :T])."""
    B, T = x.shape[0], args.seq
    ids = x[:, :T]
    with torch.no_grad(), autocast(device):
        tl, taps = target(ids, taps=TAP_IDS)
    nA = args.anchors
    # anchors p in [1, T - bs]: at least one context token, every block position has a label
    anchors = (torch.rand(B, T - bs, generator=gen).argsort(-1)[:, :nA] + 1).sort(-1).values.to(device)
    j = torch.arange(bs, device=device)
    pos = anchors[:, :, None] + j  # [B, nA, bs]
    blk = torch.full((B, nA, bs), mask_id, device=device, dtype=torch.long)
    blk[:, :, 0] = ids.gather(1, anchors)
    # labels for block positions 1..bs-1: the target's distribution at position p+j-1 (predicts token p+j)
    lab_pos = (anchors[:, :, None] + j[1:] - 1).flatten(1)  # [B, nA*(bs-1)]
    labels = tl.gather(1, lab_pos[..., None].expand(-1, -1, tl.shape[-1])).float()
    labels = labels.view(B, nA, bs - 1, -1)
    # visibility [B, 1, nA*bs, T + nA*bs]: context columns c < p_a; block columns of the same anchor
    q_anchor = anchors[:, :, None].expand(B, nA, bs).reshape(B, -1)
    ctx_vis = torch.arange(T, device=device)[None, None] < q_anchor[:, :, None]
    a_id = torch.arange(nA, device=device).repeat_interleave(bs)
    blk_vis = (a_id[:, None] == a_id[None, :])[None].expand(B, -1, -1)
    mask = torch.cat((ctx_vis, blk_vis), -1)[:, None]
    return taps, labels, blk, pos, mask


def train_drafter(args, t, d, target, train_ids, held_ids, device, mask_id):
    torch.manual_seed(args.seed + 7)
    bs = d["block_size"]
    dcfg = export.drafter_config(t, d, args.mergeable, TAP_IDS)
    decay = torch.exp(-torch.arange(bs - 1, dtype=torch.float32, device=device) / 4.0)  # position decay, gamma 4

    def fresh():
        dr = Drafter(dcfg).to(device)
        dr.init_weights(torch.Generator(device=device).manual_seed(args.seed + 7))
        return dr, make_opt(list(dr.parameters()), args.drafter_lr, device)

    dr, opt = fresh()
    gen = torch.Generator().manual_seed(args.seed + 8)
    state = {}

    def loss_of(dr, x, g):
        taps, labels, blk, pos, mask = drafter_batch(target, x, args, bs, mask_id, g, device)
        B, nA = blk.shape[:2]
        with autocast(device):
            emb = target.embed_tokens(blk).view(B, nA * bs, -1)
            logits = dr(emb, pos.view(B, -1), taps, torch.arange(args.seq, device=device), mask, target.lm_head)
        logits = logits.float().view(B, nA, bs, -1)[:, :, 1:]
        lp = F.log_softmax(logits, -1)
        ce = -(F.softmax(labels, -1) * lp).sum(-1)  # [B, nA, bs-1]
        loss = (ce * decay).sum(-1).mean() / decay.sum()
        agree = (logits.argmax(-1) == labels.argmax(-1)).float()  # [B, nA, bs-1]
        return loss, agree

    def step(i, total, probe=False):
        x = windows(train_ids, args.batch, args.seq, gen, device)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, total, args.drafter_lr, 100)
        loss, agree = loss_of(dr, x, gen)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, agree

    @torch.no_grad()
    def held(n=8):
        g = torch.Generator().manual_seed(4321)
        ag = []
        for _ in range(n):
            _, a = loss_of(dr, windows(held_ids, args.batch, args.seq, g, device), g)
            ag.append(a)
        a = torch.cat(ag).flatten(0, 1)  # [N, bs-1]
        chain = torch.cumprod(a, -1).sum(-1).mean().item() + 1  # accepted drafts + bonus on the data path
        return a.mean(0).tolist(), chain

    if args.drafter_steps:
        total = args.drafter_steps
    else:
        total = calibrate(step, args.drafter_seconds, 0, "drafter")
        dr, opt = fresh()
        gen.manual_seed(args.seed + 8)
    t1 = time.time()
    for i in range(total):
        loss, agree = step(i, total)
        if i % 100 == 0 or i == total - 1:
            msg = f"drafter step {i}/{total} loss {loss.item():.4f} top1-agree {agree.mean().item():.3f}"
            if i % 500 == 0 or i == total - 1:
                per, chain = held()
                msg += f" | held-out agree per depth {[round(v, 3) for v in per]} chain-tau {chain:.2f}"
            log(msg + f" | {(time.time() - t1):.0f}s")
    per, chain = held(16)
    return dr, total, per, chain


# ---------------------------------------------------------------------------------------------- outputs

def heldout_prompts(held_docs, rng, n_text=16, n_chat=4):
    """Prompts from held-out files: code from a line start (~240 chars, ending at a line end) and chat questions
    from held-out docstrings."""
    out = []
    docs = [(r, t) for r, t in held_docs if len(t) > 2000]
    for k in range(n_text):
        rel, text = docs[rng.randrange(len(docs))]
        starts = [i + 1 for i, ch in enumerate(text[:-600]) if ch == "\n" and text[i + 1:i + 2].strip()]
        s = starts[rng.randrange(len(starts))]
        e = text.find("\n", s + 240)
        out.append(({"id": f"held-{k:02d}", "prompt": text[s:e + 1], "max_tokens": 64}, rel))
    qa = [(rel, q) for rel, t in held_docs for q, _ in data.functions_with_docstrings(t)]
    for k in range(min(n_chat, len(qa))):
        rel, q = qa[rng.randrange(len(qa))]
        out.append(({"id": f"held-chat-{k}", "messages": [{"role": "user", "content": q}], "thinking": False,
                     "max_tokens": 64}, rel))
    return out


def main():
    args = parse()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t, d = dict(TARGET), dict(DRAFTER)
    if args.toy:
        t.update(num_hidden_layers=2, intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2)
        d.update(num_hidden_layers=1, intermediate_size=256)
        args.mergeable = min(args.mergeable, 512)
    global TAP_IDS
    if args.toy:
        TAP_IDS = [0, 1]
    log(f"torch {torch.__version__} on {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
        + f"; args {vars(args)}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    root, train_docs, held_docs = load_corpus(args)
    tokens = build_tokenizer(args, train_docs)
    enc = bpe.tiktoken_encoding(tokens)
    rng = random.Random(args.seed)
    train_ids, n_chat = encode_stream(enc, train_docs, rng, args.workers)
    held_ids, n_chat_h = encode_stream(enc, held_docs, rng, args.workers)
    n_chars = sum(len(x) for _, x in train_docs)
    log(f"tokens: train {len(train_ids)} ({n_chat} chat samples; {n_chars / len(train_ids):.2f} chars/token on docs+chat), "
        f"held out {len(held_ids)} ({n_chat_h} chat)")
    tc = export.text_config(t, args.mergeable)

    target, t_steps = train_target(args, tc, train_ids, held_ids, device)
    held_fp = eval_target(target, held_ids, args, device)
    qt = quantised_copy(target, tc, device)
    held_q = eval_target(qt, held_ids, args, device)
    log(f"target held-out CE: trained {held_fp:.4f}, as exported (bf16 + INT4 experts) {held_q:.4f}")

    mask_id = args.mergeable + bpe.UNK
    dr, d_steps, per, chain = train_drafter(args, tc, d, qt, train_ids, held_ids, device, mask_id)
    log(f"drafter held-out top-1 agreement per depth {[round(v, 3) for v in per]}, data-path chain tau {chain:.2f}")

    out = os.path.join(args.out, "kdtree-tiny")
    with open(args.chat_template) as f:
        template = f.read()
    # export from the trained weights (re-quantising qt's dequantised experts would change scales where q = -8)
    export.write_pair(out, target.cpu(), dr.cpu(), tc, d, tokens, TAP_IDS, template, args.seed)
    prompts = heldout_prompts(held_docs, random.Random(args.seed + 99))
    with open(os.path.join(args.out, "heldout_prompts.jsonl"), "w") as f:
        for p, _ in prompts:
            f.write(json.dumps(p) + "\n")
    ev = {"seed": args.seed, "torch": torch.__version__, "python": sys.version.split()[0], "stdlib": root,
          "files_train": len(train_docs), "files_held_out": len(held_docs), "tokens_train": len(train_ids),
          "tokens_held_out": len(held_ids), "mergeable": args.mergeable, "target_steps": t_steps,
          "drafter_steps": d_steps, "batch": args.batch, "seq": args.seq,
          "target_held_out_ce": held_fp, "target_held_out_ce_exported": held_q,
          "drafter_held_out_top1_per_depth": per, "drafter_data_path_chain_tau": chain,
          "heldout_prompt_sources": {p["id"]: rel for p, rel in prompts},
          "held_out_files": [r for r, _ in held_docs]}
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(ev, f, indent=1)
    sizes = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fs in os.walk(out) for fn in fs)
    log(f"wrote {out} ({sizes / 1e6:.1f} MB); total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()

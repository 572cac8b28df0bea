//! The ops a device round issues, recorded: a backend that forwards every `Backend` call to the CPU
//! reference and logs the call's name and shapes (row counts, buffer lengths, offsets; never values) runs a
//! single-sequence AR step, DDTree round and chain round (greedy and sampled) and the batched AR step and
//! rounds of two sequences, and the log is compared with tests/fixtures/round_ops.txt, recorded from the
//! code before the single-sequence round became a batch of one (issue 25). On a GPU the same calls are the
//! same kernels in the same order with the same shapes, so the tokens there stay as they were too.
//! `KDTREE_BLESS_ROUND_OPS=1` rewrites the fixture.

use half::bf16;
use kdtree_convert::synth::{configs, resolve};
use kdtree_engine::backend::{Cols, Compute, PosOf, Resources, RopeSeg, RopeTable, TreeOps, VocabShards, WeightRef};
use kdtree_engine::cpu::ops::{Fill, MlaDims, Router};
use kdtree_engine::cpu::CpuBackend;
use kdtree_engine::ddtree::{TreeResult, Visibility};
use kdtree_engine::drafter::DFlashDrafter;
use kdtree_engine::generate::{Mode, Sampling};
use kdtree_engine::model::source::Slab;
use kdtree_engine::model::weights::{I4Stack, Mat};
use kdtree_engine::model::{AttnMode, DummySource, Model, TargetModel, Weights};
use kdtree_engine::Loaded;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

type C = CpuBackend;

/// The CPU backend, logging every call.
#[derive(Clone, Default)]
struct Rec {
    inner: C,
    log: Arc<Mutex<Vec<String>>>,
}

impl Rec {
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

macro_rules! rec {
    ($self:ident, $name:literal $(, $a:expr)*) => {{
        let parts: Vec<String> = vec![String::from($name) $(, $a.to_string())*];
        $self.note(parts.join(" "));
    }};
}

fn cols(c: Cols) -> String {
    format!("[{}..{} of {}]", c.off, c.off + c.width, c.ld)
}

fn pos(p: &PosOf<'_, Rec>) -> &'static str {
    match p {
        PosOf::Kv(_) => "kv",
        PosOf::Pos(_) => "pos",
    }
}

fn cpu_pos<'a>(p: PosOf<'a, Rec>) -> PosOf<'a, C> {
    match p {
        PosOf::Kv(k) => PosOf::Kv(k),
        PosOf::Pos(p) => PosOf::Pos(p),
    }
}

impl Resources for Rec {
    type Act = <C as Resources>::Act;
    type LinIn = <C as Resources>::LinIn;
    type Mat = <C as Resources>::Mat;
    type I4 = <C as Resources>::I4;
    type Vector = <C as Resources>::Vector;
    type VectorF32 = <C as Resources>::VectorF32;
    type Kv = <C as Resources>::Kv;
    type Routes = <C as Resources>::Routes;
    type Ids = <C as Resources>::Ids;
    type Rope = <C as Resources>::Rope;
    type Mask = <C as Resources>::Mask;
    type Tree = <C as Resources>::Tree;
    type Pos = <C as Resources>::Pos;
    type Graph = <C as Resources>::Graph;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn check(&self) -> anyhow::Result<()> {
        rec!(self, "check");
        self.inner.check()
    }
    fn upload_bf16(&self, m: Mat) -> anyhow::Result<Self::Mat> {
        self.inner.upload_bf16(m)
    }
    fn upload_i4g32(&self, s: I4Stack) -> anyhow::Result<Self::I4> {
        self.inner.upload_i4g32(s)
    }
    fn upload_vector(&self, v: Slab<bf16>) -> anyhow::Result<Self::Vector> {
        self.inner.upload_vector(v)
    }
    fn upload_vector_f32(&self, v: Slab<f32>) -> anyhow::Result<Self::VectorF32> {
        self.inner.upload_vector_f32(v)
    }
    fn mat_rows(&self, m: &Self::Mat) -> usize {
        self.inner.mat_rows(m)
    }
    fn stack_rows(&self, mats: &mut [&mut Self::Mat]) -> anyhow::Result<()> {
        self.inner.stack_rows(mats)
    }
    fn weight_check(&self) -> kdtree_engine::backend::WeightCheck {
        self.inner.weight_check()
    }
    fn weight_xxh3(&self, w: WeightRef<'_, Self>) -> anyhow::Result<Vec<u64>> {
        self.inner.weight_xxh3(match w {
            WeightRef::Mat(m) => WeightRef::Mat(m),
            WeightRef::Vector(v) => WeightRef::Vector(v),
            WeightRef::VectorF32(v) => WeightRef::VectorF32(v),
            WeightRef::I4(v) => WeightRef::I4(v),
        })
    }
    fn fill_bf16(&self, rows: usize, cols: usize, f: &Fill) -> anyhow::Result<Self::Mat> {
        self.inner.fill_bf16(rows, cols, f)
    }
    fn fill_vector(&self, n: usize, f: &Fill) -> anyhow::Result<Self::Vector> {
        self.inner.fill_vector(n, f)
    }
    fn fill_vector_f32(&self, n: usize, f: &Fill) -> anyhow::Result<Self::VectorF32> {
        self.inner.fill_vector_f32(n, f)
    }
    fn fill_i4g32(
        &self,
        first: usize,
        count: usize,
        n: usize,
        k: usize,
        packed: &Fill,
        scales: &Fill,
    ) -> anyhow::Result<Self::I4> {
        self.inner.fill_i4g32(first, count, n, k, packed, scales)
    }
    fn rope_upload(&self, r: RopeTable) -> Self::Rope {
        rec!(self, "rope_upload");
        self.inner.rope_upload(r)
    }
    fn rope_gather(&self, r: &RopeTable, idx: &Self::Ids, t: usize) -> Self::Rope {
        rec!(self, "rope_gather", idx.len(), t);
        self.inner.rope_gather(r, idx, t)
    }
    fn mask_upload(&self, v: &Visibility) -> Self::Mask {
        rec!(self, "mask_upload");
        self.inner.mask_upload(v)
    }
    fn ids_from_host(&self, ids: &[u32]) -> Self::Ids {
        rec!(self, "ids_from_host", ids.len());
        self.inner.ids_from_host(ids)
    }
    fn ids_copy(&self, dst: &mut Self::Ids, at: usize, src: &Self::Ids, n: usize) {
        rec!(self, "ids_copy", dst.len(), at, src.len(), n);
        self.inner.ids_copy(dst, at, src, n)
    }
    fn ids_gather(&self, dst: &mut Self::Ids, srcs: &[(&Self::Ids, usize)]) {
        let ns: Vec<usize> = srcs.iter().map(|s| s.1).collect();
        rec!(self, "ids_gather", dst.len(), format!("{ns:?}"));
        self.inner.ids_gather(dst, srcs)
    }
    fn ids_write(&self, dst: &mut Self::Ids, at: usize, host: &[u32]) -> anyhow::Result<()> {
        rec!(self, "ids_write", dst.len(), at, host.len());
        self.inner.ids_write(dst, at, host)
    }
    fn ids_to_host(&self, ids: &Self::Ids) -> anyhow::Result<Vec<u32>> {
        rec!(self, "ids_to_host", ids.len());
        self.inner.ids_to_host(ids)
    }
    fn pos_new(&self, v: usize) -> Self::Pos {
        rec!(self, "pos_new");
        self.inner.pos_new(v)
    }
    fn pos_get(&self, p: &Self::Pos) -> usize {
        rec!(self, "pos_get");
        self.inner.pos_get(p)
    }
    fn pos_set(&self, p: &mut Self::Pos, v: usize) {
        rec!(self, "pos_set");
        self.inner.pos_set(p, v)
    }
    fn pos_add(&self, p: &mut Self::Pos, n: usize) {
        rec!(self, "pos_add", n);
        self.inner.pos_add(p, n)
    }
    fn pos_add_host(&self, p: &mut Self::Pos, n: usize) {
        rec!(self, "pos_add_host", n);
        self.inner.pos_add_host(p, n)
    }
    fn act_from_host(&self, x: Vec<f32>) -> Self::Act {
        rec!(self, "act_from_host", x.len());
        self.inner.act_from_host(x)
    }
    fn to_host(&self, x: &Self::Act) -> Vec<f32> {
        rec!(self, "to_host", x.len());
        self.inner.to_host(x)
    }
    fn rows(&self, x: &Self::Act, cols: usize, from: usize, to: usize) -> Self::Act {
        rec!(self, "rows", x.len(), cols, from, to);
        self.inner.rows(x, cols, from, to)
    }
    fn append_rows(&self, acc: &mut Self::Act, x: &Self::Act) {
        rec!(self, "append_rows", acc.len(), x.len());
        self.inner.append_rows(acc, x)
    }
    fn truncate(&self, x: &mut Self::Act, n: usize) {
        rec!(self, "truncate", x.len(), n);
        self.inner.truncate(x, n)
    }
    fn set_rows(&self, dst: &mut Self::Act, cols: usize, at: usize, src: &Self::Act, n: usize) {
        rec!(self, "set_rows", dst.len(), cols, at, src.len(), n);
        self.inner.set_rows(dst, cols, at, src, n)
    }
    fn set_cols(&self, dst: &mut Self::Act, dst_cols: usize, at: usize, src: &Self::Act, src_cols: usize, t: usize) {
        rec!(self, "set_cols", dst.len(), dst_cols, at, src.len(), src_cols, t);
        self.inner.set_cols(dst, dst_cols, at, src, src_cols, t)
    }
    fn zeros(&self, n: usize) -> Self::Act {
        rec!(self, "zeros", n);
        self.inner.zeros(n)
    }
    fn cols(&self, x: &Self::Act, ld: usize, from: usize, width: usize, t: usize) -> Self::Act {
        rec!(self, "cols", x.len(), ld, from, width, t);
        self.inner.cols(x, ld, from, width, t)
    }
    fn ids_blocks(&self, dst: &mut Self::Ids, roots: &[&Self::Ids], block: usize, fill: u32) {
        rec!(self, "ids_blocks", dst.len(), roots.len(), block, fill);
        self.inner.ids_blocks(dst, roots, block, fill)
    }
    fn write_rows_at_segs(&self, dsts: &mut [(&mut Self::Act, &Self::Pos, usize)], cols: usize, src: &Self::Act) {
        let ns: Vec<usize> = dsts.iter().map(|d| d.2).collect();
        rec!(self, "write_rows_at_segs", format!("{ns:?}"), cols, src.len());
        let mut d: Vec<(&mut <C as Resources>::Act, &<C as Resources>::Pos, usize)> =
            dsts.iter_mut().map(|(a, p, n)| (&mut **a, *p, *n)).collect();
        self.inner.write_rows_at_segs(&mut d, cols, src)
    }
    fn reserve_rows(&self, x: &mut Self::Act, cols: usize, rows: usize) -> bool {
        rec!(self, "reserve_rows", x.len(), cols, rows);
        self.inner.reserve_rows(x, cols, rows)
    }
    fn stash_rows(
        &self,
        dsts: &mut [(&mut Self::Act, &mut Self::Pos)],
        cols: usize,
        src: &Self::Act,
    ) -> anyhow::Result<()> {
        rec!(self, "stash_rows", dsts.len(), cols, src.len());
        self.inner.stash_rows(dsts, cols, src)
    }
    fn write_rows_at(&self, dst: &mut Self::Act, cols: usize, at: &Self::Pos, src: &Self::Act, n: usize) {
        rec!(self, "write_rows_at", cols, src.len(), n);
        self.inner.write_rows_at(dst, cols, at, src, n)
    }
    fn kv_new(&self, layers: usize, width: usize) -> Self::Kv {
        rec!(self, "kv_new", layers, width);
        self.inner.kv_new(layers, width)
    }
    fn kv_committed(&self, kv: &Self::Kv) -> usize {
        self.inner.kv_committed(kv)
    }
    fn kv_reserve(&self, kv: &mut Self::Kv, rows: usize) -> anyhow::Result<()> {
        rec!(self, "kv_reserve", rows);
        self.inner.kv_reserve(kv, rows)
    }
    fn kv_id(&self, kv: &Self::Kv) -> u64 {
        rec!(self, "kv_id");
        self.inner.kv_id(kv)
    }
    fn kv_drop_scratch(&self, kv: &mut Self::Kv) {
        rec!(self, "kv_drop_scratch");
        self.inner.kv_drop_scratch(kv)
    }
    fn kv_set_scratch(&self, kv: &mut Self::Kv, t: usize) {
        rec!(self, "kv_set_scratch", t);
        self.inner.kv_set_scratch(kv, t)
    }
    fn kv_compact(&self, kv: &mut Self::Kv, path: &[usize]) -> anyhow::Result<()> {
        rec!(self, "kv_compact", path.len());
        self.inner.kv_compact(kv, path)
    }
    fn kv_commit_rows(&self, kv: &mut Self::Kv, n: usize) -> anyhow::Result<()> {
        rec!(self, "kv_commit_rows", n);
        self.inner.kv_commit_rows(kv, n)
    }
    fn kv_commit_rows_segs(&self, kvs: &mut [&mut Self::Kv], n: usize) -> anyhow::Result<()> {
        rec!(self, "kv_commit_rows_segs", kvs.len(), n);
        self.inner.kv_commit_rows_segs(kvs, n)
    }
    fn kv_commit_rows_host(&self, kv: &mut Self::Kv, n: usize) {
        rec!(self, "kv_commit_rows_host", n);
        self.inner.kv_commit_rows_host(kv, n)
    }
    fn kv_truncate(&self, kv: &mut Self::Kv, len: usize) -> anyhow::Result<()> {
        rec!(self, "kv_truncate", len);
        self.inner.kv_truncate(kv, len)
    }
    fn kv_reset(&self, kv: &mut Self::Kv) {
        rec!(self, "kv_reset");
        self.inner.kv_reset(kv)
    }
    fn kv_row_bytes(&self, kv: &Self::Kv) -> usize {
        self.inner.kv_row_bytes(kv)
    }
    fn kv_release(&self, kv: &mut Self::Kv) {
        rec!(self, "kv_release");
        self.inner.kv_release(kv)
    }
    fn mem_free(&self) -> Option<usize> {
        self.inner.mem_free()
    }
    fn rope_cat(&self, ropes: &[&Self::Rope]) -> Self::Rope {
        rec!(self, "rope_cat", ropes.len());
        self.inner.rope_cat(ropes)
    }
}

impl Compute for Rec {
    fn decide_rows(
        &self,
        logits: &Self::Act,
        row0: usize,
        rows: usize,
        vocab: usize,
        s: &Sampling,
        base: PosOf<'_, Self>,
        offset: usize,
        out: &mut Self::Ids,
    ) -> anyhow::Result<()> {
        rec!(
            self,
            "decide_rows",
            logits.len(),
            row0,
            rows,
            vocab,
            s.is_greedy(),
            pos(&base),
            offset,
            out.len()
        );
        self.inner
            .decide_rows(logits, row0, rows, vocab, s, cpu_pos(base), offset, out)
    }
    fn rope_at(
        &self,
        inv_freq: &Self::VectorF32,
        factor: f64,
        base: PosOf<'_, Self>,
        offsets: Option<&Self::Ids>,
        t: usize,
    ) -> Self::Rope {
        rec!(self, "rope_at", pos(&base), offsets.map_or(0, |o| o.len()), t);
        self.inner.rope_at(inv_freq, factor, cpu_pos(base), offsets, t)
    }
    fn linear(&self, x: &Self::Act, t: usize, w: &Self::Mat) -> Self::Act {
        rec!(self, "linear", x.len(), t, self.inner.mat_rows(w));
        self.inner.linear(x, t, w)
    }
    fn rms_norm_in(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> Self::LinIn {
        rec!(self, "rms_norm_in", x.len(), w.len());
        self.inner.rms_norm_in(x, w, eps)
    }
    fn add_rms_norm_in(&self, x: &mut Self::Act, a: &Self::Act, w: &Self::Vector, eps: f32) -> Self::LinIn {
        rec!(self, "add_rms_norm_in", x.len(), w.len());
        self.inner.add_rms_norm_in(x, a, w, eps)
    }
    fn lin_in(&self, x: &Self::Act) -> Self::LinIn {
        rec!(self, "lin_in", x.len());
        self.inner.lin_in(x)
    }
    fn linear_in(&self, x: &Self::LinIn, t: usize, w: &Self::Mat) -> Self::Act {
        rec!(self, "linear", x.len(), t, self.inner.mat_rows(w));
        self.inner.linear_in(x, t, w)
    }
    fn linear_in_cat(&self, x: &Self::LinIn, t: usize, ws: &[&Self::Mat]) -> Self::Act {
        let rows: Vec<String> = ws.iter().map(|w| self.inner.mat_rows(w).to_string()).collect();
        rec!(self, "linear_in_cat", x.len(), t, rows.join("+"));
        self.inner.linear_in_cat(x, t, ws)
    }
    fn rms_norm_in_cols(&self, x: &Self::Act, c: Cols, t: usize, w: &Self::Vector, eps: f32) -> Self::LinIn {
        rec!(self, "rms_norm_in_cols", x.len(), cols(c), t, w.len());
        self.inner.rms_norm_in_cols(x, c, t, w, eps)
    }
    fn silu_mul_in_cols(&self, x: &Self::Act, gate: Cols, up: Cols, t: usize) -> Self::LinIn {
        rec!(self, "silu_mul_in_cols", x.len(), cols(gate), cols(up), t);
        self.inner.silu_mul_in_cols(x, gate, up, t)
    }
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> Self::Act {
        rec!(self, "rms_norm", x.len(), w.len());
        self.inner.rms_norm(x, w, eps)
    }
    fn add(&self, acc: &mut Self::Act, x: &Self::Act) {
        rec!(self, "add", acc.len(), x.len());
        self.inner.add(acc, x)
    }
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act {
        rec!(self, "silu_mul", gate.len(), up.len());
        self.inner.silu_mul(gate, up)
    }
    fn silu_mul_in(&self, gate: &Self::Act, up: &Self::Act) -> Self::LinIn {
        rec!(self, "silu_mul_in", gate.len(), up.len());
        self.inner.silu_mul_in(gate, up)
    }
    fn all_reduce(&self, partials: Vec<Self::Act>) -> Self::Act {
        rec!(self, "all_reduce", partials.len());
        self.inner.all_reduce(partials)
    }
    fn embedding(&self, v: &VocabShards<'_, Self::Mat>, h: usize, tokens: &[u32]) -> Self::Act {
        rec!(self, "embedding", h, tokens.len());
        self.inner.embedding(v, h, tokens)
    }
    fn embedding_ids(&self, v: &VocabShards<'_, Self::Mat>, h: usize, ids: &Self::Ids, n: usize) -> Self::Act {
        rec!(self, "embedding_ids", h, ids.len(), n);
        self.inner.embedding_ids(v, h, ids, n)
    }
    fn lm_head(&self, x: &Self::Act, n: usize, h: usize, v: &VocabShards<'_, Self::Mat>) -> Self::Act {
        rec!(self, "lm_head", x.len(), n, h);
        self.inner.lm_head(x, n, h, v)
    }
    fn lm_head_argmax_into(
        &self,
        x: &Self::Act,
        n: usize,
        h: usize,
        v: &VocabShards<'_, Self::Mat>,
        out: &mut Self::Ids,
        row0: usize,
    ) -> anyhow::Result<()> {
        rec!(self, "lm_head_argmax_into", x.len(), n, h, out.len(), row0);
        self.inner.lm_head_argmax_into(x, n, h, v, out, row0)
    }
    fn kv_append_latent(
        &self,
        kv: &mut Self::Kv,
        l: usize,
        ckv: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        rope: &Self::Rope,
    ) {
        rec!(self, "kv_append_latent", l, ckv.len());
        self.inner.kv_append_latent(kv, l, ckv, norm, eps, rope)
    }
    fn kv_append_latent_cols(
        &self,
        kv: &mut Self::Kv,
        l: usize,
        ckv: &Self::Act,
        c: Cols,
        t: usize,
        norm: &Self::Vector,
        eps: f32,
        rope: &Self::Rope,
    ) {
        rec!(self, "kv_append_latent_cols", l, ckv.len(), cols(c), t);
        self.inner.kv_append_latent_cols(kv, l, ckv, c, t, norm, eps, rope)
    }
    fn rope_q(&self, q: &mut Self::Act, heads: usize, nope: usize, rope: &Self::Rope) {
        rec!(self, "rope_q", q.len(), heads, nope);
        self.inner.rope_q(q, heads, nope, rope)
    }
    fn mla_attention(
        &self,
        q: &Self::Act,
        t: usize,
        kv: &Self::Kv,
        l: usize,
        mask: &Self::Mask,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::Act {
        rec!(self, "mla_attention", q.len(), t, l, format!("{mode:?}"));
        self.inner.mla_attention(q, t, kv, l, mask, kv_b, d, mode)
    }
    fn mla_attention_in(
        &self,
        q: &Self::Act,
        t: usize,
        kv: &Self::Kv,
        l: usize,
        mask: &Self::Mask,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::LinIn {
        rec!(self, "mla_attention", q.len(), t, l, format!("{mode:?}"));
        self.inner.mla_attention_in(q, t, kv, l, mask, kv_b, d, mode)
    }
    fn mla_attention_segs_in(
        &self,
        q: &Self::Act,
        segs: &[(&Self::Kv, &Self::Mask, usize)],
        l: usize,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::LinIn {
        let ts: Vec<usize> = segs.iter().map(|s| s.2).collect();
        rec!(
            self,
            "mla_attention_segs",
            q.len(),
            format!("{ts:?}"),
            l,
            format!("{mode:?}")
        );
        self.inner.mla_attention_segs_in(q, segs, l, kv_b, d, mode)
    }
    fn mla_attention_segs(
        &self,
        q: &Self::Act,
        segs: &[(&Self::Kv, &Self::Mask, usize)],
        l: usize,
        kv_b: &Self::Mat,
        d: &MlaDims,
        mode: AttnMode,
    ) -> Self::Act {
        let ts: Vec<usize> = segs.iter().map(|s| s.2).collect();
        rec!(
            self,
            "mla_attention_segs",
            q.len(),
            format!("{ts:?}"),
            l,
            format!("{mode:?}")
        );
        self.inner.mla_attention_segs(q, segs, l, kv_b, d, mode)
    }
    fn kv_append_latent_segs(
        &self,
        segs: &mut [(&mut Self::Kv, usize)],
        l: usize,
        ckv: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        width: usize,
        rope_all: &Self::Rope,
    ) {
        let ts: Vec<usize> = segs.iter().map(|s| s.1).collect();
        rec!(self, "kv_append_latent_segs", format!("{ts:?}"), l, ckv.len(), width);
        self.inner
            .kv_append_latent_segs(segs, l, ckv, norm, eps, width, rope_all)
    }
    fn moe_route(&self, logits: &Self::Act, t: usize, r: &Router, bias: Option<&Self::VectorF32>) -> Self::Routes {
        rec!(self, "moe_route", logits.len(), t, bias.is_some());
        self.inner.moe_route(logits, t, r, bias)
    }
    fn moe_route_cols(
        &self,
        logits: &Self::Act,
        c: Cols,
        t: usize,
        r: &Router,
        bias: Option<&Self::VectorF32>,
    ) -> Self::Routes {
        rec!(self, "moe_route_cols", logits.len(), cols(c), t, bias.is_some());
        self.inner.moe_route_cols(logits, c, t, r, bias)
    }
    fn routes_to_host(&self, routes: &Self::Routes) -> (Vec<i32>, Vec<f32>) {
        rec!(self, "routes_to_host");
        self.inner.routes_to_host(routes)
    }
    fn moe_experts(
        &self,
        x: &Self::LinIn,
        t: usize,
        h: usize,
        routes: &Self::Routes,
        gate: &Self::I4,
        up: &Self::I4,
        down: &Self::I4,
    ) -> Self::Act {
        rec!(self, "moe_experts", x.len(), t, h);
        self.inner.moe_experts(x, t, h, routes, gate, up, down)
    }
    fn head_norm_rope_neox(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        heads: usize,
        rope: &Self::Rope,
    ) -> Self::Act {
        rec!(self, "head_norm_rope_neox", x.len(), heads);
        self.inner.head_norm_rope_neox(x, w, eps, heads, rope)
    }
    fn gqa_attention(
        &self,
        q: &Self::Act,
        b: usize,
        ctx: (&Self::Act, &Self::Act),
        ctx_len: &Self::Pos,
        block: (&Self::Act, &Self::Act),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self::Act {
        rec!(
            self,
            "gqa_attention",
            q.len(),
            b,
            ctx.0.len(),
            block.0.len(),
            heads,
            kv_heads,
            head_dim
        );
        self.inner
            .gqa_attention(q, b, ctx, ctx_len, block, heads, kv_heads, head_dim)
    }
    fn gqa_attention_segs(
        &self,
        q: &Self::Act,
        b: usize,
        ctx: &[(&Self::Act, &Self::Act, &Self::Pos)],
        block: (&Self::Act, &Self::Act),
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self::Act {
        rec!(
            self,
            "gqa_attention_segs",
            q.len(),
            b,
            ctx.len(),
            block.0.len(),
            heads,
            kv_heads,
            head_dim
        );
        self.inner
            .gqa_attention_segs(q, b, ctx, block, heads, kv_heads, head_dim)
    }
    fn rope_at_segs(&self, inv_freq: &Self::VectorF32, factor: f64, segs: &[RopeSeg<'_, Self>]) -> Self::Rope {
        let desc: Vec<String> = segs
            .iter()
            .map(|(b, o, t)| format!("{}:{}:{t}", pos(b), o.map_or(0, |o| o.len())))
            .collect();
        rec!(self, "rope_at_segs", desc.join(","));
        let cpu: Vec<RopeSeg<'_, C>> = segs
            .iter()
            .map(|(b, o, t)| {
                let b = match b {
                    PosOf::Kv(k) => PosOf::Kv(*k),
                    PosOf::Pos(p) => PosOf::Pos(*p),
                };
                (cpu_pos(b), *o, *t)
            })
            .collect();
        self.inner.rope_at_segs(inv_freq, factor, &cpu)
    }
}

impl TreeOps for Rec {
    fn tree_new(&self, budget: usize, rows: usize, vocab: usize, k: usize) -> anyhow::Result<Self::Tree> {
        rec!(self, "tree_new", budget, rows, vocab, k);
        self.inner.tree_new(budget, rows, vocab, k)
    }
    fn tree_build(&self, tree: &mut Self::Tree, draft: &Self::Act, row0: usize) -> anyhow::Result<()> {
        rec!(self, "tree_build", draft.len(), row0);
        self.inner.tree_build(tree, draft, row0)
    }
    fn tree_build_batch(&self, trees: &mut [&mut Self::Tree], draft: &Self::Act, rows: usize) -> anyhow::Result<()> {
        rec!(self, "tree_build_batch", trees.len(), draft.len(), rows);
        self.inner.tree_build_batch(trees, draft, rows)
    }
    fn tree_walk_decided_batch(
        &self,
        trees: &mut [&mut Self::Tree],
        decisions: &Self::Ids,
        row0: &[usize],
    ) -> anyhow::Result<()> {
        rec!(
            self,
            "tree_walk_decided_batch",
            trees.len(),
            decisions.len(),
            format!("{row0:?}")
        );
        self.inner.tree_walk_decided_batch(trees, decisions, row0)
    }
    fn tree_path_rows_batch(
        &self,
        trees: &[&Self::Tree],
        x: &Self::Act,
        row0: &[usize],
        cols: usize,
        rows_out: usize,
    ) -> Self::Act {
        rec!(
            self,
            "tree_path_rows_batch",
            trees.len(),
            x.len(),
            format!("{row0:?}"),
            cols,
            rows_out
        );
        self.inner.tree_path_rows_batch(trees, x, row0, cols, rows_out)
    }
    fn tree_result_into_batch(&self, trees: &[&Self::Tree], stage: &mut Self::Ids, at: &[usize]) {
        rec!(
            self,
            "tree_result_into_batch",
            trees.len(),
            stage.len(),
            format!("{at:?}")
        );
        self.inner.tree_result_into_batch(trees, stage, at)
    }
    fn tree_root_only(&self, tree: &mut Self::Tree) -> anyhow::Result<()> {
        rec!(self, "tree_root_only");
        self.inner.tree_root_only(tree)
    }
    fn tree_set_root(&self, tree: &mut Self::Tree, root: u32) -> anyhow::Result<()> {
        rec!(self, "tree_set_root");
        self.inner.tree_set_root(tree, root)
    }
    fn tree_root<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Ids {
        rec!(self, "tree_root");
        self.inner.tree_root(tree)
    }
    fn tree_tokens<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Ids {
        rec!(self, "tree_tokens");
        self.inner.tree_tokens(tree)
    }
    fn tree_depths<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Ids {
        rec!(self, "tree_depths");
        self.inner.tree_depths(tree)
    }
    fn tree_mask<'t>(&self, tree: &'t Self::Tree) -> &'t Self::Mask {
        rec!(self, "tree_mask");
        self.inner.tree_mask(tree)
    }
    fn tree_walk(
        &self,
        tree: &mut Self::Tree,
        logits: &Self::Act,
        row0: usize,
        s: &Sampling,
        kv: &Self::Kv,
    ) -> anyhow::Result<()> {
        rec!(self, "tree_walk", logits.len(), row0, s.is_greedy());
        self.inner.tree_walk(tree, logits, row0, s, kv)
    }
    fn tree_walk_decided(&self, tree: &mut Self::Tree, decisions: &Self::Ids, row0: usize) -> anyhow::Result<()> {
        rec!(self, "tree_walk_decided", decisions.len(), row0);
        self.inner.tree_walk_decided(tree, decisions, row0)
    }
    fn tree_path_rows(&self, tree: &Self::Tree, x: &Self::Act, row0: usize, cols: usize, rows_out: usize) -> Self::Act {
        rec!(self, "tree_path_rows", x.len(), row0, cols, rows_out);
        self.inner.tree_path_rows(tree, x, row0, cols, rows_out)
    }
    fn tree_commit(&self, tree: &mut Self::Tree, kv: &mut Self::Kv, ctx: &mut Self::Pos) -> anyhow::Result<()> {
        rec!(self, "tree_commit");
        self.inner.tree_commit(tree, kv, ctx)
    }
    fn tree_commit_batch(&self, items: &mut [(&mut Self::Tree, &mut Self::Kv, &mut Self::Pos)]) -> anyhow::Result<()> {
        rec!(self, "tree_commit_batch", items.len());
        self.inner.tree_commit_batch(items)
    }
    fn tree_commit_host(&self, tree: &Self::Tree, kv: &mut Self::Kv, ctx: &mut Self::Pos, n: usize) {
        rec!(self, "tree_commit_host", n);
        self.inner.tree_commit_host(tree, kv, ctx, n)
    }
    fn tree_result(&self, tree: &Self::Tree) -> anyhow::Result<TreeResult> {
        rec!(self, "tree_result");
        self.inner.tree_result(tree)
    }
    fn tree_result_words(&self, tree: &Self::Tree) -> usize {
        rec!(self, "tree_result_words");
        self.inner.tree_result_words(tree)
    }
    fn tree_result_into(&self, tree: &Self::Tree, stage: &mut Self::Ids, at: usize) {
        rec!(self, "tree_result_into", stage.len(), at);
        self.inner.tree_result_into(tree, stage, at)
    }
    fn tree_result_from(&self, tree: &Self::Tree, words: &[u32]) -> anyhow::Result<TreeResult> {
        rec!(self, "tree_result_from", words.len());
        self.inner.tree_result_from(tree, words)
    }
    fn graph_run(
        &self,
        graph: &mut Option<Self::Graph>,
        key: u64,
        body: &mut dyn FnMut() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        rec!(self, "graph_run {");
        let r = self.inner.graph_run(graph, key, body);
        rec!(self, "graph_run }");
        r
    }
}

/// The tiny preset with seeded dummy weights (target and drafter) on the recording backend.
fn model(rec: &Rec) -> Loaded {
    let p = resolve("tiny", None).unwrap();
    let (c, d) = (
        configs::model_config(&p).to_string(),
        configs::drafter_config(&p).to_string(),
    );
    let src = DummySource::from_json("tiny/config.json", &c, Some(("tiny/drafter/config.json", &d)), 1, 0, 5).unwrap();
    let src: Arc<dyn kdtree_engine::model::TensorSource> = Arc::new(src);
    let taps = src.drafter_config().unwrap().dflash_config.target_layer_ids.clone();
    let w = Arc::new(Weights::load_on(rec.clone(), src.clone()).unwrap());
    let target = TargetModel::new(w.clone(), taps, AttnMode::Absorbed).unwrap();
    let drafter = DFlashDrafter::load_on(rec.clone(), &*src, w).unwrap();
    Loaded::of("rec", "cpu".into(), Model::new(target, Some(drafter)))
}

fn sampled() -> Sampling {
    Sampling {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 0,
        seed: 3,
    }
}

const PROMPTS: [&[u32]; 2] = [&[1, 300, 5, 9, 511, 17], &[7, 8, 9]];

/// Every scenario's log, one section per step.
fn record() -> String {
    let rec = Rec::default();
    let mut m = model(&rec);
    let mut out = String::new();
    let section = |out: &mut String, name: String, log: Vec<String>| {
        let _ = writeln!(out, "== {name}");
        for l in log {
            let _ = writeln!(out, "{l}");
        }
    };
    let modes = [
        ("ar", Mode::Ar),
        ("tree8", Mode::DDTree { budget: 8 }),
        ("tree32", Mode::DDTree { budget: 32 }),
        ("chain", Mode::Chain),
    ];
    for (s_name, s) in [("greedy", Sampling::greedy()), ("sampled", sampled())] {
        for (m_name, mode) in modes {
            let mut sess = m.session(mode).unwrap();
            sess.prefill(PROMPTS[0], &s).unwrap();
            rec.take();
            for k in 0..2 {
                sess.step().unwrap();
                assert!(
                    sess.device_rounds() + sess.device_steps() == k + 1,
                    "{m_name}: a device step"
                );
                section(&mut out, format!("single {m_name} {s_name} step {k}"), rec.take());
            }
        }
    }
    for (s_name, s) in [("greedy", Sampling::greedy()), ("sampled", sampled())] {
        for (m_name, mode) in modes {
            let mut batch = m.batch(mode, 2, None).unwrap();
            let items: Vec<(usize, &[u32], &Sampling)> = vec![(0, PROMPTS[0], &s), (1, PROMPTS[1], &s)];
            for r in batch.prefill_many(&items) {
                r.unwrap();
            }
            rec.take();
            for k in 0..2 {
                batch.step(&[0, 1]).unwrap();
                section(&mut out, format!("batch {m_name} {s_name} step {k}"), rec.take());
            }
            assert_eq!(batch.batched_steps, 2, "{m_name}: batched steps");
        }
    }
    out
}

#[test]
fn rounds_issue_the_recorded_ops() {
    let got = record();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/round_ops.txt");
    if std::env::var_os("KDTREE_BLESS_ROUND_OPS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap();
    let (g, w): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
    if let Some(i) = (0..g.len().max(w.len())).find(|&i| g.get(i) != w.get(i)) {
        let head = w[..i.min(w.len())]
            .iter()
            .rev()
            .find(|l| l.starts_with("=="))
            .unwrap_or(&"");
        panic!(
            "op {i} differs (section {head}): got {:?}, recorded {:?}",
            g.get(i),
            w.get(i)
        );
    }
}

/// A target runs the device round only with its own model's drafter: with another model's drafter (same
/// backend, same weights) the round is left to the host (None), and with its own it runs. Before issue 25 the
/// target took any drafter of its backend it could downcast to.
#[test]
fn a_device_round_needs_the_models_own_drafter() {
    let (mut a, mut b) = (model(&Rec::default()), model(&Rec::default()));
    let s = Sampling::greedy();
    let other = b.drafter.as_deref_mut().unwrap();
    assert!(
        a.target.device_round(other, 5, 8, &s).is_none(),
        "another model's drafter"
    );
    assert!(
        a.target.device_chain(other, 5, &s).is_none(),
        "another model's drafter (chain)"
    );
    let own = a.drafter.as_deref_mut().unwrap();
    let r = a.target.device_round(own, 5, 8, &s).expect("its own drafter").unwrap();
    assert_eq!(r.drafted, 8);
    assert_eq!(a.target.committed(), r.walk.path.len());
}

//! A prompt record as safetensors: the tensors of one prompt file (the table in bundle.rs), written
//! deterministically ([`PromptRecord::to_bytes`]) and read back with every name, dtype and shape checked.

use super::{ArRecord, DdtreeRecord, LayerTrace, PromptRecord, TraceRecord, FORMAT};
use anyhow::{bail, ensure, Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};

/// Owned tensor for the safetensors writer.
pub(super) struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &Owned {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

#[derive(Default)]
struct Tensors(BTreeMap<String, Owned>);

impl Tensors {
    fn put(&mut self, name: impl Into<String>, dtype: Dtype, shape: &[usize], data: Vec<u8>) {
        let name = name.into();
        let prev = self.0.insert(
            name.clone(),
            Owned {
                dtype,
                shape: shape.to_vec(),
                data,
            },
        );
        assert!(prev.is_none(), "tensor {name} written twice");
    }
    fn f32(&mut self, name: impl Into<String>, shape: &[usize], v: &[f32]) {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        self.put(
            name,
            Dtype::F32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
    fn i32(&mut self, name: impl Into<String>, shape: &[usize], v: impl IntoIterator<Item = i64>) {
        let data: Vec<u8> = v
            .into_iter()
            .flat_map(|x| i32::try_from(x).expect("value does not fit i32").to_le_bytes())
            .collect();
        assert_eq!(shape.iter().product::<usize>() * 4, data.len());
        self.put(name, Dtype::I32, shape, data);
    }
    fn u64(&mut self, name: impl Into<String>, shape: &[usize], v: &[u64]) {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        self.put(
            name,
            Dtype::U64,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
}

fn ids(v: &[u32]) -> impl Iterator<Item = i64> + '_ {
    v.iter().map(|&x| x as i64)
}

impl PromptRecord {
    /// The safetensors bytes of this record (deterministic).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut t = Tensors::default();
        t.i32("prompt_ids", &[self.prompt_ids.len()], ids(&self.prompt_ids));
        let ar = &self.ar;
        let n = ar.tokens.len();
        ensure!(
            ar.topk_ids.len() == n * ar.topk && ar.topk_logits.len() == n * ar.topk,
            "ar top-k arrays do not match {n} steps x k {}",
            ar.topk
        );
        ensure!(
            ar.full_logits.len() == ar.full_steps * ar.vocab && ar.full_steps <= n,
            "ar full logits do not match {} steps x vocab {}",
            ar.full_steps,
            ar.vocab
        );
        t.i32("ar.tokens", &[n], ids(&ar.tokens));
        t.i32("ar.topk_ids", &[n, ar.topk], ids(&ar.topk_ids));
        t.f32("ar.topk_logits", &[n, ar.topk], &ar.topk_logits);
        t.f32("ar.full_logits", &[ar.full_steps, ar.vocab], &ar.full_logits);
        if !ar.router_margins.is_empty() {
            ensure!(ar.router_margins.len() == n, "ar router margins do not match {n} steps");
            t.f32("ar.router_margins", &[n], &ar.router_margins);
        }
        if let Some(tr) = &self.trace {
            t.i32(
                "trace.meta",
                &[3],
                [tr.step as i64, tr.position as i64, tr.token as i64],
            );
            for (l, lt) in tr.layers.iter().enumerate() {
                let p = format!("trace.layer.{l}");
                t.f32(format!("{p}.attn_out"), &[lt.attn_out.len()], &lt.attn_out);
                t.f32(format!("{p}.mlp_out"), &[lt.mlp_out.len()], &lt.mlp_out);
                t.f32(format!("{p}.residual"), &[lt.residual.len()], &lt.residual);
                ensure!(
                    lt.router_ids.len() == lt.router_weights.len(),
                    "layer {l}: router ids/weights lengths differ"
                );
                if !lt.router_ids.is_empty() {
                    t.i32(format!("{p}.router_ids"), &[lt.router_ids.len()], ids(&lt.router_ids));
                    t.f32(
                        format!("{p}.router_weights"),
                        &[lt.router_weights.len()],
                        &lt.router_weights,
                    );
                }
            }
        }
        if let Some(d) = &self.ddtree {
            let nodes = d.tree_tokens.len();
            ensure!(
                d.tree_parents.len() == nodes && d.tree_depths.len() == nodes,
                "ddtree tree arrays differ in length"
            );
            ensure!(
                d.visibility.len() == nodes * d.visibility_words,
                "ddtree visibility is not [N+1, W]"
            );
            ensure!(
                d.verify_logits.len() == nodes * d.vocab,
                "ddtree verify logits are not [N+1, V]"
            );
            ensure!(
                d.draft_logits.len() == d.draft_rows * d.vocab,
                "ddtree draft logits are not [R, V]"
            );
            ensure!(
                d.accepted.len() == d.decisions.len(),
                "ddtree accepted/decisions lengths differ"
            );
            t.i32(
                "ddtree.meta",
                &[4],
                [d.start as i64, d.root as i64, d.budget as i64, d.bonus as i64],
            );
            t.f32("ddtree.draft_logits", &[d.draft_rows, d.vocab], &d.draft_logits);
            t.i32("ddtree.tree_tokens", &[nodes], ids(&d.tree_tokens));
            t.i32(
                "ddtree.tree_parents",
                &[nodes],
                d.tree_parents.iter().map(|&x| x as i64),
            );
            t.i32("ddtree.tree_depths", &[nodes], ids(&d.tree_depths));
            t.u64("ddtree.visibility", &[nodes, d.visibility_words], &d.visibility);
            t.f32("ddtree.verify_logits", &[nodes, d.vocab], &d.verify_logits);
            t.i32(
                "ddtree.accepted",
                &[d.accepted.len()],
                d.accepted.iter().map(|&x| x as i64),
            );
            t.i32("ddtree.decisions", &[d.decisions.len()], ids(&d.decisions));
            if !d.router_margins.is_empty() {
                ensure!(
                    d.router_margins.len() == nodes,
                    "ddtree router margins do not match {nodes} nodes"
                );
                t.f32("ddtree.router_margins", &[nodes], &d.router_margins);
            }
        }
        let meta = HashMap::from([("format".to_string(), FORMAT.to_string())]);
        Ok(safetensors::serialize(
            t.0.iter().map(|(k, v)| (k.as_str(), v)),
            Some(meta),
        )?)
    }

    /// Parse the bytes of one prompt file.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).with_context(|| format!("{what}: not a safetensors file"))?;
        let (_, meta) = SafeTensors::read_metadata(bytes)?;
        let fmt = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format"))
            .map(String::as_str);
        ensure!(
            fmt == Some(FORMAT),
            "{what}: metadata format {fmt:?}, expected {FORMAT:?}"
        );
        let r = Reader { st: &st, what };
        let prompt_ids = r.u32s("prompt_ids")?.1;
        let (tshape, tokens) = r.u32s("ar.tokens")?;
        let n = tshape[0];
        let (kshape, topk_ids) = r.u32s("ar.topk_ids")?;
        let (_, topk_logits) = r.f32s("ar.topk_logits", Some(&kshape))?;
        ensure!(
            kshape.len() == 2 && kshape[0] == n,
            "{what}: ar.topk_ids shape {kshape:?} vs {n} tokens"
        );
        let (fshape, full_logits) = r.f32s("ar.full_logits", None)?;
        ensure!(
            fshape.len() == 2 && fshape[0] <= n,
            "{what}: ar.full_logits shape {fshape:?}"
        );
        let ar = ArRecord {
            tokens,
            topk: kshape[1],
            topk_ids,
            topk_logits,
            vocab: fshape[1],
            full_steps: fshape[0],
            full_logits,
            router_margins: match r.has("ar.router_margins") {
                true => r.f32s("ar.router_margins", Some(&[n]))?.1,
                false => Vec::new(),
            },
        };

        let trace = if r.has("trace.meta") {
            let meta = r.u32s("trace.meta")?.1;
            ensure!(meta.len() == 3, "{what}: trace.meta has {} values", meta.len());
            let mut layers = Vec::new();
            while r.has(&format!("trace.layer.{}.attn_out", layers.len())) {
                let p = format!("trace.layer.{}", layers.len());
                let (router_ids, router_weights) = if r.has(&format!("{p}.router_ids")) {
                    let (s, ids) = r.u32s(&format!("{p}.router_ids"))?;
                    (ids, r.f32s(&format!("{p}.router_weights"), Some(&s))?.1)
                } else {
                    (Vec::new(), Vec::new())
                };
                layers.push(LayerTrace {
                    attn_out: r.f32s(&format!("{p}.attn_out"), None)?.1,
                    router_ids,
                    router_weights,
                    mlp_out: r.f32s(&format!("{p}.mlp_out"), None)?.1,
                    residual: r.f32s(&format!("{p}.residual"), None)?.1,
                });
            }
            Some(TraceRecord {
                step: meta[0] as usize,
                position: meta[1] as usize,
                token: meta[2],
                layers,
            })
        } else {
            None
        };

        let ddtree = if r.has("ddtree.meta") {
            let meta = r.u32s("ddtree.meta")?.1;
            ensure!(meta.len() == 4, "{what}: ddtree.meta has {} values", meta.len());
            let (dshape, draft_logits) = r.f32s("ddtree.draft_logits", None)?;
            let (nshape, tree_tokens) = r.u32s("ddtree.tree_tokens")?;
            let (_, parents) = r.ints("ddtree.tree_parents", Some(&nshape))?;
            let (_, tree_depths) = r.u32s_shaped("ddtree.tree_depths", Some(&nshape))?;
            let (vshape, visibility) = r.u64s("ddtree.visibility")?;
            ensure!(
                vshape.len() == 2 && vshape[0] == nshape[0],
                "{what}: ddtree.visibility shape {vshape:?}"
            );
            let (lshape, verify_logits) = r.f32s("ddtree.verify_logits", None)?;
            ensure!(
                lshape == [nshape[0], dshape[1]],
                "{what}: ddtree.verify_logits shape {lshape:?}"
            );
            let (ashape, accepted) = r.u32s("ddtree.accepted")?;
            let (_, decisions) = r.u32s_shaped("ddtree.decisions", Some(&ashape))?;
            Some(DdtreeRecord {
                start: meta[0] as usize,
                root: meta[1],
                budget: meta[2] as usize,
                bonus: meta[3],
                vocab: dshape[1],
                draft_rows: dshape[0],
                draft_logits,
                tree_tokens,
                tree_parents: parents,
                tree_depths,
                visibility_words: vshape[1],
                visibility,
                verify_logits,
                accepted: accepted.iter().map(|&x| x as usize).collect(),
                decisions,
                router_margins: match r.has("ddtree.router_margins") {
                    true => r.f32s("ddtree.router_margins", Some(&nshape))?.1,
                    false => Vec::new(),
                },
            })
        } else {
            None
        };
        Ok(PromptRecord {
            prompt_ids,
            ar,
            trace,
            ddtree,
        })
    }
}

struct Reader<'a> {
    st: &'a SafeTensors<'a>,
    what: &'a str,
}

impl<'a> Reader<'a> {
    fn has(&self, name: &str) -> bool {
        self.st.tensor(name).is_ok()
    }
    fn get(&self, name: &str, dtype: Dtype, shape: Option<&[usize]>) -> Result<TensorView<'a>> {
        let t = self
            .st
            .tensor(name)
            .with_context(|| format!("{}: no tensor {name}", self.what))?;
        ensure!(
            t.dtype() == dtype,
            "{}: {name} is {:?}, expected {dtype:?}",
            self.what,
            t.dtype()
        );
        if let Some(s) = shape {
            ensure!(
                t.shape() == s,
                "{}: {name} has shape {:?}, expected {s:?}",
                self.what,
                t.shape()
            );
        }
        Ok(t)
    }
    fn ints(&self, name: &str, shape: Option<&[usize]>) -> Result<(Vec<usize>, Vec<i32>)> {
        let t = self.get(name, Dtype::I32, shape)?;
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
    fn u32s_shaped(&self, name: &str, shape: Option<&[usize]>) -> Result<(Vec<usize>, Vec<u32>)> {
        let (s, v) = self.ints(name, shape)?;
        if let Some(bad) = v.iter().find(|&&x| x < 0) {
            bail!("{}: {name} holds negative value {bad}", self.what);
        }
        Ok((s, v.into_iter().map(|x| x as u32).collect()))
    }
    fn u32s(&self, name: &str) -> Result<(Vec<usize>, Vec<u32>)> {
        self.u32s_shaped(name, None)
    }
    fn f32s(&self, name: &str, shape: Option<&[usize]>) -> Result<(Vec<usize>, Vec<f32>)> {
        let t = self.get(name, Dtype::F32, shape)?;
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
    fn u64s(&self, name: &str) -> Result<(Vec<usize>, Vec<u64>)> {
        let t = self.get(name, Dtype::U64, None)?;
        let v = t
            .data()
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
}

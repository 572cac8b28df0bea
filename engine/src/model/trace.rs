//! Trace hook for the golden tool: while enabled, every target forward records named per-layer tensors
//! (attention output, router top-k ids and weights, MLP/MoE output, residual after the layer), each with
//! its shape, in the order computed. Names: `layers.{L}.attn_out` [T, H], `layers.{L}.router.topk_ids`
//! [T, k] (selection order), `layers.{L}.router.topk_weights` [T, k] (after norm and scaling),
//! `layers.{L}.router.logits` [T, E] (the gate's, before the sigmoid: what `cpu::ops::route_margin` judges),
//! `layers.{L}.mlp_out` [T, H], `layers.{L}.residual` [T, H], then `final_norm` [T, H] and `logits` [T, V].
//! Test: engine/tests/target_model.rs `trace_records_every_layer`.

/// One recorded tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TraceData,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TraceData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// Tensors recorded by forwards since tracing was enabled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub tensors: Vec<TraceTensor>,
}

impl Trace {
    pub fn f32(&mut self, name: String, shape: &[usize], data: &[f32]) {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len(), "trace {name}");
        self.tensors.push(TraceTensor {
            name,
            shape: shape.to_vec(),
            data: TraceData::F32(data.to_vec()),
        });
    }
    pub fn i32(&mut self, name: String, shape: &[usize], data: Vec<i32>) {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len(), "trace {name}");
        self.tensors.push(TraceTensor {
            name,
            shape: shape.to_vec(),
            data: TraceData::I32(data),
        });
    }
    /// The tensor called `name` (first recorded), if any.
    pub fn get(&self, name: &str) -> Option<&TraceTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

//! `kdtree-convert inspect`: what a converted model holds (plan, bytes per rank) and, for one tensor,
//! its dtype, shapes, layout, split and a few values (INT4 dequantized with formats::int4). Opens the
//! model through ModelDir, so it also checks sizes, headers and placements. Output on stdout.
//! Tests: tests/repack.rs (inspect_reports_plan_and_dequantized_values).

use anyhow::{bail, Result};
use half::bf16;
use kdtree_formats::int4::dequant_row_f32;
use kdtree_formats::{Dtype, Layout, ModelDir};
use std::fmt::Write;
use std::path::Path;

/// Values shown per tensor.
const SHOW: usize = 8;

/// The report for `dir`, and for `tensor` when given.
pub fn inspect(dir: &Path, tensor: Option<&str>) -> Result<String> {
    let d = ModelDir::open(dir)?;
    let m = d.manifest();
    let mut s = String::new();
    writeln!(s, "model      {}", dir.display())?;
    writeln!(s, "format     v{} ({})", m.format_version, m.generator)?;
    let t = d.text_config();
    writeln!(
        s,
        "target     {} layers, hidden {}, {} experts (top {}), vocab {}",
        t.num_hidden_layers, t.hidden_size, t.n_routed_experts, t.num_experts_per_tok, t.vocab_size
    )?;
    if let Some(dc) = d.drafter_config() {
        writeln!(
            s,
            "drafter    {} layers, target layers {:?}, block {}",
            dc.num_hidden_layers,
            dc.dflash_config.target_layer_ids,
            dc.block_size().unwrap_or(0)
        )?;
    }
    writeln!(
        s,
        "plan       ranks {}, experts {:?}, group {}, max file {} bytes, experts from {}",
        m.plan.ranks, m.plan.experts, m.plan.group_size, m.plan.max_file_size, m.plan.experts_source
    )?;
    for r in &m.plan.splits {
        writeln!(s, "  {:<60} {}", r.class, r.split)?;
    }
    writeln!(
        s,
        "skipped    {} source tensors (vision_tower.*, mm_projector.*)",
        m.skipped.len()
    )?;
    for r in 0..d.ranks() {
        let files: Vec<_> = m.files.iter().filter(|f| f.rank == r).collect();
        let bytes: u64 = files.iter().map(|f| f.size).sum();
        let n = m.tensors.iter().filter(|t| t.rank == r).count();
        writeln!(
            s,
            "rank {r:<5} {bytes} bytes ({:.2} GiB) in {} files, {n} tensors",
            bytes as f64 / (1u64 << 30) as f64,
            files.len()
        )?;
    }
    if let Some(name) = tensor {
        if !m.tensors.iter().any(|t| t.name == name) {
            bail!("{}: no tensor named \"{name}\"", dir.join("manifest.toml").display());
        }
        for r in 0..d.ranks() {
            describe(&mut s, &d, name, r)?;
        }
    }
    Ok(s)
}

fn describe(s: &mut String, d: &ModelDir, name: &str, rank: usize) -> Result<()> {
    let t = d.tensor(name, rank)?;
    let e = d
        .manifest()
        .tensors
        .iter()
        .find(|e| e.name == name && e.rank == rank)
        .expect("opened");
    let split = match t.split_axis {
        Some(a) => format!("axis {a} from {}", t.split_offset),
        None => "replicated".into(),
    };
    writeln!(
        s,
        "\n{name} rank {rank}\n  dtype {} shape {:?} logical {:?} layout {:?} split {split}",
        t.dtype, t.shape, t.logical_shape, t.layout
    )?;
    let sum = if e.xxh3.is_empty() {
        format!("sha256 {}", e.sha256)
    } else {
        format!("xxh3 {}", e.xxh3)
    };
    writeln!(s, "  file {} offset {} bytes {} {sum}", e.file, e.offset, e.nbytes)?;
    let vals: Vec<f32> = match (t.layout, t.dtype) {
        (Layout::Int4G32, _) => {
            // First row of the first expert: K_r = 2 * bytes per row; needs the matching scales.
            let scale = d.tensor(&name.replace("weight_packed", "weight_scale"), rank)?;
            let k = t.shape[2] * 2;
            let sc: Vec<bf16> = scale.data[..k / 32 * 2]
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect();
            let mut out = vec![0f32; k];
            dequant_row_f32(&t.data[..k / 2], &sc, &mut out);
            writeln!(s, "  dequantized values of expert 0, row 0 (q * scale):")?;
            out.into_iter().take(SHOW).collect()
        }
        (_, Dtype::BF16) => t
            .data
            .chunks_exact(2)
            .take(SHOW)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        (_, Dtype::F32) => t
            .data
            .chunks_exact(4)
            .take(SHOW)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        _ => Vec::new(),
    };
    writeln!(s, "  first values {vals:?}")?;
    Ok(())
}

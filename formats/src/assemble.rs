//! From plan to manifest: the exact byte layout of each planned shard file (computed from shapes alone,
//! the same header the writer emits) and the assembly of `Manifest` from the per-file records the
//! converter keeps (size, sha256 of the file, xxh3-64 of each tensor). Used by kdtree-convert repack, and by
//! formats/tests/manifest_k26.rs to build the full K2.6 manifest without any weights.

use crate::error::Result;
use crate::manifest::{FileEntry, Manifest, Model, PlanInfo, Source, SplitRule, TensorEntry, FORMAT_VERSION};
use crate::plan::{split_rules, Plan, PlannedFile, GROUP};
use crate::writer::{header_bytes, TensorSpec};
use serde::{Deserialize, Serialize};

/// What one finished shard file holds (also the converter's per-file completion record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    pub name: String,
    pub size: u64,
    pub sha256: String,
    pub tensors: Vec<TensorRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    pub name: String,
    pub offset: u64,
    pub nbytes: u64,
    /// xxh3-64 of the tensor's data (format v2).
    pub xxh3: String,
}

/// Tensor specs of a planned file, in write (name) order.
pub fn file_specs(plan: &Plan, f: &PlannedFile) -> Vec<TensorSpec> {
    f.tensors
        .iter()
        .map(|&i| {
            let t = &plan.tensors[i];
            TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            }
        })
        .collect()
}

/// The record a planned file will have, with empty hashes: exact size and offsets.
pub fn planned_record(plan: &Plan, f: &PlannedFile) -> Result<FileRecord> {
    let specs = file_specs(plan, f);
    let (header, offs) = header_bytes(&f.name, &specs)?;
    let start = 8 + header.len() as u64;
    let size = start + offs.last().map_or(0, |o| o.1 as u64);
    let tensors = specs
        .iter()
        .zip(offs)
        .map(|(s, (b, e))| TensorRecord {
            name: s.name.clone(),
            offset: start + b as u64,
            nbytes: (e - b) as u64,
            xxh3: String::new(),
        })
        .collect();
    Ok(FileRecord {
        name: f.name.clone(),
        size,
        sha256: String::new(),
        tensors,
    })
}

/// Everything the manifest needs besides the plan and the records.
pub struct ManifestInputs {
    pub generator: String,
    pub skipped: Vec<String>,
    pub source: Source,
    pub model: Model,
    pub max_file_size: u64,
    pub experts_source: String,
}

/// Assemble the manifest; `records[i]` belongs to `files[i]`.
pub fn build_manifest(plan: &Plan, files: &[PlannedFile], records: &[FileRecord], inputs: ManifestInputs) -> Manifest {
    let mut fentries = Vec::with_capacity(files.len());
    let mut tentries = Vec::with_capacity(plan.tensors.len());
    for (f, r) in files.iter().zip(records) {
        fentries.push(FileEntry {
            name: f.name.clone(),
            rank: f.rank,
            part: f.part,
            size: r.size,
            sha256: r.sha256.clone(),
        });
        for (&i, tr) in f.tensors.iter().zip(&r.tensors) {
            let t = &plan.tensors[i];
            debug_assert_eq!(t.name, tr.name);
            tentries.push(TensorEntry {
                name: t.name.clone(),
                rank: t.rank,
                dtype: t.dtype,
                shape: t.shape.clone(),
                logical_shape: t.logical_shape.clone(),
                layout: t.layout,
                split_axis: t.split_axis,
                split_offset: t.split_offset,
                file: f.name.clone(),
                offset: tr.offset,
                nbytes: tr.nbytes,
                sha256: String::new(),
                xxh3: tr.xxh3.clone(),
            });
        }
    }
    Manifest {
        format_version: FORMAT_VERSION,
        generator: inputs.generator,
        skipped: inputs.skipped,
        source: inputs.source,
        model: inputs.model,
        plan: PlanInfo {
            ranks: plan.ranks,
            experts: plan.experts,
            group_size: GROUP,
            max_file_size: inputs.max_file_size,
            experts_source: inputs.experts_source,
            splits: split_rules(plan.experts)
                .into_iter()
                .map(|(c, s)| SplitRule {
                    class: c.into(),
                    split: s.into(),
                })
                .collect(),
        },
        files: fentries,
        // Filled in by the converter once the carried files are copied (they are not part of the plan).
        aux_files: Vec::new(),
        tensors: tentries,
    }
}

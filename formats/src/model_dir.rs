//! Reading a converted model: `ModelDir::open(path)` parses manifest.toml, validates its configs
//! (formats::validate), re-derives the plan from them and requires every manifest entry to be exactly a
//! planned tensor (dtype, shard shape, logical_shape, layout, split_axis, split_offset; none missing, none
//! extra), so an edited manifest cannot send a reader out of range (issue 16 item 8); then it checks every
//! listed file's size before mapping it, validates each header strictly and checks that every manifest
//! tensor sits in its file with the recorded dtype, shape and offset. It does not hash (that is
//! `kdtree-convert verify`).
//! The API is the one in docs/design/interfaces.md (formats → engine). Tests: formats/tests/model_dir.rs.

use crate::config::{parse_drafter_config, parse_text_config, DrafterConfig, TextConfig};
use crate::error::{FormatError, Result};
use crate::manifest::{Manifest, TensorEntry, MANIFEST};
use crate::plan::{plan_model, Layout, OutTensor, SourceQuant, GROUP};
use crate::reader::SafeFile;
use crate::validate::check_model;
use crate::Dtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One tensor of one rank, borrowed from the mapped shard.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub dtype: Dtype,
    /// Shape stored in the shard (this rank's slice).
    pub shape: &'a [usize],
    /// Shape of the whole tensor (INT4 stacks: `[E, N, K]` in elements; scales `[E, N, K/32]`).
    pub logical_shape: &'a [usize],
    pub layout: Layout,
    /// Axis of `logical_shape` sliced for this rank (None: replicated) and where the slice starts.
    pub split_axis: Option<usize>,
    pub split_offset: usize,
    pub data: &'a [u8],
    /// The manifest's xxh3-64 of `data` (format 2; None in format 1 or a source without checksums).
    pub xxh3: Option<u64>,
    /// The shard file holding `data`, as the manifest names it (inside the model directory; None: a source
    /// without files), for messages about these bytes.
    pub file: Option<&'a str>,
}

/// A converted model directory, opened and mapped read-only.
pub struct ModelDir {
    root: PathBuf,
    manifest: Manifest,
    text: TextConfig,
    drafter: Option<DrafterConfig>,
    files: Vec<SafeFile>,
    /// (name, rank) → (index into manifest.tensors, index into files)
    index: HashMap<(String, usize), (usize, usize)>,
}

impl ModelDir {
    /// Open `path`: manifest, configs, every shard (size, header, tensor placement). Files are mapped
    /// read-only; they must not be modified while the ModelDir lives (mmap contract).
    pub fn open(path: impl AsRef<Path>) -> Result<ModelDir> {
        let root = path.as_ref().to_path_buf();
        let mpath = root.join(MANIFEST);
        let mname = mpath.display().to_string();
        let text = std::fs::read_to_string(&mpath).map_err(|e| FormatError::io(&mpath, e))?;
        let manifest = Manifest::parse(&mname, &text)?;
        let tc = parse_text_config(
            &format!("{mname} [model.text_config_json]"),
            &manifest.model.text_config_json,
        )
        .map_err(|e| FormatError::file(&mname, e))?;
        let dc = match &manifest.model.drafter_config_json {
            Some(j) => Some(
                parse_drafter_config(&format!("{mname} [model.drafter_config_json]"), j)
                    .map_err(|e| FormatError::file(&mname, e))?,
            ),
            None => None,
        };
        let dname = format!("{mname} [model.drafter_config_json]");
        check_model(
            &format!("{mname} [model.text_config_json]"),
            &tc,
            dc.as_ref().map(|d| (dname.as_str(), d)),
        )
        .map_err(|e| FormatError::file(&mname, e))?;
        check_against_plan(&mname, &manifest, &tc, dc.as_ref())?;
        let mut files = Vec::with_capacity(manifest.files.len());
        let mut by_name = HashMap::new();
        for f in &manifest.files {
            let p = root.join(&f.name);
            let len = std::fs::metadata(&p).map_err(|e| FormatError::io(&p, e))?.len();
            if len != f.size {
                return Err(FormatError::file(
                    p.display(),
                    format!("size {len} but the manifest says {} (truncated or replaced?)", f.size),
                ));
            }
            by_name.insert(f.name.clone(), files.len());
            files.push(SafeFile::open(&p)?);
        }
        let mut index = HashMap::with_capacity(manifest.tensors.len());
        for (i, t) in manifest.tensors.iter().enumerate() {
            let fi = by_name[&t.file];
            check_entry(&files[fi], t)?;
            index.insert((t.name.clone(), t.rank), (i, fi));
        }
        Ok(ModelDir {
            root,
            manifest,
            text: tc,
            drafter: dc,
            files,
            index,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    pub fn text_config(&self) -> &TextConfig {
        &self.text
    }
    pub fn drafter_config(&self) -> Option<&DrafterConfig> {
        self.drafter.as_ref()
    }
    pub fn ranks(&self) -> usize {
        self.manifest.plan.ranks
    }

    /// Tensor `name` (converted name, see interfaces.md) of `rank`.
    pub fn tensor(&self, name: &str, rank: usize) -> Result<TensorRef<'_>> {
        let &(ti, fi) = self.index.get(&(name.to_string(), rank)).ok_or_else(|| {
            FormatError::tensor(
                self.root.join(MANIFEST).display(),
                name,
                format!("no such tensor for rank {rank} (ranks = {})", self.ranks()),
            )
        })?;
        let t = &self.manifest.tensors[ti];
        let data = &self.files[fi].bytes()[t.offset as usize..(t.offset + t.nbytes) as usize];
        Ok(TensorRef {
            dtype: t.dtype,
            shape: &t.shape,
            logical_shape: &t.logical_shape,
            layout: t.layout,
            split_axis: t.split_axis,
            split_offset: t.split_offset,
            data,
            xxh3: crate::manifest::parse_xxh3_hex(&t.xxh3),
            file: Some(&t.file),
        })
    }
}

/// The manifest entry must match the shard header exactly.
fn check_entry(f: &SafeFile, t: &TensorEntry) -> Result<()> {
    let h = f
        .header
        .get(&t.name)
        .ok_or_else(|| FormatError::tensor(f.name(), &t.name, "listed in the manifest but not in the shard header"))?;
    let off = (f.header.data_start() + h.begin) as u64;
    if h.dtype != t.dtype || h.shape != t.shape || off != t.offset || h.nbytes() as u64 != t.nbytes {
        return Err(FormatError::tensor(
            f.name(),
            &t.name,
            format!(
                "manifest says {} {:?} at {} ({} bytes), header says {} {:?} at {off} ({} bytes)",
                t.dtype,
                t.shape,
                t.offset,
                t.nbytes,
                h.dtype,
                h.shape,
                h.nbytes()
            ),
        ));
    }
    Ok(())
}

/// Every manifest entry must be the tensor the plan of the manifest's own config puts there, and every
/// planned tensor must be listed. The plan is the converter's (`plan_model`); the source quantization
/// only changes where bytes come from, not the output entries.
fn check_against_plan(mname: &str, m: &Manifest, text: &TextConfig, drafter: Option<&DrafterConfig>) -> Result<()> {
    if m.plan.group_size != GROUP {
        return Err(FormatError::file(
            mname,
            format!("plan.group_size = {}, this build reads {GROUP}", m.plan.group_size),
        ));
    }
    let prefix = if m.tensors.iter().any(|t| t.name.starts_with("language_model.")) {
        "language_model."
    } else {
        ""
    };
    let plan = plan_model(text, drafter, prefix, SourceQuant::Bf16, m.plan.ranks, m.plan.experts)
        .map_err(|e| FormatError::file(mname, e))?;
    let mut want: HashMap<(&str, usize), &OutTensor> =
        plan.tensors.iter().map(|t| ((t.name.as_str(), t.rank), t)).collect();
    for t in &m.tensors {
        let Some(p) = want.remove(&(t.name.as_str(), t.rank)) else {
            return Err(FormatError::tensor(
                mname,
                &t.name,
                format!(
                    "rank {}: not a tensor of the model the manifest's config describes",
                    t.rank
                ),
            ));
        };
        let differs = |what: &str, found: String, planned: String| {
            FormatError::tensor(
                mname,
                &t.name,
                format!(
                    "rank {}: {what} is {found} in the manifest, the plan says {planned}",
                    t.rank
                ),
            )
        };
        if t.dtype != p.dtype {
            return Err(differs("dtype", t.dtype.to_string(), p.dtype.to_string()));
        }
        if t.layout != p.layout {
            return Err(differs("layout", format!("{:?}", t.layout), format!("{:?}", p.layout)));
        }
        if t.logical_shape != p.logical_shape {
            return Err(differs(
                "logical_shape",
                format!("{:?}", t.logical_shape),
                format!("{:?}", p.logical_shape),
            ));
        }
        if t.shape != p.shape {
            return Err(differs("shape", format!("{:?}", t.shape), format!("{:?}", p.shape)));
        }
        if t.split_axis != p.split_axis {
            return Err(differs(
                "split_axis",
                format!("{:?}", t.split_axis),
                format!("{:?}", p.split_axis),
            ));
        }
        if t.split_offset != p.split_offset {
            return Err(differs(
                "split_offset",
                t.split_offset.to_string(),
                p.split_offset.to_string(),
            ));
        }
    }
    if let Some(((name, rank), _)) = want.into_iter().min_by_key(|(k, _)| *k) {
        return Err(FormatError::tensor(
            mname,
            name,
            format!("rank {rank}: planned but not listed in the manifest"),
        ));
    }
    Ok(())
}

//! The GPU backend's and the rank groups' switches ([`GpuOptions`]): typed, passed in where a GPU is opened
//! (`cuda::Gpu::new`, `OpenOptions::gpu`), never read from the environment by the library itself.
//!
//! The tools (kdtree-run, kdtree-golden) and the GPU tests build them with [`GpuOptions::from_env`], the one
//! reader of the `KDTREE_*` switches; [`KNOBS`] lists every one (docs/design/options.md is the same table).
//! Defaults are those of a run with none of them set. Test: engine/tests/options.rs.

use std::time::Duration;

/// Switches of a GPU and of the tensor-parallel groups on it (see [`KNOBS`] for each one's variable).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuOptions {
    /// Capture DDTree rounds and AR steps into CUDA graphs (off: the same ops run eagerly).
    pub graphs: bool,
    /// Fill every buffer an op must write with NaN bytes first (test runs: a kernel that leaves an element
    /// unwritten shows up as NaN).
    pub poison: bool,
    /// Launch the W4A16 GEMMs with programmatic dependent launch (sm_90+ only; off on older GPUs whatever this
    /// says).
    pub pdl: bool,
    /// bf16 GEMMs of up to this many rows through the small-M tensor-core GEMM (kernels/cuda/gemm_small_bf16.cu)
    /// instead of cuBLAS; 0 (the default, [`SMALL_GEMM_ROWS`]): cuBLAS always outside the batch-invariant forwards.
    /// A row's bits do not depend on the call's rows in that kernel, so the decode step and tree verifies up to this
    /// many rows sum their linears alike.
    pub small_gemm_rows: usize,
    /// CTAs per SM the small-M GEMM's k-split count aims at (a row's bits depend on it: one value a run).
    pub small_ctas_per_sm: usize,
    /// A forward's sums independent of the call's rows, so that greedy DDTree == AR bit for bit
    /// (`cuda::Gpu::batch_invariant`; opt in).
    pub batch_invariant: bool,
    /// Blocks per SM the W4A16 split count aims at (1..=4).
    pub w4a16_blocks_per_sm: usize,
    /// At most this many W4A16 k-splits.
    pub w4a16_max_splits: usize,
    /// Forwards of at least this many rows (a prefill) run MLA in its expanded, multi-head form (kv_b expands the
    /// latent rows into per-head keys and values: 320 multiply-adds a head and row pair against the latent form's
    /// 1088); 0: the latent (absorbed) form everywhere.
    pub mla_expanded_min_rows: usize,
    /// The expanded form of a causal prefill through the one-kernel flash-attention form (`ops::mla_prefill`)
    /// where it is built for the widths; off: the split kernel's expanded form (the A/B of the bench).
    pub mla_prefill_flash: bool,
    /// The flash prefill feeds P to the value mma as one bf16 operand (FlashAttention's and torch SDPA's form: half
    /// the value mma's) instead of its rounding and remainder (K2.6's widths). On by default since run 99: 15 %
    /// faster (8.16 against 9.65 ms a 16K chunk after 16K), max error 2.9e-3 of the largest output against the f32
    /// reference (1.95e-3 for the split P), within the derived 8e-3; off: the A/B.
    pub mla_prefill_p1: bool,
    /// One-node MLA (the AR step) through the decode kernel (`ops::mla_decode`: latent rows as the mma's rows, the
    /// heads as its columns) where it is built for the widths (K2.6's, up to 8 heads, sm_90); off: the split kernel.
    /// Run 103: 24.0 against 50.9 us a layer at 32K rows (13.7 against 19.3 at 4K).
    pub mla_decode: bool,
    /// The device's memory pool keeps what it reserved instead of unmapping unused memory at every
    /// synchronisation (`Gpu::pool_keep`; rank groups always do).
    pub pool_keep: bool,
    /// Log every tensor-parallel group's calls and stream drains on stderr.
    pub tp_trace: bool,
    /// Time every eager backend op (host time, device time by CUDA events, the GPU's idle time before it) and
    /// print the table on stderr when the GPU is dropped (`cuda::profile`).
    pub op_profile: bool,
    /// How long a rank waits for the others inside a device-side sum (one GPU, several groups) before the
    /// kernel traps: an error, not a hang.
    pub group_timeout: Duration,
    /// How long a rank's thread waits at a launch gate for the others.
    pub gate_timeout: Duration,
}

impl Default for GpuOptions {
    fn default() -> GpuOptions {
        GpuOptions {
            graphs: true,
            poison: false,
            pdl: true,
            small_gemm_rows: SMALL_GEMM_ROWS,
            small_ctas_per_sm: 4,
            batch_invariant: false,
            w4a16_blocks_per_sm: 4,
            w4a16_max_splits: 64,
            mla_expanded_min_rows: 1024,
            mla_prefill_flash: true,
            mla_prefill_p1: true,
            mla_decode: true,
            pool_keep: false,
            tp_trace: false,
            op_profile: false,
            group_timeout: Duration::from_secs(20),
            gate_timeout: Duration::from_secs(60),
        }
    }
}

/// Rows up to which bf16 GEMMs take the small-M tensor-core GEMM by default (`small_gemm_rows`): none. Measured on
/// the H200 (runs 128–131) it is level with cuBLAS at one row (the K2.6 TP8 rank-0 AR step 8.18 against 8.14 ms)
/// and slower from 17 rows (b16 rounds 20.1 against 13.9 ms at 128), so by default it serves the batch-invariant
/// forwards only (`batch_invariant`), where its row-count-independent sums are the point.
pub const SMALL_GEMM_ROWS: usize = 0;

/// The prefix of every switch's environment variable.
pub const ENV_PREFIX: &str = "KDTREE_";

/// Every switch: (variable, field of [`GpuOptions`], values and default). The variables keep the meaning
/// they had when the library read them itself.
pub const KNOBS: [(&str, &str, &str); 17] = [
    ("KDTREE_CUDA_GRAPHS", "graphs", "`0`: off; anything else or unset: on"),
    ("KDTREE_CUDA_POISON", "poison", "`1`: on; otherwise off"),
    ("KDTREE_PDL", "pdl", "`0`: off; anything else or unset: on (sm_90+)"),
    (
        "KDTREE_SMALL_GEMM_ROWS",
        "small_gemm_rows",
        "an integer (0: off); unset or not a number: 0",
    ),
    (
        "KDTREE_SMALL_CTAS_PER_SM",
        "small_ctas_per_sm",
        "an integer >= 1; unset or not a number: 4",
    ),
    ("KDTREE_BATCH_INVARIANT", "batch_invariant", "`1`: on; otherwise off"),
    (
        "KDTREE_W4A16_BLOCKS_PER_SM",
        "w4a16_blocks_per_sm",
        "an integer; unset or not a number: 4",
    ),
    (
        "KDTREE_W4A16_MAX_SPLITS",
        "w4a16_max_splits",
        "an integer; unset or not a number: 64",
    ),
    (
        "KDTREE_MLA_EXPANDED_MIN_ROWS",
        "mla_expanded_min_rows",
        "an integer (0: off); unset or not a number: 1024",
    ),
    (
        "KDTREE_MLA_PREFILL_FLASH",
        "mla_prefill_flash",
        "`0`: off; anything else or unset: on",
    ),
    (
        "KDTREE_MLA_PREFILL_P1",
        "mla_prefill_p1",
        "`0`: off; anything else or unset: on",
    ),
    (
        "KDTREE_MLA_DECODE",
        "mla_decode",
        "`0`: off; anything else or unset: on",
    ),
    ("KDTREE_POOL_KEEP", "pool_keep", "`1`: on; otherwise off"),
    ("KDTREE_TP_TRACE", "tp_trace", "`1`: on; otherwise off"),
    ("KDTREE_OP_PROFILE", "op_profile", "`1`: on; otherwise off"),
    ("KDTREE_GROUP_TIMEOUT_S", "group_timeout", "seconds > 0; otherwise 20"),
    ("KDTREE_GATE_TIMEOUT_S", "gate_timeout", "seconds > 0; otherwise 60"),
];

impl GpuOptions {
    /// The switches from the process environment ([`KNOBS`]); unset ones keep their defaults.
    pub fn from_env() -> GpuOptions {
        GpuOptions::from_vars(|name| std::env::var(name).ok())
    }

    /// The switches from `var` (a variable's value, None when unset), read as [`KNOBS`] says.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> GpuOptions {
        let d = GpuOptions::default();
        let get = |suffix: &str| var(&format!("{ENV_PREFIX}{suffix}"));
        let not_zero = |suffix: &str, default: bool| get(suffix).map_or(default, |v| v != "0");
        let one = |suffix: &str| get(suffix).is_some_and(|v| v == "1");
        let count = |suffix: &str, default: usize| get(suffix).and_then(|v| v.parse().ok()).unwrap_or(default);
        let seconds = |suffix: &str, default: Duration| {
            get(suffix)
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|s| *s > 0.0)
                .map_or(default, Duration::from_secs_f64)
        };
        GpuOptions {
            graphs: not_zero("CUDA_GRAPHS", d.graphs),
            poison: one("CUDA_POISON"),
            pdl: not_zero("PDL", d.pdl),
            small_gemm_rows: count("SMALL_GEMM_ROWS", d.small_gemm_rows),
            small_ctas_per_sm: count("SMALL_CTAS_PER_SM", d.small_ctas_per_sm).max(1),
            batch_invariant: one("BATCH_INVARIANT"),
            w4a16_blocks_per_sm: count("W4A16_BLOCKS_PER_SM", d.w4a16_blocks_per_sm),
            w4a16_max_splits: count("W4A16_MAX_SPLITS", d.w4a16_max_splits),
            mla_expanded_min_rows: count("MLA_EXPANDED_MIN_ROWS", d.mla_expanded_min_rows),
            mla_prefill_flash: not_zero("MLA_PREFILL_FLASH", d.mla_prefill_flash),
            mla_prefill_p1: not_zero("MLA_PREFILL_P1", d.mla_prefill_p1),
            mla_decode: not_zero("MLA_DECODE", d.mla_decode),
            pool_keep: one("POOL_KEEP"),
            tp_trace: one("TP_TRACE"),
            op_profile: one("OP_PROFILE"),
            group_timeout: seconds("GROUP_TIMEOUT_S", d.group_timeout),
            gate_timeout: seconds("GATE_TIMEOUT_S", d.gate_timeout),
        }
    }
}

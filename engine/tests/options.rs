//! The GPU switches (engine/src/options.rs): `GpuOptions::from_vars` reads each `KDTREE_*` variable of
//! `options::KNOBS` into its own field, with the meaning the library's own reads had (docs/design/options.md).

use kdtree_engine::options::{GpuOptions, KNOBS};
use std::collections::HashMap;
use std::time::Duration;

fn from(vars: &[(&str, &str)]) -> GpuOptions {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    GpuOptions::from_vars(|k| m.get(k).cloned())
}

/// The fields of `a` that differ from `b`, by name.
fn changed(a: &GpuOptions, b: &GpuOptions) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut check = |name: &'static str, differs: bool| {
        if differs {
            out.push(name)
        }
    };
    check("graphs", a.graphs != b.graphs);
    check("poison", a.poison != b.poison);
    check("pdl", a.pdl != b.pdl);
    check("small_gemm_rows", a.small_gemm_rows != b.small_gemm_rows);
    check("small_ctas_per_sm", a.small_ctas_per_sm != b.small_ctas_per_sm);
    check("batch_invariant", a.batch_invariant != b.batch_invariant);
    check("w4a16_blocks_per_sm", a.w4a16_blocks_per_sm != b.w4a16_blocks_per_sm);
    check("w4a16_max_splits", a.w4a16_max_splits != b.w4a16_max_splits);
    check(
        "mla_expanded_min_rows",
        a.mla_expanded_min_rows != b.mla_expanded_min_rows,
    );
    check("mla_prefill_flash", a.mla_prefill_flash != b.mla_prefill_flash);
    check("mla_prefill_p1", a.mla_prefill_p1 != b.mla_prefill_p1);
    check("mla_decode", a.mla_decode != b.mla_decode);
    check("pool_keep", a.pool_keep != b.pool_keep);
    check("tp_trace", a.tp_trace != b.tp_trace);
    check("op_profile", a.op_profile != b.op_profile);
    check("group_timeout", a.group_timeout != b.group_timeout);
    check("gate_timeout", a.gate_timeout != b.gate_timeout);
    out
}

#[test]
fn nothing_set_is_the_default() {
    let d = GpuOptions::default();
    assert_eq!(from(&[]), d);
    assert!(
        d.graphs
            && d.pdl
            && d.mla_prefill_flash
            && d.mla_prefill_p1
            && !d.pool_keep
            && d.mla_decode
            && !d.poison
            && !d.tp_trace
            && !d.op_profile
            && !d.batch_invariant
    );
    assert_eq!((d.w4a16_blocks_per_sm, d.w4a16_max_splits), (4, 64));
    assert_eq!((d.mla_expanded_min_rows, d.small_gemm_rows), (1024, 0));
    assert_eq!(
        (d.group_timeout, d.gate_timeout),
        (Duration::from_secs(20), Duration::from_secs(60))
    );
}

#[test]
fn each_variable_sets_its_own_field_and_no_other() {
    // A value that moves each switch off its default.
    let moved = |name: &str| match name {
        "KDTREE_CUDA_GRAPHS"
        | "KDTREE_PDL"
        | "KDTREE_MLA_PREFILL_FLASH"
        | "KDTREE_MLA_PREFILL_P1"
        | "KDTREE_MLA_DECODE" => "0",
        "KDTREE_W4A16_BLOCKS_PER_SM" => "2",
        "KDTREE_W4A16_MAX_SPLITS" => "16",
        "KDTREE_MLA_EXPANDED_MIN_ROWS" => "512",
        "KDTREE_SMALL_GEMM_ROWS" => "64",
        "KDTREE_SMALL_CTAS_PER_SM" => "2",
        "KDTREE_GROUP_TIMEOUT_S" | "KDTREE_GATE_TIMEOUT_S" => "1.5",
        _ => "1",
    };
    assert_eq!(KNOBS.len(), 17);
    for (var, field, _) in KNOBS {
        assert!(var.starts_with(kdtree_engine::options::ENV_PREFIX), "{var}");
        let got = from(&[(var, moved(var))]);
        assert_eq!(
            changed(&got, &GpuOptions::default()),
            vec![field],
            "{var}={}",
            moved(var)
        );
    }
    let all: Vec<(&str, &str)> = KNOBS.iter().map(|(v, _, _)| (*v, moved(v))).collect();
    let o = from(&all);
    assert!(
        !o.graphs
            && !o.pdl
            && !o.mla_prefill_flash
            && !o.mla_prefill_p1
            && o.pool_keep
            && !o.mla_decode
            && o.poison
            && o.tp_trace
            && o.op_profile
            && o.batch_invariant
    );
    assert_eq!((o.w4a16_blocks_per_sm, o.w4a16_max_splits), (2, 16));
    assert_eq!((o.mla_expanded_min_rows, o.small_gemm_rows), (512, 64));
    assert_eq!(
        (o.group_timeout, o.gate_timeout),
        (Duration::from_millis(1500), Duration::from_millis(1500))
    );
}

#[test]
fn values_keep_the_meaning_the_library_gave_them() {
    // On/off switches that default on: only "0" turns them off.
    assert!(from(&[("KDTREE_CUDA_GRAPHS", "1")]).graphs);
    assert!(from(&[("KDTREE_CUDA_GRAPHS", "no")]).graphs);
    assert!(!from(&[("KDTREE_PDL", "0")]).pdl);
    assert!(!from(&[("KDTREE_POOL_KEEP", "yes")]).pool_keep);
    // A number: 0 switches the expanded form off.
    assert_eq!(from(&[("KDTREE_MLA_EXPANDED_MIN_ROWS", "0")]).mla_expanded_min_rows, 0);
    // Opt-in switches: only "1" turns them on.
    assert!(!from(&[("KDTREE_CUDA_POISON", "0")]).poison);
    assert!(!from(&[("KDTREE_CUDA_POISON", "yes")]).poison);
    assert!(!from(&[("KDTREE_TP_TRACE", "true")]).tp_trace);
    // A row bound: 0 switches the small GEMM off; what does not parse keeps the default (off).
    assert_eq!(from(&[("KDTREE_SMALL_GEMM_ROWS", "16")]).small_gemm_rows, 16);
    assert_eq!(from(&[("KDTREE_SMALL_GEMM_ROWS", "all")]).small_gemm_rows, 0);
    // Numbers that do not parse, and timeouts <= 0, keep the defaults.
    assert_eq!(from(&[("KDTREE_W4A16_MAX_SPLITS", "many")]).w4a16_max_splits, 64);
    assert_eq!(from(&[("KDTREE_W4A16_BLOCKS_PER_SM", "-1")]).w4a16_blocks_per_sm, 4);
    assert_eq!(
        from(&[("KDTREE_GROUP_TIMEOUT_S", "0")]).group_timeout,
        Duration::from_secs(20)
    );
    assert_eq!(
        from(&[("KDTREE_GATE_TIMEOUT_S", "-3")]).gate_timeout,
        Duration::from_secs(60)
    );
    // Variables without the prefix are not switches.
    assert_eq!(
        from(&[("CUDA_GRAPHS", "0"), ("SMALL_GEMM_ROWS", "1")]),
        GpuOptions::default()
    );
}

//! Latent-KV compaction after a tree verify (ddtree.md §3.4): of the scratch rows written after the
//! committed prefix, keep the accepted path's rows, in path order, as the next committed rows, and drop the
//! rest. One layer's rows `[committed + scratch, W]` f32 per call. Test below; the model-level check is
//! engine/tests/target_model.rs `commit_compaction_then_continue_equals_chain`.

/// Move rows `committed + path[k]` to `committed + k` for every k, then cut the layer at
/// `committed + path.len()` rows. Path entries must be < the scratch row count (checked by the caller).
pub fn kv_compact(layer: &mut Vec<f32>, width: usize, committed: usize, path: &[usize]) {
    let (c, w) = (committed, width);
    // Gather first (clone), then write: no overlap hazard whatever the path.
    let kept: Vec<f32> = path
        .iter()
        .flat_map(|&p| layer[(c + p) * w..(c + p + 1) * w].to_vec())
        .collect();
    layer.truncate(c * w);
    layer.extend_from_slice(&kept);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_path_rows_in_path_order() {
        // 1 committed row then 4 scratch rows of width 2; keep scratch 3 then 1 (a path may go backwards
        // in index order only in a test, but the op must not care).
        let mut l: Vec<f32> = (0..10).map(|v| v as f32).collect();
        kv_compact(&mut l, 2, 1, &[3, 1]);
        assert_eq!(l, vec![0.0, 1.0, 8.0, 9.0, 4.0, 5.0]);
        kv_compact(&mut l, 2, 3, &[]);
        assert_eq!(l.len(), 6);
    }
}

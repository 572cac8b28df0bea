//! Timing helpers of the CUDA benches (engine/tests/cuda_bench*.rs): CUDA-event timing of eager calls and
//! of calls captured into one CUDA graph (mean of one replay, or the median of many), the graph's node
//! count, the device copy bandwidth and the cuBLAS bf16 matrix rate measured in the same run.

use cudarc::driver::CudaGraph;
use half::bf16;
use kdtree_engine::cuda::ops;
use kdtree_engine::cuda::Gpu;

/// Mean ms per call of `f(i)` over `iters` calls after `warm` calls, timed with CUDA events.
pub fn time_ms(g: &Gpu, warm: usize, iters: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..warm {
        f(i);
    }
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let a = g.stream.record_event(flags).unwrap();
    for i in 0..iters {
        f(warm + i);
    }
    let b = g.stream.record_event(flags).unwrap();
    b.synchronize().unwrap();
    a.elapsed_ms(&b).unwrap() as f64 / iters as f64
}

/// `f(i)`, i < iters, captured once into a CUDA graph (no host sync or allocation may happen inside).
pub fn capture(g: &Gpu, iters: usize, mut f: impl FnMut(usize)) -> CudaGraph {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    g.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    for i in 0..iters {
        f(i);
    }
    let graph = g
        .stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    graph.upload().unwrap();
    graph
}

/// Mean ms per call of `f(i)`, i < iters, captured once into a CUDA graph (so host launch cost is out of
/// the figure, as in a captured forward) and replayed after one warm-up replay.
pub fn time_graph_ms(g: &Gpu, iters: usize, f: impl FnMut(usize)) -> f64 {
    let graph = capture(g, iters, f);
    graph.launch().unwrap();
    time_ms(g, 0, 1, |_| graph.launch().unwrap()) / iters as f64
}

/// Median ms of one replay of `graph` (each replay between its own events) after one warm-up replay;
/// the number of replays is chosen from the warm-up's time so the whole takes about `budget_ms`
/// (between `min_reps` and 50 replays). Returns (median, replays).
pub fn replay_median_ms(g: &Gpu, graph: &CudaGraph, budget_ms: f64, min_reps: usize) -> (f64, usize) {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let first = time_ms(g, 0, 1, |_| graph.launch().unwrap());
    let reps = ((budget_ms / first.max(1e-3)).ceil() as usize).clamp(min_reps, 50);
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = g.stream.record_event(flags).unwrap();
        graph.launch().unwrap();
        let b = g.stream.record_event(flags).unwrap();
        b.synchronize().unwrap();
        v.push(a.elapsed_ms(&b).unwrap() as f64);
    }
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], reps)
}

/// (kernel nodes, all nodes) of a captured graph (cuBLAS GEMMs count with every kernel they launch).
pub fn graph_nodes(graph: &CudaGraph) -> (usize, usize) {
    use cudarc::driver::sys::{cuGraphGetNodes, cuGraphNodeGetType, CUgraphNode, CUgraphNodeType, CUresult};
    let mut n = 0usize;
    // SAFETY: the graph is live (owned by `graph`); a null node array asks for the count only.
    let st = unsafe { cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut n) };
    assert_eq!(st, CUresult::CUDA_SUCCESS, "cuGraphGetNodes: {st:?}");
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds n entries, as the driver was told.
    let st = unsafe { cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut n) };
    assert_eq!(st, CUresult::CUDA_SUCCESS, "cuGraphGetNodes: {st:?}");
    let mut kernels = 0;
    for &node in &nodes[..n] {
        let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: node comes from the live graph above.
        let st = unsafe { cuGraphNodeGetType(node, &mut ty) };
        assert_eq!(st, CUresult::CUDA_SUCCESS, "cuGraphNodeGetType: {st:?}");
        kernels += (ty == CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) as usize;
    }
    (kernels, n)
}

/// Device-to-device copy bandwidth (GB/s, bytes read + written) of a 1 GiB `memcpy_dtod`.
pub fn copy_gbps(g: &Gpu) -> f64 {
    let n = 1usize << 30;
    let src = g.zeros::<u8>(n).unwrap();
    let mut dst = g.zeros::<u8>(n).unwrap();
    let ms = time_ms(g, 2, 10, |_| g.stream.memcpy_dtod(&src, &mut dst).unwrap());
    2.0 * n as f64 / (ms * 1e-3) / 1e9
}

/// cuBLAS bf16 GEMM rate (TFLOP/s) on an 8192 x 8192 x 8192 product of `data` (random bf16, at least
/// 8192² elements), eagerly, mean of 10 calls after 3.
pub fn matmul_tflops(g: &Gpu, data: &cudarc::driver::CudaSlice<bf16>) -> f64 {
    let n = 8192usize;
    let (a, b) = (data.slice(0..n * n), data.slice(data.len() - n * n..));
    let mut y = g.zeros::<bf16>(n * n).unwrap();
    let ms = time_ms(g, 3, 10, |_| {
        ops::gemm_bf16::gemm_bf16(g, &a, &b, &mut y.as_view_mut(), n, n, n).unwrap()
    });
    2.0 * (n * n * n) as f64 / (ms * 1e-3) / 1e12
}

# Sourced by the GPU suites (scripts/gpu-test.sh, scripts/gpu-test-k26.sh; staged next to them by
# `make gpu-stage`): the environment the CUDA binaries need on a machine with only the driver and the CUDA 13
# libraries. cudarc dlopens libcuda, libcublas and libnccl by name: add the usual CUDA 13 library folders when
# libcublas is not found, and a libnccl.so name for pip's nvidia-nccl-cu13 (which ships libnccl.so.2).
# Rank groups on one GPU each run on their own stream and meet inside their kernels: more hardware queues
# than streams, so that no group's kernel waits behind another's.
export KDTREE_REQUIRE_GPU=1
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
      $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cublas")))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
fi
ncclso="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)"
if [ -f "$ncclso" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_dir="$(mktemp -d)" && ln -s "$ncclso" "$nccl_dir/libnccl.so" && export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# compute-sanitizer: on PATH, or in the toolkit's folder.
sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)"

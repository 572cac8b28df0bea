# Sourced by the bench scripts (bench/gpu-bench.sh, bench/batch.sh): cudarc dlopens libcuda and libcublas by
# name, so when the loader does not find libcublas, add the usual CUDA 13 library folders (the system toolkit's
# and pip's nvidia-* wheels') to LD_LIBRARY_PATH. scripts/gpu-test.sh keeps its own copy: it runs staged, away
# from this folder.
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
      $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cublas")))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
fi

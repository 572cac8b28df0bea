# kdtree: reproducible entry points. `make test` is what CI runs (.ci/run).
# Everything builds with no CUDA toolkit. GPU work: `make gpu-stage` here (builds the CUDA test binaries
# and tools into .dev-gpu/), then `make gpu-test` on the GPU machine (scripts/gpu-test.sh; builds nothing), or
# `make gpu-bench` there (bench/gpu-bench.sh: the W4A16 timings against PyTorch's, one table last).

CARGO      ?= cargo
OUT        ?= out
RELEASE    := target/release
CONVERT    := $(RELEASE)/kdtree-convert
GOLDEN     := $(RELEASE)/kdtree-golden
RUN        := $(RELEASE)/kdtree-run
SEED       ?= 0
PAIR       ?= models/kdtree-tiny
FUZZ_SECONDS ?= 600

.PHONY: fuzz fuzz-smoke lint kernels-check cuda-check gpu-stage gpu-test gpu-test-k26 gpu-bench bench-batch bench-table-check build test demo demo-synth train bench-acceptance golden golden-check crosscheck fixtures bench-convert clean

## build: release binaries kdtree-convert, kdtree-golden, kdtree-run
build:
	$(CARGO) build --release --locked -p kdtree-convert -p kdtree-golden -p kdtree-run

## test: every unit and integration test of the workspace (the README's test command; CI runs it)
test:
	$(CARGO) test --workspace --locked

## lint: rustfmt (rustfmt.toml: width 120) and clippy with warnings as errors on the whole workspace, and on the engine with the CUDA backend
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	KDTREE_NVCC="$$(bash tools/cuda/install-nvcc.sh)" $(CARGO) clippy -p kdtree-engine --features cuda --all-targets --locked -- -D warnings

## kernels-check: compile every CUDA kernel for sm_90a and sm_120a, warnings as errors (installs nvcc from PyPI into .cuda/)
kernels-check:
	bash kernels/check.sh

## cuda-check: build the CUDA backend and its GPU tests (no GPU needed) and run the GPU-free unit tests of engine::cuda
cuda-check:
	KDTREE_NVCC="$$(bash tools/cuda/install-nvcc.sh)" $(CARGO) test -p kdtree-engine --features cuda --release --locked --no-run
	KDTREE_NVCC="$$(bash tools/cuda/install-nvcc.sh)" $(CARGO) test -p kdtree-engine --features cuda --release --locked --lib cuda::

## gpu-stage: build the GPU suite (CUDA test binaries, kdtree-run/kdtree-golden with --features cuda) into .dev-gpu/
gpu-stage:
	bash scripts/gpu-test.sh --stage .dev-gpu

## gpu-test: on the GPU machine (driver + CUDA 13 libraries only): the whole GPU suite from .dev-gpu/, a table last
## (KDTREE_GPU_SANITIZE=0: all but the compute-sanitizer runs; =only: those alone)
gpu-test:
	bash .dev-gpu/gpu-test.sh .dev-gpu

## gpu-test-k26: on the GPU machine: the real-width gate (scripts/gpu-test-k26.sh: the k26-gate model converted for
## 1 and 8 ranks, five configurations x AR / DDTree 16 / 256 x 3 runs, identical records, teacher-forced gaps
## against the CPU reference within the measured bf16 bound, --verify golden/k26-gate, memcheck); ~55 GB of disk
gpu-test-k26:
	bash .dev-gpu/gpu-test-k26.sh .dev-gpu

## bench-batch: on the GPU machine: the batched-generation throughput table (bench/batch.sh, from .dev-gpu/)
bench-batch:
	bash bench/batch.sh .dev-gpu

## gpu-bench: on the GPU machine (+ python3 with torch): every staged cuda_bench* timing and bench/peers.py, one W4A16 table last
gpu-bench:
	bash bench/gpu-bench.sh .dev-gpu

## fuzz: the libFuzzer targets of fuzz/ (docs/fuzzing.md), each for FUZZ_SECONDS (default 600), one at a time, nice 19;
## every run appended to fuzz/runs.tsv. FUZZ_TARGETS="prompts chat" picks targets. Needs no cargo-fuzz
fuzz:
	FUZZ_RECORD=1 bash fuzz/fuzz.sh all $(FUZZ_SECONDS)

## fuzz-smoke: build the fuzz targets and run each for 25 s from its seeds (CI runs it)
fuzz-smoke:
	bash fuzz/fuzz.sh all 25

## bench-table-check: bench/table.py on its committed fixtures (python3 standard library only; CI runs it)
bench-table-check:
	python3 -m unittest bench/test_table.py

## demo: the trained pair models/kdtree-tiny -> repack -> verify -> golden -> run example prompts -> verify against golden
demo: build
	rm -rf $(OUT)/demo && mkdir -p $(OUT)/demo
	$(CONVERT) repack $(PAIR) $(OUT)/demo/model --drafter $(PAIR)/drafter
	$(CONVERT) verify $(OUT)/demo/model
	$(CONVERT) inspect $(OUT)/demo/model
	$(GOLDEN) $(OUT)/demo/model --prompts golden/kdtree-tiny/prompts.jsonl --out $(OUT)/demo/golden --quiet
	$(RUN) $(OUT)/demo/model --prompts examples/prompts.jsonl --out $(OUT)/demo/results.jsonl --summary $(OUT)/demo/summary.json
	cat $(OUT)/demo/results.jsonl
	cat $(OUT)/demo/summary.json; echo
	$(RUN) $(OUT)/demo/model --prompts golden/kdtree-tiny/prompts.jsonl --out $(OUT)/demo/verify.jsonl --verify $(OUT)/demo/golden --max-tokens 16

## demo-synth: the same on the synthetic tiny preset (random weights; checks the pipeline, prints noise)
demo-synth: build
	rm -rf $(OUT)/demo-synth && mkdir -p $(OUT)/demo-synth
	$(CONVERT) synth tiny $(OUT)/demo-synth/hf --drafter --seed $(SEED)
	$(CONVERT) repack $(OUT)/demo-synth/hf $(OUT)/demo-synth/model --drafter $(OUT)/demo-synth/hf/drafter
	$(CONVERT) verify $(OUT)/demo-synth/model
	$(GOLDEN) $(OUT)/demo-synth/model --prompts golden/prompts.jsonl --out $(OUT)/demo-synth/golden --quiet
	$(RUN) $(OUT)/demo-synth/model --prompts golden/prompts.jsonl --out $(OUT)/demo-synth/verify.jsonl --verify $(OUT)/demo-synth/golden

## train: re-train the pair from scratch (needs python3 with torch, safetensors, tiktoken, regex; a GPU: ~2.5 min on an H200)
train:
	python3 tools/train/train.py --out $(OUT)/train --seed $(SEED) --target-steps 1200 --drafter-steps 3000

## bench-acceptance: DDTree acceptance length of the trained pair per budget on held-out prompts (CPU, ~20 min)
bench-acceptance: build
	bash tools/train/bench_acceptance.sh $(OUT)/bench-acceptance

## golden: regenerate the committed reference bundles in golden/ on purpose
golden: build
	bash golden/regen.sh

## golden-check: rebuild golden bundles from nothing and fail on any byte difference
golden-check: build
	bash golden/regen.sh --check

## crosscheck: compare the CPU reference with transformers' DeepseekV3ForCausalLM (installs torch CPU)
crosscheck: build
	bash crosscheck/run.sh

## fixtures: re-create the compressed-tensors INT4 fixture with the real Python library
fixtures:
	bash tools/kdtree-convert/fixtures/make_fixtures.sh

## bench-convert: repack throughput vs cp, peak RSS (writes bench/RESULTS.md figures to stdout)
bench-convert: build
	bash bench/convert.sh

clean:
	rm -rf $(OUT)

PYTHON ?= python3
# Extra arguments for train/bench, e.g. make train ARGS="--attention cosine --use-cuda-kernel"
ARGS ?=

.PHONY: install train train-tiny test test-gpu bench compare context-limit throughput clean

install:  ## dependencies + this package (builds the CUDA kernels where torch has CUDA and nvcc exists)
	$(PYTHON) -m pip install -r requirements.txt
	$(PYTHON) -m pip install --no-build-isolation -e .

train:  ## the main job: base config (dim 512, depth 8, seq 8192); enwik8 is downloaded on first use
	$(PYTHON) train.py --config configs/base $(ARGS)

train-tiny:  ## a few minutes on a CPU, on the first 4 MB of enwik8 shipped beside the repo
	$(PYTHON) train.py --config configs/tiny_cpu --data-path ../shared/data/enwik8-first4mb $(ARGS)

test:  ## CPU tests; GPU tests skip themselves without CUDA
	$(PYTHON) -m pytest -q

test-gpu:  ## only the GPU-marked tests (needs a CUDA GPU)
	$(PYTHON) -m pytest -q -m gpu

bench:  ## kernels vs baselines on the seeds' shapes (needs a CUDA GPU)
	$(PYTHON) benchmark.py --preset seeds --json bench/results_seeds.json $(ARGS)

compare:  ## softmax vs cosine vs fastmax at several context lengths on one token budget -> bench/compare/
	$(PYTHON) compare.py --data-path ../shared/data/enwik8-first4mb $(ARGS)

context-limit:  ## longest context one training step fits per attention (batch 1, configs/base) -> bench/context_limit.*
	$(PYTHON) scripts/context_limit.py $(ARGS)

throughput:  ## training tokens/s and peak memory per attention and context length (one process) -> bench/throughput.*
	$(PYTHON) scripts/throughput.py $(ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache attention_cuda/*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

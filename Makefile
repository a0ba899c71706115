PYTHON ?= python3
# Extra arguments for train/bench, e.g. make train ARGS="--attention cosine --use-cuda-kernel"
ARGS ?=

.PHONY: install train train-tiny test test-gpu bench compare context-limit throughput clean

# The torch a machine without one gets. Where no NVIDIA GPU answers, the CPU build: PyPI's Linux wheels
# bundle CUDA (several GB). Our machines hold the CPU wheel of 2.13.0 locally; elsewhere take PyTorch's
# CPU index:  make install TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0
# A local enwik8 copy for train, train-tiny and compare (DATA=path); empty = the verified download.
DATA ?=
DATA_FLAG = $(if $(DATA),--data-path $(DATA))

install:  ## torch (CPU build without a GPU), dependencies, this package (+ kernels where torch has CUDA and nvcc exists)
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
	  if nvidia-smi -L >/dev/null 2>&1; then $(PYTHON) -m pip install "torch>=2.5"; \
	  else echo "install: no NVIDIA GPU here, so the CPU build of torch: $(TORCH_CPU)"; $(PYTHON) -m pip install $(TORCH_CPU); fi; }
	$(PYTHON) -m pip install -r requirements.txt
	$(PYTHON) -m pip install --no-build-isolation -e .
	@$(PYTHON) -m attention_cuda

train:  ## the main job: configs/base on a GPU, configs/tiny_cpu (said so) without one; enwik8 is downloaded on first use (DATA=path for a local copy)
	$(PYTHON) train.py $(DATA_FLAG) $(ARGS)

train-tiny:  ## a few minutes on a CPU (DATA=path for a local copy)
	$(PYTHON) train.py --config configs/tiny_cpu $(DATA_FLAG) $(ARGS)

test:  ## CPU tests; GPU tests skip themselves without CUDA
	$(PYTHON) -m pytest -q

test-gpu:  ## only the GPU-marked tests (needs a CUDA GPU)
	$(PYTHON) -m pytest -q -m gpu

bench:  ## kernels vs baselines on the seeds' shapes (needs a CUDA GPU)
	$(PYTHON) benchmark.py --preset seeds --json bench/results_seeds.json $(ARGS)

compare:  ## the study (docs/study.md): attention x short conv x context x seed on every GPU, rate sweeps, recall probe -> bench/study/ (DATA=path for a local copy)
	$(PYTHON) compare.py $(DATA_FLAG) $(ARGS)

context-limit:  ## longest context one training step fits per attention (batch 1, configs/base) -> bench/context_limit.*
	$(PYTHON) scripts/context_limit.py $(ARGS)

throughput:  ## training tokens/s and peak memory per attention and context length (one process) -> bench/throughput.*
	$(PYTHON) scripts/throughput.py $(ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache attention_cuda/*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

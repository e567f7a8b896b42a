# Every target sets up what it needs: `make train` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned (the CPU build here); override for another build, e.g.
# make setup TORCH_SPEC="torch==2.11.0"
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9._-' '_')

.PHONY: setup train test test-gpu lint demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	rm -f $(VENV)/.setup-*
	touch $@

# The default run: dense-tiny, baseline scales, AdamW, cosine, the embedded stdlib corpus.
train: setup
	$(PY) -m scalevec_train.train $(ARGS)

test: setup
	$(PY) -m pytest

# The GPU tests (tests/gpu) on a machine with CUDA; `make test` hides the GPUs and skips them.
test-gpu: setup
	SCALEVEC_GPU_TESTS=1 $(PY) -m pytest tests/gpu

# dense-tiny under baseline and unified (a few minutes on a CPU), then the comparison plot and table.
DEMO := runs/demo
demo: setup
	$(PY) -m scalevec_train.train -m +experiment=demo
	$(PY) scripts/compare_runs.py $(DEMO)/dense-tiny-baseline-adamw-cosine-s0 \
	  $(DEMO)/dense-tiny-unified-adamw-cosine-s0 --reference scale=baseline --out $(DEMO)/compare
	@echo "comparison plot:  $(DEMO)/compare/curves.png"
	@echo "comparison table: $(DEMO)/compare/summary.md (and summary.csv)"

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) runs data_cache

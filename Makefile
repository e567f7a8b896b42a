# Every target sets up what it needs: `make train` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned (the CPU build here); override for another build, e.g.
# make setup TORCH_SPEC="torch==2.11.0"
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9._-' '_')

.PHONY: setup train test test-gpu lint demo ladder-demo clean

setup: $(STAMP)

# pip byte-compiles what it installs on one core; compileall does it on all of them (the bytecode is
# written here because PYTHONDONTWRITEBYTECODE may forbid it later), but for the packages' own test
# suites and transformers' model files other than Llama's, which nothing here imports (a third of
# the source; one imported anyway compiles when imported). A file pip too leaves uncompiled (one
# written for a newer Python) does not fail the setup. The package builds in the venv, whose first
# install brings pyproject.toml's build requirements, not in an isolated build environment that pip
# would fill first.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --disable-pip-version-check "$(TORCH_SPEC)" \
	  "setuptools>=68" wheel
	$(PY) -m pip install -q --no-compile --disable-pip-version-check --no-build-isolation \
	  -e ".[dev]"
	$(PY) -c "import compileall, re, sysconfig; \
	compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, \
	  workers=0, rx=re.compile(r'/(tests?|testing/_internal)/|/transformers/models/(?!llama/|auto/)'))"
	rm -f $(VENV)/.setup-*
	touch $@

# The default run: dense-tiny, baseline scales, AdamW, cosine, the embedded stdlib corpus.
train: setup
	$(PY) -m scalevec_train.train $(ARGS)

# The lint first (a second), then one pytest worker per core (pytest-xdist), each test file on one
# worker (its module fixtures and order kept). The tests write bytecode whatever
# PYTHONDONTWRITEBYTECODE says: each of the many Python processes they start would otherwise
# compile the project's sources, and pytest rewrite the test files, again (a tenth of the CPU time
# of the process-heavy files).
TEST_WORKERS ?= auto
test: lint
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The GPU tests (tests/gpu) on a machine with CUDA; `make test` hides the GPUs and skips them.
test-gpu: setup
	SCALEVEC_GPU_TESTS=1 $(PY) -m pytest tests/gpu

# dense-tiny under baseline and unified (a few minutes on a CPU), then the comparison plot and
# table.
DEMO := runs/demo
demo: setup
	$(PY) -m scalevec_train.train -m +experiment=demo
	$(PY) scripts/compare_runs.py $(DEMO)/dense-tiny-baseline-adamw-cosine-s0 \
	  $(DEMO)/dense-tiny-unified-adamw-cosine-s0 --reference scale=baseline --out $(DEMO)/compare
	@echo "comparison plot:  $(DEMO)/compare/curves.png"
	@echo "comparison table: $(DEMO)/compare/summary.md (and summary.csv)"

# The scaling-ladder workflow in miniature (configs/experiment/ladder_demo.yaml): WSD trunks over
# three ladder rungs, branches of them to half the budget, and the compute multiplier of unified at
# both budgets.
LADDER := runs/ladder_demo
BRANCH_FROM := $(LADDER)/$${model.name}-$${scale.name}-$${schedule.name}-tpp0.5-s$${seed}
ladder-demo: setup
	$(PY) -m scalevec_train.train -m +experiment=ladder_demo
	$(PY) -m scalevec_train.train -m +experiment=ladder_demo train.tokens_per_param=0.25 \
	  'branch_from=$(BRANCH_FROM)'
	$(PY) scripts/compare_runs.py $(LADDER)/*-tpp0.5-s* --efficiency --reference scale=baseline \
	  --out $(LADDER)/efficiency_tpp0.5
	$(PY) scripts/compare_runs.py $(LADDER)/*-tpp0.25-s* --efficiency --reference scale=baseline \
	  --out $(LADDER)/efficiency_tpp0.25
	$(PY) scripts/compare_runs.py $(LADDER)/dense-l3-*-s* \
	  --reference 'scale=baseline train.tokens_per_param=0.5' --out $(LADDER)/branches_l3
	@echo "compute multipliers: $(LADDER)/efficiency_tpp{0.5,0.25}/efficiency.{md,png}"
	@echo "trunks and branches: $(LADDER)/branches_l3/curves.png"

# ruff at 100 columns (pyproject.toml), pinned so that a new release's rules do not fail CI.
lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) runs data_cache

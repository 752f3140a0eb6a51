# Two commands matter: `make demo` and `make test`. Both create .venv when it is missing.
# GPU users: make TORCH_SPEC="torch==2.11.0 --index-url <your CUDA wheel index>" demo
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint notebooks clean

$(STAMP): pyproject.toml Makefile requirements-sglang-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q -e '.[mooncake]' || echo "Mooncake is not installable here: its tests will skip"
	$(PY) -m pip install -q --no-deps sglang==0.5.23 -r requirements-sglang-cpu.txt \
		|| echo "sglang is not installable here: its source beside the lab's is skipped"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hicache_lab demo --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests

# Re-execute every notebook in place (quick mode, outputs kept for reading unrun).
notebooks: $(STAMP)
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 notebooks/*.ipynb

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf runs .pytest_cache .ruff_cache .hypothesis

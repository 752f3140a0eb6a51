# Two commands matter: `make demo` and `make test`. Both create .venv when it is missing.
# Laptops: on Linux the default torch wheel from PyPI pulls the CUDA libraries (gigabytes); for the CPU build
#   make TORCH_SPEC="torch==2.13.0 --index-url <PyTorch's CPU wheel index>" demo   (macOS wheels are CPU builds)
# GPU users: make TORCH_SPEC="torch==2.11.0 --index-url <your CUDA wheel index>" demo
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# SGLang's releases as a rank's cache (`--cache-impl sglang==X`, `python -m hicache_lab releases`): each installed
# --no-deps in .releases/sglang-X, the pure-Python imports it pins in .releases/pins (0.5.23 is the venv's).
# `make releases` installs RELEASES; `make test` installs TEST_RELEASES (one that fails only skips its tests).
RELEASES ?= 0.5.10 0.5.11 0.5.12 0.5.13 0.5.14 0.5.15 0.5.16 0.5.17 0.5.18 0.5.22
TEST_RELEASES ?= 0.5.10 0.5.11 0.5.12 0.5.13 0.5.15

.PHONY: demo test check lint notebooks render clean releases test-releases

$(STAMP): pyproject.toml Makefile requirements-sglang-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing into $(VENV) (minutes; quiet unless something fails; Mooncake or sglang failing only skips their parts)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q -e '.[mooncake]' || echo "Mooncake is not installable here: its tests will skip"
	$(PY) -m pip install -q --no-deps sglang==0.5.23 -r requirements-sglang-cpu.txt \
		|| echo "sglang is not installable here: its source beside the lab's is skipped"
	touch $(STAMP)

releases: $(STAMP)
	$(PY) -m hicache_lab.lab.sglang.releases $(RELEASES)

test-releases: $(STAMP)
	$(PY) -m hicache_lab.lab.sglang.releases --best-effort $(TEST_RELEASES)

demo: $(STAMP)
	$(PY) -m hicache_lab demo --out runs/demo

# Two workers (pytest-xdist), each taking a whole file at a time: much of the suite waits on processes and
# timeouts, not on the cores.
test: $(STAMP) test-releases
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile tests

# The inner loop: every test that runs in this one process and quickly (no spawned ranks, CLI runs, torchrun or
# notebooks: markers in pyproject.toml, kept honest by tests/conftest.py), every subpackage touched.
check: $(STAMP)
	$(PY) -m pytest -q --durations=5 -m "not spawns and not notebook and not slow" tests

# Re-execute every notebook in place (quick mode, outputs kept for reading unrun; a progress bar's updates
# coalesced to its last line, as Jupyter shows it).
notebooks: $(STAMP)
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace --coalesce-streams --ExecutePreprocessor.timeout=600 \
		notebooks/*.ipynb

# Render every notebook as committed (not re-executed) to runs/html/NN.html and, where Debian's chromium is
# installed, screenshot each page (runs/html/NN.png): how a teacher checks the notebooks look right.
render: $(STAMP)
	$(PY) -m jupyter nbconvert --log-level ERROR --to html --output-dir runs/html notebooks/*.ipynb
	@if command -v chromium >/dev/null 2>&1; then \
		for page in runs/html/*.html; do \
			chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1100,16000 \
				--screenshot="$(CURDIR)/$${page%.html}.png" "file://$(CURDIR)/$$page" 2>/dev/null; \
		done; \
		$(PY) -c "import glob; from PIL import Image, ImageOps; \
			shots = sorted(glob.glob('runs/html/*.png')); \
			[Image.open(f).crop((0, 0, 1100, ImageOps.invert(Image.open(f).convert('L')).getbbox()[3] + 40)).save(f) for f in shots]; \
			print(*shots, sep='\\n')"; \
	else echo "chromium is not installed: open runs/html/*.html in a browser"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf runs .pytest_cache .ruff_cache .hypothesis

# Two commands do all the set-up on a fresh machine:
#   make demo   -- create .venv, install recboost (compiled), run the online-training demo
#   make test   -- create .venv, install recboost (compiled) + test deps, run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-fallback bench gate report clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python setup.py pyproject.toml _fast.pyx
	RECBOOST_REQUIRE_EXTENSIONS=1 $(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m recboost demo $(ARGS)

# The whole suite runs on the compiled backend (a missing extension is an error; every kernel test runs
# on both backends there: the `backend` fixture's ids `fast` and `py`, and the compiled-vs-twin parity
# tests). Beside it, the end-to-end subset marked `fallback` (pytest.ini) runs with the extension forced
# off, as a project that vendors recboost.py alone runs it; its output goes to .test-fallback.log,
# printed when both are done; either failing fails the target. `make test-fallback` runs the whole suite
# on the fallback.
test: $(STAMP)
	@RECBOOST_NO_EXTENSIONS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m fallback tests $(ARGS) \
		> .test-fallback.log 2>&1 & fallback=$$!; \
	echo "RECBOOST_REQUIRE_EXTENSIONS=1 pytest tests (compiled), with RECBOOST_NO_EXTENSIONS=1 pytest -m fallback tests beside it"; \
	RECBOOST_REQUIRE_EXTENSIONS=1 $(BIN)/python -m pytest -q tests $(ARGS); compiled=$$?; \
	wait $$fallback; status=$$?; \
	echo "---- the numpy fallback run (RECBOOST_NO_EXTENSIONS=1 pytest -m fallback tests):"; cat .test-fallback.log; \
	echo "compiled: exit $$compiled, fallback: exit $$status"; \
	test $$compiled -eq 0 -a $$status -eq 0

test-fallback: $(STAMP)
	RECBOOST_NO_EXTENSIONS=1 $(BIN)/python -m pytest -q tests $(ARGS)

# Benchmarks: every bench_*.py under bench/ (RECBOOST_BENCH_QUICK=1 for a short run); results go to
# bench/results/ (git-ignored).
bench: $(STAMP)
	RECBOOST_REQUIRE_EXTENSIONS=1 $(BIN)/python -m pytest -q -s -o python_files='bench_*.py' bench \
		--benchmark-json bench/results/benchmarks.json $(ARGS)

# The benchmark gate (bench/gate.py): HEAD timed against the commit in bench/BASELINE, built beside
# it, in alternating processes on this machine (A/B, ABBA), each timed row against its tolerance in
# bench/floors.py; then one report run whose quality, memory and size rows must meet their absolute
# targets. RECBOOST_BENCH_SLOWDOWN=1.5 or RECBOOST_NO_EXTENSIONS=1 reach HEAD only (and fail it, on
# purpose). Results in bench/results/ (gate.json, benchmarks.json).
gate: $(STAMP)
	$(BIN)/python bench/gate.py $(ARGS)

# The performance table of docs/performance.md and docs/performance.png (committed), from a fresh quick-suite run.
# matplotlib is the bench-only extra, installed here and nowhere else.
report: $(STAMP)
	RECBOOST_REQUIRE_EXTENSIONS=1 $(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/report.py --run $(ARGS)

clean:
	rm -rf build *.egg-info _recboost_fast*.so _fast.c $(VENV)

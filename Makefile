# Two commands do all the set-up on a fresh machine:
#   make demo   -- create .venv, install recboost (compiled), run the online-training demo
#   make test   -- create .venv, install recboost (compiled) + test deps, run the newcomer's check
#   (make test-all runs the whole suite, as CI does)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-fallback bench gate report clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python setup.py pyproject.toml _fast.pyx
	RECBOOST_REQUIRE_EXTENSIONS=1 $(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m recboost demo $(ARGS)

# Two test commands, each on the compiled backend (a missing extension is an error; every kernel test
# runs on both backends there: the `backend` fixture's ids `fast` and `py`, and the compiled-vs-twin
# parity tests) with the end-to-end subset marked `fallback` (pytest.ini) run with the extension forced
# off, as a project that vendors recboost.py alone runs it. `make test-fallback` runs the whole suite on
# the fallback.
#   make test      the newcomer's check (minutes): the tests not marked `slow`
#   make test-all  the whole suite (what CI runs)
# Each runs every test but the `serial` ones on two processes (pytest-xdist), then the serial ones (msrun
# jobs, kills at chosen moments) with the fallback subset beside them. The fallback's output goes to
# .test-fallback.log, printed when both are done; any part failing fails the target (a part that selects
# no test, exit 5, passes).
FALLBACK = RECBOOST_NO_EXTENSIONS=1 $(BIN)/python -m pytest -q -p no:cacheprovider
COMPILED = RECBOOST_REQUIRE_EXTENSIONS=1 $(BIN)/python -m pytest -q
# $(call suite,MARKS): the three parts, each marker expression followed by MARKS
define suite
	@echo "pytest -n 2 -m 'not serial$(1)' (compiled), then -m 'serial$(1)' (compiled) with -m 'fallback$(1)' on the numpy fallback beside it"; \
	$(COMPILED) -n 2 -m "not serial$(1)" tests $(ARGS); parallel=$$?; \
	$(FALLBACK) -m "fallback$(1)" tests $(ARGS) > .test-fallback.log 2>&1 & fallback=$$!; \
	$(COMPILED) -m "serial$(1)" tests $(ARGS); serial=$$?; \
	wait $$fallback; status=$$?; \
	echo "---- the numpy fallback run:"; cat .test-fallback.log; \
	echo "compiled: exit $$parallel, then $$serial (serial); fallback: exit $$status"; \
	for s in $$parallel $$serial $$status; do [ $$s -eq 0 -o $$s -eq 5 ] || exit 1; done
endef

test: $(STAMP)
	$(call suite, and not slow)

test-all: $(STAMP)
	$(call suite,)

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

"""Shared bench helpers: recboost timed by pytest-benchmark, its alternatives interleaved with it.

Absolute times on shared machines drift by +-50%, so every figure is a ratio of two alternatives
timed in the same process, interleaved in ABBA order (A, B, recboost | recboost, B, A | ...) so that
drift, and whatever a callable leaves behind for the next one, hits all alike. ``compare`` does that
through ``benchmark.pedantic``: the recboost contender is what pytest-benchmark times (its statistics
land in ``--benchmark-json``); the alternatives run in the untimed ``setup`` of the rounds and are
timed here. ``record`` puts a bench's figures in ``benchmark.extra_info`` (where ``bench/gate.py``
and ``bench/report.py`` read them) and in ``bench/results/<name>.json`` (git-ignored).

Two modes, chosen by ``RECBOOST_BENCH_MODE``:

- ``report`` (the default): every alternative runs; the figures are ratios against the anchors and
  the quality, memory and size rows (``bench/floors.py`` TARGETS).
- ``ab``: one side of the gate's A/B test (``bench/gate.py``). Only the recboost contender runs and
  is timed, and ``compare`` returns NaN for every alternative; its median time becomes the row
  ``<bench>`` of ``extra_info["ab"]`` (benches with several timed paths add rows with ``ab_row``).
  Tests marked ``untimed`` (quality and memory only) are skipped. Results checks that need an
  alternative's output are the report run's job.

``RECBOOST_BENCH_TREE`` names the directory whose ``recboost.py`` (and ``_recboost_fast`` build) the
benches import (``bench/conftest.py`` puts it first on ``sys.path``); the gate sets it to the
baseline's build for the A side. Default: this checkout.
"""
import collections
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
QUICK = os.environ.get("RECBOOST_BENCH_QUICK") == "1"
MODE = os.environ.get("RECBOOST_BENCH_MODE") or "report"
if MODE not in ("report", "ab"):
    raise ValueError("RECBOOST_BENCH_MODE must be 'report' or 'ab', got %r" % MODE)
AB = MODE == "ab"
TREE = os.path.abspath(os.environ.get("RECBOOST_BENCH_TREE") or ROOT)
#: ``RECBOOST_BENCH_SLOWDOWN=1.5`` makes every timed recboost contender 1.5x slower (it sleeps half
#: its own time inside the timed call): the gate must fail then. Read here only, never by recboost;
#: the gate passes it to HEAD's processes only, never to the baseline's.
SLOWDOWN = float(os.environ.get("RECBOOST_BENCH_SLOWDOWN", "1") or "1")
NAN = float("nan")


def slowed(fn, factor=None):
    """``fn`` made ``factor`` times slower (default SLOWDOWN) by sleeping after it; ``fn`` itself
    when the factor is 1."""
    factor = SLOWDOWN if factor is None else factor
    if factor < 1:
        raise ValueError("RECBOOST_BENCH_SLOWDOWN must be >= 1, got %r" % factor)
    if factor == 1:
        return fn

    def slow(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        time.sleep((time.perf_counter() - t0) * (factor - 1))
        return out
    return slow


def abba(names, rounds):
    """The order of ``rounds`` interleaved rounds over ``names``: forward, then backward (A B C | C B A
    | A B C ...), so each callable follows and precedes the others equally often."""
    names = list(names)
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


def interleaved(fns, rounds, inner=1, warmup=1):
    """Time each callable of ``fns`` (dict name -> fn) ``rounds`` times, in ABBA order.

    Each timing is ``inner`` calls; the callables must sync (``asnumpy()``) before returning.
    Returns dict name -> median seconds per call. (For figures outside a benchmark; a bench's
    recboost contender goes through ``compare``.)
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for order in abba(fns, rounds):
        for name in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            samples[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(v) for name, v in samples.items()}


def _not_run(names):
    """A/B mode's figures for the alternatives, which do not run: NaN for every listed name (benches
    build their own dicts from ``.items()``) and for any other (benches that skip building costly
    alternatives in A/B mode still read them by name)."""
    figures = collections.defaultdict(lambda: NAN)
    figures.update(dict.fromkeys(names, NAN))
    return figures


def compare(benchmark, contender, alternatives=None, rounds=5, warmup=1, prepare=None, check=None, ab_rounds=None):
    """Time ``contender`` with ``benchmark.pedantic`` and every alternative in the same rounds, ABBA.

    ``contender``: the recboost path, a callable that syncs (``asnumpy()``) and returns its result;
    ``alternatives``: dict name -> callable, run and timed (``perf_counter``) in the untimed ``setup``
    of the rounds: before the contender in even rounds (forward order), after it in odd rounds
    (backward order; those run in the next round's setup, and the last ones after the rounds).
    ``prepare``: optional dict name -> callable returning a tuple of arguments for that callable,
    called untimed before every call (e.g. a fresh model that has been compiled). ``warmup``:
    untimed calls of each callable before the rounds (graph compilation). ``check(result)``:
    asserts that the contender's last timed result is right (report mode). Returns ``(times,
    ratios)``: dict name -> median seconds per call, the contender under ``"recboost"``, and dict
    name -> median of the per-round ratios contender / alternative. In A/B mode the alternatives
    neither run nor get prepared (their times and ratios are NaN) and the contender's median time
    is ``benchmark.extra_info["ab_seconds"]``, over ``ab_rounds`` rounds when given (a contender of a
    millisecond or less needs more rounds than the report's for a stable median).
    ``benchmark.extra_info["rounds"]`` gets the rounds run.
    """
    if not benchmark.enabled:
        raise RuntimeError("the benches need pytest-benchmark enabled (no --benchmark-disable)")
    names = list(alternatives or {})
    rounds = ab_rounds if AB and ab_rounds else rounds
    alternatives = {} if AB else dict(alternatives or {})
    prepare = dict(prepare or {})
    unknown = set(prepare) - set(names) - {"recboost"}
    if unknown:
        raise ValueError("prepare names no callable: %s" % sorted(unknown))

    def args(name):
        return tuple(prepare[name]()) if name in prepare else ()

    for _ in range(warmup):
        for name, fn in list(alternatives.items()) + [("recboost", contender)]:
            fn(*args(name))
    samples = {name: [] for name in alternatives}
    pending = []                               # the alternatives still to run after an odd round

    def run_alternatives(names):
        for name in names:
            a = args(name)
            t0 = time.perf_counter()
            alternatives[name](*a)
            samples[name].append(time.perf_counter() - t0)

    state = {"round": 0}

    def setup():
        run_alternatives(pending)
        del pending[:]
        if state["round"] % 2 == 0:
            run_alternatives(list(alternatives))
        else:
            pending.extend(list(alternatives)[::-1])
        state["round"] += 1
        return args("recboost"), {}

    result = benchmark.pedantic(slowed(contender), setup=setup, rounds=rounds, warmup_rounds=0, iterations=1)
    run_alternatives(pending)
    if check is not None and not AB:
        check(result)
    ours = benchmark.stats.stats.data
    times, ratios = (_not_run(names), _not_run(names)) if AB else ({}, {})
    times.update((name, statistics.median(v)) for name, v in samples.items())
    ratios.update((name, statistics.median(a / b for a, b in zip(ours, v))) for name, v in samples.items())
    times["recboost"] = statistics.median(ours)
    benchmark.extra_info["rounds"] = rounds
    benchmark.extra_info["ab_seconds"] = times["recboost"]
    return times, ratios


def ab_row(benchmark, row, seconds):
    """Add the A/B row ``row`` (a timed recboost path, ``seconds`` per call: a median) to
    ``benchmark.extra_info["ab"]``, for a bench with more timed paths than its ``compare`` contender."""
    benchmark.extra_info.setdefault("ab", {})[row] = seconds


def record(name, payload, benchmark=None):
    """Save one bench result (a dict) as ``results/<name>.json``, print it, and put it in
    ``benchmark.extra_info`` (with ``bench=name``) when a benchmark fixture is given; returns it.
    The contender's time from ``compare`` becomes the A/B row ``name``; the payload also names the
    mode and the ``recboost.py`` the bench imported (the gate checks it is the side it meant)."""
    import recboost
    os.makedirs(RESULTS, exist_ok=True)
    payload = dict(payload, bench=name, time=time.strftime("%Y-%m-%dT%H:%M:%S"), mode=MODE,
                   recboost_file=os.path.abspath(recboost.__file__), fast_backend=bool(recboost.FAST_BACKEND))
    if benchmark is not None:
        if "ab_seconds" in benchmark.extra_info:
            ab_row(benchmark, name, benchmark.extra_info.pop("ab_seconds"))
        payload["ab"] = dict(benchmark.extra_info.get("ab", {}), **payload.get("ab", {}))
    with open(os.path.join(RESULTS, name + ".json"), "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
    print("\n[%s] %s" % (name, json.dumps(payload, sort_keys=True)))
    if benchmark is not None:
        benchmark.extra_info.update(payload)
    return payload


def warm_predictor(predictor, *batch):
    """Run ``batch`` through ``predictor`` until its size has a graph of its own: a Predictor runs a
    size it has seen fewer times on one graph of any size, about 1.3x slower. A timing of a steady
    size starts from there."""
    import recboost as rb  # pylint: disable=import-outside-toplevel  (the tree the bench imported)
    for _ in range(rb._ServedModel.STATIC_AFTER + 1):
        predictor.predict(*batch)


def warm_online(model, batches, warmup):
    """``(model, rest)``: ``model`` after ``online_train`` on the first ``warmup`` batches (compiles
    and fills its tables outside the timed part), and the batches left to time."""
    model.online_train(batches[:warmup], dataset_sink_mode=False)
    return model, batches[warmup:]


def run_online(model, stream):
    """Train ``model`` on ``stream`` (the timed recboost contender); returns the model."""
    model.online_train(stream, dataset_sink_mode=False)
    return model

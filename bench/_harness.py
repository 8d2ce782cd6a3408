"""Shared bench helpers: recboost timed by pytest-benchmark, its alternatives interleaved with it.

Absolute times on shared machines drift by +-50%, so every figure is a ratio of two alternatives
timed in the same process, interleaved round by round (A, B, ..., recboost, A, B, ..., recboost) so
drift hits all alike. ``compare`` does that through ``benchmark.pedantic``: the recboost contender is
what pytest-benchmark times (its statistics land in ``--benchmark-json``); the alternatives run in
the untimed ``setup`` of every round and are timed here. ``record`` puts a bench's figures in
``benchmark.extra_info`` (where ``bench/gate.py`` and ``bench/report.py`` read them) and in
``bench/results/<name>.json`` (git-ignored).
"""
import json
import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUICK = os.environ.get("RECBOOST_BENCH_QUICK") == "1"
#: ``RECBOOST_BENCH_SLOWDOWN=1.5`` makes every timed recboost contender 1.5x slower (it sleeps half
#: its own time inside the timed call): the gate must fail then. Read here only, never by recboost.
SLOWDOWN = float(os.environ.get("RECBOOST_BENCH_SLOWDOWN", "1") or "1")


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


def interleaved(fns, rounds, inner=1, warmup=1):
    """Time each callable of ``fns`` (dict name -> fn) ``rounds`` times, interleaved.

    Each timing is ``inner`` calls; the callables must sync (``asnumpy()``) before returning.
    Returns dict name -> median seconds per call. (For figures outside a benchmark; a bench's
    recboost contender goes through ``compare``.)
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(v) for name, v in samples.items()}


def compare(benchmark, contender, alternatives=None, rounds=5, warmup=1, prepare=None, check=None):
    """Time ``contender`` with ``benchmark.pedantic`` and every alternative in the same rounds.

    ``contender``: the recboost path, a callable that syncs (``asnumpy()``) and returns its result;
    ``alternatives``: dict name -> callable, run and timed (``perf_counter``) one after the other in
    the untimed ``setup`` of each pedantic round, just before the contender. ``prepare``: optional
    dict name -> callable returning a tuple of arguments for that callable, called untimed before
    every call (e.g. a fresh model that has been compiled). ``warmup``: untimed calls of each
    callable before the rounds (graph compilation). ``check(result)``: asserts that the contender's
    last timed result is right. Returns dict name -> median seconds per call, the contender under
    ``"recboost"``; ``benchmark.extra_info["rounds"]`` gets ``rounds``.
    """
    if not benchmark.enabled:
        raise RuntimeError("the benches need pytest-benchmark enabled (no --benchmark-disable)")
    alternatives = dict(alternatives or {})
    prepare = dict(prepare or {})
    unknown = set(prepare) - set(alternatives) - {"recboost"}
    if unknown:
        raise ValueError("prepare names no callable: %s" % sorted(unknown))

    def args(name):
        return tuple(prepare[name]()) if name in prepare else ()

    for _ in range(warmup):
        for name, fn in list(alternatives.items()) + [("recboost", contender)]:
            fn(*args(name))
    samples = {name: [] for name in alternatives}

    def setup():
        for name, fn in alternatives.items():
            a = args(name)
            t0 = time.perf_counter()
            fn(*a)
            samples[name].append(time.perf_counter() - t0)
        return args("recboost"), {}

    result = benchmark.pedantic(slowed(contender), setup=setup, rounds=rounds, warmup_rounds=0, iterations=1)
    if check is not None:
        check(result)
    ours = benchmark.stats.stats.data
    times = {name: statistics.median(v) for name, v in samples.items()}
    ratios = {name: statistics.median(a / b for a, b in zip(ours, v)) for name, v in samples.items()}
    times["recboost"] = statistics.median(ours)
    benchmark.extra_info["rounds"] = rounds
    return times, ratios


def record(name, payload, benchmark=None):
    """Save one bench result (a dict) as ``results/<name>.json``, print it, and put it in
    ``benchmark.extra_info`` (with ``bench=name``) when a benchmark fixture is given; returns it."""
    os.makedirs(RESULTS, exist_ok=True)
    payload = dict(payload, bench=name, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(os.path.join(RESULTS, name + ".json"), "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
    print("\n[%s] %s" % (name, json.dumps(payload, sort_keys=True)))
    if benchmark is not None:
        benchmark.extra_info.update(payload)
    return payload


def warm_online(model, batches, warmup):
    """``(model, rest)``: ``model`` after ``online_train`` on the first ``warmup`` batches (compiles
    and fills its tables outside the timed part), and the batches left to time."""
    model.online_train(batches[:warmup], dataset_sink_mode=False)
    return model, batches[warmup:]


def run_online(model, stream):
    """Train ``model`` on ``stream`` (the timed recboost contender); returns the model."""
    model.online_train(stream, dataset_sink_mode=False)
    return model

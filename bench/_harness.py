"""Shared bench helpers: interleaved timing of alternatives in one process, reported as ratios.

Absolute times on shared machines drift by +-50%, so every figure is a ratio of two alternatives
timed in the same process, interleaved round by round (A, B, A, B, ...) so drift hits both alike.
Results are appended to ``bench/results/<name>.json`` (git-ignored).
"""
import json
import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUICK = os.environ.get("RECBOOST_BENCH_QUICK") == "1"


def interleaved(fns, rounds, inner=1, warmup=1):
    """Time each callable of ``fns`` (dict name -> fn) ``rounds`` times, interleaved.

    Each timing is ``inner`` calls; the callables must sync (``asnumpy()``) before returning.
    Returns dict name -> median seconds per call.
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


def record(name, payload):
    """Print and save one bench result (a dict); returns it."""
    os.makedirs(RESULTS, exist_ok=True)
    payload = dict(payload, bench=name, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(os.path.join(RESULTS, name + ".json"), "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
    print("\n[%s] %s" % (name, json.dumps(payload, sort_keys=True)))
    return payload

"""Shared fixtures.

``backend`` runs a test once per available kernel backend (ids ``py`` and ``fast``): it rebinds the
kernel names in ``recboost`` to that backend's implementations for the duration of the test, so
higher-level classes (HashEmbedding, GradientFreeze, ...) use it too. ``make test`` runs the whole
suite compiled (both ids) and, beside it, the end-to-end subset marked ``fallback`` with
``RECBOOST_NO_EXTENSIONS=1`` (``py`` only; ``make test-fallback`` runs every test there). The
compiled-vs-twin parity tests need both backends and say so when skipped on the fallback run.
"""
import contextlib
import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import recboost  # noqa: E402


def _available_backends():
    return ["py", "fast"] if recboost.FAST_BACKEND else ["py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (still part of the default suite)")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", _available_backends(), indirect=True)


@pytest.fixture
def backend(request, monkeypatch):
    """A namespace with ``name`` ('py'/'fast') and every kernel of that backend, bound in recboost.
    ``HashCache`` is the public class: its argument checks in front of that backend's kernel."""
    kernels = recboost._backend_kernels(request.param)
    kernel = kernels["HashCache"]
    kernels["HashCache"] = recboost.HashCache if kernel is recboost._HashCacheKernel else \
        type("HashCache", (recboost._HashCacheChecks, kernel), {"__doc__": recboost.HashCache.__doc__})
    for name, obj in kernels.items():
        monkeypatch.setattr(recboost, name, obj)
    return types.SimpleNamespace(name=request.param, **kernels)


@contextlib.contextmanager
def _in_mode(name):
    """MindSpore in GRAPH_MODE ("graph") or PYNATIVE_MODE ("pynative") on CPU, its mode restored after."""
    import mindspore as ms
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE if name == "graph" else ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    try:
        yield name
    finally:
        ms.set_context(mode=old)


@pytest.fixture(params=["graph", "pynative"])
def ms_mode(request):
    """Run the test in GRAPH_MODE and in PYNATIVE_MODE on CPU."""
    with _in_mode(request.param) as name:
        yield name


@pytest.fixture
def pynative():
    """Run the test in PYNATIVE_MODE on CPU."""
    with _in_mode("pynative"):
        yield


@pytest.fixture
def graph_mode():
    """Run the test in GRAPH_MODE on CPU."""
    with _in_mode("graph"):
        yield


@pytest.fixture(autouse=True)
def _fresh_mindspore_autoboost():
    """MindSpore's AutoBoost is a process-wide singleton whose first level wins: a stock
    ``mindspore.train.Model(..., boost_level=...)`` would get whatever level an earlier test asked for.
    Every test starts without one."""
    from mindspore.boost.boost import AutoBoost
    AutoBoost._instance = None
    yield
    AutoBoost._instance = None


@pytest.fixture(scope="session")
def dist_jobs(tmp_path_factory):
    """One msrun launch (tests/_dist_jobs_worker.py, 2 ranks on 127.0.0.1) for the successful 2-rank jobs
    of test_boost_dist, test_budget_dist and test_ranks (an msrun start costs more than most of what it
    runs): the output folder, holding each job's folder (``boost``, ``budget``, ``ranks``) and the
    workers' ``logs``."""
    from _dist import msrun_results
    out = tmp_path_factory.mktemp("dist_jobs")
    msrun_results(out, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dist_jobs_worker.py"),
                  os.path.join("ranks", "stall_%d.npz"), out, timeout=420)
    return out

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
import shutil
import subprocess
import sys
import tempfile
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


_DIST_JOBS_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dist_jobs_worker.py")
_STALL_TEST = "test_ranks.py::test_a_stall_longer_than_mindspores_collective_timeout_does_not_end_the_job"
_STALL_JOB = pytest.StashKey()


def pytest_collection_finish(session):
    """When test_ranks' stall test is to run, its msrun launch starts now, once per session (the stash's
    ``(folder, running job)``): its rank 1 sleeps for longer than MindSpore's collective timeout and rank 0
    waits for it, idle time the tests before it fill."""
    if not session.config.option.collectonly and any(item.nodeid.endswith(_STALL_TEST) for item in session.items):
        from _dist import msrun_start
        out = tempfile.mkdtemp(prefix="recboost-stall-")
        session.config.stash[_STALL_JOB] = (out, msrun_start(os.path.join(out, "stall"), _DIST_JOBS_WORKER, out,
                                                             "stall"))


def pytest_sessionfinish(session):
    """The stall launch's folder is removed; a launch no test waited for (a run stopped early) is waited
    for here, within its bound, then killed."""
    if _STALL_JOB in session.config.stash:
        from _dist import msrun_wait
        out, job = session.config.stash[_STALL_JOB]
        if job[2].returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                msrun_wait(job, timeout=300)
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def dist_jobs(tmp_path_factory, pytestconfig):
    """The successful 2-rank jobs of test_boost_dist, test_budget_dist and test_ranks
    (tests/_dist_jobs_worker.py; an msrun start costs more than most of what it runs): one msrun launch
    runs boost, budget and ranks in turn (the output folder's ``boost``, ``budget``, ``ranks``, its
    workers' ``logs``); test_ranks' stall case, when it is to run, in its own launch, started when the
    tests were collected (``stall``). The output folder."""
    from _dist import msrun, msrun_wait, succeeded
    out = tmp_path_factory.mktemp("dist_jobs")
    succeeded(out, os.path.join("ranks", "uneven_%d.npz"), msrun(out, _DIST_JOBS_WORKER, out, "boost", "budget",
                                                                 "ranks", timeout=300))
    if _STALL_JOB in pytestconfig.stash:
        stall_out, stall = pytestconfig.stash[_STALL_JOB]
        ran = msrun_wait(stall, timeout=300)
        shutil.copytree(os.path.join(stall_out, "stall"), out / "stall")
        succeeded(out, os.path.join("stall", "stall_%d.npz"), ran)
    return out

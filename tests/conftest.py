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
import re
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


def _argnames(names):
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def pytest_generate_tests(metafunc):
    """Every test that takes ``backend`` runs on each available backend, unless it names its backends
    itself (``@pytest.mark.parametrize("backend", [...], indirect=True)``) or is marked ``live_backend``
    (pytest.ini): a whole training run, which runs on the live backend only (the compiled one when it is
    built; the twins in the fallback run)."""
    named = any("backend" in _argnames(mark.args[0]) for mark in metafunc.definition.iter_markers("parametrize"))
    live = metafunc.definition.get_closest_marker("live_backend") is not None
    if live and ("backend" not in metafunc.fixturenames or named):
        raise pytest.UsageError("%s is marked live_backend but does not take the backend fixture's own "
                                "parametrization" % metafunc.definition.nodeid)
    if "backend" in metafunc.fixturenames and not named:
        metafunc.parametrize("backend", _available_backends()[-1:] if live else _available_backends(), indirect=True)


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


#: The environment variable that tells a test of ``fresh_process`` it is the new process's run.
_FRESH = "RECBOOST_FRESH_PROCESS"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``fresh_process`` runs in a new Python process (pytest on its node id alone, with this
    environment), so nothing an earlier test left in MindSpore reaches it: MindSpore 2.10's compiler keeps
    state from a stock ``Model(boost_level="O1")`` that trained with gradient freezing, after which
    mindrec's published ``TrainStepWrap`` no longer compiles (docs/coming-from-mindspore.md, "Known issue")."""
    if pyfuncitem.get_closest_marker("fresh_process") is None or os.environ.get(_FRESH) == pyfuncitem.nodeid:
        return None
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                         cwd=ROOT, env=dict(os.environ, **{_FRESH: pyfuncitem.nodeid}), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and re.search(r"\b1 passed\b", out.stdout), out.stdout[-6000:] + out.stderr[-3000:]
    return True


@pytest.fixture(autouse=True)
def _fresh_mindspore_autoboost():
    """MindSpore's AutoBoost is a process-wide singleton whose first level wins: a stock
    ``mindspore.train.Model(..., boost_level=...)`` would get whatever level an earlier test asked for.
    Every test starts without one."""
    from mindspore.boost.boost import AutoBoost
    AutoBoost._instance = None
    yield
    AutoBoost._instance = None


@pytest.fixture(autouse=True)
def _mindspore_mode_kept():
    """A test leaves MindSpore's mode as it found it (a module's fixture may set one for the whole module):
    a test that ran in another mode would otherwise decide the mode of whichever test its worker runs
    next. One that leaves another mode fails here, naming both, and the mode is put back."""
    import mindspore as ms
    mode = ms.get_context("mode")
    yield
    left = ms.get_context("mode")
    if left != mode:
        ms.set_context(mode=mode)
        names = {ms.GRAPH_MODE: "GRAPH_MODE", ms.PYNATIVE_MODE: "PYNATIVE_MODE"}
        pytest.fail("the test left MindSpore in %s; it started in %s" % (names.get(left, left), names.get(mode, mode)))


_HERE = os.path.dirname(os.path.abspath(__file__))
_DIST_JOBS_WORKER = os.path.join(_HERE, "_dist_jobs_worker.py")
_EARLY = pytest.StashKey()


def _early_launches():
    """The msrun launches that start when the tests are collected, each when a test that needs it is to
    run: name -> (whether a test item needs it, the function that starts it given the output folder), in
    the order they start. Their idle time (msrun's start and rendezvous, a rank waiting), and the core
    the tests before them leave free, fill with the tests before them: conftest's shared launch of
    ``dist_jobs`` (about one core busy); test_ranks' stall case (its rank 1 sleeps for longer than
    MindSpore's collective timeout and rank 0 waits for it); test_tables_dist's killed rank (the scheduler
    waits out the dead rank's heartbeat) and its docs example (half of its wall time idle). Not its
    stalled rank: its watchdog's 8 s would also end a rank merely slowed by all of this (seen: rank 0 ended
    in another wait than the stall's)."""
    from _dist import FAILING_JOB_ENV, msrun_start
    reshard = os.path.join(_HERE, "_tables_reshard_worker.py")

    def test(name):
        return lambda item: item.nodeid.endswith(name)
    tables_dist = "test_tables_dist.py::test_"
    return {
        "shared": (lambda item: "dist_jobs" in item.fixturenames,
                   lambda folder: msrun_start(os.path.join(folder, "shared"), _DIST_JOBS_WORKER,
                                              os.path.join(folder, "shared"), "boost", "budget", "ranks")),
        "stall": (test("test_ranks.py::test_a_stall_longer_than_mindspores_collective_timeout_does_not_end_the_job"),
                  lambda folder: _start_worker(folder, "stall", _DIST_JOBS_WORKER, "stall")),
        "kill": (test(tables_dist + "a_killed_rank_ends_the_job_and_its_last_checkpoint_restores_in_one_process"),
                 lambda folder: _start_worker(folder, "kill", reshard, "kill", "row_wise", env=FAILING_JOB_ENV)),
        "readme": (test(tables_dist + "the_readme_msrun_example_runs"), _start_docs_example)}


def _start_worker(folder, name, script, *args, env=None):
    """``script`` (a test worker) started under msrun with ``folder`` and ``args``: it writes into ``folder``,
    msrun and its workers' logs go into ``folder/name`` (``folder/name/logs``)."""
    from _dist import msrun_start
    return msrun_start(os.path.join(folder, name), script, folder, *args, env=env)


def _start_docs_example(folder):
    """The data-parallel example of docs/distributed.md, as written (``folder/readme/train.py``), started
    under its msrun command in ``folder/readme`` (its logs in ``folder/readme/logs``)."""
    import re
    from _dist import msrun_start
    out = os.path.join(folder, "readme")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(ROOT, "docs", "distributed.md"), encoding="utf-8") as fh:
        section = fh.read().split("## Hash tables across processes (msrun)", 1)[1]
    script = os.path.join(out, "train.py")
    with open(script, "w") as fh:
        fh.write(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    return msrun_start(out, script, cwd=out, env={"PYTHONPATH": ROOT})


def pytest_collection_finish(session):
    """Every launch of :func:`_early_launches` whose test is to run starts now, once per session (the
    stash's ``(folder, {name: running job})``)."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return          # a pytest-xdist worker: each would start its own; its tests start them when they wait
    names = [name for name, (wanted, _) in _early_launches().items() if any(map(wanted, session.items))]
    if names:
        folder = tempfile.mkdtemp(prefix="recboost-early-")
        jobs = {}
        for name in names:
            with contextlib.suppress(Exception):   # one that cannot start now starts (and fails) in its test
                jobs[name] = _early_launches()[name][1](folder)
        session.config.stash[_EARLY] = (folder, jobs)


def _wait_launch(config, name, timeout):
    """The launch ``name`` of :func:`_early_launches` (started when the tests were collected, or now when
    it was not) waited for, bounded by ``timeout`` seconds from its start: ``(what msrun_wait returns,
    the folder its worker wrote into)``; its logs are in ``folder/name/logs``."""
    import pathlib
    from _dist import msrun_wait
    if _EARLY not in config.stash:
        config.stash[_EARLY] = (tempfile.mkdtemp(prefix="recboost-early-"), {})
    folder, jobs = config.stash[_EARLY]
    if name not in jobs:
        jobs[name] = _early_launches()[name][1](folder)
    return msrun_wait(jobs[name], timeout=timeout), pathlib.Path(folder)


@pytest.fixture
def early_launch(pytestconfig):
    """``wait(name, timeout)``: a launch of :func:`_early_launches` waited for (:func:`_wait_launch`)."""
    return lambda name, timeout: _wait_launch(pytestconfig, name, timeout)


def pytest_sessionfinish(session):
    """The early launches' folder is removed; a launch no test waited for (a run stopped early) is waited
    for here, within its bound, then killed."""
    if _EARLY in session.config.stash:
        from _dist import msrun_wait
        folder, jobs = session.config.stash[_EARLY]
        for job in jobs.values():
            if job[2].returncode is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    msrun_wait(job, timeout=300)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def dist_jobs(tmp_path_factory, pytestconfig):
    """The successful 2-rank jobs of test_boost_dist, test_budget_dist and test_ranks
    (tests/_dist_jobs_worker.py; an msrun start costs more than most of what it runs): one msrun launch,
    started when the tests were collected, runs boost, budget and ranks in turn (the output folder's
    ``boost``, ``budget``, ``ranks``, its workers' ``logs``); test_ranks' stall case, when it is to run, in
    its own launch beside it (``stall``). The output folder."""
    from _dist import succeeded
    out = tmp_path_factory.mktemp("dist_jobs")
    ran, folder = _wait_launch(pytestconfig, "shared", timeout=300)
    shutil.copytree(folder / "shared", out, dirs_exist_ok=True)
    succeeded(out, os.path.join("ranks", "uneven_%d.npz"), ran)
    if _EARLY in pytestconfig.stash and "stall" in pytestconfig.stash[_EARLY][1]:
        ran, folder = _wait_launch(pytestconfig, "stall", timeout=300)
        shutil.copytree(folder / "stall", out / "stall")
        succeeded(out, os.path.join("stall", "stall_%d.npz"), ran)
    return out

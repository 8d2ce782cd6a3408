"""What the msrun tests share: launching a 2-worker job on 127.0.0.1 (test side) and joining the
data-parallel context (worker side)."""
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time


_GIVEN_PORTS = set()


def free_port():
    """A free TCP port on 127.0.0.1 for msrun's master, never one given before in this process (jobs
    may run beside each other, and a port given a moment ago may not be bound yet)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


#: The environment of a job that ends by a rank's failure. msrun kills the other workers as soon as one
#: exits non-zero, then waits for its scheduler, which lets the dead ranks go only after MindSpore's node
#: heartbeat timeout (MS_NODE_TIMEOUT, 30 s by default): at 10 s such a job ends 20 s sooner. The heartbeat
#: is MindSpore's own thread, so a rank stalled in Python is still alive to it: this changes neither which
#: rank ends a job nor when, only how long the scheduler waits after it.
FAILING_JOB_ENV = {"MS_NODE_TIMEOUT": "10"}


def msrun_start(out, script, *args, cwd=None, env=None):
    """Start ``script`` under msrun with 2 workers on 127.0.0.1 (logs in ``out/logs``) and return at once:
    the running job, for :func:`msrun_wait`."""
    exe = os.path.join(os.path.dirname(sys.executable), "msrun")
    env = dict(os.environ, **(env or {}))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env.setdefault("PYTHONFAULTHANDLER", "1")      # a worker that crashes writes every thread's stack to its log
    cmd = [exe, "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
           "--master_port=%d" % free_port(), "--join=True", "--log_dir=%s" % os.path.join(str(out), "logs"),
           str(script)] + [str(a) for a in args]
    os.makedirs(str(out), exist_ok=True)
    # msrun's own output goes to files, not pipes: a job nobody reads yet never blocks on a full pipe
    with open(os.path.join(str(out), "msrun.out"), "w") as stdout, \
            open(os.path.join(str(out), "msrun.err"), "w") as stderr:
        start = time.perf_counter()
        popen = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd)
    # its end is timed when it comes: a job started early may be waited for long after it ended
    threading.Thread(target=_time_end, args=(popen,), daemon=True).start()
    return out, start, popen


def _time_end(popen):
    """``popen.ended``: the moment ``popen`` ended (time.perf_counter)."""
    popen.wait()
    popen.ended = time.perf_counter()


def msrun_wait(job, timeout=240):
    """Wait for a job of :func:`msrun_start`, bounded by ``timeout`` seconds from its start (past it, msrun
    is killed and ``subprocess.TimeoutExpired`` raised): ``(completed process, wall seconds from its start
    to its end, the error lines of the workers' logs)``."""
    out, start, popen = job
    try:
        popen.wait(timeout=max(1.0, start + timeout - time.perf_counter()))
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
        raise
    wall = getattr(popen, "ended", time.perf_counter()) - start
    if wall > timeout:                           # a job started early, which ended past its bound
        raise subprocess.TimeoutExpired(popen.args, timeout)
    output = []
    for name in ("msrun.out", "msrun.err"):
        with open(os.path.join(str(out), name), errors="replace") as fh:
            output.append(fh.read())
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, *output)
    logs, folder = "", os.path.join(str(out), "logs")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name), errors="replace") as fh:
            text = fh.read()
        logs += "\n".join(line for line in text.splitlines() if "Traceback" in line or "Error" in line)[-3000:]
    return proc, wall, logs


def msrun(out, script, *args, timeout=240, cwd=None, env=None):
    """Run ``script`` under msrun with 2 workers on 127.0.0.1 (logs in ``out/logs``), bounded by
    ``timeout``: ``(completed process, wall seconds, the error lines of the workers' logs)``."""
    return msrun_wait(msrun_start(out, script, *args, cwd=cwd, env=env), timeout)


def msrun_results(out, script, results, *args, **kwargs):
    """:func:`msrun` of ``script`` that must succeed (its output and the workers' errors otherwise),
    then each rank's ``out / (results % rank)`` (an ``.npz`` the worker wrote) as a dict."""
    return succeeded(out, results, msrun(out, script, *args, **kwargs))


def succeeded(out, results, ran):
    """``ran`` (what :func:`msrun` or :func:`msrun_wait` returned) must be a success (its output and the
    workers' errors otherwise): each rank's ``out / (results % rank)`` as a dict."""
    import numpy as np
    proc, wall, logs = ran
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    script = [a for a in proc.args if a.endswith(".py")][0]
    print("msrun %s: %.1f s wall" % (os.path.basename(script), wall))
    return [dict(np.load(os.path.join(str(out), results % r))) for r in range(2)]


def init_data_parallel():
    """Worker side: GRAPH mode on CPU, ``mindspore.communication.init()``, DATA_PARALLEL with averaged
    gradients over every rank; returns ``(rank, size)``."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    rank, size = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=size)
    return rank, size


@contextlib.contextmanager
def graph_mode_on_cpu():
    """Test side: GRAPH mode on CPU, like the workers, for a one-process reference (module-scoped
    fixtures cannot use conftest's ``graph_mode``); the mode before is restored."""
    import mindspore as ms
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    try:
        yield
    finally:
        ms.set_context(mode=mode)

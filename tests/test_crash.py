"""Crash safety: online training killed with SIGKILL at random moments resumes exactly."""
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

# Kills at chosen moments: the whole suite's serial part (make test-all), not the
# newcomer's check (make test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_online_worker.py")
TOTAL = 150
KILLS = int(os.environ.get("RECBOOST_CRASH_KILLS", "20"))


def _start(ckpt, out, slow=True, flags=()):
    cmd = [sys.executable, WORKER, ckpt, out, str(TOTAL)] + (["--slow-writes"] if slow else []) + list(flags)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, GLOG_v="3"))


def _run_to_end(ckpt, out, proc=None):
    """``proc`` (or a run started now) waited for to its end, which must be a success: its output."""
    proc = proc or _start(ckpt, out)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


def _kill_chain(ckpt, out, kills, seed, flags=(), first=2):
    """Runs in ``ckpt`` (the worker's ``flags``) killed ``kills`` times, each at a random moment after it
    printed a step (each one resuming from the last's checkpoints): ``(kills, resumes, kills inside a
    write)``. A run that found no checkpoint to resume from is killed only after step ``first``, by whose
    print a checkpoint is complete (OnlineCheckpoint comes first among the callbacks: step 2's is written
    before it prints, or in the background, waited for by step 4's save): so every later run has one
    to resume from, however slowly a busy machine runs the steps."""
    rng = np.random.default_rng(seed)
    done = resumes = inside_write = 0
    while done < kills:
        proc = _start(ckpt, out, flags=flags)
        # wait until it trains (prints a step; the first run, step ``first``), then kill after a random delay
        line, resumed = proc.stdout.readline(), False
        while line and not (line.startswith("step") and (resumed or int(line.split()[1]) >= first)):
            if line.startswith("resume"):
                resumes += 1
                resumed = True
            line = proc.stdout.readline()
        if not line:                         # it finished before we could kill it: start over
            proc.wait()
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            break
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done += 1
        # a kill inside a write leaves only a temporary file; every final name is complete
        names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
        inside_write += any(name.startswith(".tmp-") for name in names)
        for name in names:
            if not name.startswith("."):          # not a temporary, nor the lock file a kill leaves
                with np.load(os.path.join(ckpt, name)) as data:
                    assert "manifest" in data.files
    return done, resumes, inside_write


def test_sigkill_at_random_moments_then_resume_is_exact(tmp_path):
    """KILLS kills in two chains of runs side by side (each its own directory; a run mostly waits on
    its start and compiling, and there are two cores), each chain then resumed to its end: both end bit
    for bit as the uninterrupted reference run, which goes on beside them."""
    ref_out = str(tmp_path / "reference.npz")
    # the uninterrupted reference run goes on beside the killed ones (its own directory); waited for below
    reference = _start(str(tmp_path / "ref-ckpt"), ref_out)
    chains = [(str(tmp_path / ("ckpt-%d" % k)), str(tmp_path / ("resumed-%d.npz" % k)), (KILLS + 1 - k) // 2, 2026 + k)
              for k in (0, 1)]                   # (checkpoints, output, its kills, its seed)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            counts = list(pool.map(lambda chain: _kill_chain(*chain), chains))
        for (_, _, kills, _), (done, resumes, _) in zip(chains, counts):
            assert done == kills, "training finished after %d kills; make TOTAL larger" % done
            assert resumes >= kills - 2
        assert sum(inside for _, _, inside in counts) >= 1, "no kill landed inside a checkpoint write"
        _run_to_end(str(tmp_path / "ref-ckpt"), ref_out, reference)
    finally:                                  # a failure above leaves no reference run behind
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    resumed = [_start(ckpt, out) for ckpt, out, _, _ in chains]     # both chains to their end, side by side
    try:
        for (ckpt, out, _, _), proc in zip(chains, resumed):
            _run_to_end(ckpt, out, proc)
    finally:
        for proc in resumed:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    with np.load(ref_out) as ref:
        for ckpt, out, _, _ in chains:
            assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]   # stale temporaries cleaned
            with np.load(out) as got:
                assert sorted(ref.files) == sorted(got.files)
                for name in ref.files:
                    np.testing.assert_array_equal(ref[name], got[name], err_msg="%s of %s" % (name, out))


def test_sigkill_inside_background_checkpoint_writes_then_resume_is_exact(tmp_path):
    """``OnlineCheckpoint(background=True)``, its writes slowed so that the steps go on during most of
    them: KILLS // 2 kills at random moments in one chain of runs (most inside a write), then resumed to
    its end: bit for bit as the uninterrupted run with blocking checkpoints, which goes on beside it."""
    ref_out, ckpt, out = (str(tmp_path / name) for name in ("reference.npz", "ckpt", "resumed.npz"))
    reference = _start(str(tmp_path / "ref-ckpt"), ref_out)
    try:
        done, resumes, inside = _kill_chain(ckpt, out, KILLS // 2, 62, flags=["--background"], first=4)
        assert done == KILLS // 2, "training finished after %d kills; make TOTAL larger" % done
        assert resumes >= done - 1
        assert inside >= 1, "no kill landed inside a background checkpoint write"
        _run_to_end(str(tmp_path / "ref-ckpt"), ref_out, reference)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    _run_to_end(ckpt, out, _start(ckpt, out, flags=["--background"]))
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]
    with np.load(ref_out) as ref, np.load(out) as got:
        assert sorted(ref.files) == sorted(got.files)
        for name in ref.files:
            np.testing.assert_array_equal(ref[name], got[name], err_msg=name)

"""Ranks that agree or fail clearly, within the stated timeout (issue 27): tests/_ranks_worker.py's four
cases on 2 msrun workers on 127.0.0.1 (conftest's ``dist_jobs``: three in turn in a shared launch, the
stall case in its own launch beside it). Ranks configured apart fail at once, naming the first
difference; uneven streams end together; a rank stalled for longer than MindSpore's own CPU collective
timeout (30 s) but less than ``RECBOOST_EXCHANGE_TIMEOUT`` does not end the job."""
import os

import numpy as np
import pytest

from _ranks_worker import STALL

# msrun jobs or kills at chosen moments: the whole suite's serial part (make test-all), not the
# newcomer's check (make test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def job(dist_jobs):
    """A case's ``[rank 0's results, rank 1's]`` (the stall case ran in its own launch), and the logs of
    the workers of the other cases."""
    assert STALL > 30                                  # MindSpore 2.10's CPU collective timeout
    logs = "".join(open(os.path.join(dist_jobs, "logs", name), errors="replace").read()
                   for name in sorted(os.listdir(os.path.join(dist_jobs, "logs"))))
    folder = {"stall": dist_jobs / "stall"}
    return lambda case: [dict(np.load(folder.get(case, dist_jobs / "ranks") / ("%s_%d.npz" % (case, r))))
                         for r in range(2)], logs


@pytest.mark.parametrize("case, path, theirs, mine", [("seed", "tables.ids.seed", "0", "1"),
                                                      ("capacity", "tables.ids.capacity", "256", "320")])
def test_ranks_configured_apart_fail_at_once_naming_the_difference(job, case, path, theirs, mine):
    ranks = job[0](case)
    want = ("For 'RecModel.online_train', the configuration of every rank (%s) must be rank 0's %s, but got "
            "'%s on rank 1'." % (path, theirs, mine))
    assert [str(r["error"]) for r in ranks] == [want, want]
    assert [int(r["step"]) for r in ranks] == [0, 0]


def test_uneven_streams_end_together(job):
    """Rank 1's stream ends 4 batches early: both ranks stop at step 6 and say why; rank 0's 7th
    batch was read, not trained, and not counted as consumed."""
    ranks, logs = job[0]("uneven"), job[1]
    assert [int(r["step"]) for r in ranks] == [6, 6] and [int(r["consumed"]) for r in ranks] == [6, 6]
    np.testing.assert_array_equal(ranks[0]["weight"], ranks[1]["weight"])
    assert "the stream of rank(s) [1] ended: every rank stops at step 6" in logs
    assert "this rank's stream batch 7 was read and not trained" in logs


def test_a_stall_longer_than_mindspores_collective_timeout_does_not_end_the_job(job):
    """MindSpore 2.10's CPU collectives give up after 30 s (MS_CPU_COMM_OP_TIMEOUT; a job run with it
    at 30 fails here with "Launch kernel failed, name:Default/AllGather"): recboost sets it from
    RECBOOST_EXCHANGE_TIMEOUT (600 s), so a 35 s stall of one rank's data source passes."""
    ranks = job[0]("stall")
    assert [int(r["step"]) for r in ranks] == [10, 10] and [str(r["error"]) for r in ranks] == ["", ""]
    np.testing.assert_array_equal(ranks[0]["weight"], ranks[1]["weight"])

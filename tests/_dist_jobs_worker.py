"""Worker of the shared msrun launches (conftest's ``dist_jobs``: 2 ranks, CPU, 127.0.0.1) of
tests/test_boost_dist.py, tests/test_budget_dist.py and tests/test_ranks.py: an msrun start costs more
than most of what it runs.

``<out> JOB [JOB ...]``: joins the data-parallel context once, then runs the jobs in the order given,
each into its own folder ``<out>/<JOB>``: ``boost`` (tests/_boost_dist_worker.py's scenarios), ``budget``
(tests/_budget_dist_worker.py's two shardings), ``ranks`` (tests/_ranks_worker.py's cases but the stall;
two of them fail on purpose) and ``stall`` (its stall case: rank 1 sleeps ``_ranks_worker.STALL`` seconds).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _boost_dist_worker  # noqa: E402
import _budget_dist_worker  # noqa: E402
import _ranks_worker  # noqa: E402
from _dist import init_data_parallel  # noqa: E402

#: Each job: what it runs, given its folder and this rank.
JOBS = {"boost": _boost_dist_worker.run,
        "budget": _budget_dist_worker.run,
        "ranks": lambda out, rank: _ranks_worker.run_all(out, rank, 0.0, ("seed", "capacity", "uneven")),
        "stall": lambda out, rank: _ranks_worker.run_all(out, rank, _ranks_worker.STALL, ("stall",))}


def main():
    out, jobs = sys.argv[1], sys.argv[2:]
    unknown = sorted(set(jobs) - set(JOBS))
    assert jobs and not unknown, "jobs must be among %s, but got %s" % (sorted(JOBS), jobs)
    rank, _ = init_data_parallel()
    for job in jobs:
        os.makedirs(os.path.join(out, job), exist_ok=True)
        JOBS[job](os.path.join(out, job), rank)


if __name__ == "__main__":
    main()

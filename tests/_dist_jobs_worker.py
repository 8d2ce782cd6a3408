"""Worker of the shared msrun launch (conftest's ``dist_jobs``: 2 ranks, CPU, 127.0.0.1) of
tests/test_boost_dist.py, tests/test_budget_dist.py and tests/test_ranks.py: an msrun start costs more
than most of what it runs.

``<out>``: joins the data-parallel context once, then runs in turn, each into its own
folder, tests/_boost_dist_worker.py's scenarios (``<out>/boost``), tests/_budget_dist_worker.py's two
shardings (``<out>/budget``) and tests/_ranks_worker.py's four cases (``<out>/ranks``; last: two of them
fail on purpose, and its stall case sleeps ``_ranks_worker.STALL`` seconds).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _boost_dist_worker  # noqa: E402
import _budget_dist_worker  # noqa: E402
import _ranks_worker  # noqa: E402
from _dist import init_data_parallel  # noqa: E402

#: The jobs in the order they run, each the folder of its results under ``<out>``.
JOBS = ("boost", "budget", "ranks")


def main():
    out = sys.argv[1]
    rank, _ = init_data_parallel()
    folders = {job: os.path.join(out, job) for job in JOBS}
    for folder in folders.values():
        os.makedirs(folder, exist_ok=True)
    _boost_dist_worker.run(folders["boost"], rank)
    _budget_dist_worker.run(folders["budget"], rank)
    _ranks_worker.run_all(folders["ranks"], rank, _ranks_worker.STALL)


if __name__ == "__main__":
    main()

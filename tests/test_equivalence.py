"""Behaviour does not change while recboost.py is reorganised (issue #24): the same seeded run under
this tree's recboost and under the behaviour reference, the recboost.py of commit ``REFERENCE``
(checked out of git into a temporary folder; numpy kernels, which are bit-identical to the compiled
ones), gives the same losses at every step, the same dense parameters, the same table (rows, slots,
cache) and the same checkpoint members, bit for bit, at boost O0 and O1
(``tests/_equivalence_worker.py``, one process per side).

``REFERENCE`` moves forward only in a commit of its own that changes behaviour on purpose and says
why, as ``bench/BASELINE`` does for speed."""
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.fallback       # also on make test's numpy-fallback run (pytest.ini)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REFERENCE = "2bd9983"            # states and checkpoints carry the score policy's four settings (issue 62)


def _run(folder, out, env):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_equivalence_worker.py"), folder, out],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as data:
        return {key: data[key] for key in data.files}


def test_a_seeded_run_is_bit_for_bit_the_reference_run(tmp_path):
    source = subprocess.run(["git", "-C", ROOT, "show", "%s:recboost.py" % REFERENCE], capture_output=True,
                            check=True).stdout
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "recboost.py").write_bytes(source)
    (tmp_path / "head").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RECBOOST_REQUIRE_EXTENSIONS"}    # (the compiled run sets it)
    reference = _run(str(tmp_path / "reference"), str(tmp_path / "reference" / "out.npz"),
                     dict(env, RECBOOST_NO_EXTENSIONS="1"))
    head = _run(ROOT, str(tmp_path / "head" / "out.npz"), dict(os.environ))
    assert sorted(head) == sorted(reference)
    for key in reference:
        np.testing.assert_array_equal(head[key], reference[key], err_msg=key)
    for level in ("O0", "O1"):                     # the run reaches every kind of table decision
        assert head[level + ":losses"].size == 30
        for stat in ("rejected", "evicted", "grown", "admitted"):
            assert int(head["%s:cache:%s" % (level, stat)]) > 0, (level, stat)
    assert not np.array_equal(head["O0:losses"], head["O1:losses"])       # O1 is not O0
    assert any(key.startswith("O0:ckpt:tables.0.") for key in head)      # the checkpoint holds the table

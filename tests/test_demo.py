"""The main job (python -m recboost demo) runs end to end and reports its figures."""
import os
import subprocess
import sys

import numpy as np

import recboost as rb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_command_line_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "recboost", "demo", "--steps", "12", "--batch-size", "256",
                          "--checkpoint-dir", str(tmp_path / "ckpt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l for l in out.stderr.splitlines() if l.startswith("[recboost]")]
    assert lines[0].startswith("[recboost] training widedeep online on the synthetic stream: 12 steps")
    assert any(" | loss " in l and "samples/s" in l for l in lines)        # progress line
    done = lines[-1]
    assert done.startswith("[recboost] done: 12 steps") and "oracle" in done and "log loss" in done
    assert rb.latest_checkpoint(str(tmp_path / "ckpt")).endswith("recboost-12.npz")


def test_demo_on_a_criteo_file(tmp_path, graph_mode):
    path = str(tmp_path / "day.txt")
    rb.SyntheticClickStream(seed=1).write_criteo(path, 256 * 10)
    with open(path, "a") as fh:
        fh.write("this line is malformed\n")
    lines = []
    result = rb.demo(steps=100, batch_size=256, data=path, eval_batches=2, printer=lines.append)
    assert result["steps"] == 10                       # the file ends after 10 batches (+ 1 bad line)
    assert 0.0 <= result["auc"] <= 1.0 and np.isfinite(result["log_loss"])
    assert "oracle_auc" not in result
    assert sum(result["reader"]["malformed"].values()) == 1
    assert any("1 malformed lines skipped" in l for l in lines)

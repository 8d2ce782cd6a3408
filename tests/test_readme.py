"""The README's runnable examples, as written, each in a fresh process in an empty directory."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(heading):
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme[readme.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("heading, check", [
    ("### Multi-hot features and many tables",
     lambda out, here: out.split()[0] == "50" and int(out.split()[1]) > 500 and
     out.split(None, 3)[3].strip() == "(2, 1)"),
    ("## Export to serving",                           # its own asserts compare Predictor with RecModel
     lambda out, here: all((here / "serving" / b / "manifest.json").exists() for b in ("full", "delta-40"))),
])
def test_readme_example_runs(tmp_path, heading, check):
    script = tmp_path / "example.py"                   # a file: graph mode reads construct's source
    script.write_text(_example(heading))
    out = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert check(out.stdout, tmp_path), out.stdout

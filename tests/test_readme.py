"""The runnable examples of the README and docs/, as written, each in a fresh process in an empty directory."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fallback       # also on make test's numpy-fallback run (pytest.ini)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(document, heading):
    readme = open(os.path.join(ROOT, document), encoding="utf-8").read()
    section = readme[readme.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _first_run(out):
    """The README's first run: held-out AUC within 0.04 of the oracle's, a table that admitted ids and
    rejected others (admission on the second sighting)."""
    import ast
    found = re.search(r"held-out AUC (\S+), oracle (\S+)", out)
    stats = ast.literal_eval(re.search(r"table: (\{.*\})", out).group(1))          # the printed dict
    return found and 0 <= float(found.group(2)) - float(found.group(1)) < 0.04 and \
        stats["admitted"] > 0 and stats["rejected"] > 0


def _budget(out):
    """The README's budget table: its 8192 rows, at most as many ids tracked, ids replaced."""
    found = re.search(r"rows (\d+) ids tracked (\d+) replaced (\d+)", out)
    return found and int(found.group(1)) == 8192 and int(found.group(2)) <= 8192 and int(found.group(3)) > 1000


def _lines(out, pattern):
    """The first group of every line of ``out`` that matches ``pattern``."""
    return [m.group(1) for m in re.finditer(pattern, out, re.M)]


def _numbers(out, pattern, count):
    """The ``count`` numbers ``pattern``'s first group finds in ``out`` (else a list of -1s)."""
    found = [float(x) for x in _lines(out, pattern)]
    return found if len(found) == count else [-1.0] * count


def _number(out, pattern):
    return _numbers(out, pattern, 1)[0]


#: docs/tables.md's step by hand takes a batch and a network on its rows as given: these (each id seen twice,
#: so admitted with access_threshold=2).
PRE_HOST_TABLE = '''# The names the example takes as given: a batch (dense features, ids, a time, labels) and a network
# on the rows of its 3 ids (net_with_loss(dense, rows, label) -> loss) with its dense optimizer.
import numpy as np
import recboost
from mindspore import Tensor, nn, ops


class NetWithLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.out, self.loss = nn.Dense(4 + 3 * 16, 1), nn.BCEWithLogitsLoss()

    def construct(self, dense, rows, label):
        return self.loss(self.out(ops.concat((dense, rows.reshape(rows.shape[0], -1)), 1)), label)


net_with_loss = NetWithLoss()
dense_optimizer = nn.Adam(net_with_loss.trainable_params(), 1e-3)
rng = np.random.default_rng(0)
ids, ts = np.repeat(rng.integers(0, 20, (8, 3)), 2, axis=0), 1000       # each id seen twice: admitted
dense = Tensor(rng.normal(size=(16, 4)).astype(np.float32))
label = Tensor(rng.integers(0, 2, (16, 1)).astype(np.float32))
'''

#: Each runnable example: its page, its section and the check of its output.
EXAMPLES = [
    ("README.md", "## A first run", lambda out, here: _first_run(out)),
    ("README.md", "## Tables in a fixed memory budget",      # its rows, no more ids tracked, replacing
     lambda out, here: _budget(out)),
    ("docs/tables.md", "## Multi-hot features and many tables",
     lambda out, here: out.split()[0] == "50" and int(out.split()[1]) > 500 and
     out.split(None, 3)[3].strip() == "(2, 1)"),
    ("docs/tables.md", "### The score policy: ids that earn clicks keep their rows",    # scores, a row refused
     lambda out, here: out.split("\n")[:3] == ["[1.0, 1.1, 0.1]", "[2, 3, 3, 0]", "[0, 0, 0, 0]"]),
    ("docs/tables.md", "## Table optimizers: schedules, clipping and decay",     # decays with dense Adam
     lambda out, here: "table steps 6 dense global_step 6" in out and
     _number(out, r"largest difference from dense Adam (\S+)") < 1e-5 and
     _numbers(out, r"^step \d rate (\S+)$", 6)[5] < 0.01),
    ("docs/tables.md", "## Weighted ids and the max combiner",    # its asserts: weighted mean, ragged, Predictor
     lambda out, here: _number(out, r"^60 (\S+)$") > 0.9),
    ("docs/serving.md", "## Export to serving",        # its own asserts compare Predictor with RecModel
     lambda out, here: all((here / "serving" / b / "manifest.json").exists() for b in ("full", "delta-40"))),
    ("docs/boost.md", "## Using AutoBoost",             # a boosted step by hand, then all at once: each trains
     lambda out, here: 0 < _number(out, r"^boost O1 loss (\S+)$") < 10 and
     0 < _number(out, r"^BoostTrainOneStepCell (\S+)$") < 10),
    ("docs/coming-from-mindspore.md", "## From mindspore.train.Model",     # eval's callbacks, then its AUC
     lambda out, here: _lines(out, r"eval step (\d) of 4") == ["1", "2", "3", "4"] and
     _number(out, r"\{'auc': (\S+)\}") > 0.8),
    ("docs/coming-from-mindspore.md", "## From MindSpore Recommender",     # online until stopped, eval's AUC
     lambda out, here: "trained 60 steps" in out and _number(out, r"evaluated 4 batches: \{'auc': (\S+)\}") > 0.8),
    ("docs/coming-from-mindspore.md", "## From the Rec SDK",               # admitted, rejected, evicted; AUC
     lambda out, here: all(n > 0 for n in _numbers(out, r"'(?:admitted|rejected|evicted)': (\d+)", 3)) and
     _number(out, r"^auc (\S+)$") > 0.8 and "lookup (3, 8)" in out),
]


@pytest.mark.parametrize("document, heading, check", [      # the newcomer's check (make test) runs the first
    pytest.param(*case, marks=() if case[1] == "## A first run" else pytest.mark.slow) for case in EXAMPLES])
def test_readme_example_runs(tmp_path, document, heading, check):
    script = tmp_path / "example.py"                   # a file: graph mode reads construct's source
    script.write_text(_example(document, heading))
    out = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert check(out.stdout, tmp_path), out.stdout


#: The examples that take some names as given (a part of a longer script): each runs as written between a
#: prelude that defines those names and a line printing what the check reads, in a fresh process; the check
#: holds the example to its own words. Their page, section, prelude, printing line and check.
FRAGMENTS = [
    ("docs/training.md", "## RecModel and online training",      # trains the stream, checkpoints at its end
     "import os\nimport recboost as rb\nfrom mindspore import nn\n"
     "stream = ({'dense': d, 'ids': i, 'label': y, 'timestamp': t} for d, i, y, t in\n"
     "          rb.SyntheticClickStream(seed=0, batch_size=256, with_timestamp=True, num_batches=30))\n",
     "print('step', model.step, 'files', sorted(os.listdir('ckpt')), 'rows', table.cache.stats()['size'])\n",
     lambda out: "step 30 files ['recboost-30.npz'] rows " in out and _number(out, r"rows (\d+)$") > 1000),
    ("docs/training.md", "## Data and metrics",       # the items' dtypes and shapes, the reader's counters
     "", "print('items', [(a.dtype.name, a.shape[1:]) for a in (dense, ids, label)], prob.shape)\n"
         "print('stats', sorted(reader.stats()), reader.stats()['rows'], sorted(reader.position()))\n",
     lambda out: 0.74 < float(out.split()[0]) < 0.80 and
     "items [('float32', (13,)), ('int64', (26,)), ('float32', (1,))] (2048, 1)" in out and
     "stats ['batches', 'lines', 'malformed', 'rows', 'rows_yielded'] 100000 ['lines', 'offset', 'rows']" in out),
    ("docs/tables.md", "## Host tables: HashEmbedding", PRE_HOST_TABLE,        # rows, their gradient, an update
     "assert rows.shape == ids.shape + (16,) and grad.shape == rows.shape and not bool(overflow.asnumpy())\n"
     "print('moved', float(np.abs(emb.gather(emb.prepare(ids, timestamp=ts, is_train=False)) - rows).max()))\n",
     lambda out: 0 < _number(out, r"^moved (\S+)$") < 0.01),
    ("docs/training.md", "## Loss scaling and mixed precision that work on CPU",   # a scaled step; O2's dynamic scale
     "import numpy as np\nfrom mindspore import Tensor, nn\n"
     "net, loss_fn = nn.Dense(4, 1), nn.BCEWithLogitsLoss()\n"
     "net_with_loss, optimizer = nn.WithLossCell(net, loss_fn), nn.Adam(net.trainable_params(), 1e-3)\n"
     "inputs = (Tensor(np.ones((8, 4), np.float32)), Tensor(np.ones((8, 1), np.float32)))\n",
     "print('scaled', bool(overflow.asnumpy()), float(scale.asnumpy()))\n"
     "out = train(*inputs)        # fp16 overflows at the first dynamic scale, 2**24: halved\n"
     "print('o2', len(out), bool(out[1].asnumpy()), float(out[2].asnumpy()))\n",
     lambda out: "scaled False 4096.0" in out and "o2 3 True 8388608.0" in out),
    ("docs/serving.md", "## Exporting from a long run: `OnlineExport`",     # the chain, oldest first; no failure
     "import os\nimport recboost as rb\nfrom mindspore import nn\n"
     "table = rb.HashEmbedding(5, 4096, input_index=1, use_dynamic_expansion=True)\n"
     "net = rb.WideDeep(13, 26, 4, (8,), embedding=table)\n"
     "model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))\n"
     "stream, hook = rb.SyntheticClickStream(seed=0, batch_size=32, num_batches=1001), rb.ProgressMonitor()\n",
     "print('paths', [os.path.basename(p) for p in exporter.paths], 'failures', exporter.failures)\n",
     lambda out: "paths ['bundle-000000500', 'bundle-000001000', 'bundle-000001001'] failures []" in out),
]


@pytest.mark.slow
@pytest.mark.parametrize("document, heading, prelude, printing, check", FRAGMENTS,
                         ids=[case[1].lstrip("# ") for case in FRAGMENTS])
def test_docs_fragment_runs_between_its_prelude_and_its_claims(tmp_path, document, heading, prelude, printing,
                                                               check):
    script = tmp_path / "example.py"
    script.write_text(prelude + _example(document, heading) + printing)
    out = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert check(out.stdout), out.stdout


DOCS = ["README.md"] + sorted("docs/" + name for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
LONGEST_SECTION = 60        # lines of prose (code blocks not counted) a section may run without a heading


def _headings_and_runs(document):
    """``(headings, runs)`` of a markdown file outside its code blocks: ``(level, text)`` of each
    heading in order, and per heading the lines of prose before the next one (code blocks left out)."""
    headings, runs, fenced = [], [], False
    for line in open(os.path.join(ROOT, document), encoding="utf-8").read().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            headings.append((len(line) - len(line.lstrip("#")), line.lstrip("#").strip()))
            runs.append([])
        elif not fenced and runs:
            runs[-1].append(line)
    return headings, runs


@pytest.mark.parametrize("document", DOCS)
def test_every_page_says_what_it_covers_without_doubled_headings_or_long_sections(document):
    """A page opens with one title and a paragraph of what it covers; no heading repeats another of the
    page (e.g. '# Performance' then '## Performance'); no section runs more than LONGEST_SECTION lines
    of prose without a sub-heading."""
    headings, runs = _headings_and_runs(document)
    assert [level for level, _ in headings].count(1) == 1 and headings[0][0] == 1, headings
    opening = [line for line in runs[0] if line.strip() and not line.startswith(("|", "![", "<!--"))]
    assert opening, "%s: no paragraph between its title and the first sub-heading" % document
    texts = [re.sub(r"\W+", " ", text).strip().lower() for _, text in headings]
    assert len(set(texts)) == len(texts), "%s: doubled headings %s" % (
        document, sorted({t for t in texts if texts.count(t) > 1}))
    long = [(headings[i][1], len(run)) for i, run in enumerate(runs) if len(run) > LONGEST_SECTION]
    assert not long, "%s: sections longer than %d lines without a sub-heading: %s" % (
        document, LONGEST_SECTION, long)


def test_the_readme_says_how_long_make_demo_and_make_test_take_on_which_cpu():
    """The README gives the run times of its two commands and of a fresh-clone CI, with the CPU they
    were measured on."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    times = readme[readme.index("## Set-up and the two commands"):readme.index("## A first run")]
    assert re.search(r"`make demo`\s+\d+ s", times) and re.search(r"`make test`\s+[\d.]+\s+minutes", times), times
    assert re.search(r"\d+\s+cores\W+an?\s+(AMD|Intel)\s+\w+", times), times
    assert re.search(r"fresh-clone\s+CI\s+run\b.*?took\s+[\d.]+\s+minutes\s+on", times, re.S), times


#: What a child process runs first so that recboost cannot be imported in it (an installed or a
#: path copy alike): a served model must need MindSpore and numpy only.
NO_RECBOOST = "import sys\nsys.modules['recboost'] = sys.modules['_recboost_fast'] = None\n"


@pytest.mark.slow
def test_serving_without_recboost_runs_in_a_process_that_cannot_import_it(tmp_path):
    """docs/serving.md: the MindIR export (with recboost), then serve.py in a fresh process where
    ``import recboost`` fails; its own assert compares its predictions with Predictor's, bit for bit."""
    export = tmp_path / "export.py"
    export.write_text(_example("docs/serving.md", "## The dense network as MindIR"))
    out = subprocess.run([sys.executable, str(export)], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    serve = tmp_path / "serve.py"
    serve.write_text(NO_RECBOOST + _example("docs/serving.md", "## Serving without recboost"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(serve)], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("served (8, 1) without recboost"), out.stdout

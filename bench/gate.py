"""The benchmark gate: HEAD against its baseline commit on this machine (A/B), then the targets.

    .venv/bin/python bench/gate.py                     # the whole gate; exit 1 on a regression
    .venv/bin/python bench/gate.py --pairs 6           # more A/B pairs (default 4)
    .venv/bin/python bench/gate.py --baseline REF      # another baseline than bench/BASELINE
    .venv/bin/python bench/gate.py --skip-targets      # the A/B part only
    .venv/bin/python bench/gate.py --checked-only      # the targets part: only what can fail it (CI)

1. **Baseline.** ``bench/BASELINE`` names a commit (moved forward on purpose, in its own commit). Its
   tree is checked out with ``git archive`` into ``bench/results/baseline-<sha>/src`` and built
   with its own ``_fast.pyx`` (``pip install --no-deps --target .../site``, the extension required);
   the MindSpore install is shared. A build is reused while its stamp names the same commit.
2. **A/B.** The quick suite in A/B mode (``RECBOOST_BENCH_MODE=ab``: only recboost's own paths run,
   the ``untimed`` benches are left out) runs in alternating processes, baseline and HEAD, ``pairs``
   times in ABBA order (A B | B A | A B ...). Every process runs HEAD's bench code on the same work;
   ``RECBOOST_BENCH_TREE`` makes it import one side's ``recboost.py`` and build, and each result
   names the file it imported (checked). Per timed row: the median over the pairs of HEAD's time over
   the baseline's. A row beyond ``1 + tolerance`` (bench/floors.py: 10% or 15%, with the reason) is
   measured again, with twice as many fresh pairs of only the benches that time it; it fails only
   when the confirming run's median is beyond its tolerance too. ``RECBOOST_BENCH_SLOWDOWN`` and
   ``RECBOOST_NO_EXTENSIONS`` reach HEAD's processes only, so either must fail the gate. On Linux
   both sides' processes run without transparent huge pages (``no_huge_pages``): on a VM the first
   touch of a fresh huge page runs at two speeds from one process to the next, and only the side
   that asks for huge pages would pay it.
3. **Targets.** One report-mode run of the quick suite on HEAD: every figure against its anchor and
   its target, for the table. Rows with ``checked=True`` (AUC losses, memory growth, sizes) fail the
   gate when they miss their absolute target in that run and in one confirming re-run. With
   ``--checked-only`` (CI) that run is only the benches that record a checked row
   (``floors.CHECKED_BENCHES``): the same verdict in about a third of the time, without the reported
   rows of the other benches.

4. **The main job against the previous round.** ``bench/REFERENCE`` names the previous round's last
   commit, fixed for a round: the baseline moves forward within a round, so a creep inside each
   change's tolerance could add up unseen. ``python -m recboost demo --steps 600`` runs ``pairs`` ABBA
   pairs of processes, the reference's build against HEAD's (``PYTHONPATH``; each process names the
   file it imported, checked), and HEAD's time over the reference's (its samples/s over HEAD's) must
   stay within ``MAIN_JOB_TOLERANCE`` (3%), confirmed as above. ``--skip-reference`` leaves it out.

The verdicts and every measurement are printed and written to ``bench/results/gate.json``.
Exit status 0 when nothing failed, 1 otherwise (a timed row slower than its tolerance twice, a timed
row missing on HEAD or without a stated tolerance, a checked target missed twice, a HEAD bench that
failed, or a result that imported the wrong ``recboost.py``).
"""
import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import floors  # noqa: E402

RESULTS = os.path.join(HERE, "results")
JSON = os.path.join(RESULTS, "benchmarks.json")
BASELINE_FILE = os.path.join(HERE, "BASELINE")
REFERENCE_FILE = os.path.join(HERE, "REFERENCE")
#: The main job as a user runs it (``make demo``'s command, shorter), and how far HEAD may trail the
#: previous round's last commit (bench/REFERENCE) at it: samples/s from the job's own last line.
MAIN_JOB = ["demo", "--steps", "600"]
MAIN_JOB_TOLERANCE = 0.03
PAIRS = 4
# Benches not in the gate: bench_boost's six-configuration run and per-algorithm costs, the boost
# breakdown with tables and the fixed-budget tables' AUC and throughput (long, `make bench`; the
# baseline has no eviction policy), the msrun comparison of 2 ranks against 1 (separate jobs: no
# pairing possible), and the train command's memory and file-vs-ready-batches runs (minutes of
# training; the baseline has no train command), the finite check's cost against the check it replaced
# (bench_finite_check.py: two 1M-row models, run on demand), and the table optimizers' kernels against
# their tree before the options and on bfloat16 rows, the weighted pooled step and the tables' memory placement
# (bench_host_memory.py) (in-process comparisons, run on demand; the baseline has neither the options nor
# weights), and the room for overlapping the host work with the dense step (bench_tables.py's
# test_host_overlap_room: minutes of training, a measurement for issue #38, run on demand), and
# bench_serve.py (the serving process under a real client: several processes on shared cores, and
# the int8 rows' AUC, a quality figure; run on demand), and bench_compile.py (a new model's first step,
# compile time against MindSpore's cell: reported, run on demand).
NOT_GATED = ("not test_boost_throughput_and_auc and not test_boost_algorithm_costs and not test_dist_two_ranks_vs_one "
             "and not test_boost_breakdown_with_tables and not test_budget_tables_auc and not test_budget_table_throughput "
             "and not test_train_cli_peak_rss "
             "and not test_train_cli_file_vs_ready_batches and not test_finite_check_cost "
             "and not test_table_optimizer_kernels and not test_bfloat16_update_kernels "
             "and not test_weighted_pooled_step "
             "and not test_host_memory_adam_copy_rate and not test_host_overlap_room "
             "and not test_int8_auc and not test_serve_throughput and not test_serve_p99_during_deltas "
             "and not test_worker_rss and not test_serve_batching and not test_sorted_lookups "
             "and not test_first_step_compile")
HEAD_ONLY_ENV = ("RECBOOST_BENCH_SLOWDOWN", "RECBOOST_NO_EXTENSIONS")
#: ``prctl`` option (linux/prctl.h, Linux 3.15 on): transparent huge pages off for the process and
#: the processes it starts, across ``exec``.
PR_SET_THP_DISABLE = 41


def no_huge_pages():
    """The A/B processes' ``preexec_fn``: transparent huge pages off in the new process (Linux; a
    failing ``prctl`` raises ``OSError``, which the parent gets as ``SubprocessError``).

    Why: the two sides ask for huge pages (``MADV_HUGEPAGE``) for different arrays: HEAD for a
    table's rows, slots and hash map, the baseline for the map only. On a VM the first touch of a
    fresh huge page ran at 23 GB/s in most processes and at 0.9-4 GB/s in others (256 MB, one
    process each), and a 1M-row table's rows and map are first touched inside the timed rounds as
    new ids arrive: HEAD's ``multihot`` measured 6 ms or 20 ms a call from one process to the next
    on the same code, the baseline 7-9 ms. Without huge pages both sides take the same 4 KB pages
    and the pair compares the code. The huge pages' own gain is measured at scale
    (bench/bench_scale.py), outside the gate."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")


# ---- running the suite ----------------------------------------------------------------------------
def run_suite(json_path=JSON, mode="report", tree=ROOT, nodeids=None, env=None):
    """Run the quick suite (or only ``nodeids``) in ``mode`` importing ``tree``'s recboost, writing
    pytest-benchmark JSON to ``json_path``; returns ``(pytest exit code, seconds)``."""
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    if os.path.exists(json_path):
        os.remove(json_path)
    env = dict(os.environ if env is None else env, RECBOOST_BENCH_QUICK="1", RECBOOST_BENCH_MODE=mode,
               RECBOOST_BENCH_TREE=tree)
    targets = list(nodeids) if nodeids else ["-k", NOT_GATED, os.path.join(ROOT, "bench")]
    if mode == "ab" and not nodeids:
        targets = ["-m", "not untimed"] + targets
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "python_files=bench_*.py",
           "--benchmark-json", json_path, "--benchmark-columns", "median,min,max,rounds", "--durations=12"] + targets
    huge_pages_off = mode == "ab" and sys.platform.startswith("linux")
    print("+ [%s, %s%s] pytest %s" % (mode, os.path.relpath(tree, ROOT) if tree != ROOT else "HEAD",
                                       ", no huge pages" if huge_pages_off else "", " ".join(cmd[4:])), flush=True)
    t0 = time.perf_counter()
    if mode != "ab":
        code = subprocess.call(cmd, env=env, cwd=ROOT)
    else:                                        # an A/B process's output goes to a log beside its JSON
        log = os.path.splitext(json_path)[0] + ".log"
        with open(log, "w") as fh:
            code = subprocess.call(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                   preexec_fn=no_huge_pages if huge_pages_off else None)
        if code:
            with open(log) as fh:
                print("".join(fh.readlines()[-40:]), flush=True)
    return code, time.perf_counter() - t0


def load(json_path):
    """``{bench name: extra_info}`` of a pytest-benchmark JSON file (benches that called record)."""
    with open(json_path) as fh:
        data = json.load(fh)
    return {b["extra_info"]["bench"]: dict(b["extra_info"], _nodeid=b.get("fullname"))
            for b in data.get("benchmarks", []) if "bench" in b.get("extra_info", {})}


def ab_times(extra):
    """``{timed row: seconds}`` of one A/B process's results (from ``load``)."""
    out = {}
    for info in extra.values():
        out.update(info.get("ab", {}))
    return out


def row_nodeids(extra):
    """``{timed row: pytest node id}`` of the benches in ``extra`` (from ``load``)."""
    return {row: info["_nodeid"] for info in extra.values() for row in info.get("ab", {}) if info.get("_nodeid")}


def wrong_tree(extra, tree):
    """The benches of ``extra`` whose recboost.py is not ``tree``'s (the gate's proof of the side)."""
    want = os.path.realpath(os.path.join(tree, "recboost.py"))
    return sorted(name for name, info in extra.items()
                  if os.path.realpath(info.get("recboost_file", "")) != want)


# ---- the baseline ---------------------------------------------------------------------------------
def baseline_ref(path=BASELINE_FILE):
    """The commit named in ``bench/BASELINE``: its first word that is not a comment."""
    with open(path) as fh:
        for line in fh:
            word = line.split("#", 1)[0].strip()
            if word:
                return word
    raise SystemExit("gate: %s names no commit" % path)


def resolve(ref):
    """The full sha of ``ref`` in this repository (SystemExit naming it when git does not know it)."""
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", ref + "^{commit}"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit("gate: the baseline %r is not a commit of this repository (%s)" % (ref, out.stderr.strip()))
    return out.stdout.strip()


def build_baseline(sha, results=RESULTS):
    """The directory holding the baseline's ``recboost.py`` and its own ``_recboost_fast`` build
    (built once per commit; a build whose stamp names another commit is rebuilt)."""
    folder = os.path.join(results, "baseline-" + sha[:12])
    site, stamp = os.path.join(folder, "site"), os.path.join(folder, "stamp")
    if os.path.exists(stamp) and open(stamp).read().strip() == sha and os.path.exists(os.path.join(site, "recboost.py")):
        print("gate: baseline %s already built in %s" % (sha[:12], os.path.relpath(folder, ROOT)), flush=True)
        return site
    shutil.rmtree(folder, ignore_errors=True)
    src = os.path.join(folder, "src")
    os.makedirs(src)
    t0 = time.perf_counter()
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", src], stdin=archive.stdout, check=True)
    if archive.wait():
        raise SystemExit("gate: git archive %s failed" % sha)
    env = dict(os.environ, RECBOOST_REQUIRE_EXTENSIONS="1")
    env.pop("RECBOOST_NO_EXTENSIONS", None)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, src],
                   env=env, check=True)
    with open(stamp, "w") as fh:
        fh.write(sha + "\n")
    print("gate: baseline %s built in %.0f s" % (sha[:12], time.perf_counter() - t0), flush=True)
    return site


# ---- the A/B verdict ------------------------------------------------------------------------------
def abba_sides(pairs):
    """The order of the processes: ``["A", "B", "B", "A", "A", "B", ...]`` (A the baseline, B HEAD)."""
    return [side for k in range(pairs) for side in (("A", "B") if k % 2 == 0 else ("B", "A"))]


def paired_ratios(runs):
    """``{row: [HEAD / baseline per pair]}`` from ``runs``, a list of ``(side, {row: seconds})`` in
    process order (two consecutive processes make a pair). A row the baseline did not time is left
    out (no baseline); a row HEAD did not time in some pair gets None there."""
    out = {}
    for k in range(0, len(runs) - 1, 2):
        pair = dict(runs[k:k + 2])
        base, head = pair.get("A", {}), pair.get("B", {})
        for row, t in base.items():
            out.setdefault(row, []).append(head[row] / t if row in head and t > 0 else None)
    return out


def verdict(ratios, timed_row):
    """``(median ratio or None, status)`` of one row: ``"pass"``, ``"SLOWER"`` (beyond its tolerance),
    ``"MISSING"`` (HEAD did not time it in some pair) or ``"NO TOLERANCE"`` (not in floors.TIMED)."""
    if timed_row is None:
        return (statistics.median(ratios) if ratios and None not in ratios else None), "NO TOLERANCE"
    if not ratios or None in ratios:
        return None, "MISSING"
    median = statistics.median(ratios)
    return median, ("pass" if median <= 1 + timed_row.tolerance else "SLOWER")


def run_ab(base_tree, pairs=PAIRS, nodeids=None, runner=run_suite, tag="ab"):
    """Run ``pairs`` ABBA pairs of A/B processes (only ``nodeids`` when given). Returns ``(runs,
    problems, nodes)``: ``runs`` as ``paired_ratios`` takes them, ``problems`` a list of failure
    messages (a HEAD bench that failed, a result that imported the wrong tree), ``nodes`` each timed
    row's pytest node id."""
    runs, problems, nodes = [], [], {}
    for i, side in enumerate(abba_sides(pairs)):
        tree = base_tree if side == "A" else ROOT
        env = dict(os.environ)
        if side == "A":
            for name in HEAD_ONLY_ENV:
                env.pop(name, None)
            env["RECBOOST_REQUIRE_EXTENSIONS"] = "1"
        path = os.path.join(RESULTS, "%s-%d-%s.json" % (tag, i + 1, side))
        code, seconds = runner(path, mode="ab", tree=tree, nodeids=nodeids, env=env)
        extra = load(path) if os.path.exists(path) else {}
        print("gate: %s process %d (%s) exit %d, %.0f s, %d rows" % (
            tag, i + 1, "baseline" if side == "A" else "HEAD", code, seconds, len(ab_times(extra))), flush=True)
        if code and side == "B":
            problems.append("HEAD's benches failed in %s process %d (pytest exit %d)" % (tag, i + 1, code))
        elif code:
            print("gate: the baseline's benches failed in %s process %d (exit %d): rows it did not time have "
                  "no baseline" % (tag, i + 1, code), flush=True)
        bad = wrong_tree(extra, tree)
        if bad:
            problems.append("%s process %d imported another recboost.py than %s: %s" % (tag, i + 1, tree, bad))
        runs.append((side, ab_times(extra)))
        nodes.update(row_nodeids(extra))
    return runs, problems, nodes


def ab_gate(base_tree, pairs=PAIRS, runner=run_suite):
    """The A/B part: measure, confirm the rows beyond their tolerance, and give ``(rows, problems)``
    with ``rows`` a list of dicts (row, tolerance, first/confirm ratios and medians, status)."""
    runs, problems, nodes = run_ab(base_tree, pairs, runner=runner)
    first = paired_ratios(runs)
    head_rows = set().union(*[set(times) for side, times in runs if side == "B"]) if runs else set()
    rows = []
    for row in sorted(set(first) | head_rows | {t.row for t in floors.TIMED}):
        timed = floors.tolerance(row)
        if row in first:
            median, status = verdict(first[row], timed)
        else:                          # not timed by the baseline: new on HEAD, or gone from both
            median, status = None, ("MISSING" if row not in head_rows else
                                    "NEW (no baseline)" if timed else "NO TOLERANCE")
        rows.append({"row": row, "tolerance": timed and timed.tolerance, "ratios": first.get(row, []),
                     "median": median, "status": status})
    slower = [r for r in rows if r["status"] == "SLOWER"]
    if slower:
        ids = sorted({nodes[r["row"]] for r in slower if r["row"] in nodes})
        print("gate: %d row(s) beyond their tolerance, confirming with %d fresh pairs: %s"
              % (len(slower), 2 * pairs, ", ".join(r["row"] for r in slower)), flush=True)
        again, more, _ = run_ab(base_tree, 2 * pairs, nodeids=ids, runner=runner, tag="confirm")
        problems += more
        confirm = paired_ratios(again)
        for r in slower:               # the verdict: the confirming run's own median
            median, status = verdict(confirm.get(r["row"], []), floors.tolerance(r["row"]))
            r.update(confirm_ratios=confirm.get(r["row"], []), confirm_median=median,
                     status="pass (confirmed)" if status == "pass" else status)
    return rows, problems


def ab_failed(r):
    """Whether an A/B row fails the gate."""
    return not (r["status"].startswith("pass") or r["status"].startswith("NEW"))


# ---- the main job against the previous round ------------------------------------------------------
_MAIN_JOB_CODE = ("import sys, recboost; print('recboost_file', recboost.__file__, flush=True); "
                  "sys.exit(recboost.main(sys.argv[1:]))")


def run_main_job(tree, env=None):
    """One ``python -m recboost`` main-job process importing ``tree``'s recboost.py and build (without
    transparent huge pages, as every A/B process): ``(samples/s, the recboost.py it imported)``."""
    import re  # pylint: disable=import-outside-toplevel
    env = dict(os.environ if env is None else env, PYTHONPATH=tree)
    os.makedirs(RESULTS, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", _MAIN_JOB_CODE] + MAIN_JOB, env=env, cwd=RESULTS, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         preexec_fn=no_huge_pages if sys.platform.startswith("linux") else None)
    done = re.search(r"done: \d+ steps, ([\d.]+)K samples/s", out.stdout)
    imported = re.search(r"^recboost_file (\S+)$", out.stdout, re.M)
    if out.returncode or not done:
        print(out.stdout[-3000:], flush=True)
        return None, imported and imported.group(1)
    return float(done.group(1)) * 1e3, imported and imported.group(1)


def reference_gate(ref_tree, pairs=PAIRS, runner=run_main_job):
    """The main job, ``pairs`` ABBA pairs of processes, the reference (A) against HEAD (B): the median
    of HEAD's time over the reference's (the reference's samples/s over HEAD's). Beyond
    ``MAIN_JOB_TOLERANCE`` it is measured again with twice the pairs, and fails only if that median is
    beyond it too. Returns ``(row, problems)``."""
    def measure(n):
        rates, problems = {"A": [], "B": []}, []
        for side in abba_sides(n):
            tree, env = (ref_tree, dict(os.environ)) if side == "A" else (ROOT, None)
            if side == "A":                 # as in run_ab: the slowdown and the fallback reach HEAD only
                for name in HEAD_ONLY_ENV:
                    env.pop(name, None)
                env["RECBOOST_REQUIRE_EXTENSIONS"] = "1"
            rate, imported = runner(tree, env)
            want = os.path.realpath(os.path.join(tree, "recboost.py"))
            if imported is None or os.path.realpath(imported) != want:
                problems.append("a main-job process imported %s, not %s" % (imported, want))
            if rate is None:
                problems.append("the main job failed on %s" % ("HEAD" if side == "B" else "the reference"))
            rates[side].append(rate)
        ratios = [a / b for a, b in zip(rates["A"], rates["B"]) if a and b]
        print("gate: the main job, samples/s: reference %s, HEAD %s" % (rates["A"], rates["B"]), flush=True)
        return ratios, problems
    ratios, problems = measure(pairs)
    row = {"row": "main job (python -m recboost %s) against the reference" % " ".join(MAIN_JOB),
           "tolerance": MAIN_JOB_TOLERANCE, "ratios": ratios, "median": statistics.median(ratios) if ratios else None}
    row["status"] = ("MISSING" if problems or len(ratios) < pairs else
                     "pass" if row["median"] <= 1 + MAIN_JOB_TOLERANCE else "SLOWER")
    if row["status"] == "SLOWER":
        again, more = measure(2 * pairs)
        problems += more
        median = statistics.median(again) if again else None
        row.update(confirm_ratios=again, confirm_median=median,
                   status="pass (confirmed)" if median is not None and median <= 1 + MAIN_JOB_TOLERANCE and not more
                   else "SLOWER")
    return row, problems


# ---- the targets ----------------------------------------------------------------------------------
def value(extra, metric):
    """The number at ``metric`` (``"bench:dotted.key"``) in ``extra`` (from ``load``), or None."""
    bench, _, key = metric.partition(":")
    node = extra.get(bench)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def check_targets(extra, targets=None):
    """One dict per target: metric, value, met (True/False/None) and status: ``"pass"`` or ``"MISSED"``
    for a checked row, ``"met"``/``"missed"``/``"-"`` for a reported one, ``"MISSING"`` when a checked
    row was not measured."""
    out = []
    for t in floors.TARGETS if targets is None else targets:
        v = value(extra, t.metric)
        met = floors.meets(t, v)
        if t.checked:
            status = "MISSING" if v is None else ("pass" if met else "MISSED")
        else:
            status = {True: "met", False: "missed", None: "-"}[met]
        out.append({"target": t, "metric": t.metric, "value": v, "met": met, "status": status})
    return out


def targets_gate(runner=run_suite, checked_only=False):
    """The targets part: one report-mode run on HEAD, the checked rows that miss measured once more.
    With ``checked_only`` that run is only the benches that record a checked target
    (``floors.CHECKED_BENCHES``), and the rows are those targets and the others those benches record.
    Returns ``(rows, extra, problems)``."""
    nodeids = sorted(set(floors.CHECKED_BENCHES.values())) if checked_only else None
    code, seconds = runner(JSON, mode="report", tree=ROOT, nodeids=nodeids, env=dict(os.environ))
    print("gate: report run exit %d, %.0f s" % (code, seconds), flush=True)
    problems = ["the report run's benches failed (pytest exit %d): a result check failed" % code] if code else []
    extra = load(JSON) if os.path.exists(JSON) else {}
    rows = check_targets(extra, [t for t in floors.TARGETS
                                 if not checked_only or t.checked or t.metric.partition(":")[0] in extra])
    missed = [r for r in rows if r["status"] == "MISSED"]
    if missed:
        ids = sorted({extra[r["metric"].partition(":")[0]]["_nodeid"] for r in missed})
        print("gate: %d checked target(s) missed, measuring again: %s" % (len(missed), ", ".join(r["metric"] for r in missed)),
              flush=True)
        path = os.path.join(RESULTS, "benchmarks-confirm.json")
        code, _ = runner(path, mode="report", tree=ROOT, nodeids=ids, env=dict(os.environ))
        again = check_targets(load(path) if os.path.exists(path) else {}, [r["target"] for r in missed])
        for r, a in zip(missed, again):
            r.update(confirm=a["value"], status="MISSED" if a["status"] != "pass" else "pass (confirm)")
    return rows, extra, problems


# ---- output ---------------------------------------------------------------------------------------
def fmt(x):
    return "-" if x is None else "%.3g" % x


def bound(t):
    """``>= x`` or ``<= x`` for a Target."""
    return "-" if t.target is None else ("%s %s" % (">=" if t.direction == "min" else "<=", fmt(t.target)))


def text_table(head, body):
    widths = [max(len(str(r[i])) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body])


def ab_table(rows):
    body = [(r["row"], "-" if r["tolerance"] is None else "%.0f%%" % (100 * r["tolerance"]),
             " ".join(fmt(x) for x in r["ratios"]) or "-", fmt(r["median"]),
             " ".join(fmt(x) for x in r.get("confirm_ratios", [])) or "-", fmt(r.get("confirm_median")), r["status"])
            for r in rows]
    return text_table(("timed row", "tolerance", "HEAD/baseline per pair", "median", "confirm", "confirm median",
                       "result"), body)


def targets_table(rows):
    body = [(t["target"].what, t["target"].against, fmt(t["value"]), bound(t["target"]),
             "checked" if t["target"].checked else "reported", t["status"]) for t in rows]
    return text_table(("what", "against", "value", "target", "kind", "result"), body)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="the baseline commit (default: the one bench/BASELINE names)")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="A/B pairs of processes (default %(default)s)")
    parser.add_argument("--skip-targets", action="store_true", help="the A/B part only")
    parser.add_argument("--skip-ab", action="store_true", help="the targets part only")
    parser.add_argument("--skip-reference", action="store_true",
                        help="leave out the main job against the previous round's commit (bench/REFERENCE)")
    parser.add_argument("--checked-only", action="store_true",
                        help="the targets part runs only the benches of the checked targets (CI's choice)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be >= 1, got %d" % args.pairs)
    t0 = time.perf_counter()
    summary, problems, failed = {}, [], []
    if not args.skip_ab:
        sha = resolve(args.baseline or baseline_ref())
        head = resolve("HEAD")
        print("gate: baseline %s, HEAD %s, %d ABBA pairs" % (sha[:12], head[:12], args.pairs), flush=True)
        rows, more = ab_gate(build_baseline(sha), args.pairs)
        problems += more
        failed += [r["row"] for r in rows if ab_failed(r)]
        print(ab_table(rows))
        summary["ab"] = {"baseline": sha, "head": head, "pairs": args.pairs, "rows": rows}
    if not args.skip_reference:
        ref = resolve(baseline_ref(REFERENCE_FILE))
        print("gate: the main job, reference %s against HEAD, %d ABBA pairs" % (ref[:12], args.pairs), flush=True)
        row, more = reference_gate(build_baseline(ref), args.pairs)
        problems += more
        failed += [row["row"]] if ab_failed(row) else []
        print(ab_table([row]))
        summary["reference"] = dict(row, commit=ref)
    if not args.skip_targets:
        rows, extra, more = targets_gate(checked_only=args.checked_only)
        problems += more
        failed += [r["metric"] for r in rows if r["status"] in ("MISSED", "MISSING")]
        backends = sorted({"%s" % ("compiled" if info.get("fast_backend") else "numpy") for info in extra.values()})
        print("kernels in the report run: %s" % (", ".join(backends) or "-"))
        print(targets_table(rows))
        summary["targets"] = [dict(r, target=r["target"]._asdict()) for r in rows]
    summary.update(problems=problems, failed=failed, seconds=round(time.perf_counter() - t0))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gate.json"), "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
    for p in problems:
        print("gate: FAIL: " + p)
    if failed:
        print("gate: FAIL, %d row(s): %s" % (len(failed), ", ".join(failed)))
    if failed or problems:
        return 1
    print("gate: pass (%.0f s)" % (time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

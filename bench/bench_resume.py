"""Bench: how long ``python -m recboost train`` takes to resume on a large input, and what proving the
input costs (issue #35, item 2). A script, not part of the gate; run it by hand.

It compares checkouts (``--tree``, one or more: e.g. the commit before the proof, 602e899, and this
one) on the same generated Criteo-format file of ``--size-gb`` GB (SyntheticClickStream; made once in
``--workdir`` and kept):

1. For each tree, one run trains the file up to ``--stop-before`` batches before its end with
   checkpoints (``--checkpoint-every``): its last checkpoint's input position is near the end of the
   file, so a resume has about the whole file before it.
2. Resume times, in alternating order over the trees, ``--repeat`` times: a copy of that checkpoint
   directory (copied outside the clock) and the same command with ``--steps`` 10 more; the wall time
   of the whole process (start-up, compile, proof or fallback, 10 steps) and the lines it says it
   read. ``seek``: with the input position (the old tree seeks unproven; the new one proves the input,
   reading every byte before the position once, then seeks); ``reread``: the position removed (a side
   file, or the checkpoint's own field: ``_drop_positions``; the old tree's fallback; the new tree with
   ``--resume-by-count``).
3. The digest's cost per GB on the same file, read in 4 MiB chunks from the page cache (read once
   first): reading alone, reading + BLAKE2b-256 (what recboost records), reading + SHA-256 (for
   comparison), and the new tree's whole proof of the file (``_read_input_prefix``, also counting
   newlines), in seconds per GB.

Results are printed and written to ``<workdir>/bench_resume.json`` (``--workdir`` defaults to
``resume-bench`` in the temporary directory, ``$TMPDIR``). Example, from this checkout, the old tree
built first, its extension too:

    git worktree add ../rb-602e899 602e899
    (cd ../rb-602e899 && RECBOOST_REQUIRE_EXTENSIONS=1 "$OLDPWD/.venv/bin/python" setup.py build_ext --inplace)
    .venv/bin/python bench/bench_resume.py --tree ../rb-602e899 --tree . --size-gb 1 --repeat 2
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CHUNK = 1 << 22


# The checkpoints of ``sys.argv[1]`` rewritten without the input position they carry (the manifest's
# "extra", recboost after the side files), run with a tree's own recboost; a no-op for an older tree.
_DROP_POSITIONS = """
import os, sys
import recboost as rb
for name in os.listdir(sys.argv[1]):
    path = os.path.join(sys.argv[1], name)
    if name.endswith(".npz") and hasattr(rb, "_checkpoint_extra"):
        manifest, arrays = rb._read_checkpoint_file(path)
        manifest = {k: v for k, v in manifest.items() if k not in ("members", "sha256", "extra")}
        with open(path, "wb") as fh:
            rb._write_checkpoint_file(fh, manifest, arrays)
"""


def _drop_positions(tree, run):
    """The checkpoint directory ``run`` without its input positions, so a resume cannot seek: the side
    files ``*.input.json`` removed (trees before the position rode inside the checkpoint) and the
    checkpoints' own positions dropped (``_DROP_POSITIONS`` with ``tree``'s recboost)."""
    for name in os.listdir(run):
        if name.endswith(".input.json"):
            os.unlink(os.path.join(run, name))
    subprocess.run([sys.executable, "-c", _DROP_POSITIONS, run], cwd=tree, check=True)


def _make_input(path, size_gb, seed):
    """A Criteo-format file of about ``size_gb`` GB (kept when it exists); returns its line count."""
    meta = path + ".lines"
    if os.path.exists(path) and os.path.exists(meta):
        with open(meta) as fh:
            return int(fh.read())
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import recboost as rb  # pylint: disable=import-outside-toplevel
    probe = path + ".probe"
    rb.SyntheticClickStream(seed=seed).write_criteo(probe, 10000)
    per_line = os.path.getsize(probe) / 10000
    os.unlink(probe)
    lines = int(size_gb * 1e9 / per_line)
    rb.SyntheticClickStream(seed=seed).write_criteo(path, lines)
    with open(meta, "w") as fh:
        fh.write(str(lines))
    return lines


def _train(tree, data, ckpt, steps, args, extra=()):
    """One ``python -m recboost train`` process of ``tree``: (wall seconds, its stderr)."""
    cmd = [sys.executable, "-m", "recboost", "train", "--data", data, "--batch-size", str(args.batch_size),
           "--checkpoint-dir", ckpt, "--checkpoint-every", str(args.checkpoint_every), "--steps", str(steps),
           "--progress-seconds", "1e9"] + list(extra)
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=24 * 3600)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError("%s failed (exit %d):\n%s" % (" ".join(cmd), out.returncode, out.stderr[-3000:]))
    return elapsed, out.stderr


def _has_flag(tree, flag):
    out = subprocess.run([sys.executable, "-m", "recboost", "train", "--help"], cwd=tree,
                         env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, timeout=600)
    return flag in out.stdout


def _read_rate(path, make):
    """Seconds per GB to read ``path`` in chunks, each chunk given to ``make()``'s update (None: read only)."""
    hasher = make() if make else None
    size, t0 = 0, time.perf_counter()
    with open(path, "rb") as fh:
        while True:
            data = fh.read(CHUNK)
            if not data:
                break
            size += len(data)
            if hasher is not None:
                hasher.update(data)
    return (time.perf_counter() - t0) / (size / 1e9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="a recboost checkout (repeatable)")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "resume-bench"))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--stop-before", type=int, default=20, help="batches before the end the first run stops")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.tree]
    os.makedirs(args.workdir, exist_ok=True)
    data = os.path.join(args.workdir, "criteo-%sgb.txt" % args.size_gb)
    lines = _make_input(data, args.size_gb, args.seed)
    size = os.path.getsize(data)
    stop = lines // args.batch_size - args.stop_before
    print("input %s: %d lines, %.3f GB; the first run stops at step %d of %d" % (
        data, lines, size / 1e9, stop, -(-lines // args.batch_size)), flush=True)

    results = {"input": {"path": data, "lines": lines, "bytes": size}, "trees": {}}
    for k, tree in enumerate(trees):
        base = os.path.join(args.workdir, "tree%d-base" % k)
        if not os.path.isdir(base):
            elapsed, _ = _train(tree, data, base, stop, args)
            print("tree %d (%s): trained %d steps in %.1f s" % (k, tree, stop, elapsed), flush=True)
        results["trees"][tree] = {"seek": [], "reread": [], "by_count_flag": _has_flag(tree, "--resume-by-count")}

    for _ in range(args.repeat):
        for variant in ("seek", "reread"):
            for k, tree in enumerate(trees):
                run = os.path.join(args.workdir, "tree%d-run" % k)
                shutil.rmtree(run, ignore_errors=True)
                shutil.copytree(os.path.join(args.workdir, "tree%d-base" % k), run)
                extra = []
                if variant == "reread":
                    _drop_positions(tree, run)
                    if results["trees"][tree]["by_count_flag"]:
                        extra = ["--resume-by-count"]
                elapsed, log = _train(tree, data, run, stop + 10, args, extra)
                read = re.search(r"read (\d+) lines", log)
                entry = {"seconds": round(elapsed, 3), "lines_read": int(read.group(1)) if read else None,
                         "resume_line": next((l for l in log.splitlines() if "resuming from" in l), "")[:300]}
                results["trees"][tree][variant].append(entry)
                print("tree %d %-6s %.2f s, read %s lines" % (k, variant, elapsed, entry["lines_read"]), flush=True)
                shutil.rmtree(run, ignore_errors=True)

    _read_rate(data, None)                                   # into the page cache
    costs = {"read": _read_rate(data, None),
             "read+blake2b-256": _read_rate(data, lambda: hashlib.blake2b(digest_size=32)),
             "read+sha256": _read_rate(data, hashlib.sha256)}
    new = trees[-1]
    proof = subprocess.run(
        [sys.executable, "-c", "import sys, time, recboost as rb; n = int(sys.argv[2]); t0 = time.perf_counter(); "
         "rb._read_input_prefix(sys.argv[1], n, n); print((time.perf_counter() - t0) / (n / 1e9))", data, str(size)],
        cwd=new, env=dict(os.environ, PYTHONPATH=new), capture_output=True, text=True, timeout=24 * 3600)
    if proof.returncode == 0:
        costs["proof (_read_input_prefix) of tree %s" % new] = float(proof.stdout.split()[-1])
    results["seconds_per_gb"] = costs
    for name, value in costs.items():
        print("%-40s %.3f s/GB" % (name, value))
    for tree, runs in results["trees"].items():
        for variant in ("seek", "reread"):
            times = [r["seconds"] for r in runs[variant]]
            print("%s %-6s resume: %s s" % (tree, variant, ", ".join("%.2f" % t for t in times)))
    with open(os.path.join(args.workdir, "bench_resume.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()

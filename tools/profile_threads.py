"""Where a training process's cores go, thread by thread (issue #63).

    python tools/profile_threads.py [--steps N] [--window A B] [--perf] [-- demo arguments...]

Runs ``python -m recboost demo --steps N`` (default 600) and reads every thread's CPU time and context
switches from ``/proc/<pid>/task/<tid>/`` twice a second. The table it prints covers a window of the
run's wall time (by default from 40% to 90%: past the compile and the warm-up, before the end), with the
threads grouped by name (``comm``): user and system seconds, the cores each group kept busy over the
window, and its voluntary and involuntary switches.

With ``--perf`` the run goes under ``perf record`` on the ``sched_yield`` and ``futex`` system-call
tracepoints, with call chains (one call in ``PERIOD`` recorded, its stack unwound from a copy); each call is then billed to its thread's name and to the first frame of
its chain outside the C library and the kernel (the library and function that asked to yield or wait).
This needs ``perf`` and tracepoints readable by the user (``/proc/sys/kernel/perf_event_paranoid`` at
most 2 as root, or -1).

Time the demo only on a quiet machine: another busy process changes how often threads yield.
"""
import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LIBC = ("libc.so", "libc-", "libpthread", "[kernel", "[unknown]", "[vdso]", "inlined")
#: ``--perf`` records one call in this many (each recorded call copies its stack: every call would
#: slow the run several times over)
PERIOD = 20


def _threads(pid):
    """``{tid: (name, user s, system s, voluntary, involuntary)}`` of a live process (threads that end
    between the listing and the read are left out)."""
    out = {}
    base = "/proc/%d/task" % pid
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open("%s/%s/stat" % (base, tid)) as f:
                stat = f.read()
            with open("%s/%s/status" % (base, tid)) as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS,
                         int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return out


def _window(samples, start, end):
    """Per thread name: (threads, user s, system s, voluntary, involuntary) between the samples nearest
    to the fractions ``start`` and ``end`` of the run, and the window's wall seconds."""
    t0, t1 = samples[0][0], samples[-1][0]
    first = min(samples, key=lambda s: abs(s[0] - (t0 + start * (t1 - t0))))
    last = min(samples, key=lambda s: abs(s[0] - (t0 + end * (t1 - t0))))
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    for tid, (name, user, system, vol, invol) in last[1].items():
        before = first[1].get(tid, (name, 0.0, 0.0, 0, 0))     # a thread born inside the window: from 0
        row = groups[name]
        row[0] += 1
        for k, (now, then) in enumerate(zip((user, system, vol, invol), before[1:]), 1):
            row[k] += now - then
    return dict(groups), last[0] - first[0]


def _run(command, interval=0.5):
    """Run ``command``, sampling the threads of its recboost process; returns the samples
    ``[(monotonic time, threads)]`` and the exit code."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    samples, pid = [], None
    while proc.poll() is None:
        pid = pid or _python_pid(proc.pid)
        if pid:
            threads = _threads(pid)
            if threads:
                samples.append((time.monotonic(), threads))
        time.sleep(interval)
    return samples, proc.returncode


def _python_pid(root):
    """The recboost process: ``root`` itself, or (under perf) its child running python."""
    try:
        with open("/proc/%d/task/%d/children" % (root, root)) as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return None
    for child in children:
        try:
            with open("/proc/%d/cmdline" % child, "rb") as f:
                if b"recboost" in f.read():
                    return child
        except OSError:
            pass
    with open("/proc/%d/cmdline" % root, "rb") as f:
        return root if b"perf\0" not in f.read() else None


def _perf_callers(data):
    """``{(thread name, event, library, function): calls}`` from ``perf script`` of ``data``."""
    text = subprocess.run(["perf", "script", "-i", data, "-F", "comm,event,ip,sym,dso"], check=True,
                          capture_output=True, text=True).stdout
    counts = collections.Counter()
    for block in text.split("\n\n"):
        lines = [l for l in block.splitlines() if l.strip()]
        if not lines:
            continue
        head = lines[0].split()
        comm, event = head[0], next((w.rstrip(":") for w in head if "sys_enter" in w), "?")
        caller = ("?", "?")
        for frame in lines[1:]:
            parts = frame.split(None, 1)
            if len(parts) < 2:
                continue
            sym, _, dso = parts[1].rpartition(" (")
            dso = os.path.basename(dso.rstrip(")"))
            if not dso.startswith(LIBC) and "kernel" not in dso:
                caller = (dso, sym.split("+")[0][:60])
                break
        counts[(comm, event.replace("syscalls:sys_enter_", ""), *caller)] += PERIOD
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--window", type=float, nargs=2, default=(0.4, 0.9), metavar=("START", "END"),
                        help="the fractions of the run's wall time the table covers (default 0.4 0.9)")
    parser.add_argument("--perf", action="store_true", help="also record who calls sched_yield and futex")
    parser.add_argument("--top", type=int, default=15)
    args, rest = parser.parse_known_args(argv)
    if not 0 <= args.window[0] < args.window[1] <= 1:
        parser.error("--window: expected 0 <= START < END <= 1, got %s %s" % tuple(args.window))
    rest = [a for a in rest if a != "--"]
    command = [sys.executable, "-m", "recboost", "demo", "--steps", str(args.steps)] + rest
    data = None
    if args.perf:
        data = tempfile.NamedTemporaryFile(suffix=".perf", delete=False).name
        command = ["perf", "record", "-q", "--call-graph", "dwarf,4096", "-c", str(PERIOD), "-o", data,
                   "-e", "syscalls:sys_enter_sched_yield", "-e", "syscalls:sys_enter_futex", "--"] + command
    print("running:", " ".join(command), flush=True)
    samples, code = _run(command)
    if code != 0 or len(samples) < 4:
        sys.exit("the run failed (exit %d) or ended before it could be sampled" % code)
    groups, wall = _window(samples, *args.window)
    print("\n%.1f s of wall time (%.0f%%-%.0f%% of the run), by thread name:" % (
        wall, 100 * args.window[0], 100 * args.window[1]))
    print("%-22s %7s %9s %9s %7s %12s %12s" % ("thread", "count", "user s", "system s", "cores",
                                               "voluntary", "involuntary"))
    total = [0.0, 0.0, 0, 0]
    for name, (n, user, system, vol, invol) in sorted(groups.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print("%-22s %7d %9.2f %9.2f %7.2f %12d %12d" % (name, n, user, system, (user + system) / wall, vol, invol))
        total = [a + b for a, b in zip(total, (user, system, vol, invol))]
    print("%-22s %7s %9.2f %9.2f %7.2f %12d %12d" % ("all", "", total[0], total[1],
                                                    (total[0] + total[1]) / wall, total[2], total[3]))
    if data:
        counts = _perf_callers(data)
        os.unlink(data)
        print("\nsystem calls over the whole run (estimated from one in %d), by thread name and first caller "
              "outside libc:" % PERIOD)
        print("%-22s %-12s %10s  %s" % ("thread", "call", "calls", "library: function"))
        for (comm, event, dso, sym), n in counts.most_common(args.top):
            print("%-22s %-12s %10d  %s: %s" % (comm, event, n, dso, sym))


if __name__ == "__main__":
    main()

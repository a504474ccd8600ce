"""Pass rates of the OpInfo t2j_jit mode (each sample through ``t2j.jit`` as a user
would; see tests/test_opinfo.py), per dtype, with the failures grouped by cause.

    python tools/opinfo_t2j_jit.py [--jobs 2] [--dtype float32 ...] [--timeout 120]
                                   [--every N --offset K] [--out docs/opinfo_t2j_jit.json] [name-substring ...]

Samples run in-process in worker processes (one per job, ops sharded among them);
a worker that crashes or hangs is restarted after the case it was running, which
is recorded as crashed. For each sample it records: pass, fail (with the error),
n/a (torch rejects it and so do we), and whether t2j.jit fell back to eager (its
one-time "runs eagerly" warning). A failing sample is re-run in eager mode, so
that failures of t2j.jit itself (eager passes) are told apart from failures of
the op's lowering (eager fails too). The JSON has one row per sample and a
summary: per dtype, samples/cases passing, eager fallbacks, and the failure
classes (the error with numbers, shapes and names blanked) with counts and ops.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
DEFAULT_OUT = os.path.join(ROOT, "docs", "opinfo_t2j_jit.json")
DTYPES = ("float32", "bfloat16", "int64", "bool", "complex64")


def _one_line(e):
    text = str(e)
    if "Traceback (most recent call last)" in text:
        text = text.strip().splitlines()[-1]
    return f"{type(e).__name__}: {' '.join(text.split())}"[:400]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("sample timed out")


def run_case(name, dname, timeout, emit):
    import warnings

    import torch

    import test_opinfo as T
    from opinfo_util import check_sample, samples

    op, dtype = T.OPS[name], T.DTYPES[dname]
    torch.manual_seed(0)
    try:
        sample_list = samples(op, dtype)
    except Exception as e:  # noqa: BLE001
        emit({"op": name, "dtype": dname, "sample": -1, "status": "nosamples", "error": _one_line(e)})
        return
    for i, s in enumerate(sample_list):
        row = {"op": name, "dtype": dname, "sample": i}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            signal.alarm(timeout)
            try:
                ran = check_sample(op, s, dtype, "t2j_jit", f"{name} {dname} t2j_jit sample {i}")
                row["status"] = "pass" if ran else "n/a"
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                row["status"], row["error"] = "fail", _one_line(e)
            finally:
                signal.alarm(0)
        fell = [str(w.message) for w in caught if "t2j.jit" in str(w.message) and "runs eagerly" in str(w.message)]
        if fell:
            row["fallback"] = fell[0][:400]
        if row["status"] == "fail":
            signal.alarm(timeout)
            try:
                check_sample(op, s, dtype, "eager", "")
                row["eager"] = "pass"
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                row["eager"] = "fail: " + _one_line(e)
            finally:
                signal.alarm(0)
        emit(row)


def worker(timeout):
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, TESTS)
    signal.signal(signal.SIGALRM, _alarm)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def emit(msg):
        print(json.dumps(msg), file=out, flush=True)

    for name, dname in json.load(sys.stdin):
        emit({"start": [name, dname]})
        run_case(name, dname, timeout, emit)
        emit({"end": [name, dname]})


def run_shard(cases, timeout, rows, lock, log):
    """Run ``cases`` in a worker process, restarting it after a crash or hang."""
    while cases:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--timeout", str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, text=True,
            start_new_session=True,
        )
        proc.stdin.write(json.dumps(cases))
        proc.stdin.close()
        done, running = set(), None
        deadline = time.monotonic() + 4 * timeout + 300  # imports count against the first case
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                why = "hangs"
                break
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                why = f"crashes (exit {proc.returncode})"
                break
            msg = json.loads(line)
            if "start" in msg:
                running = tuple(msg["start"])
                deadline = time.monotonic() + 4 * timeout + 60
            elif "end" in msg:
                done.add(tuple(msg["end"]))
                running = None
            else:
                with lock:
                    rows.append(msg)
                    log(msg)
        if proc.returncode == 0:
            return
        if running is None:
            running = next((tuple(c) for c in cases if tuple(c) not in done), None)
        if running is not None:
            with lock:
                rows.append({"op": running[0], "dtype": running[1], "sample": -1, "status": "crash", "error": why})
        cases = [c for c in cases if tuple(c) not in done and tuple(c) != running]


_BLANKS = [
    (re.compile(r"Tensor\([^()]*\)"), "Tensor(..)"),
    (re.compile(r"\b\d+(\.\d+)?(e[-+]?\d+)?\b"), "N"),
    (re.compile(r"\b(aten|prims)\.[\w.]+"), r"\1.OP"),
    (re.compile(r"^(\w+: )[\w.]+ (\w+) t2j_jit sample N"), r"\1SAMPLE"),
    (re.compile(r"\(at index [^)]*\)"), ""),
    (re.compile(r"torch\.(float|int|bfloat|complex|bool|uint)\w*"), "torch.DTYPE"),
    (re.compile(r"\([N, ]*\)"), "(SHAPE)"),
]


def error_class(error):
    text = error
    for pat, rep in _BLANKS:
        text = pat.sub(rep, text)
    return text[:140]


def summarize(rows):
    per = collections.defaultdict(lambda: {
        "samples": 0, "passed": 0, "n/a": 0, "failed": 0, "failed_eager_passes": 0, "fallback_passed": 0,
        "cases": set(), "failing_cases": set(), "crashed_cases": [], "classes": collections.Counter(),
        "class_ops": collections.defaultdict(set),
    })
    for r in rows:
        d = per[r["dtype"]]
        case = r["op"]
        d["cases"].add(case)
        if r["status"] in ("crash", "nosamples"):
            if r["status"] == "crash":
                d["crashed_cases"].append(case)
                d["failing_cases"].add(case)
            continue
        d["samples"] += 1
        if r["status"] == "pass":
            d["passed"] += 1
            d["fallback_passed"] += "fallback" in r
        elif r["status"] == "n/a":
            d["n/a"] += 1
        else:
            d["failed"] += 1
            d["failing_cases"].add(case)
            eager_ok = r.get("eager") == "pass"
            d["failed_eager_passes"] += eager_ok
            key = ("[t2j.jit only] " if eager_ok else "[eager fails too] ") + error_class(r["error"])
            d["classes"][key] += 1
            d["class_ops"][key].add(case)
    out = {}
    for dname, d in sorted(per.items()):
        applicable = d["samples"] - d["n/a"]
        out[dname] = {
            "samples": d["samples"], "passed": d["passed"], "not_applicable": d["n/a"], "failed": d["failed"],
            "sample_rate": round(100 * d["passed"] / max(applicable, 1), 2),
            "cases": len(d["cases"]), "cases_passing": len(d["cases"] - d["failing_cases"]),
            "case_rate": round(100 * len(d["cases"] - d["failing_cases"]) / max(len(d["cases"]), 1), 2),
            "failed_where_eager_passes": d["failed_eager_passes"],
            "passed_via_eager_fallback": d["fallback_passed"],
            "crashed_cases": sorted(d["crashed_cases"]),
            "classes": [
                {"class": k, "samples": n, "ops": sorted(d["class_ops"][k])}
                for k, n in d["classes"].most_common()
            ],
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dtype", action="append", help=f"dtypes (default {', '.join(DTYPES)})")
    ap.add_argument("--timeout", type=int, default=120, help="seconds one sample may take")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--every", type=int, default=1, help="only every n-th op (a sample of the op_db)")
    ap.add_argument("--offset", type=int, default=0, help="with --every: start at the op with this index")
    ap.add_argument("filters", nargs="*", help="op-name substrings")
    args = ap.parse_args()
    if args.worker:
        return worker(args.timeout)

    sys.path.insert(0, TESTS)
    import test_opinfo as T

    dtypes = args.dtype or list(DTYPES)
    names = sorted(T.OPS)[args.offset:: args.every]
    cases = [
        [name, dname] for name in names for dname in dtypes
        if (not args.filters or any(f in name for f in args.filters))
        and T.DTYPES[dname] in T.OPS[name].supported_dtypes("cpu")
    ]
    print(f"running {len(cases)} cases on {args.jobs} workers", file=sys.stderr)
    rows, lock, start = [], threading.Lock(), time.monotonic()
    seen = set()

    def save():
        with open(args.out + ".tmp", "w") as f:
            json.dump({"dtypes": dtypes, "every": args.every, "offset": args.offset, "summary": summarize(rows), "rows": rows}, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    def log(msg):
        seen.add((msg["op"], msg["dtype"]))
        if len(seen) % 25 == 0 and msg["sample"] <= 0:
            print(f"\r{len(seen)}/{len(cases)} cases, {time.monotonic() - start:.0f}s", end="", file=sys.stderr,
                  flush=True)
            save()

    # shard by op so that one op's dtypes share a worker's compile caches
    shards = [cases[i:: args.jobs] for i in range(args.jobs)]
    threads = [threading.Thread(target=run_shard, args=(s, args.timeout, rows, lock, log), daemon=True)
               for s in shards]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        print("\ninterrupted: saving what ran", file=sys.stderr)
    with lock:
        save()
    print(file=sys.stderr)
    for dname, s in summarize(rows).items():
        print(f"{dname:10} samples {s['passed']}/{s['samples'] - s['not_applicable']} ({s['sample_rate']}%), "
              f"cases {s['cases_passing']}/{s['cases']} ({s['case_rate']}%), fallback-passed "
              f"{s['passed_via_eager_fallback']}, failed-but-eager-passes {s['failed_where_eager_passes']}",
              file=sys.stderr)


if __name__ == "__main__":
    main()

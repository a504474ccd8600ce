"""Run the OpInfo suite and write docs/op_coverage.md, docs/op_coverage.json and tests/opinfo_xfails.py.

    python tools/op_coverage.py [--jobs 2] [--mode jit] [--dtype float32] [name-substring ...]

Only the selected cases are re-run; their results are merged into the earlier
ones kept in docs/op_coverage.json (results of cases that no longer exist are
dropped).

For every (op, dtype, mode) case of tests/test_opinfo.py it counts passing
samples; a case with any failing sample becomes a strict xfail with the first
error as its reason. Cases run in chunks, each chunk in its own `python`
process with a time limit per case, so a hard crash (a C++ abort, a segfault)
or a hang loses only the case it happened in: the worker reports each case as
it starts and ends, the case that was running is re-run alone in a fresh
process to confirm it, and if it crashes alone it is recorded in CRASHES
(skipped by the tests, with the reason). The rest of the chunk is re-queued.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
RESULTS = os.path.join(ROOT, "docs", "op_coverage.json")
XFAILS = os.path.join(TESTS, "opinfo_xfails.py")


def _one_line(e):
    text = str(e)
    if "Traceback (most recent call last)" in text:  # an error raised in a host callback: keep its last line
        text = text.strip().splitlines()[-1]
    return f"{type(e).__name__}: {' '.join(text.split())}"[:160]


def run_case(case):
    """(passed, total, reason) for one case; reason is the first failing sample's error or ''."""
    import torch

    import test_opinfo as T
    from opinfo_util import check_sample, samples

    name, dname, mode = case
    op, dtype = T.OPS[name], T.DTYPES[dname]
    passed = total = 0
    reason = ""
    torch.manual_seed(0)
    try:
        sample_list = samples(op, dtype, requires_grad=mode == "grad")
    except Exception as e:  # noqa: BLE001
        return 0, 0, _one_line(e)
    for i, s in enumerate(sample_list):
        try:
            ran = check_sample(op, s, dtype, mode, f"{name} {dname} {mode} sample {i}")
        except Exception as e:  # noqa: BLE001
            total += 1
            reason = reason or _one_line(e)
            continue
        total += ran
        passed += ran
    return passed, total, reason


def worker():
    """Run the cases given as a JSON list on stdin; one JSON line per case start and end on stdout."""
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, TESTS)
    # ops may print: keep our protocol on a private copy of stdout
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    cases = json.load(sys.stdin)
    for case in cases:
        print(json.dumps({"start": case}), file=out, flush=True)
        passed, total, reason = run_case(tuple(case))
        print(json.dumps({"case": case, "result": [passed, total, reason]}), file=out, flush=True)


def run_chunk(chunk, timeout):
    """Run cases in one worker process.

    Returns (results, crashed, message): results for the cases that finished;
    crashed is the case that was running when the process died or timed out
    (None if it exited normally), with a one-line message why.
    """
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, text=True,
            start_new_session=True,
        )
        proc.stdin.write(json.dumps([list(c) for c in chunk]))
        proc.stdin.close()
        results, running, message = {}, None, ""
        # time to import torch and the OpInfo database counts against the first case
        deadline = time.monotonic() + timeout + 120
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                message = f"hangs: no result in {timeout}s"
                break
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                break
            msg = json.loads(line)
            if "start" in msg:
                running = tuple(msg["start"])
                deadline = time.monotonic() + timeout
            else:
                results[tuple(msg["case"])] = tuple(msg["result"])
                running = None
        if proc.returncode == 0 and not message:
            return results, None, ""
        if running is None:  # died before or between cases: blame the first unfinished one
            running = next((c for c in chunk if c not in results), None)
        if not message:
            err.seek(0)
            tail = [ln.strip() for ln in err.read().splitlines() if ln.strip()]
            code = proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            message = f"crashes the process ({how}): {tail[-1] if tail else 'no output'}"
        return results, running, message


def run_all(cases, jobs, chunk_size, timeout, save):
    """Results for every case: case -> (passed, total, reason, crashed); ``save(results)``
    after every chunk, so an interrupted run keeps what it did."""
    work = queue.Queue()
    for i in range(0, len(cases), chunk_size):
        work.put(cases[i:i + chunk_size])
    results, lock = {}, threading.Lock()
    start = time.monotonic()

    def progress():
        done = len(results)
        crashed = sum(r[3] for r in results.values())
        print(f"\r{done}/{len(cases)} cases, {crashed} crashed, {time.monotonic() - start:.0f}s",
              end="", file=sys.stderr, flush=True)

    def loop():
        while True:
            chunk = work.get()
            try:
                done, crashed, message = run_chunk(chunk, timeout)
                with lock:
                    results.update({c: (*r, False) for c, r in done.items()})
                    if crashed is not None and len(chunk) == 1:
                        results[crashed] = (0, 0, message[:160], True)
                    elif crashed is not None:
                        print(f"\n{'|'.join(crashed)}: {message}; re-running it alone", file=sys.stderr)
                        work.put([crashed])
                        rest = [c for c in chunk if c not in done and c != crashed]
                        if rest:
                            work.put(rest)
                    progress()
                    save(results)
            finally:
                work.task_done()

    for _ in range(jobs):
        threading.Thread(target=loop, daemon=True).start()
    work.join()
    print(file=sys.stderr)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes at once (default 2)")
    ap.add_argument("--mode", action="append", choices=("eager", "jit", "grad"), help="only these modes")
    ap.add_argument("--dtype", action="append", help="only these dtypes")
    ap.add_argument("--chunk", type=int, default=40, help="cases per worker process (default 40)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one case may take (default 300)")
    ap.add_argument("filters", nargs="*", help="op-name substrings, or exact name|dtype|mode keys")
    args = ap.parse_args()
    if args.worker:
        return worker()

    sys.path.insert(0, TESTS)
    import test_opinfo as T

    every = [tuple(p.values) for p in T.cases()]
    cases = [
        c for c in every
        if (not args.filters or any(f == "|".join(c) or ("|" not in f and f in c[0]) for f in args.filters))
        and (not args.mode or c[2] in args.mode) and (not args.dtype or c[1] in args.dtype)
    ]
    print(f"running {len(cases)} cases", file=sys.stderr)
    earlier = load_results()

    def save(new):
        merged = {**earlier, **new}
        merged = {c: merged[c] for c in every if c in merged}
        with open(RESULTS + ".tmp", "w") as f:
            f.write("[\n" + ",\n".join(json.dumps([*c, *r]) for c, r in sorted(merged.items())) + "\n]\n")
        os.replace(RESULTS + ".tmp", RESULTS)
        return merged

    results = save(run_all(cases, args.jobs, args.chunk, args.timeout, save))
    write_xfails(results, every)
    write_doc(results)
    for (dname, mode), (ok, n, sp, st, _, bds) in sorted(rates(results).items()):
        print(f"{dname:10} {mode:6} {ok}/{n} cases ({_pct(ok, n)}), {sp}/{st} samples ({_pct(sp, st)}; "
              f"{_pct(sp, st - bds)} without by-design failures)", file=sys.stderr)


def load_results():
    """Earlier results, so that a run over a few ops updates the report instead of replacing it."""
    if not os.path.exists(RESULTS):
        return {}
    with open(RESULTS) as f:
        return {tuple(row[:3]): tuple(row[3:]) for row in json.load(f)}


def write_xfails(results, every):
    """Failing cases become XFAIL, crashing ones CRASHES; cases never run keep their old entries."""
    sys.path.insert(0, TESTS)
    from opinfo_xfails import CRASHES, XFAIL

    xfail = {k: v for k, v in XFAIL.items() if tuple(k.split("|")) in every}
    crashes = {k: v for k, v in CRASHES.items() if tuple(k.split("|")) in every}
    for case, (_, _, reason, crashed) in results.items():
        key = "|".join(case)
        xfail.pop(key, None)
        crashes.pop(key, None)
        if crashed:
            crashes[key] = reason
        elif reason:
            xfail[key] = reason
    lines = ['"""Known OpInfo failures (generated by tools/op_coverage.py; edit by re-running it)."""', ""]
    for name, table in (("XFAIL", xfail), ("CRASHES", crashes)):
        lines.append(f"{name}: dict = {{")
        lines += [f"    {k!r}: {v!r}," for k, v in sorted(table.items())]
        lines.append("}")
    with open(XFAILS, "w") as f:
        f.write("\n".join(lines) + "\n")


# Errors by which torch2jax refuses, by design, what a traced program cannot express:
# an output shape that depends on tensor values, or Python control flow on a traced value.
BY_DESIGN = ("has an output shape that depends on tensor values", "value is not known while the program is traced")


# Why the failures that are neither by design nor open bugs fail, by op.
WHY = {
    "pca_lowrank": "complex64 grad: the weighted sum of U and V depends on the phase each singular vector comes "
                   "with (a unit complex factor), which the randomized algorithm's random start decides; torch "
                   "CPU and the jax device draw different starts.",
    "svd_lowrank": "complex64 grad: as pca_lowrank.",
    "matrix_exp": "float16 / bfloat16: torch CPU returns NaN for every element of these samples (its half-precision "
                  "kernel breaks down even in bfloat16, which cannot overflow at these magnitudes); torch2jax "
                  "computes in float32 and rounds, giving finite values that match torch's float32 result.",
    "special.bessel_j0": "float64: torch CPU's kernel is off by up to 4e-7 for x near 5 (against mpmath's values); "
                         "torch2jax's series and asymptotic expansions are within 1e-15 there.",
    "special.bessel_y1": "float64: torch CPU's kernel is off by up to 4e-7 for x near 5 (against mpmath's values); "
                         "torch2jax's is within 1e-15 there.",
    "sparse.mm.reduce": "jit: its CSR kernel runs on the host (through torch's sparse kernels, eagerly), which a "
                        "traced program cannot do; torch2jax raises its OpError saying so.",
    "sparse.sampled_addmm": "jit: as sparse.mm.reduce.",
}


def by_design(reason):
    return any(text in reason for text in BY_DESIGN)


def rates(results):
    """(dtype, mode) -> [cases passing, cases, samples passing, samples, cases failing by design,
    samples of those cases]."""
    per = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for (_, dname, mode), (passed, total, reason, _) in results.items():
        row = per[(dname, mode)]
        row[0] += not reason
        row[1] += 1
        row[2] += passed
        row[3] += total
        if by_design(reason):
            row[4] += 1
            row[5] += total - passed
    return per


def _pct(part, whole):
    return f"{100 * part / max(whole, 1):.1f}%"


def write_doc(results):
    out = [
        "# Op coverage", "",
        "Generated by `python tools/op_coverage.py` from PyTorch's OpInfo database (`tests/test_opinfo.py`,",
        "`T2J_OPINFO_SAMPLES` samples per case, default 4). A case is one (op, dtype, mode); a sample passes",
        "when our result matches torch CPU in dtype, shape and values (for `grad`: the gradients of a",
        "weighted sum of the outputs), and a case passes when all its samples do. `jit` runs the op inside",
        "`jax.jit`. Failing cases are strict xfails in `tests/opinfo_xfails.py`, with the reason below.",
        "\"by design\" counts the failing cases where torch2jax raises its clear error for what a traced",
        "program cannot express (an output shape that depends on tensor values, Python control flow on a",
        "traced value, a Python bool returned from a traced value); the rates \"without\" leave their",
        "failing samples (or cases) out.", "",
        "## Passing, per dtype and mode", "",
        "| dtype | mode | cases passing | cases | case rate | samples passing | samples | sample rate "
        "| by design (cases / samples) | case rate without | sample rate without |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dname, mode), (ok, n, sp, st, bd, bds) in sorted(rates(results).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.append(f"| {dname} | {mode} | {ok} | {n} | {_pct(ok, n)} | {sp} | {st} | {_pct(sp, st)} | {bd} / {bds} "
                   f"| {_pct(ok, n - bd)} | {_pct(sp, st - bds)} |")
    failing = {name for (name, _, _), (_, _, reason, _) in results.items() if reason and not by_design(reason)}
    out += ["", "## Why the other failures fail", "",
            "Failures not by design, by op (the table below lists every failing case):", ""]
    out += [f"- `{name}`: {WHY[name]}" for name in sorted(failing) if name in WHY]
    out += [f"- `{name}`: open bug, see the first failure below." for name in sorted(failing) if name not in WHY]
    out += ["", "## Known failures", "", "passed/total samples and the first failure (crashes are skipped by the tests).",
            "", "| op | dtype | mode | status |", "|---|---|---|---|"]
    for (name, dname, mode), (p, t, reason, crashed) in sorted(results.items()):
        if reason:
            status = ("crash: " if crashed else f"{p}/{t}: ") + reason.replace("|", "/")
            out.append(f"| {name} | {dname} | {mode} | {status} |")
    with open(os.path.join(ROOT, "docs", "op_coverage.md"), "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

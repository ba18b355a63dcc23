"""``bench/hf_model.py --parallel-compile``: one process per variant, compiled at the same time, timed in turns.

A whole-model ``torch.compile`` of the 8-layer Llama took 90-180 s per variant on the H200's host, so four variants
compiled one after another do not fit in one 10-minute device call. Here the parent starts one process per variant
(``--worker I/N``); each builds its model, compiles and captures every (workload, mode) step, and says it is ready
(a file in ``--sync``). Once all are ready (or failed), they time in turns: a token in ``SYNC/turn`` names the slot
that may run, and every process derives the same slot list from the arguments, so the rounds are interleaved as in
one process (round ``r`` starts at variant ``r mod N``) and only one process uses the GPU (or the host for a
host-bound step) at a time, the others polling a file. The parent then merges the processes' JSON files into one
result, and runs the logits check and the host table itself (they need no compile).

Each process gets ``TORCHINDUCTOR_COMPILE_THREADS = CPUs / N`` so the compiles share the host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench import hf_bench as hf

#: the file holding the slot that may run now
TURN = "turn"
POLL_S = 0.0005


class Turns:
    """The token passed between the processes through ``sync/turn``: slot ``s`` runs while the file holds ``s``."""

    def __init__(self, sync: Path, me: int, timeout: float) -> None:
        self.path, self.me, self.timeout = sync / TURN, me, timeout

    def current(self) -> int:
        try:
            return int(self.path.read_text())
        except (FileNotFoundError, ValueError):  # between the writer's replace and our read: try again
            return -1

    def wait(self, slot: int) -> None:
        """Block until ``slot`` may run (TimeoutError after ``timeout`` seconds: a process died holding it)."""
        deadline = time.monotonic() + self.timeout
        while (now := self.current()) != slot:
            if now > slot:
                raise RuntimeError(f"slot {slot} was passed over (the token is at {now})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout:.0f} s for slot {slot} (the token is at {now})")
            time.sleep(POLL_S)

    def done(self, slot: int) -> None:
        """Hand the token on (an atomic replace: a reader sees the old or the new number)."""
        tmp = self.path.with_name(f"{TURN}.{self.me}.tmp")
        tmp.write_text(str(slot + 1))
        os.replace(tmp, self.path)


def barrier(sync: Path, me: int, n: int, ok: bool, timeout: float) -> list[int]:
    """Say ``ready`` (or ``failed``) and wait for the ``n`` processes; returns the ready ones, sorted."""
    (sync / f"{'ready' if ok else 'failed'}-{me}").write_text("")
    deadline = time.monotonic() + timeout
    while True:
        ready = sorted(i for i in range(n) if (sync / f"ready-{i}").exists())
        failed = [i for i in range(n) if (sync / f"failed-{i}").exists()]
        if len(ready) + len(failed) >= n:
            return ready
        if time.monotonic() > deadline:  # a process never finished its compiles: time without it
            hf.log(f"barrier: {n - len(ready) - len(failed)} process(es) not ready after {timeout:.0f} s")
            return ready
        time.sleep(0.05)


def schedule(rows: int, rounds: int, active: list[int]) -> list[tuple[int, int, int]]:
    """``[(row, round, process), ...]``: per row, ``rounds`` rounds over the active processes, round ``r`` rotated
    by ``r`` (as ``hf_model.time_steps`` rotates the variants), then one profile slot each (round -1)."""
    slots: list[tuple[int, int, int]] = []
    if not active:
        return slots
    for j in range(rows):
        for r in range(rounds):
            k = r % len(active)
            slots += [(j, r, w) for w in active[k:] + active[:k]]
        slots += [(j, -1, w) for w in active]
    return slots


def worker_main(args: Any) -> int:
    """One variant's process: build, compile and capture every step, wait for the others, time in turns."""
    me, n = (int(v) for v in args.worker.split("/"))
    sync: Path = args.sync
    turns = Turns(sync, me, args.turn_timeout)
    bench = None
    prepared: list[tuple[dict[str, Any], dict[str, Any]]] = []
    ok = True
    try:
        bench = hf.Bench(args)
        bench.compile()
        for workload, mode in bench.rows():
            prepared.append(bench.steps(workload, mode))
        if args.device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # the others time without this process
        ok = False
        hf.log(f"worker {me}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    active = barrier(sync, me, n, ok, args.turn_timeout)
    if not ok or bench is None:
        return 1
    rows = bench.rows()
    slots = schedule(len(rows), args.rounds, active)
    samples = [({}, {}) for _ in rows]  # per row: ({variant: [µs]}, {variant: [host µs]})
    results = [{"workload": w, "mode": m} for w, m in rows]
    for s, (j, r, w) in enumerate(slots):
        if w != me:
            continue
        turns.wait(s)
        try:
            steps, rewinds = prepared[j]
            if r < 0:
                bench.profiles(results[j], steps, rewinds)
            for name, fn in steps.items() if r >= 0 else ():
                rewind = rewinds.get(name, hf._nothing)
                rewind()
                samples[j][0].setdefault(name, []).append(hf.cuda_time_us(fn, args.iters, args.device))
                if results[j]["mode"] != "graph":
                    rewind()
                    samples[j][1].setdefault(name, []).append(
                        hf.host_per_call_us(fn, args.step_host_calls, args.device, busy=False))
        except Exception as exc:  # hand the token on whatever happened
            key = f"{'/'.join(bench.models)}/{rows[j][0]}/{rows[j][1]}"
            bench.result["errors"][key] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            if args.device == "cuda":
                torch.cuda.synchronize()
            turns.done(s)
    for j, (us, host) in enumerate(samples):
        results[j].update(hf.timed_row(us, host))
    bench.result["rows"] = results
    bench.write()
    turns.wait(len(slots))  # leave (free the GPU) only once every process has timed
    return 0


def worker_argv(argv: list[str], variant: str, i: int, n: int, out: Path, sync: Path) -> list[str]:
    """The parent's arguments for worker ``i``: later options win in argparse, so the overrides are appended."""
    base = [a for a in argv if a != "--parallel-compile"]
    return [*base, "--variants", variant, "--out", str(out), "--worker", f"{i}/{n}", "--sync", str(sync),
            "--check-tokens", "0", "--host-rounds", "0"]


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the processes' results: their rows' per-variant entries side by side."""
    result = {k: v for k, v in parts[0].items() if k not in ("rows", "notes", "errors")}
    result.update(rows=[], notes={}, errors={})
    by_row: dict[tuple[str, str], dict[str, Any]] = {}
    for part in parts:
        result["notes"].update(part.get("notes", {}))
        result["errors"].update(part.get("errors", {}))
        for row in part.get("rows", []):
            key = (row["workload"], row["mode"])
            if key not in by_row:
                by_row[key] = {"workload": row["workload"], "mode": row["mode"], "us": {}, "host_us": {}}
                result["rows"].append(by_row[key])
            for field in ("us", "host_us", "us_rounds", "profile", "step_profile"):
                if row.get(field):
                    by_row[key].setdefault(field, {}).update(row[field])
    return result


def parent_main(args: Any, argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = list(dict.fromkeys(args.variants))
    n = len(variants)
    sync = args.out / "sync"
    shutil.rmtree(sync, ignore_errors=True)
    sync.mkdir(parents=True)
    (sync / TURN).write_text("0")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    procs = []
    t0 = time.perf_counter()
    for i, variant in enumerate(variants):
        out = args.out / f"worker-{variant}"
        log_file = open(args.out / f"worker-{variant}.log", "w")  # noqa: SIM115 (closed after the process ends)
        cmd = [sys.executable, "-m", "bench.hf_model", *worker_argv(argv, variant, i, n, out, sync)]
        procs.append((variant, out, log_file, subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                                               env=env, cwd=Path(hf.__file__).resolve().parents[1])))
    hf.log(f"{n} processes: {', '.join(variants)}")
    parts, failures = [], {}
    for variant, out, log_file, proc in procs:
        rc = proc.wait()
        log_file.close()
        path = out / f"hf_model_{args.model}.json"
        if path.exists():
            parts.append(json.loads(path.read_text(encoding="utf-8")))
        if rc != 0 or not path.exists():
            failures[f"process {variant}"] = f"exit status {rc}; see worker-{variant}.log"
    hf.log(f"processes done in {time.perf_counter() - t0:.0f} s")
    for variant, *_ in procs:
        text = (args.out / f"worker-{variant}.log").read_text(errors="replace").splitlines()
        for line in text:
            if "ready in" in line or "ERROR" in line or "Error" in line:
                hf.log(f"[{variant}] {line.strip()}")
    if not parts:
        hf.log("no process measured anything")
        return 1
    result = merge(parts)
    result["errors"].update(failures)
    result["check_tokens"] = args.check_tokens
    result["header"]["command"] = " ".join([Path(sys.argv[0]).name, *argv])  # the parent's, not a worker's
    result["header"]["parallel_compile"] = {"processes": n, "compile_threads": env["TORCHINDUCTOR_COMPILE_THREADS"]}
    if args.check_tokens or args.host_rounds:  # after the processes: the GPU is free again
        bench = hf.Bench(args)
        bench.checks()
        result["accuracy"], result["host"] = bench.result["accuracy"], bench.result["host"]
        result["host_profile"] = bench.result["host_profile"]
    for row in result["rows"]:
        hf.log(f"{row['workload']} / {row['mode']}: " + ", ".join(
            f"{k} {v:.0f} µs (host {row['host_us'].get(k, 0):.0f})" for k, v in row["us"].items()))
    out_base = args.out / f"hf_model_{args.model}"
    common.write_json(out_base.with_suffix(".json"), result)
    common.write_markdown(out_base.with_suffix(".md"), hf.render(result))
    hf.plot(result, out_base.with_suffix(".png"))
    return 0 if not failures else 2

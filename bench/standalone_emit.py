"""Peak host memory and time of ``autopar codegen PLAN -o OUT --standalone`` on the README's GPT-3 175B plan.

The README's flow, literally: ``autopar plan gpt3-175b --cluster 128x8xA100-80GB --global-batch 1536 -o
gpt3.json``, then ``autopar codegen gpt3.json -o run/ --standalone``, each in a fresh process (so its peak
resident set size, which includes importing torch, is its own). Emitting the folder needs the model's
graph, not its weights: the model is built and exported on the meta device (codegen/standalone.py).
Target (issue 48): the codegen's peak RSS under 2 GB (it was 22.8 GB, then the kernel's OOM killer,
when the model was built on the CPU).

A watchdog polls each process's RSS every 0.2 s and kills it past ``--kill-gb`` (default 3: this
machine is shared), which fails the run. Peak = the larger of the polled ``VmHWM`` and the child's
``ru_maxrss`` (os.wait4). The folder is then checked: every file present, no temporary folder left
beside it, every ``.py`` compiles, and ``program.py`` imports in a process where autopar cannot be
imported (torch alone). Exits 1 when the peak is over ``--limit-gb`` or a check fails.

Run: .venv/bin/python bench/standalone_emit.py            (about 1-2 minutes: plan, emit, import)
     .venv/bin/python bench/standalone_emit.py --model gpt2-xl --cluster 1x8xA100-80GB --global-batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GB = 1e9
EXPECTED = ("train.py", "program.py", "plan.json", "planned_model.py", "buffers.pt", "autopar_runtime")
REFUSE_AUTOPAR = '''import sys


class _RefuseAutopar:
    def find_spec(self, name, path=None, target=None):
        if name == "autopar" or name.startswith("autopar."):
            raise ImportError("autopar cannot be imported here")
        return None


sys.meta_path.insert(0, _RefuseAutopar())
'''


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            found = re.search(rf"{field}:\s+(\d+) kB", fh.read())
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return int(found.group(1)) if found else 0


def guarded(cmd: list[str], kill_gb: float, env: dict | None = None, cwd: str | None = None
            ) -> tuple[int, float, float, str]:
    """Run ``cmd``, killing it past ``kill_gb`` of RSS; (exit status, peak RSS bytes, wall s, output tail)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        peak_kib, killed = 0, False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                peak_kib = max(peak_kib, usage.ru_maxrss)   # KiB on Linux
                break
            peak_kib = max(peak_kib, _status_kib(proc.pid, "VmHWM"))
            if _status_kib(proc.pid, "VmRSS") > kill_gb * GB / 1024:
                proc.kill()
                killed = True
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        tail = log.read()[-3000:]
    wall = time.perf_counter() - start
    if killed:
        tail += f"\n[killed by the watchdog past {kill_gb} GB RSS]"
    return proc.returncode, peak_kib * 1024, wall, tail


def check_folder(out: str, kill_gb: float) -> list[str]:
    """What is wrong with the emitted folder (empty: nothing)."""
    problems = [f"{name} missing" for name in EXPECTED if not os.path.exists(os.path.join(out, name))]
    parent = os.path.dirname(os.path.abspath(out))
    leftovers = [n for n in os.listdir(parent) if n != os.path.basename(os.path.abspath(out))
                 and n.startswith("." + os.path.basename(os.path.abspath(out)))]
    problems += [f"temporary folder {n} left beside the output" for n in leftovers]
    for name in sorted(os.listdir(out)):
        if name.endswith(".py"):
            with open(os.path.join(out, name)) as fh:
                try:
                    compile(fh.read(), name, "exec")
                except SyntaxError as exc:
                    problems.append(f"{name} does not compile: {exc}")
    with tempfile.TemporaryDirectory() as hook:
        with open(os.path.join(hook, "sitecustomize.py"), "w") as fh:
            fh.write(REFUSE_AUTOPAR)
        env = {**os.environ, "PYTHONPATH": hook}
        rc, peak, wall, tail = guarded([sys.executable, "-c", "import program; print(program.DEVICES)"], kill_gb,
                                       env=env, cwd=out)
        print(f"import program.py (torch alone): {wall:.1f} s, peak RSS {peak / GB:.2f} GB, exit {rc}")
        if rc != 0:
            problems.append(f"program.py does not import with torch alone:\n{tail}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--cluster", default="128x8xA100-80GB")
    parser.add_argument("--global-batch", default="1536")
    parser.add_argument("--plan", default=None, help="an existing plan JSON (skips planning)")
    parser.add_argument("--limit-gb", type=float, default=2.0, help="the target: codegen's peak RSS (GB)")
    parser.add_argument("--kill-gb", type=float, default=3.0, help="the watchdog kills a process past this RSS")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "autopar.cli"]
    with tempfile.TemporaryDirectory() as work:
        plan = args.plan
        if plan is None:
            plan = os.path.join(work, "plan.json")
            rc, peak, wall, tail = guarded([*cli, "plan", args.model, "--cluster", args.cluster, "--global-batch",
                                            args.global_batch, "-o", plan, "-q"], args.kill_gb, env=env)
            print(f"autopar plan {args.model} --cluster {args.cluster} --global-batch {args.global_batch}: "
                  f"{wall:.1f} s, peak RSS {peak / GB:.2f} GB, exit {rc}")
            if rc != 0:
                print(tail)
                return 1
        with open(plan) as fh:
            config = json.load(fh)["config"]
        shown = ("dp", "tp", "pp", "cp", "micro_batch_size", "schedule", "virtual_stages", "zero")
        print("plan: " + " ".join(f"{k}={config[k]}" for k in shown))
        out = os.path.join(work, "run")
        rc, peak, wall, tail = guarded([*cli, "codegen", plan, "-o", out, "--standalone"], args.kill_gb,
                                       env=env, cwd=work)
        print(f"autopar codegen --standalone: {wall:.1f} s, peak RSS {peak / GB:.2f} GB, exit {rc}")
        if rc != 0:
            print(tail)
            return 1
        problems = check_folder(out, args.kill_gb)
        size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
        print(f"folder: {len(os.listdir(out))} files, {size / 1e6:.1f} MB")
    for p in problems:
        print("FAIL:", p)
    ok = peak < args.limit_gb * GB and not problems
    print(f"standalone emit peak RSS under {args.limit_gb} GB and a complete folder: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

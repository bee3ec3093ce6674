"""The shared harness of ``benchmarks/``: what every script needs besides its own cases and math.

- ``run_fresh(fn, *args)``: ``fn(*args)`` in a new Python process (nothing allocated before it
  counts), its JSON-able return value back; a timeout, a crash or no JSON raises ``CaseError``.
  ``fn`` is a module-level function of a script (the child loads that file and calls it). Ranks
  of a process group come from ``tests/distributed/harness.run_ranks`` instead.
- ``measure_peak(step)``: the peak resident memory one call adds (VmHWM reset through
  ``/proc/self/clear_refs``) and its wall and CPU seconds; used inside a fresh process.
- ``timed(step)`` / ``interleaved(steps)``: warm-ups, then repeats (round-robin for several
  steps, so that load from other jobs on a shared machine hits them alike) and the median.
- ``log_slope(points)``: the exponent ``a`` of ``y ~ x^a`` (least squares on log-log).
- ``environment(script, argv)``: the command, date, device, torch and Python versions, CPU count
  and load average; ``header(title, meta)`` opens a Markdown report with them.
- ``write_results(name, record, markdown)``: ``benchmarks/results/<name>.json`` and ``.md``;
  ``parity_sections`` / ``write_parity``: the GPU parity scripts' rows, report and verdict;
  ``limit_autotune(keep)``: Triton autotuners time ``keep`` configs each (a short GPU lease);
  ``lift_fla_640_guard()``: run FLA's gated backward where it refuses (Hopper, triton < 3.7.1), to check it.

Importing this module puts this checkout's ``src/`` and root first on ``sys.path`` (its
``hybridpar`` and ``tests`` helpers). A script on the harness::

    import harness

    def case(n: int) -> dict:                  # runs in the child
        ...
        return {"seconds": harness.timed(step)["median_s"]}

    meta = harness.environment(__file__)
    rows = [harness.run_fresh(case, n) for n in (1, 2)]
    harness.write_results("mine", {"meta": meta, "rows": rows}, "\\n".join(harness.header("Mine", meta)))
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
for _path in (ROOT, ROOT / "src"):  # this checkout's hybridpar first, then tests/ helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


class CaseError(RuntimeError):
    """A case in a fresh process timed out, exited non-zero or printed no JSON."""


def child_env(threads: int | None = None) -> dict:
    """The environment of a child process: this checkout on PYTHONPATH, ``threads`` OpenMP threads."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_fresh(fn: Callable, *args, timeout_s: float = 3600, threads: int | None = None):
    """``fn(*args)`` in a new Python process (arguments and result through JSON); ``threads``
    sets OMP_NUM_THREADS there (torch's thread count; the child imports nothing before ``fn``'s script)."""
    source = sys.modules[fn.__module__].__file__
    command = [sys.executable, __file__, str(Path(source).resolve()), fn.__name__, json.dumps(args)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=child_env(threads), cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise CaseError(f"timed out after {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise CaseError(f"exit {done.returncode}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise CaseError(f"no JSON on the last line of stdout: {done.stdout.strip()[-200:]!r}") from None


def _child(source: str, name: str, args_json: str) -> None:
    """The child side of ``run_fresh``: load the script as a module, call ``name``, print JSON."""
    spec = importlib.util.spec_from_file_location(Path(source).stem, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look a class's module up here
    spec.loader.exec_module(module)
    result = getattr(module, name)(*json.loads(args_json))
    print("\n" + json.dumps(result), flush=True)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_peak(step: Callable[[], object]) -> dict:
    """Peak resident bytes ``step()`` adds (VmHWM - VmRSS before; ``hwm_reset`` False: the
    lifetime ``ru_maxrss`` had to serve), wall and CPU seconds of the call, and its return value."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
        hwm_reset = True
    except OSError:
        hwm_reset = False
    before = _status_bytes("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    value = step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _status_bytes("VmHWM") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak - before, "wall_s": wall, "cpu_s": cpu, "rss_before_bytes": before,
            "hwm_reset": hwm_reset, "value": value}


def interleaved(steps: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                limit: dict[str, int] | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, list]:
    """Seconds of each step, ``warmup`` untimed calls each, then ``repeats`` rounds calling every
    step once per round (``limit[name]`` rounds at most for a slow one)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for round_ in range(repeats):
        for name, step in steps.items():
            if round_ < (limit or {}).get(name, repeats):
                start = clock()
                step()
                samples[name].append(clock() - start)
    return samples


def timed(step: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
    """``{"median_s", "samples_s"}`` of ``step()`` after ``warmup`` untimed calls."""
    samples = interleaved({"step": step}, repeats, warmup)["step"]
    return {"median_s": statistics.median(samples), "samples_s": samples}


def log_slope(points: Iterable[tuple[float, float]]) -> float | None:
    """Least-squares slope of log y on log x over the points with positive numbers; None if < 2."""
    logs = [(math.log(x), math.log(y)) for x, y in points
            if isinstance(y, (int, float)) and not isinstance(y, bool) and x > 0 and y > 0]
    if len(logs) < 2:
        return None
    mean_x, mean_y = (sum(p[i] for p in logs) / len(logs) for i in (0, 1))
    return sum((x - mean_x) * (y - mean_y) for x, y in logs) / sum((x - mean_x) ** 2 for x, _ in logs)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """``python benchmarks/<script> <arguments>``, as a reader re-runs it from the checkout root."""
    argv = sys.argv[1:] if argv is None else argv
    return f"python benchmarks/{Path(script).name} {shlex.join(argv)}".strip()


def environment(script: str, argv: list[str] | None = None) -> dict:
    """The command, date, Python and torch versions, machine (CPU count), device and load average."""
    import torch

    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else machine
    return {"command": command_line(script, argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "machine": machine, "device": device,
            "cpus": os.cpu_count(), "load_average": list(os.getloadavg())}


def header(title: str, meta: dict) -> list[str]:
    """The first lines of a report: title, command, date, device and versions."""
    return [f"# {title}", "", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
            f"Device: {meta.get('device', meta.get('machine'))}, Python {meta.get('python', platform.python_version())}, "
            f"torch {meta['torch']}  "]


def parity_sections(runs: dict[str, Callable[[], list]], tolerance: float) -> dict[str, list[dict]]:
    """Each section's rows ``{"quantity", "rel", "ok"}`` from ``runs[name]()`` (``(quantity, relative
    difference)`` pairs), ok at ``rel <= tolerance``; a section that raises gets one failing row naming it."""
    import traceback

    sections = {}
    for name, run in runs.items():
        try:
            sections[name] = [{"quantity": q, "rel": r, "ok": r <= tolerance} for q, r in run()]
        except Exception as error:  # noqa: BLE001 - e.g. a fused kernel that cannot run here: the reason
            traceback.print_exc()
            sections[name] = [{"quantity": "fused kernel", "rel": None, "ok": False,
                               "error": f"{type(error).__name__}: {error}"[:300]}]
        worst = max(sections[name], key=lambda row: float("inf") if row["rel"] is None else row["rel"])
        print(f"parity {name}: worst {worst['quantity']} {worst['rel']}, {'ok' if worst['ok'] else 'FAIL'}", flush=True)
    return sections


def limit_autotune(keep: int) -> None:
    """Triton autotuners (FLA's kernels, made at import, before or after this call) time at most ``keep``
    of their configs: 4 warps and 2 pipeline stages first, then blocks near 64. A fresh GPU machine has no
    Triton cache, and FLA's scan alone times 48 configs per state kernel: minutes of a short lease.
    It changes which tiling runs, never what a kernel computes. ``keep <= 0`` leaves them all."""
    if keep <= 0:
        return
    from triton.runtime.autotuner import Autotuner

    def preference(config) -> tuple:
        blocks = [v for v in config.kwargs.values() if isinstance(v, int)]
        return (config.num_warps != 4, abs(config.num_stages - 2), sum(abs(b - 64) for b in blocks))

    original, prune = Autotuner.__init__, Autotuner.prune_configs

    def init(self, fn, arg_names, configs, *args, **kwargs):
        original(self, fn, arg_names, sorted(configs, key=preference)[:keep] if configs else configs, *args, **kwargs)

    def pruned(self, kwargs):
        return sorted(prune(self, kwargs), key=preference)[:keep]

    Autotuner.__init__ = init  # autotuners made from now on: one config runs untimed when keep is 1
    Autotuner.prune_configs = pruned  # and those made before


def lift_fla_640_guard() -> str | None:
    """Let fla-core run the backward of its gated chunk kernels on a Hopper GPU with triton 3.4-3.7.0,
    which it refuses (FLA #640: a triton codegen bug seen at ``BK=64``; hybridpar's Mamba and delta
    rule shapes run ``BK=128`` on Hopper), and stop hybridpar refusing it in turn. For the parity
    checks, which then say whether those kernels are right on this machine at these shapes, and for
    timing them once they are. Returns what it lifted, or None where nothing is refused."""
    from hybridpar.models.mamba import fused_op

    refusal = fused_op.fla_gated_backward_refusal()
    if refusal is None:
        return None
    import fla.ops.common.chunk_o as chunk_o  # the guard reads this module's flag at call time

    chunk_o.IS_NVIDIA_HOPPER = False
    fused_op._BACKWARD_REFUSAL = None
    print(f"lifted: {refusal}", flush=True)
    return refusal


def write_parity(name: str, title: str, meta: dict, sections: dict[str, list[dict]], out: Path | str = RESULTS) -> int:
    """``<out>/<name>.{json,md}``: each section's worst quantity and a verdict; returns 1 if any row failed."""
    failures = [(s, row["quantity"]) for s, rows in sections.items() for row in rows if not row["ok"]]
    lines = [f"# {title}", "", f"Device: {meta['device']}, torch {meta['torch']}, {meta['date']}; pass: relative "
             f"max difference <= {meta['tolerance']:g}", ""]
    for section, rows in sections.items():
        worst = max(rows, key=lambda r: -1 if r["rel"] is None else r["rel"])
        lines.append(f"- {section}: {len(rows)} quantities, worst {worst['quantity']} "
                     f"{worst.get('error') or format(worst['rel'], '.2e')}, {'ok' if all(r['ok'] for r in rows) else 'FAIL'}")
    lines += ["", f"verdict: {'FAILED ' + str(failures) if failures else 'passed'}", ""]
    write_results(name, {**meta, "sections": sections}, "\n".join(lines), out=out)
    return 1 if failures else 0


def write_results(name: str, record: dict, markdown: str, out: Path | str = RESULTS, echo: bool = True) -> None:
    """``<out>/<name>.json`` (``record``) and ``<out>/<name>.md``; ``echo`` prints the Markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    if echo:
        print(markdown)


if __name__ == "__main__":
    _child(*sys.argv[1:])

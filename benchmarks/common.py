"""Helpers shared by the benchmarks: flags, timing, batch search, results files and tables.

Every benchmark runs from the repository root as ``python -m benchmarks.<name>``. Its
flags come from :func:`parser` and :func:`add_vit`; its results file starts with
:func:`header`, its tables come from :func:`table` and it is written by
:func:`write_results`. Nothing here starts a JAX backend, so the PyTorch baseline uses
it too.

Example:
  >>> args = parser(__doc__, timing=(20, 3)).parse_args(["--no-write"])
  >>> args.no_write, args.out_dir == str(RESULTS), args.steps, args.warmup
  (True, True, 20, 3)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jamp.models import sizes
from jamp.policy import mixed_precision

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the benchmarks write their committed results."""

_PEAKS = {"h100 pcie": 756.0, "h100": 989.0, "h200": 989.0, "a100": 312.0}
"""Dense bf16/fp16 tensor-core peaks, TFLOP/s, matched in order against the device name."""


def peak_tflops(device_kind: str | None) -> float | None:
    """Dense bf16/fp16 peak of a known accelerator, TFLOP/s; ``None`` if unknown (CPU).

    Example:
      >>> peak_tflops("NVIDIA A100-SXM4-80GB"), peak_tflops("cpu")
      (312.0, None)
    """
    return next((tf for key, tf in _PEAKS.items() if key in (device_kind or "").lower()), None)


def train_flops(args: argparse.Namespace) -> float:
    """Analytic training FLOPs per image of the ViT step of ``args`` (:func:`add_vit` flags).

    Example:
      >>> a = argparse.Namespace(variant="b16", image_size=224, patch_size=16,
      ...                        num_classes=1000, num_layers=None)
      >>> round(train_flops(a) / 1e9, 1)
      105.4
    """
    return sizes.train_flops_per_image(args.variant, image_size=args.image_size,
                                       patch_size=args.patch_size,
                                       num_classes=args.num_classes, num_layers=args.num_layers)


def mfu(images_per_sec: float | None, flops_per_image: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak (``None`` if unknown).

    Example:
      >>> round(mfu(4000.0, 105.4e9, 989.0), 3)
      0.426
    """
    if images_per_sec is None or peak is None:
        return None
    return images_per_sec * flops_per_image / (peak * 1e12)


def time_steps(runs: dict[str, Callable[[], Any]], *, warmup: int, steps: int,
               rotate: bool = False) -> dict[str, list[float]]:
    """Calls each of ``runs`` in turn, ``warmup + steps`` rounds; the timed wall times (s).

    Each run must block until its work is done (``block_until_ready`` /
    ``torch.cuda.synchronize``) so each time is its own; taking them in turn lets drift
    in the machine's load hit all alike. ``rotate`` starts each round at the next run.

    Example:
      >>> {name: len(t) for name, t in time_steps({"a": lambda: None}, warmup=2,
      ...                                          steps=3).items()}
      {'a': 3}
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + steps):
        k = i % len(runs) if rotate else 0
        for name in list(runs)[k:] + list(runs)[:k]:
            t0 = time.perf_counter()
            runs[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def summarize_times(times: list[float], batch: int) -> dict[str, float]:
    """Median step time (ms), its spread (p10/p90) and images/s from the median.

    Example:
      >>> summarize_times([0.1, 0.2, 0.3], 8)["images_per_sec"]
      40.0
    """
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    median = statistics.median(ordered)
    return dict(step_ms=median * 1e3, step_ms_p10=pick(0.1) * 1e3,
                step_ms_p90=pick(0.9) * 1e3, images_per_sec=batch / median)


def largest_batch(fits: Callable[[int], bool], start: int, *, granularity: int = 8,
                  cap: int = 1 << 16, step: int | None = None) -> int | None:
    """The largest multiple of ``granularity`` for which ``fits(batch)`` holds (monotone).

    Walks away from ``start`` (a guess) in steps that double (the first is ``step``, by
    default an eighth of ``start``) until the answer changes, then bisects: with a good
    guess and ``step=granularity``, two calls. ``None`` when not even ``granularity`` fits.

    Example:
      >>> largest_batch(lambda b: b <= 300, start=128)
      296
    """
    g = granularity
    start = max(g, start // g * g)
    step = max(g, (step or start // 8) // g * g)
    if fits(start):
        lo, hi = start, None
        while hi is None:
            probe = lo + step
            if probe > cap:
                hi = cap + g
            elif fits(probe):
                lo, step = probe, step * 2
            else:
                hi = probe
    else:
        lo, hi = None, start
        while lo is None:
            probe = hi - step
            if probe < g:
                if hi == g or not fits(g):
                    return None
                lo = g
            elif fits(probe):
                lo = probe
            else:
                hi, step = probe, step * 2
    while hi - lo > g:
        mid = (lo + hi) // 2 // g * g
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return min(lo, cap)


def today() -> str:
    """Today's date as ``YYYY-MM-DD`` (UTC), for result file names: ``today()``."""
    return datetime.datetime.now(datetime.UTC).date().isoformat()


def machine() -> dict[str, Any]:
    """The host: processor, CPU count, OS, 1-minute load average: ``machine()["cpus"]``."""
    return dict(processor=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                platform=platform.platform(), python=platform.python_version(),
                load_avg_1m=round(os.getloadavg()[0], 2))


def header(script: str, argv: list[str] | None, benchmark: str | None = None,
           with_jax: bool = True) -> dict[str, Any]:
    """The fields a results file starts with: what ran, when, how, where, with which jax.

    ``command`` reproduces the run (``argv`` defaults to ``sys.argv``); ``benchmark``,
    the results file's kind, defaults to ``script``. ``with_jax`` adds the JAX platform,
    device kind and version (this starts JAX).

    Example:
      >>> h = header("run_all", ["--steps", "1"], "throughput", with_jax=False)
      >>> h["benchmark"], h["command"], sorted(h)[2:]
      ('throughput', 'python -m benchmarks.run_all --steps 1', ['date', 'machine'])
    """
    args = sys.argv[1:] if argv is None else argv
    out = dict(benchmark=benchmark or script, date=today(),
               command=" ".join(["python", "-m", f"benchmarks.{script}", *args]),
               machine=machine())
    if with_jax:
        import jax

        out.update(platform=jax.default_backend(), device=jax.devices()[0].device_kind,
                   jax=jax.__version__)
    return out


def results_stem(out_dir: str | Path, benchmark: str, device: str) -> Path:
    """``<out_dir>/<benchmark>-<device>-<today>``, a results file less its suffix.

    Example:
      >>> results_stem("/tmp", "memory", "cpu").name.startswith("memory-cpu-20")
      True
    """
    return Path(out_dir) / f"{benchmark}-{device}-{today()}"


def _write_json(path: str | Path, obj: Any) -> None:
    """Writes ``obj`` as indented JSON, creating folders."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def write_results(stem: Path, result: dict[str, Any], markdown: str) -> None:
    """Writes ``<stem>.json`` and ``<stem>.md``: ``write_results(stem, result, markdown)``."""
    _write_json(f"{stem}.json", result)
    Path(f"{stem}.md").write_text(markdown)
    print(f"wrote {stem}.md/.json", flush=True)


def process_result(args: argparse.Namespace, framework: str, device: dict[str, Any],
                   rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of one process of ``run_all``, written to ``--json`` when given.

    Example:
      >>> args = argparse.Namespace(json=None, modes=["fp32"], batch=2)
      >>> process_result(args, "jamp", {}, [])["config"]
      {'batch': 2}
    """
    config = {k: v for k, v in vars(args).items() if k not in ("json", "modes")}
    result = dict(benchmark="throughput", framework=framework, device=device, config=config,
                  results=rows)
    if args.json:
        _write_json(args.json, result)
    return result


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """Formats a number, or ``"n/a"`` for ``None``/NaN.

    Example:
      >>> fmt(1234.5, ",.0f"), fmt(None), fmt(1.5, ".2f", "x")
      ('1,234', 'n/a', '1.50x')
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def gib(nbytes: int | None) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB), ``"n/a"`` for ``None``.

    Example:
      >>> gib(3 * 2**30), gib(5 * 2**20)
      ('3.00 GiB', '5.0 MiB')
    """
    if nbytes is not None and nbytes < 2**30:
        return fmt(nbytes / 2**20, ".1f", " MiB")
    return fmt(None if nbytes is None else nbytes / 2**30, ".2f", " GiB")


def table(columns: str, rows: Iterable[Iterable[Any]]) -> list[str]:
    """The lines of a Markdown table: the ``|``-separated ``columns``, then a row of cells each.

    Example:
      >>> table("mode | img/s", [("fp32", 1.5)])
      ['| mode | img/s |', '|---|---|', '| fp32 | 1.5 |']
    """
    return [f"| {columns} |", "|---" * (columns.count("|") + 1) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def accuracy_cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Test accuracy and its difference from the fp32 run of the same framework, as cells.

    Example:
      >>> accuracy_cells({"test_accuracy": 0.95}, [{"mode": "fp32", "test_accuracy": 0.96}])
      ('95.00%', '-1.00 pt')
    """
    framework = row.get("framework", "linen")
    base = next((r["test_accuracy"] for r in rows if r["mode"] == "fp32"
                 and r.get("framework", "linen") == framework), None)
    acc = row["test_accuracy"]
    if acc is None:
        return "n/a", "—"
    delta = "—" if base is None else f"{100 * (acc - base):+.2f} pt"
    return f"{100 * acc:.2f}%", delta


def nnx_vs_linen(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """An NNX row's accuracy minus the linen row's of the same mode, as a table cell.

    Example:
      >>> rows = [{"mode": "fp16", "framework": "linen", "test_accuracy": 0.98},
      ...         {"mode": "fp16", "framework": "nnx", "test_accuracy": 0.975}]
      >>> nnx_vs_linen(rows[1], rows), nnx_vs_linen(rows[0], rows)
      ('-0.50 pt', '—')
    """
    if row.get("framework", "linen") != "nnx" or row["test_accuracy"] is None:
        return "—"
    linen = next((r["test_accuracy"] for r in rows if r["mode"] == row["mode"]
                  and r.get("framework", "linen") == "linen"), None)
    return "—" if linen is None else f"{100 * (row['test_accuracy'] - linen):+.2f} pt"


def split(text: str) -> list[str]:
    """The items of a comma-separated flag value (an argparse ``type``).

    Example:
      >>> split(" s16, b16,,"), split("")
      (['s16', 'b16'], [])
    """
    return [item.strip() for item in text.split(",") if item.strip()]


def modes(text: str) -> list[str]:
    """Canonical names of comma-separated jamp modes, aliases accepted (an argparse ``type``).

    Example:
      >>> modes("fp32, O2")
      ['fp32', 'fp16_naive']
    """
    return [mixed_precision(name).name for name in split(text)]


def parser(doc: str, json_out: bool = False,
           timing: tuple[int | None, int | None] | None = None) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--out-dir``/``--no-write``.

    With ``json_out``, ``--json`` instead (the processes of ``run_all``); with
    ``timing=(steps, warmup)``, ``--steps`` and ``--warmup`` with those defaults.

    Example:
      >>> parser("Counts.", json_out=True).parse_args(["--json", "r.json"]).json
      'r.json'
    """
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if json_out:
        ap.add_argument("--json", default=None, help="write the results here")
    else:
        ap.add_argument("--out-dir", default=str(RESULTS), help="where to write the results")
        ap.add_argument("--no-write", action="store_true", help="print only")
    if timing is not None:
        ap.add_argument("--steps", type=int, default=timing[0], help="timed steps")
        ap.add_argument("--warmup", type=int, default=timing[1],
                        help="untimed steps first (compiling ones included)")
    return ap


def add_vit(ap: argparse.ArgumentParser, variant: str | None = "b16", batch: int = 128) -> None:
    """Adds the ViT step's shape flags (``--variant`` only if ``variant`` is given).

    Example:
      >>> ap = parser("Counts.")
      >>> add_vit(ap, batch=8)
      >>> args = ap.parse_args(["--num-layers", "1"])
      >>> args.variant, args.patch_size, args.image_size, args.batch, args.num_layers
      ('b16', None, 224, 8, 1)
    """
    if variant is not None:
        ap.add_argument("--variant", default=variant, help="ti/s/b/l with patch size, e.g. b16")
    ap.add_argument("--patch-size", type=int, default=None,
                    help="patch size of a variant named without one")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--num-layers", type=int, default=None, help="override (smoke tests)")

"""jamp vs PyTorch AMP on one device: throughput, memory, max batch and MFU per mode.

Runs ``benchmarks.throughput`` (jamp) and ``benchmarks.torch_amp`` (PyTorch) on the same
device, one process per mode so that each peak memory is that mode's own, and writes
``results/throughput-<device>-<date>.md``, ``.json`` and ``.png``: per mode, images/s and
their ratio, peak memory, largest batch, MFU, and the comparison's targets (met / not met).

Usage::

  python -m benchmarks.run_all                       # ViT-B/16, 224px, batch 128, on the GPU
  python -m benchmarks.run_all --variant ti16 --image-size 64 --batch 8 --steps 5   # CPU
  python -m benchmarks.run_all --keep-dir /tmp/bench   # repeat until done if a call is cut off
  python -m benchmarks.run_all --from-dir /tmp/runs   # merge the jamp-*.json and torch-*.json
                                                      # that throughput / torch_amp wrote there
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jamp
from benchmarks import common
from jamp.models import sizes

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 3600
"""Seconds each process may take."""
TORCH_FOR = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
"""The PyTorch run each jamp mode is compared with (same precision recipe)."""

REFERENCE = (
    ("fp32", 27.2, 377.6), ("torch AMP", 20.5, 416.0), ("naive AMP", 17.0, 451.8),
    ("apex O1", 20.2, 393.0),
)
"""Colossal-AI's reported ViT-B/16, batch 128, ImageNet figures (GB, img/s), for context."""


def _run(script: str, flags: list[str], json_path: Path, timeout: float) -> dict[str, Any]:
    """Runs one benchmark process; the results it wrote to ``json_path``."""
    cmd = [sys.executable, "-m", f"benchmarks.{script}", *flags, "--json", str(json_path)]
    print("$ python", " ".join(cmd[1:]), flush=True)
    # Let XLA's allocator use as much of the GPU as PyTorch may (--memory-fraction 0.95).
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ}
    subprocess.run(cmd, check=True, timeout=timeout, env=env, cwd=REPO)
    return json.loads(json_path.read_text())


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing."""
    return a / b if a is not None and b else None


def _slug(text: str) -> str:
    """A file-name-safe, lower-case form of a device name.

    Example:
      >>> _slug("NVIDIA H100 80GB HBM3")
      'nvidia-h100-80gb-hbm3'
    """
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _merge(jamp_runs: list[dict[str, Any]], torch_runs: list[dict[str, Any]]) -> list[dict]:
    """One row per jamp mode with its PyTorch counterpart (eager and compiled) beside it."""
    torch_rows = {(r["mode"], r["compiled"]): r for run in torch_runs for r in run["results"]}
    jamp_rows = [r for run in jamp_runs for r in run["results"]]
    fp32_peak = next((r["peak_bytes"] for r in jamp_rows if r["mode"] == "fp32"), None)
    rows = []
    for j in jamp_rows:
        counterpart = TORCH_FOR.get(j["mode"])
        eager = torch_rows.get((counterpart, False), {})
        comp = torch_rows.get((counterpart, True), {})
        rows.append(dict(
            mode=j["mode"], torch_mode=counterpart,
            jamp_images_per_sec=j["images_per_sec"], jamp_step_ms=j["step_ms"],
            torch_eager_images_per_sec=eager.get("images_per_sec"),
            torch_compile_images_per_sec=comp.get("images_per_sec"),
            vs_torch_eager=_ratio(j["images_per_sec"], eager.get("images_per_sec")),
            vs_torch_compile=_ratio(j["images_per_sec"], comp.get("images_per_sec")),
            jamp_peak_bytes=j["peak_bytes"], jamp_peak_vs_fp32=_ratio(j["peak_bytes"], fp32_peak),
            torch_eager_peak_bytes=eager.get("peak_bytes"),
            torch_compile_peak_bytes=comp.get("peak_bytes"),
            jamp_xla_step_bytes=j["xla_step_bytes"],
            jamp_jax_level_bytes=j["jax_memory"]["total_bytes"],
            jamp_max_batch=j["max_batch"], torch_max_batch=eager.get("max_batch"),
            jamp_mfu=j["mfu"], torch_eager_mfu=eager.get("mfu"), torch_compile_mfu=comp.get("mfu"),
            jamp_loss_finite=j["loss_finite"], jamp_steps_skipped=j["steps_skipped"]))
    return rows


def _targets(rows: list[dict[str, Any]], on_cpu: bool) -> list[dict[str, Any]]:
    """The comparison's targets, each with its measured value and verdict."""
    by = {r["mode"]: r for r in rows}
    get = lambda mode, key: by.get(mode, {}).get(key)
    bf16_ips, fp16_ips = get("bf16", "jamp_images_per_sec"), get("fp16", "jamp_images_per_sec")
    checks = [
        ("bf16 img/s vs PyTorch AMP bf16 eager", get("bf16", "vs_torch_eager"), ">=", 1.3, "x"),
        ("bf16 img/s vs PyTorch bf16 torch.compile", get("bf16", "vs_torch_compile"), ">=", 1.0,
         "x"),
        ("bf16 MFU", get("bf16", "jamp_mfu"), ">=", 0.45, "%"),
        ("fp16 img/s vs bf16 img/s", _ratio(fp16_ips, bf16_ips), ">=", 0.97, "x"),
        ("fp16_naive img/s vs bf16 img/s", _ratio(get("fp16_naive", "jamp_images_per_sec"),
                                                  bf16_ips), ">=", 0.95, "x"),
        ("fp16 peak memory vs fp32", get("fp16", "jamp_peak_vs_fp32"), "<=", 0.55, "x"),
        ("bf16 peak memory vs fp32", get("bf16", "jamp_peak_vs_fp32"), "<=", 0.55, "x"),
        *((f"{m} peak memory vs PyTorch AMP {m} eager", _ratio(
            get(m, "jamp_peak_bytes"), get(m, "torch_eager_peak_bytes")), "<=", 1.0, "x")
          for m in ("fp16", "bf16")),
        ("bf16 largest batch vs fp32's", _ratio(get("bf16", "jamp_max_batch"),
                                                get("fp32", "jamp_max_batch")), ">=", 1.8, "x"),
    ]
    return [dict(target=name, value=value, op=op, bound=bound, unit=unit,
                 verdict="n/a on CPU" if on_cpu else "not measured" if value is None else
                 "met" if (value >= bound if op == ">=" else value <= bound) else "not met")
            for name, value, op, bound, unit in checks]


def _to_markdown(result: dict[str, Any]) -> str:
    """The results file: what ran where, the two tables, the targets, the reference."""
    d, c, rows, fmt, gib = (result["device"], result["config"], result["rows"], common.fmt,
                            common.gib)
    x = lambda v: fmt(v, ".2f", "x")
    lines = [
        f"# jamp vs PyTorch AMP: {sizes.vit_label(c['variant'])} training on "
        f"{d['device_kind']}", "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; device: {d['device_kind']} ({d['platform']}); peak "
        f"{fmt(d['peak_tflops'], '.0f', ' TFLOP/s')} (dense bf16/fp16); host "
        f"{d['machine']['cpus']} CPUs, 1-min load {d['machine']['load_avg_1m']}",
        f"- software: jax {d['jax']}, optax {d['optax']}; torch {result['torch_device']['torch']}"
        f"; PyTorch model: {result['torch_impl']}",
        f"- step: {c['image_size']}px, batch {c['batch']}, {c['num_classes']} classes, AdamW, "
        f"synthetic device-resident data; remat {c['remat']}; {c['warmup']} warm-up steps, "
        f"median of {c['steps']} timed steps (block_until_ready / cuda.synchronize)",
        f"- MFU: {fmt(result['flops_per_image'] / 1e9, '.2f')} GFLOP per image "
        "(analytic, 3 x 2 x MACs) x img/s / device peak",
    ]
    if d["platform"] == "cpu":
        lines += ["", "**CPU run: XLA:CPU (and PyTorch on CPU) compute float16/bfloat16 by "
                  "upcasting, so these numbers show that the pipeline runs end to end, not what "
                  "mixed precision gains. Peak device memory and max batch are GPU measurements "
                  "(n/a here).**"]
    lines += ["", "## Throughput", "", *common.table(
        "mode | jamp img/s | jamp ms/step | PyTorch eager img/s | PyTorch compile img/s "
        "| jamp / eager | jamp / compile | jamp MFU | PyTorch compile MFU",
        ([r["mode"] + (f" (torch {r['torch_mode']})" if r["torch_mode"] else ""),
          fmt(r["jamp_images_per_sec"], ",.1f"), fmt(r["jamp_step_ms"], ",.1f"),
          fmt(r["torch_eager_images_per_sec"], ",.1f"),
          fmt(r["torch_compile_images_per_sec"], ",.1f"), x(r["vs_torch_eager"]),
          x(r["vs_torch_compile"]), fmt(r["jamp_mfu"], ".1%"), fmt(r["torch_compile_mfu"], ".1%")]
         for r in rows))]
    lines += ["", "## Memory and largest batch", "", *common.table(
        "mode | jamp peak | vs fp32 | PyTorch eager peak | PyTorch compile peak "
        "| jamp XLA step | jamp JAX-level | jamp max batch | PyTorch max batch",
        ([r["mode"], gib(r["jamp_peak_bytes"]), x(r["jamp_peak_vs_fp32"]),
          gib(r["torch_eager_peak_bytes"]), gib(r["torch_compile_peak_bytes"]),
          gib(r["jamp_xla_step_bytes"]), gib(r["jamp_jax_level_bytes"]),
          fmt(r["jamp_max_batch"], "d"), fmt(r["torch_max_batch"], "d")] for r in rows))]
    num = lambda v, unit: fmt(v, ".1%") if unit == "%" else x(v)
    lines += [
        "",
        "jamp peak: `device.memory_stats()['peak_bytes_in_use']`, one process per mode; PyTorch "
        "peak: `torch.cuda.max_memory_allocated`. jamp XLA step: the compiled step's memory "
        "analysis (arguments + outputs - donated + temporaries; on CPU it reflects XLA:CPU's "
        "float32 upcasting). jamp JAX-level: `jamp.memory_report` (params + grads + optimizer "
        "state + residuals, from dtypes; device-independent). Max batch: "
        f"jamp {result['jamp_max_batch_method']}; PyTorch {result['torch_max_batch_method']}.",
        "", "## Targets", "", *common.table("target | measured | bound | verdict", (
            [t["target"], num(t["value"], t["unit"]), f"{t['op']} {num(t['bound'], t['unit'])}",
             t["verdict"]] for t in result["targets"])),
        "", "## Reference (reported by Colossal-AI, ViT-B/16, batch 128, ImageNet; "
        "not measured here)", "", *common.table(
            "recipe | memory | img/s", ([name, f"{gb} GB", rate] for name, gb, rate in REFERENCE))]
    if result.get("plot"):
        lines += ["", f"![throughput and memory]({result['plot']})"]
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: images/s (jamp, PyTorch eager, PyTorch compile) and memory per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, c = result["rows"], result["config"]
    x = np.arange(len(rows))
    cpu = result["device"]["platform"] == "cpu"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (label, key) in enumerate([("jamp", "jamp"), ("PyTorch eager", "torch_eager"),
                                      ("PyTorch compile", "torch_compile")]):
        ax1.bar(x + (i - 1) * 0.27, [r[f"{key}_images_per_sec"] or 0 for r in rows], 0.27,
                label=label)
    ax1.set_ylabel("images/s")
    ax1.set_title("throughput" + (" (CPU: pipeline check, not speed)" if cpu else ""))
    mem_key, mem_label = (("jamp_jax_level_bytes", "JAX-level bytes (memory_report)") if cpu
                          else ("jamp_peak_bytes", "peak device memory"))
    ax2.bar(x - 0.2, [(r[mem_key] or 0) / 2**30 for r in rows], 0.4, label=f"jamp {mem_label}")
    if not cpu:
        ax2.bar(x + 0.2, [(r["torch_eager_peak_bytes"] or 0) / 2**30 for r in rows], 0.4,
                label="PyTorch eager peak")
    ax2.set_ylabel("GiB")
    ax2.set_title("memory")
    for ax in (ax1, ax2):
        ax.set_xticks(x, [r["mode"] for r in rows], rotation=20)
        ax.legend(fontsize=8)
    fig.suptitle(f"{sizes.vit_label(c['variant'])} {c['image_size']}px batch {c['batch']} on "
                 f"{result['device']['device_kind']} ({result['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _measure(args: argparse.Namespace, shared: list[str],
             extra: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Runs each jamp mode and each PyTorch mode in its own process; their results."""
    keep = args.keep_dir
    with (contextlib.nullcontext(keep) if keep
          else tempfile.TemporaryDirectory(prefix="jamp-bench-")) as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)

        def child(script: str, name: str, flags: list[str]) -> dict[str, Any]:
            digest = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]
            path = Path(tmp) / f"{name}-{digest}.json"
            if keep and path.exists():  # measured by an earlier, interrupted invocation
                print(f"reusing {path}", flush=True)
                return json.loads(path.read_text())
            return _run(script, flags, path, TIMEOUT)

        jamp_runs = [child("throughput", f"jamp-{mode}", shared + ["--modes", mode] + extra
                           + (["--remat"] if args.remat else [])) for mode in args.modes]
        torch_runs = [child("torch_amp", f"torch-{mode}", shared + [
            "--modes", mode, "--compile", args.torch_compile] + extra + (
            ["--threads", str(args.torch_threads)] if args.torch_threads else []))
            for mode in args.torch_modes]
    return jamp_runs, torch_runs


def _read_runs(folder: Path, modes: list[str]) -> tuple[list[dict[str, Any]], list[dict]]:
    """The jamp (in ``modes``' order) and PyTorch results written as JSON in ``folder``."""
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    jamp_runs = [r for r in runs if r.get("framework") == "jamp"]
    order = {m: i for i, m in enumerate(modes)}
    jamp_runs.sort(key=lambda r: order.get(r["results"][0]["mode"], len(order)))
    torch_runs = [r for r in runs if r.get("framework") == "torch"]
    if not jamp_runs:
        raise SystemExit(f"--from-dir {folder}: no jamp results (*.json from "
                         "benchmarks.throughput --json) there.")
    return jamp_runs, torch_runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs both benchmarks and (unless ``--no-write``) writes the comparison files."""
    ap = common.parser(__doc__, timing=(20, 3))
    common.add_vit(ap)
    ap.add_argument("--modes", type=common.modes, default=list(jamp.MODES), help="jamp modes")
    ap.add_argument("--torch-modes", type=common.split, default=["fp32", "fp16", "bf16"])
    ap.add_argument("--torch-compile", default="eager,compile", help="eager and/or compile")
    ap.add_argument("--max-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="search the largest batch per mode (GPU only; n/a on CPU)")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch CPU threads (1 on a busy shared CPU host)")
    ap.add_argument("--keep-dir", default=None,
                    help="keep each subprocess's JSON here and reuse it when the same command "
                         "is run again (to finish a long run in several shorter calls)")
    ap.add_argument("--from-dir", default=None,
                    help="run nothing: merge the jamp-*.json and torch-*.json results that "
                         "benchmarks.throughput / benchmarks.torch_amp wrote (--json) there")
    args = ap.parse_args(argv)
    config = {k: getattr(args, k) for k in ("variant", "image_size", "batch", "steps", "warmup",
                                            "remat", "num_classes", "num_layers")}
    shared = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "variant", "patch_size", "image_size", "batch", "num_classes", "num_layers", "steps",
        "warmup") if getattr(args, k) is not None]
    extra = ["--max-batch"] if args.max_batch else []
    if args.from_dir:
        jamp_runs, torch_runs = _read_runs(Path(args.from_dir), args.modes)
        config = {k: jamp_runs[0]["config"].get(k, v) for k, v in config.items()}
    else:
        jamp_runs, torch_runs = _measure(args, shared, extra)
    device = jamp_runs[0]["device"]
    on_cpu = device["platform"] == "cpu"
    rows = _merge(jamp_runs, torch_runs)
    first = lambda runs, key, eager=False: next((r[key] for run in runs for r in run["results"]
                                                 if not (eager and r["compiled"])), None)
    result = dict(
        **common.header("run_all", argv, "throughput", with_jax=False), device=device,
        torch_device=torch_runs[0]["device"] if torch_runs else {"torch": "not run"},
        config=config, flops_per_image=first(jamp_runs, "flops_per_image"),
        torch_impl=first(torch_runs, "impl") or "not run",
        jamp_max_batch_method=first(jamp_runs, "max_batch_method"),
        torch_max_batch_method=first(torch_runs, "max_batch_method", eager=True) or "not run",
        rows=rows, targets=_targets(rows, on_cpu), jamp=jamp_runs, torch=torch_runs)
    stem = common.results_stem(args.out_dir, "throughput",
                               "cpu" if on_cpu else _slug(device["device_kind"]))
    result["plot"] = f"{stem.name}.png"
    if not args.no_write:
        common.write_results(stem, result, _to_markdown(result))
        _plot(result, Path(f"{stem}.png"))
    return result


if __name__ == "__main__":
    main()

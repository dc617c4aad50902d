"""Rebuilds the per-process results of a ``benchmarks/gpu_round.sh`` run from its printed log.

Each process of the GPU round prints one line per measurement; when the JSON it wrote
cannot come back from the GPU machine (the packed results outgrew the transfer limit),
the log still holds every figure. This writes, per ViT variant, the ``jamp-*.json`` and
``torch-*.json`` that ``benchmarks.throughput`` / ``benchmarks.torch_amp`` would have
written (the fields the log prints; the rest ``None``), and the trainer's figures, so that
``python -m benchmarks.run_all --from-dir`` renders them.

Usage::

  python -m benchmarks.gpu_log benchmarks/results/gpu_round-nvidia-h200-2026-11-26/log.txt \\
      --out /tmp/gpu     # then: python -m benchmarks.run_all --from-dir /tmp/gpu/b16

Example:
  >>> parse_jamp("  bf16        linen    1834.2 img/s  step     69.8 ms  compile   7.9 s  "
  ...            "peak 20.26 GiB  XLA step 20.26 GiB  JAX-level 19.31 GiB  MFU 19.5%  "
  ...            "max batch 896  loss 5.169")["max_batch"]
  896
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from benchmarks import common

_NUM = r"([\d.]+|n/a)"
_JAMP_HEAD = re.compile(r"^jamp throughput: ViT-(\S+) (\d+)px batch (\d+) on (.+) \((\w+)\), "
                        r"jax (\S+)")
_TORCH_HEAD = re.compile(r"^torch baseline: ViT-(\S+) (\d+)px batch (\d+) on (.+), torch (\S+)")
_JAMP = re.compile(
    rf"^\s+(\S+)\s+(\w+)\s+{_NUM} img/s\s+step\s+{_NUM} ms\s+compile\s+{_NUM} s\s+"
    rf"peak {_NUM} GiB\s+XLA step {_NUM} GiB\s+JAX-level {_NUM} GiB\s+MFU {_NUM}%\s+"
    rf"max batch (\d+|n/a)\s+loss (\S+)")
_TORCH = re.compile(
    rf"^\s+(\S+)\s+(eager|compile)\s+{_NUM} img/s\s+step\s+{_NUM} ms\s+first step\s+{_NUM} s"
    rf"\s+peak {_NUM} GiB\s+MFU {_NUM}%\s+max batch (\d+|n/a)\s+loss (\S+)")


def _f(text: str, scale: float = 1.0) -> float | None:
    return None if text == "n/a" else float(text) * scale


def _gib(text: str) -> int | None:
    value = _f(text, 2**30)
    return None if value is None else int(value)


def parse_jamp(line: str) -> dict[str, Any] | None:
    """One jamp measurement line as ``benchmarks.throughput``'s row (``None``: not one)."""
    m = _JAMP.match(line)
    if not m:
        return None
    mode, flax, ips, ms, compile_s, peak, xla, jax_level, mfu, max_batch, loss = m.groups()
    return dict(framework="jamp", flax=flax, mode=mode, images_per_sec=_f(ips),
                step_ms=_f(ms), compile_s=_f(compile_s), peak_bytes=_gib(peak),
                xla_step_bytes=_gib(xla), jax_memory={"total_bytes": _gib(jax_level)},
                mfu=_f(mfu, 0.01), max_batch=None if max_batch == "n/a" else int(max_batch),
                final_loss=float(loss), loss_finite=loss not in ("nan", "inf"),
                steps_skipped=None)


def parse_torch(line: str) -> dict[str, Any] | None:
    """One PyTorch measurement line as ``benchmarks.torch_amp``'s row (``None``: not one)."""
    m = _TORCH.match(line)
    if not m:
        return None
    mode, how, ips, ms, first_s, peak, mfu, max_batch, loss = m.groups()
    return dict(framework="torch", mode=mode, compiled=how == "compile",
                images_per_sec=_f(ips), step_ms=_f(ms), first_step_s=_f(first_s),
                peak_bytes=_gib(peak), mfu=_f(mfu, 0.01),
                max_batch=None if max_batch == "n/a" else int(max_batch), final_loss=float(loss))


def parse(log: str) -> list[dict[str, Any]]:
    """The processes of a GPU-round log: each with its header fields and its rows."""
    runs: list[dict[str, Any]] = []
    for line in log.splitlines():
        if m := _JAMP_HEAD.match(line):
            variant, size, batch, kind, platform, jax = m.groups()
            runs.append(dict(framework="jamp", variant=variant, image_size=int(size),
                             batch=int(batch), device_kind=kind, platform=platform, jax=jax,
                             results=[]))
        elif m := _TORCH_HEAD.match(line):
            variant, size, batch, kind, torch = m.groups()
            runs.append(dict(framework="torch", variant=variant, image_size=int(size),
                             batch=int(batch), device_kind=kind, platform="cuda", torch=torch,
                             results=[]))
        elif runs and (row := (parse_jamp if runs[-1]["framework"] == "jamp"
                               else parse_torch)(line)):
            runs[-1]["results"].append(row)
    return [r for r in runs if r["results"]]


def trainer_rates(log: str) -> dict[str, Any]:
    """The trainer's progress-line images/s per logged window and its summary throughput."""
    windows = [int(x) for x in re.findall(r"img_s=(\d+)", log)]
    summary = re.search(r"throughput\s+([\d,]+) images/s", log)
    return dict(window_images_per_sec=windows,
                summary_images_per_sec=int(summary[1].replace(",", "")) if summary else None)


def write(runs: list[dict[str, Any]], out: Path, steps: int, warmup: int,
          timm: str | None = None) -> list[Path]:
    """Writes each measurement process's JSON under ``out/<variant>/``; max-batch runs (a
    second process of the same mode) fold their largest batch into the first run's row."""
    written: list[Path] = []
    first: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        args = argparse.Namespace(variant=run["variant"], image_size=run["image_size"],
                                  patch_size=int(re.sub(r"\D", "", run["variant"]) or 16),
                                  num_classes=1000, num_layers=None)
        flops = common.train_flops(args)
        device = dict(platform="gpu" if run["framework"] == "jamp" else "cuda",
                      device_kind=run["device_kind"],
                      peak_tflops=common.peak_tflops(run["device_kind"]),
                      jax=run.get("jax"), optax=None, torch=run.get("torch"),
                      machine={"cpus": 16, "load_avg_1m": "n/a"})
        size = {"ti": "tiny", "s": "small", "b": "base", "l": "large"}[
            re.sub(r"\d", "", run["variant"])]
        for row in run["results"]:
            if run["framework"] == "torch":
                row["impl"] = (f"timm {timm} vit_{size}_patch{args.patch_size}_"
                               f"{run['image_size']}" if timm else "unknown")
            row.update(batch=run["batch"], flops_per_image=flops,
                       max_batch_method=("XLA compile-time memory analysis, confirmed by "
                                         "running 2 steps" if run["framework"] == "jamp" else
                                         "eager steps until CUDA OOM"))
            key = (run["framework"], run["variant"], row["mode"], row.get("compiled"))
            if key in first and row["max_batch"] is not None:
                first[key]["max_batch"] = row["max_batch"]
                continue
            first.setdefault(key, row)
        run["config"] = dict(variant=run["variant"], image_size=run["image_size"],
                             batch=run["batch"], steps=steps, warmup=warmup, remat=False,
                             num_classes=1000, num_layers=None)
        run["device"] = device
    for run in runs:  # second pass: the max-batch processes have folded in
        rows = [r for r in run["results"]
                if first.get((run["framework"], run["variant"], r["mode"], r.get("compiled")))
                is r]
        if not rows:
            continue
        name = f"{run['framework']}-{'-'.join(dict.fromkeys(r['mode'] for r in rows))}"
        path = out / run["variant"] / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(benchmark="throughput", framework=run["framework"],
                                        device=run["device"], config=run["config"],
                                        results=rows), indent=1))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """Parses a GPU-round log and writes the per-process JSON files."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    text = Path(args.log).read_text()
    timm = re.search(r"\btimm (\S+)", text)
    for path in write(parse(text), Path(args.out), args.steps, args.warmup,
                      timm[1] if timm else None):
        print("wrote", path)
    rates = trainer_rates(text)
    (Path(args.out) / "trainer.json").write_text(json.dumps(rates))
    print("trainer", rates)


if __name__ == "__main__":
    main()

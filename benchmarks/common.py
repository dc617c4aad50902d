"""Helpers shared by the benchmark scripts: ViT FLOPs, device peaks, timing, batch search.

Nothing here imports JAX or PyTorch, so the JAX and PyTorch benchmarks can both
use it (and the PyTorch one runs without loading JAX).

Example:
  >>> from benchmarks import common
  >>> round(common.vit_macs("b", image_size=224) / 1e9, 1)   # ViT-B/16: 17.6 GMAC/image
  17.6
  >>> common.peak_tflops("NVIDIA H100 80GB HBM3")
  989.0
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the benchmarks write their committed results."""

VIT_SIZES: dict[str, dict[str, int]] = {
    "ti": dict(hidden_size=192, num_layers=12, num_heads=3, mlp_dim=768),
    "s": dict(hidden_size=384, num_layers=12, num_heads=6, mlp_dim=1536),
    "b": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "l": dict(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096),
}
"""ViT sizes, as ``jamp.models.vit.VARIANTS`` (a test keeps the two equal)."""

# Dense half-precision (bf16/fp16) tensor-core peaks, TFLOP/s, matched in order
# against the lower-cased device name. MFU is always relative to this peak.
_PEAKS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756.0),
    ("h100", 989.0),
    ("h200", 989.0),
    ("a100", 312.0),
)


def parse_variant(name: str, patch_size: int = 16) -> tuple[str, int]:
    """Splits ``"b16"``/``"vit-s16"``/``"ti"`` into ``(size, patch_size)``.

    Example:
      >>> from benchmarks.common import parse_variant
      >>> parse_variant("b16"), parse_variant("ti", 4)
      (('b', 16), ('ti', 4))
    """
    text = name.lower().removeprefix("vit-").removeprefix("vit_")
    size = text.rstrip("0123456789")
    if size not in VIT_SIZES:
        raise ValueError(f"Unknown ViT variant {name!r}: use one of {', '.join(VIT_SIZES)} "
                         "optionally followed by the patch size (e.g. 'b16').")
    return size, int(text[len(size):]) if text[len(size):] else patch_size


def vit_dims(variant: str, **overrides: int) -> dict[str, int]:
    """Model dimensions of a ViT size with optional overrides (``num_layers=1``...).

    Example:
      >>> from benchmarks.common import vit_dims
      >>> vit_dims("s16", num_layers=2)["num_layers"]
      2
    """
    size, _ = parse_variant(variant)
    return {**VIT_SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}


def vit_macs(variant: str, *, image_size: int, patch_size: int | None = None,
             num_classes: int = 1000, channels: int = 3, **overrides: int) -> float:
    """Multiply-accumulates of one ViT forward pass for one image (analytic).

    Counts the matmuls: patch embedding, per block Q/K/V/out projections
    (``4 S D^2``), attention scores and weighted values (``2 S^2 D``), MLP
    (``2 S D M``), and the head; with ``S = (image/patch)^2 + 1`` tokens.
    Norms, softmax and GELU are left out (they are not tensor-core work).

    Example:
      >>> from benchmarks.common import vit_macs
      >>> round(vit_macs("s16", image_size=224) / 1e9, 2)
      4.6
    """
    _, default_patch = parse_variant(variant)
    patch = patch_size or default_patch
    d = vit_dims(variant, **overrides)
    hidden, mlp, layers = d["hidden_size"], d["mlp_dim"], d["num_layers"]
    patches = (image_size // patch) ** 2
    seq = patches + 1
    embed = patches * patch * patch * channels * hidden
    block = 4 * seq * hidden**2 + 2 * seq**2 * hidden + 2 * seq * hidden * mlp
    return float(embed + layers * block + hidden * num_classes)


def train_flops_per_image(variant: str, **kwargs: Any) -> float:
    """FLOPs of one training step per image: 3 passes (fwd + 2x bwd) x 2 FLOPs per MAC.

    Example:
      >>> from benchmarks.common import train_flops_per_image
      >>> round(train_flops_per_image("b16", image_size=224) / 1e9)
      105
    """
    return 6.0 * vit_macs(variant, **kwargs)


def peak_tflops(device_kind: str | None) -> float | None:
    """Dense bf16/fp16 peak of a known accelerator, TFLOP/s; ``None`` if unknown (CPU).

    Example:
      >>> from benchmarks.common import peak_tflops
      >>> peak_tflops("NVIDIA A100-SXM4-80GB"), peak_tflops("cpu")
      (312.0, None)
    """
    kind = (device_kind or "").lower()
    for key, tflops in _PEAKS:
        if key in kind:
            return tflops
    return None


def mfu(images_per_sec: float | None, flops_per_image: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak (``None`` if unknown).

    Example:
      >>> from benchmarks.common import mfu
      >>> round(mfu(4000.0, 105.4e9, 989.0), 3)
      0.426
    """
    if images_per_sec is None or peak is None:
        return None
    return images_per_sec * flops_per_image / (peak * 1e12)


def time_steps(step: Callable[[], Any], *, warmup: int, steps: int) -> list[float]:
    """Runs ``step`` ``warmup + steps`` times; returns the wall times of the timed ones (s).

    ``step`` must block until its work is done (``block_until_ready`` /
    ``torch.cuda.synchronize``) so each time is the step's own.

    Example:
      >>> from benchmarks.common import time_steps
      >>> len(time_steps(lambda: None, warmup=2, steps=3))
      3
    """
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def summarize_times(times: list[float], batch: int) -> dict[str, float]:
    """Median step time (ms), its spread (p10/p90) and images/s from the median.

    Example:
      >>> from benchmarks.common import summarize_times
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
    """The largest multiple of ``granularity`` for which ``fits(batch)`` holds.

    Walks away from ``start`` (a guess) in steps that double (the first is
    ``step``, by default an eighth of ``start``) until the answer changes, then
    bisects; assumes ``fits`` is monotone. With a good guess and
    ``step=granularity`` it takes two calls. Returns ``None`` when not even
    ``granularity`` fits.

    Example:
      >>> from benchmarks.common import largest_batch
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


def slug(text: str) -> str:
    """A file-name-safe, lower-case form of a device name.

    Example:
      >>> from benchmarks.common import slug
      >>> slug("NVIDIA H100 80GB HBM3")
      'nvidia-h100-80gb-hbm3'
    """
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def today() -> str:
    """Today's date as ``YYYY-MM-DD`` (UTC), for result file names."""
    return datetime.datetime.now(datetime.UTC).date().isoformat()


def machine() -> dict[str, Any]:
    """The host: processor, CPU count, OS, 1-minute load average."""
    return dict(processor=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                platform=platform.platform(), python=platform.python_version(),
                load_avg_1m=round(os.getloadavg()[0], 2))


def command(script: str, argv: list[str] | None) -> str:
    """The command line that reproduces a run, for the results files.

    Example:
      >>> from benchmarks.common import command
      >>> command("memory.py", []), command("memory.py", ["--batch", "2"])
      ('python benchmarks/memory.py', 'python benchmarks/memory.py --batch 2')
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"benchmarks/{script}", *args])


def write_json(path: str | Path, obj: Any) -> Path:
    """Writes ``obj`` as indented JSON (creating folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    return path


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """Formats a number, or ``"n/a"`` for ``None``/NaN.

    Example:
      >>> from benchmarks.common import fmt
      >>> fmt(1234.5, ",.0f"), fmt(None)
      ('1,234', 'n/a')
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def gib(nbytes: int | None) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB), ``"n/a"`` for ``None``.

    Example:
      >>> from benchmarks.common import gib
      >>> gib(3 * 2**30), gib(5 * 2**20)
      ('3.00 GiB', '5.0 MiB')
    """
    if nbytes is not None and nbytes < 2**30:
        return fmt(nbytes / 2**20, ".1f", " MiB")
    return fmt(None if nbytes is None else nbytes / 2**30, ".2f", " GiB")


def vit_label(variant: str, patch_size: int | None = None) -> str:
    """The usual name of a ViT variant.

    Example:
      >>> from benchmarks.common import vit_label
      >>> vit_label("ti4"), vit_label("b", 16)
      ('ViT-Ti/4', 'ViT-B/16')
    """
    size, patch = parse_variant(variant, patch_size or 16)
    return f"ViT-{'Ti' if size == 'ti' else size.upper()}/{patch}"


def accuracy_cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Test accuracy and its difference from the fp32 run, as table cells.

    Example:
      >>> from benchmarks.common import accuracy_cells
      >>> accuracy_cells({"test_accuracy": 0.95}, [{"mode": "fp32", "test_accuracy": 0.96}])
      ('95.00%', '-1.00 pt')
    """
    base = next((r["test_accuracy"] for r in rows if r["mode"] == "fp32"), None)
    acc = row["test_accuracy"]
    if acc is None:
        return "n/a", "—"
    delta = "—" if base is None else f"{100 * (acc - base):+.2f} pt"
    return f"{100 * acc:.2f}%", delta

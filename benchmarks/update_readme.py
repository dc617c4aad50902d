"""Regenerates the README's performance and accuracy tables from ``benchmarks/results/``.

Only the text between ``<!-- perf-table:start/end -->`` and ``<!-- accuracy-table:start/end
-->`` changes, rendered from the newest committed results of each kind and device (the
loss-scale tables from the ``loss_scale_overhead``/``loss_scale_vit`` files of the retired
``loss_scale_overhead`` benchmark; ``scaler_comparison`` measures it now), so the README's
numbers are never typed by hand. ``--check`` exits 1 when the README is stale.

Usage::

  python -m benchmarks.update_readme            # rewrite the two blocks of README.md
  python -m benchmarks.update_readme --check    # CI-style: is README.md up to date?

Example:
  >>> replace_block("a <!-- x:start -->old<!-- x:end --> b", "x", "new\\n")
  'a <!-- x:start -->\\nnew\\n<!-- x:end --> b'
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks import common
from jamp.models import sizes

README = Path(__file__).resolve().parents[1] / "README.md"
_NAME = re.compile(
    r"^(?P<kind>[a-z_]+)-(?P<device>.+)-(?P<date>\d{4}-\d{2}-\d{2})\.(?P<ext>json|md)$")


def latest(results: Path, kind: str, ext: str = "json") -> dict[str, Path]:
    """The newest ``<kind>-<device>-<date>.<ext>`` per device, GPUs before CPU.

    Example:
      >>> import tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> for n in ("memory-cpu-2026-01-01.json", "memory-cpu-2026-02-01.json"):
      ...     _ = (d / n).write_text("{}")
      >>> latest(d, "memory")["cpu"].name
      'memory-cpu-2026-02-01.json'
    """
    found: dict[str, tuple[str, Path]] = {}
    for path in sorted(results.glob(f"{kind}-*.{ext}")):
        m = _NAME.match(path.name)
        if m and m["kind"] == kind and m["date"] >= found.get(m["device"], ("", path))[0]:
            found[m["device"]] = (m["date"], path)
    order = sorted(found, key=lambda device: (device == "cpu", device))
    return {device: found[device][1] for device in order}


def _source(path: Path, result: dict | None = None) -> str:
    """A link to a results file's ``.md`` and, from its JSON, the command that wrote it."""
    md = path.with_suffix(".md")
    link = f"[`{md.name}`](benchmarks/results/{md.name})"
    return link if result is None else f"{link}, `{result['command'].strip()}`"


def _throughput_section(path: Path) -> list[str]:
    """A compact jamp-vs-PyTorch table for one device's run_all result."""
    r = json.loads(path.read_text())
    d, c, fmt = r["device"], r["config"], common.fmt
    cpu = d["platform"] == "cpu"
    lines = [f"**{sizes.vit_label(c['variant'])}, {c['image_size']}px, batch {c['batch']}, "
             f"AdamW, on {d['device_kind']}** ({r['date']}; {_source(path, r)})", ""]
    if cpu:
        lines += ["CPU run: XLA:CPU and PyTorch on CPU upcast float16/bfloat16, so this shows "
                  "that the benchmark runs end to end, not what mixed precision gains; peak "
                  "memory, max batch and MFU need a GPU run.", ""]
    lines += common.table(
        "mode | jamp img/s | PyTorch eager img/s | PyTorch compile img/s | jamp / eager "
        "| jamp / compile | peak memory | vs fp32 | max batch | MFU",
        ([x["mode"], *(fmt(x[f"{k}_images_per_sec"], ",.1f") for k in
                       ("jamp", "torch_eager", "torch_compile")),
          fmt(x["vs_torch_eager"], ".2f", "x"), fmt(x["vs_torch_compile"], ".2f", "x"),
          common.gib(x["jamp_peak_bytes"]), fmt(x["jamp_peak_vs_fp32"], ".2f", "x"),
          fmt(x["jamp_max_batch"], "d"), fmt(x["jamp_mfu"], ".1%")] for x in r["rows"]))
    targets = ("not applicable to a CPU run (listed in the results file)" if cpu else
               "; ".join(f"{t['target']}: {t['verdict']}" for t in r["targets"]))
    lines += ["", f"Targets: {targets}.", ""]
    if r.get("plot"):
        lines += [f"![jamp vs PyTorch on {d['device_kind']}](benchmarks/results/{r['plot']})", ""]
    return lines


def _memory_section(path: Path) -> list[str]:
    """Totals per mode and model from a ``benchmarks.memory`` result, with ratios against fp32."""
    r = json.loads(path.read_text())
    models = list(dict.fromkeys(row["model"] for row in r["results"]))
    cell = {(row["model"], row["mode"]): row for row in r["results"]}
    total = lambda row: ("—" if row is None else f"{common.gib(row['total_bytes'])} "
                                                 f"({common.fmt(row['total_ratio'], '.2f', 'x')})")
    return [f"**JAX-level memory of a training step** (`jamp.memory_report`: params + grads + "
            f"AdamW state + residuals; {r['image_size']}px, batch {r['batch']}; "
            f"{_source(path, r)})", "",
            *common.table("mode | " + " | ".join(models),
                          ([mode, *(total(cell.get((model, mode))) for model in models)]
                           for mode in dict.fromkeys(row["mode"] for row in r["results"]))), ""]


def _loss_scale_section(path: Path) -> list[str]:
    """The loss-scale overhead table rows, copied from its results file."""
    rows = [line for line in path.read_text().splitlines() if re.match(r"^\| \d+ \|", line)]
    return [f"**DynamicLossScale(adamw) vs adamw step time** ({_source(path)})", "",
            *common.table("batch | params | adamw ms/step | DynamicLossScale(adamw) ms/step "
                          "| ratio | overhead", [])] + rows + [""]


def _loss_scale_vit_section(path: Path) -> list[str]:
    """The loss-scale overhead on a ViT train step (``loss_scale_vit`` results)."""
    r = json.loads(path.read_text())
    return [f"**The same on a ViT train step** ({_source(path, r)})", "",
            *common.table("model | batch | params | adamw ms/step | DynamicLossScale(adamw) "
                          "ms/step | ratio | overhead", (
                              [f"{r['model']}, {r['image_size']}px, {r['platform']}", x["batch"],
                               x["n_params"], f"{x['plain_ms']:.1f}", f"{x['scaled_ms']:.1f}",
                               f"{x['ratio']:.4f}", f"{x['overhead_pct']:+.2f}%"]
                              for x in r.get("rows", [r]))), ""]


def _perf_block(results: Path) -> str:
    """The text of the perf-table block."""
    lines = ["Generated by `python -m benchmarks.update_readme` from `benchmarks/results/`; "
             "reproduce the comparison with `python -m benchmarks.run_all` (defaults: ViT-B/16, "
             "224px, batch 128, every mode, PyTorch eager and `torch.compile`).", ""]
    if not latest(results, "throughput"):
        lines += ["No throughput results yet.", ""]
    for kind, ext, section in (("throughput", "json", _throughput_section),
                               ("memory", "json", _memory_section),
                               ("loss_scale_overhead", "md", _loss_scale_section),
                               ("loss_scale_vit", "json", _loss_scale_vit_section)):
        for path in latest(results, kind, ext).values():
            lines += section(path)
    return "\n".join(lines).rstrip() + "\n"


_FIRST_COMMAND = dict(mode="fp16", framework="linen", seed=0)
"""The run the README's first command (``jamp.train --config vit_fp16``) trains."""

NNX_VS_LINEN = (
    "NNX starts from linen's initial weights and its steps equal linen's bit for bit, but "
    "for one sum: `optax.clip_by_global_norm` (`grad_clip_norm` 1.0) adds the parameters' "
    "squared norms in tree order, and NNX's parameter names (`attention`, `mlp`, `norm1`) "
    "sort differently from linen's (`LayerNorm_0`, `MlpBlock_0`, `SelfAttention_0`). The "
    "first clipped step whose norm rounds differently in the last bit (step 12 of a 30-step "
    "fp32 run; none of 30 without clipping) starts a run as different as another seed "
    "([`accuracy_nnx_parity-cpu-2026-11-26.md`]"
    "(benchmarks/results/accuracy_nnx_parity-cpu-2026-11-26.md)). Compare the two by their "
    "means.")
"""Why the linen and NNX rows differ (measured by ``benchmarks/accuracy_nnx_parity.py``)."""

FP16_VS_FP32 = (
    "fp16 against fp32, run from the same weights and batches: no gradient element underflows "
    "at the run's loss scale, fp16's gradients are 2-6x closer to fp32's than bf16's, and over "
    "six same-seed pairs fp16's accuracy is +0.23 ± 0.85 pt from fp32's, while a last-bit "
    "perturbation (the NNX run of the same seed) moves fp32 by up to 2.2 pt "
    "([`fp16_gap-cpu-2026-11-26.md`](benchmarks/results/fp16_gap-cpu-2026-11-26.md), "
    "`python -m benchmarks.fp16_gap`).")
"""What the fp16 - fp32 differences are (measured by ``benchmarks/fp16_gap.py``)."""


def _command(command: str) -> str:
    """A command that wrote a result, less its ``--out-dir`` (where it was written) and
    ``--keep`` (the earlier file it added to: its runs' commands are named too).

    Example:
      >>> _command("python -m benchmarks.accuracy --seeds 0 --keep /tmp/a.json --out-dir /tmp/a")
      'python -m benchmarks.accuracy --seeds 0'
    """
    return re.sub(r"\s+--(?:out-dir|keep)(?:=|\s+)\S+", "", command).strip()


def _commands(result: dict) -> str:
    """The commands that trained a result's runs, in order, as Markdown code."""
    kept = [x["kept_command"] for x in result["results"] if x.get("kept_command")]
    return ", then ".join(f"`{_command(c)}`" for c in dict.fromkeys([*kept, result["command"]]))


def _accuracy_block(results: Path) -> str:
    """The text of the accuracy-table block: per mode and framework, each seed's test
    accuracy, mean ± std, the mean's difference from fp32 and the test loss."""
    lines = []
    for path in latest(results, "accuracy").values():
        r = json.loads(path.read_text())
        c, rows = r["config"], r["results"]
        if "aggregate" not in r:  # a results file from before --seeds
            from benchmarks.accuracy import aggregate
            r["aggregate"] = aggregate(rows)
        agg, seeds = r["aggregate"], sorted({x.get("seed") for x in rows})
        md = path.with_suffix(".md")
        lines += [
            f"**Accuracy parity**: {c['model']} ({c['layers']}) on the embedded {c['dataset']}, "
            f"batch {c['batch_size']}, {c['num_epochs']} epochs, seeds "
            f"{', '.join(map(str, seeds))} (a — cell: not run) on {r['device']} "
            f"({r['date']}; [`{md.name}`](benchmarks/results/{md.name}): {_commands(r)}). "
            "Mean ± sample standard deviation over the seeds; the test split has 360 images "
            "(one image = 0.28 pt). Generated by `python -m benchmarks.update_readme`.", ""]
        first = next((x for x in rows if all(x.get(k) == v for k, v in _FIRST_COMMAND.items())),
                     None)
        if first is not None and first["test_accuracy"] is not None:
            commit = (first.get("commit") or "unknown")[:7]
            lines += [
                f"The first command above, `jamp.train --config vit_fp16`, is the "
                f"{first['mode']} / {first['framework']} row's seed {first['seed']}: at commit "
                f"`{commit}` on this CPU its summary prints `test accuracy   "
                f"{100 * first['test_accuracy']:.2f}%  (loss {first['test_loss']:.4f})`. Add "
                "`--config.seed=1` for the next column; another CPU (another XLA:CPU code "
                "path) gives another run within the row's spread.", ""]
        fp32 = {(x.get("framework", "linen"), x.get("seed")): x["test_accuracy"] for x in rows
                 if x["mode"] == "fp32" and x["test_accuracy"] is not None}
        cell = lambda a, s: next((common.fmt(None if v is None else 100 * v, ".2f")
                                  for t, v in zip(a["seeds"], a["accuracy"], strict=True)
                                  if t == s), "—")
        lines += [*common.table(
            "mode | framework | " + " | ".join(f"seed {s}" for s in seeds)
            + " | mean ± std (%) | mean vs fp32 (same seeds) | test loss, mean ± std "
            "| steps skipped per seed | outcome", (
                [a["mode"], a["framework"], *(cell(a, s) for s in seeds),
                 _pm(a["accuracy_mean"], a["accuracy_std"] if len(a["seeds"]) > 1 else None),
                 _vs_fp32(a, fp32),
                 _pm(a["loss_mean"], a["loss_std"] if len(a["seeds"]) > 1 else None, 1.0,
                     ".3f"),
                 " / ".join(map(str, a["steps_skipped"])),
                 ", ".join(o.split(":")[0] for o in a["outcomes"])] for a in agg)), "",
            NNX_VS_LINEN, "", FP16_VS_FP32, ""]
        if any(x["status"] != "ok" for x in rows):
            lines += ["Diverged runs were stopped by the trainer's divergence guard; their "
                      "accuracy is the last evaluation before the stop.", ""]
        if r.get("plot"):
            lines += [f"![{r['plot_mode']} training run](benchmarks/results/{r['plot']})", ""]
    return "\n".join(lines or ["No accuracy results yet."]).rstrip() + "\n"


def _vs_fp32(row: dict, fp32: dict) -> str:
    """A row's mean accuracy minus fp32's mean over the same seeds and framework, as a cell.

    Example:
      >>> row = dict(framework="linen", seeds=[0], accuracy=[0.95], accuracy_mean=0.95)
      >>> _vs_fp32(row, {("linen", 0): 0.96, ("linen", 1): 0.99}), _vs_fp32(row, {})
      ('-1.00 pt', '—')
    """
    seeds = [s for s, a in zip(row["seeds"], row["accuracy"], strict=True) if a is not None]
    base = [fp32.get((row["framework"], s)) for s in seeds]
    if not seeds or None in base:
        return "—"
    mean = sum(a for a in row["accuracy"] if a is not None) / len(seeds)
    return f"{100 * (mean - sum(base) / len(base)):+.2f} pt"


def _pm(mean: float | None, std: float | None, scale: float = 100.0, spec: str = ".2f") -> str:
    """``mean ± std`` as a table cell (times ``scale``); the mean alone without a std.

    Example:
      >>> _pm(0.9769, 0.0032), _pm(0.9769, None), _pm(None, None)
      ('97.69 ± 0.32', '97.69', 'n/a')
    """
    if mean is None or mean != mean:  # None or NaN
        return "n/a"
    return f"{scale * mean:{spec}}" + ("" if std is None else f" ± {scale * std:{spec}}")


def replace_block(text: str, marker: str, content: str) -> str:
    """Replaces what lies between ``<!-- marker:start -->`` and ``<!-- marker:end -->``."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"README has no {start} ... {end} markers (in that order).")
    return text[:i + len(start)] + "\n" + content + text[j:]


def render(readme_text: str, results: Path = common.RESULTS) -> str:
    """The README text with both blocks regenerated from ``results``."""
    text = replace_block(readme_text, "perf-table", _perf_block(results))
    return replace_block(text, "accuracy-table", _accuracy_block(results))


def main(argv: list[str] | None = None) -> int:
    """Rewrites (or with ``--check`` verifies) the README blocks; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", default=str(README))
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text()
    new = render(old)
    if args.check:
        print(f"{path} is {'up to date' if new == old else 'out of date'}"
              + ("" if new == old else ": run python -m benchmarks.update_readme"))
        return int(new != old)
    if new != old:
        path.write_text(new)
    print(f"{'updated' if new != old else 'unchanged'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

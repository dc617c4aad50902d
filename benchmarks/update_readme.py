"""Regenerates the README's performance and accuracy tables from ``benchmarks/results/``.

Only the text between ``<!-- perf-table:start -->``/``<!-- perf-table:end -->`` and
``<!-- accuracy-table:start -->``/``<!-- accuracy-table:end -->`` changes; it is
rendered from the committed JSON results (the newest file of each kind and
device) and the MLP loss-scale overhead table, so the README's numbers are never
typed by hand. ``--check`` changes nothing and exits 1 when the README is stale.

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


def current_command(command: str) -> str:
    """A results file's command as it runs now: ``python -m benchmarks.<name> ...``.

    Results written before the benchmarks were a package name the script's file;
    the ViT loss-scale script is now ``loss_scale_overhead --model vit``.

    Example:
      >>> current_command("python benchmarks/memory.py --batch 2")
      'python -m benchmarks.memory --batch 2'
      >>> current_command("python benchmarks/loss_scale_vit.py ")
      'python -m benchmarks.loss_scale_overhead --model vit'
    """
    m = re.match(r"python benchmarks/(\w+)\.py\b", command.strip())
    if m is None:
        return command.strip()
    name = "loss_scale_overhead --model vit" if m[1] == "loss_scale_vit" else m[1]
    return f"python -m benchmarks.{name}{command.strip()[m.end():]}"


def _cmd(result: dict) -> str:
    return f"`{current_command(result['command'])}`"


def _link(path: Path) -> str:
    return f"[`{path.name}`](benchmarks/results/{path.name})"


def throughput_section(path: Path) -> list[str]:
    """A compact jamp-vs-PyTorch table for one device's run_all result."""
    r = json.loads(path.read_text())
    d, c = r["device"], r["config"]
    cpu = d["platform"] == "cpu"
    lines = [
        f"**{sizes.vit_label(c['variant'])}, {c['image_size']}px, batch {c['batch']}, AdamW, "
        f"on {d['device_kind']}** ({r['date']}; {_link(path.with_suffix('.md'))}, "
        f"{_cmd(r)})", "",
    ]
    if cpu:
        lines += ["CPU run: XLA:CPU and PyTorch on CPU upcast float16/bfloat16, so this shows "
                  "that the benchmark runs end to end, not what mixed precision gains; peak "
                  "memory, max batch and MFU need a GPU run.", ""]
    lines += [
        "| mode | jamp img/s | PyTorch eager img/s | PyTorch compile img/s | jamp / eager "
        "| jamp / compile | peak memory | vs fp32 | max batch | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['mode']} | {common.fmt(row['jamp_images_per_sec'], ',.1f')} "
            f"| {common.fmt(row['torch_eager_images_per_sec'], ',.1f')} "
            f"| {common.fmt(row['torch_compile_images_per_sec'], ',.1f')} "
            f"| {common.fmt(row['vs_torch_eager'], '.2f', 'x')} "
            f"| {common.fmt(row['vs_torch_compile'], '.2f', 'x')} "
            f"| {common.gib(row['jamp_peak_bytes'])} "
            f"| {common.fmt(row['jamp_peak_vs_fp32'], '.2f', 'x')} "
            f"| {common.fmt(row['jamp_max_batch'], 'd')} | {common.fmt(row['jamp_mfu'], '.1%')} |")
    if cpu:
        lines += ["", "Targets: not applicable to a CPU run (listed in the results file).", ""]
    else:
        met = [f"{t['target']}: {t['verdict']}" for t in r["targets"]]
        lines += ["", "Targets: " + "; ".join(met) + ".", ""]
    if r.get("plot"):
        lines += [f"![jamp vs PyTorch on {d['device_kind']}](benchmarks/results/{r['plot']})", ""]
    return lines


def memory_section(path: Path) -> list[str]:
    """Totals per mode and model from a ``benchmarks.memory`` result, with ratios against fp32."""
    r = json.loads(path.read_text())
    models = list(dict.fromkeys(row["model"] for row in r["results"]))
    modes = list(dict.fromkeys(row["mode"] for row in r["results"]))
    cell = {(row["model"], row["mode"]): row for row in r["results"]}
    lines = [
        f"**JAX-level memory of a training step** (`jamp.memory_report`: params + grads + "
        f"AdamW state + residuals; {r['image_size']}px, batch {r['batch']}; "
        f"{_link(path.with_suffix('.md'))}, {_cmd(r)})", "",
        "| mode | " + " | ".join(models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for mode in modes:
        cells = []
        for model in models:
            row = cell.get((model, mode))
            cells.append("—" if row is None else
                         f"{common.gib(row['total_bytes'])} "
                         f"({common.fmt(row['total_ratio'], '.2f', 'x')})")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines + [""]


def loss_scale_section(path: Path) -> list[str]:
    """The loss-scale overhead table rows, copied from its results file."""
    rows = [line for line in path.read_text().splitlines()
            if re.match(r"^\| \d+ \|", line)]
    lines = [f"**DynamicLossScale(adamw) vs adamw step time** ({_link(path)})", "",
             "| batch | params | adamw ms/step | DynamicLossScale(adamw) ms/step | ratio "
             "| overhead |", "|---|---|---|---|---|---|"]
    return lines + rows + [""]


def loss_scale_vit_section(path: Path) -> list[str]:
    """The loss-scale overhead on a ViT train step (``loss_scale_overhead --model vit``)."""
    r = json.loads(path.read_text())
    return [
        f"**The same on a ViT train step** ({_link(path.with_suffix('.md'))}, {_cmd(r)})",
        "", "| model | batch | params | adamw ms/step | DynamicLossScale(adamw) ms/step | ratio "
        "| overhead |", "|---|---|---|---|---|---|---|",
        *(f"| {r['model']}, {r['image_size']}px, {r['platform']} | {x['batch']} "
          f"| {x['n_params']} | {x['plain_ms']:.1f} | {x['scaled_ms']:.1f} | {x['ratio']:.4f} "
          f"| {x['overhead_pct']:+.2f}% |" for x in r.get("rows", [r])), ""]


def perf_block(results: Path) -> str:
    """The text of the perf-table block."""
    lines = ["Generated by `python -m benchmarks.update_readme` from `benchmarks/results/`; "
             "reproduce the comparison with `python -m benchmarks.run_all` (defaults: ViT-B/16, "
             "224px, batch 128, every mode, PyTorch eager and `torch.compile`).", ""]
    throughput = latest(results, "throughput")
    if not throughput:
        lines += ["No throughput results yet.", ""]
    for path in throughput.values():
        lines += throughput_section(path)
    for path in latest(results, "memory").values():
        lines += memory_section(path)
    for path in latest(results, "loss_scale_overhead", "md").values():
        lines += loss_scale_section(path)
    for path in latest(results, "loss_scale_vit").values():
        lines += loss_scale_vit_section(path)
    return "\n".join(lines).rstrip() + "\n"


def accuracy_block(results: Path) -> str:
    """The text of the accuracy-table block."""
    lines = []
    for path in latest(results, "accuracy").values():
        r = json.loads(path.read_text())
        c = r["config"]
        lines += [
            f"**Accuracy parity**: {c['model']} ({c['layers']}) on the embedded {c['dataset']}, "
            f"batch {c['batch_size']}, {c['num_epochs']} epochs, one run per mode on "
            f"{r['device']} ({r['date']}; {_link(path.with_suffix('.md'))}, {_cmd(r)}). "
            "Generated by `python -m benchmarks.update_readme`.", "",
            "| mode | framework | test accuracy | vs fp32 | NNX vs linen | steps | steps skipped "
            "| final loss scale | outcome |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for x in r["results"]:
            accuracy, delta = common.accuracy_cells(x, r["results"])
            lines.append(f"| {x['mode']} | {x.get('framework', 'linen')} | {accuracy} | {delta} "
                         f"| {common.nnx_vs_linen(x, r['results'])} | {x['steps']} "
                         f"| {x['steps_skipped']} | {x['final_loss_scale']:g} | {x['status']} |")
        lines.append("")
        if r.get("plot"):
            lines += [f"![{r['plot_mode']} training run](benchmarks/results/{r['plot']})", ""]
    if not lines:
        lines = ["No accuracy results yet."]
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, marker: str, content: str) -> str:
    """Replaces what lies between ``<!-- marker:start -->`` and ``<!-- marker:end -->``."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"README has no {start} ... {end} markers (in that order).")
    return text[:i + len(start)] + "\n" + content + text[j:]


def render(readme_text: str, results: Path = common.RESULTS) -> str:
    """The README text with both blocks regenerated from ``results``."""
    text = replace_block(readme_text, "perf-table", perf_block(results))
    return replace_block(text, "accuracy-table", accuracy_block(results))


def main(argv: list[str] | None = None) -> int:
    """Rewrites (or with ``--check`` verifies) the README blocks; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", default=str(README))
    ap.add_argument("--results", default=str(common.RESULTS))
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text()
    new = render(old, Path(args.results))
    if args.check:
        if new != old:
            print(f"{path} is out of date: run python -m benchmarks.update_readme")
            return 1
        print(f"{path} is up to date")
        return 0
    if new != old:
        path.write_text(new)
    print(f"{'updated' if new != old else 'unchanged'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

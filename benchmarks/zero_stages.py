"""ZeRO stages 0-3 on 8 fake CPU devices: per-device bytes, collectives, trajectories, step time.

For each (data, model, pipe) mesh, precision mode and ZeRO stage, a small ViT's jitted
train step (``jamp.train.jit_train_step``) is compiled and run for ``--steps`` steps on
the same digits batches. Per row: the per-device argument bytes of the compiled step
(``memory_analysis().argument_size_in_bytes`` less the batch and the rng key) against
the train state's shard bytes counted from shapes (``jamp.bytes_per_device``), jamp's
per-device figures (``jamp.memory.per_device_bytes``: params + grads + optimizer state +
master copy) against the issue's bytes-per-parameter arithmetic (stage 0's figures with
the optimizer state, then the gradients, then the parameters divided by the 'data' size),
the collectives of the compiled HLO per mesh axis and dtype, the trajectory against
stage 0 and the median step time. Then ViT-B/16 (224px, 1000 classes, fp16_naive + AdamW)
per device at data=8, counted from abstract shapes and compiled (nothing allocated).

Usage::

  python -m benchmarks.zero_stages                      # the full grid (~30 min on 2 cores)
  python -m benchmarks.zero_stages --meshes 8,1,1 --modes fp16 --stages 0,3 --no-write
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")  # 8 fake CPU devices, before JAX starts
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
              "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from benchmarks import common  # noqa: E402
from jamp import data, experiment, memory, parallel, train  # noqa: E402
from jamp.apply import apply_policy  # noqa: E402
from jamp.config import vit_config  # noqa: E402
from jamp.models import vit  # noqa: E402
from jamp.parallel import zero  # noqa: E402

OPS = ("all-gather", "reduce-scatter", "all-reduce")
_OP = re.compile(r"= (.*?) (all-gather|reduce-scatter|all-reduce)(?:-start)?\(.*?"
                 r"replica_groups=(\{\}|\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                 r"|mesh\[[^\]]*\] \{[^}]*\})")


def _group_axes(groups: str, mesh: jax.sharding.Mesh) -> str:
    """The mesh axes one replica group spans ('data', 'model+pipe', ...) from its HLO text.

    Example:
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
      >>> _group_axes("{{0,2,4,6},{1,3,5,7}}", mesh), _group_axes("[4,2]<=[8]", mesh)
      ('data', 'model')
      >>> _group_axes("mesh['axis_0'=1,'axis_1'=8] {'axis_1'}", mesh)
      'data+model'
      >>> _group_axes("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_2','axis_0'}", mesh)
      'data+model'
      >>> _group_axes("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", mesh)
      'data'
    """
    names, shape = mesh.axis_names, mesh.devices.shape
    if groups.startswith("mesh["):  # mesh['axis_0'=2,'axis_1'=4] {'axis_0'}: an iota mesh
        sizes = [int(n) for n in re.findall(r"=(\d+)", groups)]
        picked = {int(k) for k in re.findall(r"'axis_(\d+)'", groups.split("] ")[1])}
        group = np.arange(np.prod(sizes)).reshape(sizes)[tuple(
            slice(None) if k in picked else 0 for k in range(len(sizes)))].ravel()
    elif groups == "{}":
        group = np.arange(mesh.devices.size)
    elif groups.startswith("{{"):
        group = np.array([int(i) for i in groups[2:].split("}")[0].split(",")])
    else:
        g, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                     groups).groups()
        dims_ = [int(d) for d in dims.split(",")]
        ids = np.arange(np.prod(dims_)).reshape(dims_)
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
        group = ids.reshape([int(s) for s in g.split(",")])[0]
    coords = np.array(np.unravel_index(group, shape))
    return "+".join(n for n, c in zip(names, coords, strict=True) if len(set(c)) > 1) or "none"


def collectives(hlo: str, mesh: jax.sharding.Mesh) -> dict[str, dict[str, list[int]]]:
    """``{op: {"axes dtype": [count, bytes]}}`` of a compiled HLO text: bytes of the whole
    array (a reduce-scatter's input); an op in a loop body counted once.

    Example:
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
      >>> collectives("%r = f32[16]{0} reduce-scatter(%x), replica_groups={{0,2,4,6},{1,3,5,7}}",
      ...             mesh)["reduce-scatter"]
      {'data f32': [1, 256]}
    """
    out: dict[str, dict[str, list[int]]] = {op: {} for op in OPS}
    for result, op, groups in _OP.findall(hlo):
        axes = _group_axes(groups, mesh)
        factor = int(np.prod([mesh.shape.get(a, 1) for a in axes.split("+")]))
        sizes: dict[str, int] = {}
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            bits = re.search(r"\d+", dtype)
            item = max(1, int(bits.group()) // 8) if bits else 1
            sizes[dtype] = sizes.get(dtype, 0) + item * int(np.prod(
                [int(d) for d in dims.split(",") if d] or [1]))
        for dtype, nbytes in sizes.items():
            cell = out[op].setdefault(f"{axes} {dtype}", [0, 0])
            cell[0] += 1
            cell[1] += nbytes * (factor if op == "reduce-scatter" else 1)
    return out


def _config(mode: str, mesh: tuple[int, int, int], stage: int, args: argparse.Namespace,
            model: str = "ti") -> Any:
    config = vit_config(mode)
    fields = dict(model=model, hidden_size=args.hidden, mlp_dim=args.mlp, num_layers=args.layers,
                  num_heads=args.heads, batch_size=args.batch, zero_stage=stage, dropout_rate=0.0,
                  max_steps=args.steps, warmup_steps=0, pipeline_microbatches=2, progress=False)
    for key, value in fields.items():
        config[key] = value
    for axis, size in zip(("data", "model", "pipe"), mesh, strict=True):
        config.mesh[axis] = size
    return config


def _strip(tree: Any, mesh: jax.sharding.Mesh, split: bool = False) -> Any:
    """Abstract leaves sharded as at stage 0 (no 'data'), or (``split``) split over 'data'."""
    def one(a):
        spec = zero.without_data(a.sharding.spec)
        dim = zero.split_dim(a.shape, spec, mesh.shape["data"]) if split else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
            mesh, zero.with_data(spec, dim, len(a.shape))))
    return jax.tree_util.tree_map(one, tree)


def computed(abstract: Any, mesh: jax.sharding.Mesh, stage: int) -> dict[str, Any]:
    """jamp's per-device figures of ``abstract`` at ``stage`` and the issue's arithmetic."""
    grads = _strip(abstract.params, mesh, split=stage >= 2)
    pd = memory.per_device_bytes(abstract.params, abstract.opt_state,
                                 jax.tree_util.tree_map(lambda g: g.sharding, grads))
    p, g, o, m = dataclasses.astuple(memory.per_device_bytes(
        _strip(abstract.params, mesh), _strip(abstract.opt_state, mesh)))[:4]
    n = mesh.shape["data"]
    arith = [p + g + o + m, p + g + (o + m) / n, p + (g + o + m) / n, (p + g + o + m) / n][stage]
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(abstract.params))
    return dict(state_bytes=memory.bytes_per_device(abstract), per_device=pd.as_dict(),
                arithmetic_bytes=arith, params=count, bytes_per_param=pd.total / count)


def run_case(mode: str, mesh_: tuple[int, int, int], stage: int, args: argparse.Namespace,
             batches: list[dict[str, np.ndarray]]) -> tuple[dict[str, Any], Any]:
    """One mesh/mode/stage: compiled, run ``len(batches)`` steps; (row, final params)."""
    exp = experiment.build_experiment(_config(mode, mesh_, stage, args))
    rng, mesh = jax.random.key(0), exp.mesh
    with jax.set_mesh(mesh):
        abstract, shardings = experiment.state_shardings(exp, rng)
        state = experiment.init_state(exp, rng, shardings)
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        put = lambda b: {k: jax.device_put(v, parallel.batch_sharding(mesh)) for k, v in b.items()}
        device_batches = [put(b) for b in batches]
        t0 = time.perf_counter()
        step = train.jit_train_step(exp, shardings, abstract).lower(
            state, device_batches[0], rng).compile()
        compile_s = time.perf_counter() - t0
        times, metrics = [], []
        for i, batch in enumerate(device_batches):
            t0 = time.perf_counter()
            state, m = jax.block_until_ready(step(state, batch, jax.random.fold_in(rng, i)))
            times.append(time.perf_counter() - t0)
            metrics.append({k: float(m[k]) for k in ("loss", "loss_scale", "grad_finite")})
    extra = memory.bytes_per_device(device_batches[0])  # the rng key is unused: pruned
    row = dict(mesh="x".join(map(str, mesh_)), mode=mode, stage=stage, compile_s=compile_s,
               measured_bytes=step.memory_analysis().argument_size_in_bytes - extra,
               **computed(abstract, mesh, stage), collectives=collectives(step.as_text(), mesh),
               ms=1e3 * statistics.median(times[1:] or times), metrics=metrics)
    return row, jax.device_get(state.params)


def compare(row: dict[str, Any], base: dict[str, Any], params: Any, base_params: Any) -> None:
    """Adds the trajectory and time comparison of ``row`` with stage 0's ``base`` to ``row``."""
    rel = {"/".join(str(getattr(k, "key", k)) for k in path): float(
        np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
        / max(float(np.max(np.abs(np.asarray(b, np.float64)))), 1e-30))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree_util.tree_leaves(base_params), strict=True)}
    worst = max((k for k in rel if "key_bias" not in k), key=rel.get)
    key = lambda r, k: [m[k] for m in r["metrics"]]
    row.update(max_loss_diff=max(abs(a - b) for a, b in zip(key(row, "loss"), key(base, "loss"),
                                                            strict=True)),
               max_rel_param_diff=rel[worst], worst_leaf=worst,
               skips_scales_equal=all(key(row, k) == key(base, k)
                                      for k in ("loss_scale", "grad_finite")),
               skipped=sum(1 - f for f in key(row, "grad_finite")),
               time_ratio=row["ms"] / base["ms"])


def b16(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    """ViT-B/16 (224px, 1000 classes, fp16_naive + AdamW) at data=8: counted (and compiled)."""
    config = _config("fp16_naive", (8, 1, 1), stage, args, model="b")
    for key, value in dict(hidden_size=None, mlp_dim=None, num_layers=None, num_heads=None,
                           patch_size=16, image_size=224, batch_size=8).items():
        config[key] = value
    exp = experiment.build_experiment(config)
    module = vit.create("b", num_classes=1000, patch_size=16, dropout_rate=0.0,
                        scan_layers=config.scan_layers, remat=config.remat,
                        layer_runner=zero.GatherPerLayer() if stage == 3 else None)
    model = apply_policy(module, exp.precision)
    exp = dataclasses.replace(exp, model=model, apply_fn=model.apply, info=dataclasses.replace(
        exp.info, num_classes=1000, image_shape=(224, 224, 3)))
    rng = jax.random.key(0)
    with jax.set_mesh(exp.mesh):
        abstract, shardings = experiment.state_shardings(exp, rng)
    row = dict(stage=stage, **computed(abstract, exp.mesh, stage), measured_bytes=None,
               issue_bytes_per_param=(16.0, 5.5, 3.75, 2.0)[stage])
    if stage in args.b16_compile:
        sharding = parallel.batch_sharding(exp.mesh)
        batch = {"image": jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.float32, sharding=sharding),
                 "label": jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)}
        with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
            t0 = time.perf_counter()
            step = train.jit_train_step(exp, shardings, abstract).lower(
                abstract, batch, rng).compile()
        extra = memory.bytes_per_device(batch)
        row.update(measured_bytes=step.memory_analysis().argument_size_in_bytes - extra,
                   compile_s=time.perf_counter() - t0)
    return row


def _cell(ops: dict[str, list[int]]) -> str:
    return "; ".join(f"{k} {n}x {b / 1024:,.1f}K" for k, (n, b) in sorted(ops.items())) or "-"


def to_markdown(result: dict[str, Any]) -> str:
    """The results file: how it ran, a table per stage (mesh x mode), then ViT-B/16."""
    a, m = result["args"], result["machine"]
    lines = [
        "# ZeRO stages 0-3 on 8 fake CPU devices", "",
        f"- command: `{result['command']}`; {result['date']}; jax {result['jax']}; "
        f"{m['processor']} ({m['cpus']} cores, shared; load {m['load_avg_1m']}); "
        f"run time {result['run_s'] / 60:.1f} min",
        f"- ViT hidden {a['hidden']}, mlp {a['mlp']}, {a['layers']} layers, {a['heads']} heads, "
        f"digits 8x8 patch 2, batch {a['batch']}, AdamW, dropout 0, {a['steps']} steps "
        "(same batches per stage); XLA:CPU at -O0 (cheap codegen; HLO unchanged)",
        "- measured = `memory_analysis().argument_size_in_bytes` less the batch (jit prunes "
        "unused arguments: the rng key with dropout 0, and fp16's two bool state flags, "
        "written but never read: measured = shapes - 2 B); "
        "shapes = `jamp.bytes_per_device(state)`; jamp/device = `per_device_bytes` params + "
        "grads + opt state + master (replicated: not split over 'data'); arithmetic = stage 0's "
        "figures with opt+master (1), + grads (2), + params (3) divided by 'data'; "
        "B/param = jamp/device over the parameter count",
        "- collectives: `axes dtype count x total KiB` per op in the compiled HLO; bytes of "
        "the whole array (a reduce-scatter's input); an op inside a loop body (scanned "
        "layers) is counted once; XLA:CPU compiles a bf16 collective as f32 (the bf16 rows' "
        "stage-3 gathers are bf16 in the lowered StableHLO, f32 here)",
        "- trajectory vs stage 0: max |loss diff|, max over leaves of max|dp|/max|p| after "
        "the last step (and its leaf; `key_bias` left out: its gradient is 0 in exact "
        "arithmetic, softmax ignores a shift shared by all keys, so Adam turns rounding noise "
        "into +-lr steps and any reordering of sums gives O(1) differences), loss scales "
        "and finite flags equal on every step (skipped steps); "
        "ms = median step time of steps 2..n", ""]
    for stage in sorted({r["stage"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["stage"] == stage]
        lines += [f"## Stage {stage}", "", *common.table(
            "mesh dxmxp | mode | measured B | shapes B | jamp/device B | of which replicated | "
            "arithmetic B | B/param | max abs dloss | max rel dparam (leaf) | skips, scales equal "
            "(skipped) | ms/step | vs stage 0",
            ([r["mesh"], r["mode"], r["measured_bytes"], r["state_bytes"],
              r["per_device"]["total"], r["per_device"]["replicated"],
              common.fmt(r["arithmetic_bytes"], ",.0f"), common.fmt(r["bytes_per_param"], ".2f"),
              common.fmt(r.get("max_loss_diff"), ".1e"),
              common.fmt(r.get("max_rel_param_diff"), ".1e")
              + (f" ({r['worst_leaf'].split('/')[-1]})" if "worst_leaf" in r else ""),
              f"{r.get('skips_scales_equal', '-')} ({r.get('skipped', '-')})",
              common.fmt(r["ms"], ".1f"), common.fmt(r.get("time_ratio"), ".2f", "x")]
             for r in rows)), "", *common.table(
            "mesh | mode | all-gather | reduce-scatter | all-reduce",
            ([r["mesh"], r["mode"], *(_cell(r["collectives"][op]) for op in OPS)]
             for r in rows)), ""]
    if result["b16"]:
        gb = lambda b: common.fmt(None if b is None else b / 1e9, ".3f")
        lines += ["## ViT-B/16 (224px, 1000 classes) fp16_naive + AdamW, data=8", "",
                  "Counted from abstract shapes with jamp's split rule; measured: compiled "
                  "step's argument bytes less the batch (n/a: not compiled). GB = 1e9 B.",
                  "", *common.table(
                      "stage | params | jamp/device GB | of which replicated GB | B/param | "
                      "issue B/param | issue GB | state (shapes) GB | measured GB | "
                      "measured - shapes B",
                      ([r["stage"], f"{r['params']:,}", gb(r["per_device"]["total"]),
                        gb(r["per_device"]["replicated"]), common.fmt(r["bytes_per_param"], ".2f"),
                        r["issue_bytes_per_param"], gb(r["issue_bytes_per_param"] * r["params"]),
                        gb(r["state_bytes"]), gb(r["measured_bytes"]),
                        "n/a" if r["measured_bytes"] is None
                        else r["measured_bytes"] - r["state_bytes"]] for r in result["b16"])),
                  ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the grid (and ViT-B/16); prints and (unless ``--no-write``) writes the tables."""
    ap = common.parser(__doc__)
    mesh = lambda t: [tuple(int(x) for x in m.split(",")) for m in t.split(";")]
    ap.add_argument("--meshes", type=mesh, default=mesh("8,1,1;4,2,1;2,2,2"),
                    help="';'-separated data,model,pipe")
    ap.add_argument("--modes", type=common.split, default="fp32,fp16,fp16_naive,bf16,fp8")
    ints = lambda t: [int(x) for x in t.split(",") if x]
    ap.add_argument("--stages", type=ints, default=[0, 1, 2, 3])
    for name, default in dict(hidden=64, mlp=128, layers=4, heads=8, batch=16, steps=10).items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--b16-stages", type=ints, default=[0, 1, 2, 3])
    ap.add_argument("--b16-compile", type=ints, default=[0, 1, 2, 3],
                    help="B/16 stages to compile ('' for none)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    info = data.get_dataset_info("digits")
    loader = iter(data.train_loader(info, image_size=8, global_batch_size=args.batch, seed=0))
    batches = [next(loader) for _ in range(args.steps)]
    rows = []
    for mesh_ in args.meshes:
        for mode in args.modes:
            base = None
            for stage in args.stages:
                row, params = run_case(mode, mesh_, stage, args, batches)
                if base is None:
                    base = (row, params)
                else:
                    compare(row, base[0], params, base[1])
                rows.append(row)
                print(f"{row['mesh']} {mode:<10} stage {stage}: measured {row['measured_bytes']}"
                      f" shapes {row['state_bytes']} ms {row['ms']:.1f} "
                      f"dloss {row.get('max_loss_diff')} (compile {row['compile_s']:.0f}s)",
                      flush=True)
    big = [b16(args, s) for s in args.b16_stages]
    result = dict(**common.header("zero_stages", argv), args=vars(args) | dict(meshes=[
        list(m) for m in args.meshes]), rows=rows, b16=big, run_s=time.perf_counter() - start)
    print(markdown := to_markdown(result))
    if not args.no_write:
        common.write_results(common.results_stem(args.out_dir, "zero_stages", "cpu"), result,
                             markdown)
    return result


if __name__ == "__main__":
    main()

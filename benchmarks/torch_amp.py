"""The PyTorch baseline: the same ViT trained with AdamW in fp32, autocast fp16 and bf16.

Runs timm's ``vit_<size>_patch<p>_<image>`` when timm is installed and names the shape
(``--impl auto``), else :class:`ViT` below, the same architecture in ``torch.nn``. Modes:
``fp32`` (TF32 matmuls on GPU unless ``--no-tf32``, as XLA's default), ``fp16`` (autocast +
``GradScaler``: torch AMP), ``bf16`` (autocast); each eager and/or under ``torch.compile``.
Reports per run what ``benchmarks.throughput`` does: images/s, peak memory
(``torch.cuda.max_memory_allocated``), MFU, and with ``--max-batch`` the largest batch
(multiple of 8) that trains without CUDA OOM, found by trying eager steps.

Usage::

  python -m benchmarks.torch_amp                         # ViT-B/16, 224px, batch 128
  python -m benchmarks.torch_amp --variant ti16 --image-size 64 --batch 8 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import common
from jamp.models import sizes

TORCH_MODES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
"""The PyTorch modes and their autocast dtypes."""
MEMORY_FRACTION = 0.95
"""The CUDA memory fraction the process may use (``run_all`` gives XLA as much)."""


class Block(nn.Module):
    """Pre-LN transformer block: x + Attn(LN(x)), then x + MLP(LN(x)).

    Example:
      >>> Block(8, 2, 16)(torch.zeros(1, 3, 8)).shape
      torch.Size([1, 3, 8])
    """

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_dim), nn.Linear(mlp_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """Vision Transformer classifier (class token, learned positions), NCHW input.

    Example:
      >>> ViT(image_size=8, patch_size=4, hidden_size=8, num_layers=1, num_heads=2,
      ...     mlp_dim=16, num_classes=3)(torch.zeros(2, 3, 8, 8)).shape
      torch.Size([2, 3])
    """

    def __init__(self, *, image_size: int, patch_size: int, hidden_size: int, num_layers: int,
                 num_heads: int, mlp_dim: int, num_classes: int):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, hidden_size, patch_size, stride=patch_size)
        tokens = (image_size // patch_size) ** 2 + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, hidden_size) * 0.02)
        self.blocks = nn.Sequential(*[Block(hidden_size, num_heads, mlp_dim)
                                      for _ in range(num_layers)])
        self.norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def build_model(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """timm's model where asked/available and named, else :class:`ViT`; and which one."""
    size, patch = sizes.parse_variant(args.variant, args.patch_size)
    timm_name = {"ti": "tiny", "s": "small", "b": "base", "l": "large"}[size]
    timm_name = f"vit_{timm_name}_patch{patch}_{args.image_size}"
    if args.impl in ("auto", "timm") and args.num_layers is None:
        try:
            import timm

            model = timm.create_model(timm_name, num_classes=args.num_classes)
            return model, f"timm {timm.__version__} {timm_name}"
        except Exception:  # noqa: BLE001 - not installed, or a shape timm does not name
            if args.impl == "timm":
                raise
    dims = sizes.vit_dims(args.variant, num_layers=args.num_layers)
    model = ViT(image_size=args.image_size, patch_size=patch, num_classes=args.num_classes,
                **dims)
    return model, "benchmarks.torch_amp ViT (timm not used)"


def _sync(device: torch.device) -> None:
    """Waits for the device's work (CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_step(model: nn.Module, mode: str, device: torch.device, compiled: bool,
               args: argparse.Namespace):
    """Returns ``step(images, labels) -> loss`` (one AdamW update) for a mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05,
                            fused=device.type == "cuda")
    forward = torch.compile(model, mode=args.compile_mode) if compiled else model
    dtype = TORCH_MODES[mode]
    scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(device.type, dtype=dtype) if dtype is not None
              else contextlib.nullcontext()):
            loss = F.cross_entropy(forward(images).float(), labels)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss.detach()

    return step


def _synthetic_batch(args: argparse.Namespace, batch: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random NCHW images and labels on the device."""
    g = torch.Generator(device="cpu").manual_seed(1)
    images = torch.randn(batch, 3, args.image_size, args.image_size, generator=g)
    labels = torch.randint(0, args.num_classes, (batch,), generator=g)
    return images.to(device), labels.to(device)


def _max_batch(mode: str, device: torch.device, args: argparse.Namespace) -> int | None:
    """Largest batch (multiple of 8) for which two eager steps run without CUDA OOM."""
    step = _make_step(build_model(args)[0].to(device), mode, device, False, args)

    def fits(batch: int) -> bool:
        try:
            images, labels = _synthetic_batch(args, batch, device)
            for _ in range(2):
                step(images, labels)
            _sync(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            images = labels = None
            gc.collect()
            torch.cuda.empty_cache()

    return common.largest_batch(fits, args.batch, granularity=8)


def _run(mode: str, compiled: bool, args: argparse.Namespace,
         device: torch.device) -> dict[str, Any]:
    """Measures one (mode, eager/compile) pair; returns its row of figures."""
    torch.manual_seed(0)
    model, impl = build_model(args)
    model = model.to(device)
    images, labels = _synthetic_batch(args, args.batch, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = _make_step(model, mode, device, compiled, args)
    t0 = time.perf_counter()
    step(images, labels)  # the first step compiles (torch.compile) / warms up
    _sync(device)
    first_s = time.perf_counter() - t0
    out: dict[str, torch.Tensor] = {}

    def timed():
        out["loss"] = step(images, labels)
        _sync(device)

    times = common.time_steps({mode: timed}, warmup=max(args.warmup - 1, 0),
                              steps=args.steps)[mode]
    flops = common.train_flops(args)
    row: dict[str, Any] = dict(
        framework="torch", mode=mode, compiled=compiled, impl=impl, batch=args.batch,
        first_step_s=first_s, **common.summarize_times(times, args.batch),
        peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        flops_per_image=flops, final_loss=float(out["loss"]))
    peak = common.peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
    row["mfu"] = common.mfu(row["images_per_sec"], flops, peak)
    row["max_batch"], row["max_batch_method"] = None, "skipped (--max-batch not given)"
    if args.max_batch and not compiled:
        row["max_batch_method"] = f"n/a on {device.type}"
        if cuda:
            del step, model, images, labels
            gc.collect()
            row["max_batch"] = _max_batch(mode, device, args)
            row["max_batch_method"] = ("eager steps until CUDA OOM, memory fraction "
                                       f"{MEMORY_FRACTION}")
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (see the module docstring).

    Example:
      >>> args = parse_args(["--variant", "s", "--patch-size", "8", "--compile", "eager"])
      >>> args.patch_size, args.modes, args.compile
      (8, ['fp32', 'fp16', 'bf16'], ['eager'])
    """
    ap = common.parser(__doc__, json_out=True, timing=(20, 3))
    common.add_vit(ap)
    ap.add_argument("--modes", type=common.split, default=list(TORCH_MODES))
    ap.add_argument("--compile", type=common.split, default=["eager", "compile"],
                    help="comma-separated: eager and/or compile (torch.compile)")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode")
    ap.add_argument("--impl", choices=("auto", "timm", "local"), default="auto")
    ap.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                    help="TF32 float32 matmuls on GPU (XLA's default on GPU)")
    ap.add_argument("--max-batch", action="store_true", help="search the largest batch (CUDA)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (CPU; 1 avoids stalls on a busy shared host)")
    args = ap.parse_args(argv)
    args.patch_size = sizes.parse_variant(args.variant, args.patch_size or 16)[1]
    unknown = sorted(set(args.modes) - set(TORCH_MODES))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; PyTorch modes: {', '.join(TORCH_MODES)}")
    if set(args.compile) - {"eager", "compile"}:
        ap.error("--compile takes eager and/or compile")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the baseline; prints one line per run; returns (and optionally writes) results."""
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:  # memory-fraction calls need an index
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        torch.cuda.set_per_process_memory_fraction(MEMORY_FRACTION, device)
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = dict(platform=device.type, device_kind=kind, peak_tflops=common.peak_tflops(kind),
                torch=torch.__version__, cuda=torch.version.cuda,
                threads=torch.get_num_threads(), machine=common.machine())
    print(f"torch baseline: ViT-{args.variant} {args.image_size}px batch {args.batch} on "
          f"{kind}, torch {torch.__version__}", flush=True)
    rows = []
    for mode in args.modes:
        for how in args.compile:
            rows.append(row := _run(mode, how == "compile", args, device))
            print(f"  {mode:<5} {how:<8} {row['images_per_sec']:9.1f} img/s  "
                  f"step {row['step_ms']:8.1f} ms  first step {row['first_step_s']:5.1f} s  "
                  f"peak {common.gib(row['peak_bytes'])}  MFU {common.fmt(row['mfu'], '.1%')}  "
                  f"max batch {common.fmt(row['max_batch'], 'd')}  loss {row['final_loss']:.3f}",
                  flush=True)
    return common.process_result(args, "torch", info, rows)


if __name__ == "__main__":
    main()

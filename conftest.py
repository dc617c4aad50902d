"""Test-session set-up: 8 fake CPU devices so sharded tests and doctests run anywhere.

The device count must be fixed before JAX initialises its backends, so it is set
here, at import time of the test session, for every test module.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Tests compile many small programs and run each a few times: LLVM's cheapest settings cut
# XLA:CPU compile time (tests/test_step.py + test_parallel.py: 134 s -> 104 s). HLO passes,
# collectives and dtypes are unchanged; only the machine code is less optimised.
for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The trainer tests compile the same tiny programs again and again (a run and its resume,
# subprocesses, both xdist workers): a persistent compilation cache shared by them all
# compiles each once (programs that take >= 1 s to compile, JAX's default threshold).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jamp-tests-jax-cache-{os.getuid()}"))

# pytest-xdist's `--dist loadfile` hands whole files to the workers in collection order: a
# long file collected last (tests/test_zero*.py sort last) would run alone on one worker at
# the end. The heaviest files go first (longest-first scheduling); the rest keep their order.
HEAVIEST_FIRST = (
    "tests/test_preemption.py", "tests/test_every_mesh.py", "tests/test_train.py",
    "tests/test_zero.py", "tests/test_zero_resume.py", "tests/test_parallel.py",
    "tests/test_multiprocess.py", "tests/test_notebooks.py", "tests/test_f32_accumulation.py",
    "tests/test_fp8_pipeline.py", "tests/test_vit_nnx.py", "tests/test_docs_examples.py",
)


def pytest_collection_modifyitems(session, config, items):
    root = os.path.dirname(os.path.abspath(__file__))
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), root),
                                         len(rank)))

"""Test-session set-up: 8 fake CPU devices so sharded tests and doctests run anywhere.

The device count must be fixed before JAX initialises its backends, so it is set
here, at import time of the test session, for every test module.
"""

import os

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

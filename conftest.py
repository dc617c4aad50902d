"""Test-session set-up: 8 fake CPU devices so sharded tests and doctests run anywhere.

The device count must be fixed before JAX initialises its backends, so it is set
here, at import time of the test session, for every test module.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

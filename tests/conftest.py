"""Test-wide set-up: eight fake CPU devices, so mesh tests run on any machine.

XLA reads the flag when the backend starts, so it must be set before anything imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

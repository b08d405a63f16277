"""The command line that starts one real SGLang server (``python -m sglang.launch_server``) for a
run's fleet, from the ``rollout.sglang`` section of the run config.

The flags are those of the pinned sglang version (``pip install 'areal-jax[sglang]'``); a test
checks every flag this writes against the flag declarations in that version's wheel. A run
moves weights to SGLang with ``/update_weights_from_disk`` (``rollout.weight_sync: disk``),
which needs nothing at launch but a model directory of the same architecture; pausing for an
update (``/pause_generation``, ``/continue_generation``) needs nothing either.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

SGLANG_VERSION = "0.5.23"
"""The sglang release the command line is written for (the ``sglang`` extra pins it)."""


@dataclass
class SGLangOptions:
    """How each SGLang server of ``rollout.backend: sglang`` is started."""

    tp_size: int = 1
    """Tensor-parallel GPUs per server; ``rollout.server_devices`` must give each server this many."""
    mem_fraction_static: float | None = None
    """Share of GPU memory for weights and KV cache (None: SGLang's default for the GPU)."""
    dtype: str = "auto"
    """``auto``, ``bfloat16``, ``float16`` or ``float32``: weights and activations on the server."""
    context_length: int | None = None
    """None: the model's ``max_position_embeddings``."""
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter that has sglang installed (another venv's, if it lives apart)."""
    extra_args: list[str] = field(default_factory=list)
    """More ``sglang.launch_server`` flags, passed as written (checked by SGLang itself)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"rollout.sglang.tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"rollout.sglang.mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
            raise ValueError(f"rollout.sglang.dtype={self.dtype!r}: choose auto, bfloat16, float16 or float32")


def sglang_command(opts: SGLangOptions, model_path: str, port: int, *, host: str = "127.0.0.1", seed: int = 0,
                   api_key: str | None = None, weight_version: int = 0) -> list[str]:
    """argv of one server. ``weight_version`` labels the starting weights (SGLang reports the
    label in every reply; the client keeps its own record of what each server holds)."""
    cmd = [opts.python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(opts.tp_size), "--dtype", opts.dtype,
           "--random-seed", str(seed), "--weight-version", str(weight_version)]
    if opts.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(opts.mem_fraction_static)]
    if opts.context_length is not None:
        cmd += ["--context-length", str(opts.context_length)]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(opts.extra_args)

"""Multi-host for real: two processes on this machine join through jax.distributed (CPU
collectives over gloo, two fake devices each), build one global mesh, and a sharded forward and
gradient agree with the single-process result."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import load_pretrained, logprobs_from_logits
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "hf_llama"


@pytest.mark.slow
def test_two_processes_agree_with_one(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "multihost.npz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    worker = Path(__file__).with_name("multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(MODEL), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out:\n" + "\n".join(logs))
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)[-4000:]
    got = np.load(out)

    model = load_pretrained(MODEL)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (4, 16)).astype(np.int32))
    graphdef, state = nnx.split(model)

    def loss_fn(state, ids):
        return -jnp.mean(logprobs_from_logits(nnx.merge(graphdef, state)(ids)[:, :-1], ids[:, 1:]))

    loss, grads = jax.value_and_grad(loss_fn)(state, ids)
    np.testing.assert_allclose(got["logits"], np.asarray(model(ids)), atol=1e-5)
    np.testing.assert_allclose(got["loss"], float(loss), rtol=1e-6)
    flat = nnx.to_flat_state(grads)
    assert sum(k.startswith("grad/") for k in got.files) == len(flat)
    for path, g in flat:
        np.testing.assert_allclose(got["grad/" + "/".join(map(str, path))], np.asarray(g.get_value()), atol=2e-6)

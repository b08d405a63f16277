"""Multi-host for real: two processes on this machine join through jax.distributed (CPU
collectives over gloo, two fake devices each), build one global mesh, and a sharded forward and
gradient, full train steps and a spread export agree with the single-process result."""

import json
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


def _run_two(worker: str | Path, *args: str) -> list[str]:
    """Run ``worker`` (a script beside this file, or a path) as processes 0 and 1 of one
    jax.distributed job; returns their logs."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    path = worker if isinstance(worker, Path) else Path(__file__).with_name(worker)
    procs = [subprocess.Popen([sys.executable, str(path), str(i), str(port), *args], env=env,
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
    return logs


@pytest.mark.slow
def test_two_processes_agree_with_one(tmp_path: Path) -> None:
    out = tmp_path / "multihost.npz"
    _run_two("multihost_worker.py", str(MODEL), str(out))
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


@pytest.mark.slow
def test_two_processes_export_spread_shards_that_transformers_loads(tmp_path: Path) -> None:
    """Each process writes whole tensors into its own shards (no host gathers the model); the
    directory has the index, config and every tensor exactly as the original checkpoint."""
    from safetensors import safe_open

    out = tmp_path / "export"
    logs = _run_two("export_worker.py", str(MODEL), str(out))
    assert all(f"saved: {out}" in log for log in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # the staging directory is gone
    index = json.loads((out / "model.safetensors.index.json").read_text())
    writers, got = {}, {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / fname), framework="np") as f:
            writers[fname] = f.metadata()["written_by_process"]
            got.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(writers.values()) == {"0", "1"}  # both processes wrote, each its own files
    assert {k: index["weight_map"][k] for k in got} == index["weight_map"]
    with safe_open(str(MODEL / "model.safetensors"), framework="np") as f:
        original = {k: f.get_tensor(k) for k in f.keys()}
    assert set(got) == set(original)
    for k, v in original.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in original.values())
    assert json.loads((out / "config.json").read_text())["architectures"]
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(np.random.default_rng(0).integers(0, 96, (2, 9)))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(MODEL)).eval()(ids).logits
        ours = AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
    np.testing.assert_array_equal(ours.numpy(), ref.numpy())


ESTIMATORS = ("grpo", "gae", "grpo@split")


@pytest.fixture(scope="module")
def two_process_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    """Each estimator's train steps over two processes, all from one pair of processes, one
    estimator after the other (starting and joining a pair costs more than its steps)."""
    out = tmp_path_factory.mktemp("train")
    _run_two(ROOT / "tests" / "trainer" / "train_worker.py", str(out), ",".join(ESTIMATORS))
    return {e: dict(np.load(out / f"{e}.npz")) for e in ESTIMATORS}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_two_processes_train_like_one(two_process_steps: dict[str, dict[str, np.ndarray]], estimator: str) -> None:
    """Full train steps on a mesh that spans two processes, each placing only the batch rows its
    devices hold, give the single-process loss, gradient, statistics and updated params (and,
    with a critic, its values, statistics and params). ``@split``: on a mesh of one device of
    each process, the others left to an engine (``rollout.local.placement: split``): a step that
    put a host value with ``jax.device_put`` checked it with an all-gather over every device,
    which reached the trainer's gloo group in another order on each process while the step's
    gradient still ran ("collective mismatch", both processes aborted)."""
    from sharding import make_mesh
    from tests.trainer.multihost_flow import MESH, run, split_mesh

    got = two_process_steps[estimator]
    name, _, where = estimator.partition("@")
    want = run(split_mesh(jax.devices()[:2]) if where == "split" else make_mesh(MESH, devices=jax.devices()[:4]), name)
    assert set(got) == set(want) and any(k.startswith("grad/") for k in want)
    # Reductions run in another order across processes (and the compilers' flags differ): losses,
    # statistics and gradients agree to about 1e-5; a row placed on the wrong process would move
    # them by 1e-1. Adam turns a near-zero gradient into a full step of the learning rate (1e-2),
    # so an updated param may differ by a small part of one step.
    for key, value in want.items():
        tol = dict(rtol=0, atol=1e-3) if key.startswith(("param/", "critic/")) else dict(rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(got[key], value, **tol, err_msg=key)
    assert want["stats1/loss"] != want["stats0/loss"]  # two different steps were compared

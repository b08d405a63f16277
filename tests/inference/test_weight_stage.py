"""Staging new weights part by part: each parameter converted once all its tensors arrived, the
served model untouched, bad parts refused before anything is staged."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.weights import WeightStage, stage_checkpoint
from areal_jax.models import CheckpointError, iter_hf_tensors
from areal_jax.models.hf_io import load_pretrained, read_hf_dir


def _values(state: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def test_parts_convert_as_their_parameters_complete(ckpt: Path, ckpt_v1: Path) -> None:
    served = load_pretrained(ckpt)
    before = dict(iter_hf_tensors(served))
    new = list(iter_hf_tensors(load_pretrained(ckpt_v1)))  # the order a push sends them in
    stage = WeightStage(served)
    # The first part ends inside the second stacked parameter of the stream: the first one is
    # complete and converted, the second waits for the rest of its layers.
    starts = [i for i, (name, _) in enumerate(new) if ".layers.0." in name]
    cut = starts[1] + 1
    done = {name for name, _ in new[starts[0]:starts[1]]}
    waiting = new[starts[1]][0].replace(".layers.0.", ".layers.1.")
    stage.add(dict(new[:cut]))
    staged = dict(iter_hf_tensors(stage.staged))
    for name, value in new:
        if name in done:
            np.testing.assert_array_equal(staged[name], value, err_msg=name)
    np.testing.assert_array_equal(staged[new[starts[1]][0]], before[new[starts[1]][0]])  # not converted yet
    assert waiting in stage.missing() and len(stage.missing()) == len(new) - cut
    stage.add(dict(new[cut:]))
    assert not stage.missing()
    finished = dict(iter_hf_tensors(nnx.merge(nnx.graphdef(served), stage.finish())))
    for name, value in new:
        np.testing.assert_array_equal(finished[name], value, err_msg=name)
    for name, value in iter_hf_tensors(served):  # the served model never changed
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_bad_parts_are_refused_before_anything_is_staged(ckpt: Path, ckpt_v1: Path) -> None:
    served = load_pretrained(ckpt)
    tensors = read_hf_dir(ckpt_v1)
    name = next(iter(tensors))
    stage = WeightStage(served)
    with pytest.raises(CheckpointError, match="not parameters"):
        stage.check({"model.layers.99.mlp.up_proj.weight": tensors[name]})
    with pytest.raises(CheckpointError, match="has shape"):
        stage.add({name: np.zeros((3, 3), np.float32)})
    assert not stage.received
    stage.add({name: tensors[name]})
    with pytest.raises(CheckpointError, match="sent twice"):
        stage.add({name: tensors[name]})
    assert len(stage.missing()) == len(tensors) - 1  # what a server checks before it commits a version


def test_a_checkpoint_stages_whole_or_not_at_all(ckpt: Path, ckpt_v1: Path, tmp_path: Path) -> None:
    served = load_pretrained(ckpt)
    stage = stage_checkpoint(served, str(ckpt_v1))
    assert not stage.missing()
    state = stage.finish()
    target = _values(nnx.state(load_pretrained(ckpt_v1)))
    assert all(np.array_equal(v, target[k]) for k, v in _values(state).items())
    assert all(isinstance(v.get_value(), jax.Array) for _, v in nnx.to_flat_state(state))
    from safetensors.numpy import save_file

    partial = {k: v for i, (k, v) in enumerate(read_hf_dir(ckpt_v1).items()) if i % 2}
    (tmp_path / "part").mkdir()
    save_file(partial, str(tmp_path / "part" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensors missing"):
        stage_checkpoint(served, str(tmp_path / "part"))


def test_a_state_that_cannot_serve_in_place_is_named_by_its_parameter(ckpt: Path) -> None:
    from areal_jax.inference.weights import check_swappable

    served = nnx.state(load_pretrained(ckpt), nnx.Param)
    check_swappable(served, served)  # itself: nothing to say
    leaves, treedef = jax.tree.flatten(served)
    paths = [jax.tree_util.keystr(p, simple=True, separator=".")
             for p, _ in jax.tree_util.tree_leaves_with_path(served)]
    i = next(i for i, p in enumerate(paths) if "q_proj" in p)
    narrower = jax.tree.unflatten(treedef, [x.astype(jax.numpy.bfloat16) if j == i else x
                                            for j, x in enumerate(leaves)])
    with pytest.raises(ValueError, match=rf"new weights: {paths[i]} is .* bfloat16 .* the engine serves .* float32"):
        check_swappable(served, narrower)
    with pytest.raises(ValueError, match="parameter tree differs"):
        check_swappable(served, {"other": leaves[0]})

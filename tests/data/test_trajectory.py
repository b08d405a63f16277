"""Trajectory validation: each inconsistency is an error naming the field."""

import numpy as np
import pytest

from areal_jax.data.trajectory import Trajectory, TrajectoryError


def _fields(**changes):
    f = dict(input_ids=np.arange(6), loss_mask=[0, 0, 1, 1, 1, 1], behavior_logprobs=[0, 0, -1, -2, -1, -0.5],
             versions=[-1, -1, 3, 3, 4, 4], reward=1.0, group_id=0, prompt_len=2)
    f.update(changes)
    return f


def test_valid_and_staleness() -> None:
    t = Trajectory(**_fields())
    assert t.answer_len == 4 and len(t) == 6
    assert t.staleness(5) == 2
    built = Trajectory.from_prompt_and_answer([1, 2], [3, 4, 5], [-1, -1, -1], 2, reward=0.0, group_id=7)
    assert built.versions.tolist() == [-1, -1, 2, 2, 2] and built.loss_mask.tolist() == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("changes, field", [
    (dict(loss_mask=[0, 0, 1, 1, 1]), "loss_mask"),
    (dict(behavior_logprobs=[0, 0, -1]), "behavior_logprobs"),
    (dict(versions=[-1, -1, 3, 3, 4, 4, 4]), "versions"),
    (dict(loss_mask=[0, 0, 0, 0, 0, 0]), "empty answer"),
    (dict(prompt_len=6), "empty answer"),
    (dict(versions=[-1, 0, 3, 3, 4, 4]), "versions[1]"),
    (dict(loss_mask=[0, 1, 1, 1, 1, 1]), "prompt token"),
    (dict(versions=[-1, -1, -1, 3, 4, 4]), "versions is negative"),
    (dict(behavior_logprobs=[0, 0, -1, np.nan, -1, -1]), "behavior_logprobs"),
    (dict(prompt_len=0), "prompt_len"),
])
def test_errors_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(TrajectoryError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Trajectory(**_fields(**changes))

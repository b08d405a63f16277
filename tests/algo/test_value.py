"""The clipped value loss and explained variance held against NumPy references written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.algo import clipped_value_loss, explained_variance


def _reference(v, v_old, ret, mask, eps):
    """Loss, d loss / d values and clip fraction from the formula, in float64."""
    v, v_old, ret, mask = (np.asarray(x, np.float64) for x in (v, v_old, ret, mask))
    count = max(mask.sum(), 1.0)
    unclipped = (v - ret) ** 2
    if eps is None:
        per, grad, wins = unclipped, (v - ret), np.zeros(v.shape, bool)
    else:
        inside = np.abs(v - v_old) < eps
        v_clip = v_old + np.clip(v - v_old, -eps, eps)
        clipped = (v_clip - ret) ** 2
        wins = clipped > unclipped
        per = np.maximum(unclipped, clipped)
        # On the clipped branch the value moves the loss only while it is inside the clip range.
        grad = np.where(wins, (v_clip - ret) * inside, v - ret)
    loss = 0.5 * (per * mask).sum() / count
    return loss, grad * mask / count, (wins & (mask > 0)).sum() / count


@pytest.mark.parametrize("eps", [0.2, 0.05, None])
def test_clipped_value_loss_vs_reference(eps):
    rng = np.random.default_rng(0)
    shape = (3, 17)
    v_old = rng.normal(size=shape).astype(np.float32)
    v = (v_old + rng.normal(scale=0.3, size=shape)).astype(np.float32)
    ret = rng.normal(size=shape).astype(np.float32)
    mask = (rng.random(shape) < 0.7).astype(np.float32)
    mask[2] = 0.0  # a fully masked row (a padding row of a micro-batch)
    v[~(mask > 0)] = np.inf  # padding may hold anything; no NaN may leak from it

    def f(values):
        return clipped_value_loss(values, jnp.asarray(v_old), jnp.asarray(ret), jnp.asarray(mask), eps_clip=eps)

    (loss, stats), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(v))
    ref_loss, ref_grad, ref_frac = _reference(np.where(mask > 0, v, 0), v_old, ret, mask, eps)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(stats["value_loss"], ref_loss, rtol=1e-5)
    np.testing.assert_allclose(stats["value_clip_fraction"], ref_frac, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)  # masked tokens get exactly no gradient
    if eps == 0.05:
        assert 0 < ref_frac < 1  # both branches occur, so the comparison covers the clipping


def test_clipped_value_loss_of_an_empty_mask_is_zero():
    z = jnp.zeros((2, 4))
    loss, stats = clipped_value_loss(z + 1, z, z, z, eps_clip=0.2)
    assert float(loss) == 0.0 and float(stats["value_clip_fraction"]) == 0.0


def test_explained_variance_vs_reference():
    rng = np.random.default_rng(1)
    ret = rng.normal(size=(4, 9))
    v = ret + rng.normal(scale=0.5, size=ret.shape)
    mask = rng.random(ret.shape) < 0.6
    ref = 1 - np.var((ret - v)[mask]) / np.var(ret[mask])
    np.testing.assert_allclose(explained_variance(jnp.asarray(v), jnp.asarray(ret), jnp.asarray(mask)), ref, rtol=1e-5)
    np.testing.assert_allclose(explained_variance(jnp.asarray(ret), jnp.asarray(ret), jnp.asarray(mask)), 1.0)
    assert float(explained_variance(jnp.asarray(v), jnp.ones_like(jnp.asarray(ret)), jnp.asarray(mask))) == 0.0

"""Hugging Face checkpoints: read a model directory onto a mesh, write one back.

The correspondence between our parameter paths and HF tensor names is a table per family
(``NAME_TABLES``): a regex over our dotted path, the HF name template, and a layout transform.
Decoder layers are stacked (a leading ``layers`` axis): one of our parameters is the HF tensors
of every layer, ``{layer}`` in the template, stacked on read and sliced on write.
Loading reads each tensor straight onto its devices, one tensor at a time, and each device reads
only its own slice from the memory-mapped safetensors file. ``iter_hf_tensors`` yields the model
back as HF tensors (unfused names, exact HF shapes, no ``lm_head`` when embeddings are tied),
one at a time; ``hf_write`` puts them on disk. With ``hf_layout=False`` the same tensors keep our
``[in, out]`` kernels: a push between our own trainer and server (HTTP buckets that say so) then
transposes nothing on either side, while everything written to disk or sent to SGLang is HF.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open

from areal_jax.models.config import ModelConfig, dtype_name
from areal_jax.models.decoder import Decoder
from areal_jax.models.fused import FusedLayout
from areal_jax.models.hf_device import from_hf, from_hf_fused, read_safetensors, to_hf
from sharding import DEFAULT_RULES, activate, gather_to_host
from sharding.rules import Rules

# (our path regex, HF name template, transpose?) — our kernels are [in, out], HF weights [out, in].
# A template with {layer} names one tensor per layer of a stacked parameter.
_DECODER_TABLE: tuple[tuple[str, str, bool], ...] = (
    (r"embed_tokens\.embedding", "model.embed_tokens.weight", False),
    (r"layers\.self_attn\.([qkvo])_proj\.kernel", r"model.layers.{layer}.self_attn.\1_proj.weight", True),
    (r"layers\.self_attn\.([qkv])_proj\.bias", r"model.layers.{layer}.self_attn.\1_proj.bias", False),
    (r"layers\.self_attn\.([qk])_norm\.weight", r"model.layers.{layer}.self_attn.\1_norm.weight", False),
    (r"layers\.mlp\.(gate|up|down)_proj\.kernel", r"model.layers.{layer}.mlp.\1_proj.weight", True),
    (r"layers\.(input_layernorm|post_attention_layernorm)\.weight", r"model.layers.{layer}.\1.weight", False),
    (r"norm\.weight", "model.norm.weight", False),
    (r"lm_head\.kernel", "lm_head.weight", True),
)

# Qwen2, Qwen3 and Llama share HF names; a family with other names (fused qkv, say) adds a table.
NAME_TABLES: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "qwen2": _DECODER_TABLE,
    "qwen3": _DECODER_TABLE,
    "llama": _DECODER_TABLE,
}

# Buffers some checkpoints carry that are derived, not learned.
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the tensor."""


@dataclass(frozen=True)
class HFParam:
    """One HF tensor: all of one of our parameters, or one layer's slice of a stacked one."""

    path: tuple[Any, ...]
    """Our NNX state path, e.g. ('layers', 'self_attn', 'q_proj', 'kernel')."""
    hf_name: str
    transpose: bool
    layer: int | None = None
    """Index into the parameter's leading ``layers`` axis; None for an unstacked parameter."""
    cols: tuple[int, int] | None = None
    """For a part of a fused parameter (``models.fused``): its column span in the unfused
    concatenation; None for a whole parameter."""
    fused: FusedLayout | None = field(default=None, compare=False, repr=False)
    """The fused parameter's layout, with ``cols``."""

    def transposed(self, hf_layout: bool = True) -> bool:
        """Whether the tensor is our parameter transposed: in HF's layout, for a kernel."""
        return self.transpose and hf_layout

    def hf_shape(self, shape: tuple[int, ...], hf_layout: bool = True) -> tuple[int, ...]:
        """The HF tensor's shape, from our whole parameter's shape (in our own layout, not
        transposed, with ``hf_layout=False``)."""
        shape = tuple(shape[1:]) if self.layer is not None else tuple(shape)
        if self.cols is not None:
            shape = (*shape[:-1], self.cols[1] - self.cols[0])
        return tuple(reversed(shape)) if self.transposed(hf_layout) else shape


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def hf_name_map(cfg: ModelConfig, paths: list[tuple[Any, ...]],
                fused: Mapping[str, FusedLayout] | None = None) -> list[list[HFParam]]:
    """For each of our parameter paths, its HF tensors (one per layer for a stacked parameter)
    through the family's table. A fused parameter (its module named in ``fused``, the model's
    ``fused_layouts()``) has the HF tensors of each of its parts, each with its columns."""
    out = []
    for path in paths:
        layout = (fused or {}).get(str(getattr(path[-2], "key", path[-2]))) if len(path) >= 2 else None
        if layout is None:
            out.append(_hf_tensors(cfg, path, path))
        else:  # the parts' names through the table, as if unfused
            out.append([HFParam(path, p.hf_name, p.transpose, p.layer, layout.columns(part), layout)
                        for part in layout.parts for p in _hf_tensors(cfg, path, (*path[:-2], part, path[-1]))])
    return out


def _hf_tensors(cfg: ModelConfig, path: tuple[Any, ...], named: tuple[Any, ...]) -> list[HFParam]:
    """The HF tensors of our parameter at ``path``, named as the table names ``named``."""
    dotted = _dotted(named)
    for pattern, template, transpose in NAME_TABLES[cfg.model_type]:
        m = re.fullmatch(pattern, dotted)
        if m:
            name = m.expand(template)
            if "{layer}" in name:
                return [HFParam(path, name.replace("{layer}", str(i)), transpose, i)
                        for i in range(cfg.num_hidden_layers)]
            return [HFParam(path, name, transpose)]
    raise KeyError(f"parameter {dotted!r} has no entry in the {cfg.model_type} name table")


# --- reading ----------------------------------------------------------------------------------

def _weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from None
        files = {name: model_dir / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"{index} names {f.name}, which is missing from {model_dir}")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(
            f"{model_dir}: no model.safetensors, model.safetensors.index.json or *.safetensors file"
        )
    files = {}
    for f in shards:
        with safe_open(str(f), framework="np") as st:
            files.update({k: f for k in st.keys()})
    return files


class _Reader:
    """Keeps safetensors files open (memory-mapped) while a checkpoint loads."""

    def __init__(self) -> None:
        self._open: dict[Path, Any] = {}

    def slice(self, file: Path, name: str) -> Any:
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="np")
        return self._open[file].get_slice(name)


def load_pretrained(
    model_dir: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    dtype: Any = None,
    rules: Rules = DEFAULT_RULES,
    **config_overrides: Any,
) -> Decoder:
    """Load a HF model directory (config.json + safetensors) as a ``Decoder``.

    With a ``mesh``, every parameter is created directly with its sharding: each device reads
    only its slice of the tensor from disk. ``dtype`` (a name such as "bfloat16" or a JAX/NumPy
    dtype) sets both the parameter and compute dtype; None keeps the checkpoint's own
    (config.json's ``torch_dtype``). Finer control goes through ``config_overrides``
    (``param_dtype``, ``dtype``, ``remat``). A config or a tensor the decoder does not implement
    is an error, never a warning: it would give wrong logits.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory; load_pretrained needs a HF model directory")
    if dtype is not None:
        dtype = dtype_name(dtype)
        config_overrides = {"param_dtype": dtype, "dtype": dtype, **config_overrides}
    try:
        cfg = ModelConfig.from_json_file(model_dir / "config.json", **config_overrides)
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    files = _weight_files(model_dir)

    with activate(mesh, rules):
        abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abs_state)
    groups = hf_name_map(cfg, [tuple(p) for p, _ in flat], abstract.fused_layouts())
    expected = {p.hf_name for group in groups for p in group}
    extra = sorted(n for n in files if n not in expected and not _IGNORED_HF.fullmatch(n))
    if extra:
        raise CheckpointError(
            f"{model_dir}: {len(extra)} tensors are not parameters of a {cfg.model_type} model as its "
            f"config.json describes it, e.g. {extra[:3]}: the checkpoint holds weights this decoder "
            f"would ignore, so its logits would be wrong"
        )
    reader = _Reader()
    values = []
    for group, (_, var) in zip(groups, flat, strict=True):
        spec = var.get_value()
        slices = [_checked_slice(reader, files, model_dir, cfg, p, spec.shape) for p in group]
        if group[0].fused is not None:
            read = partial(_read_fused, group, slices, np.dtype(spec.dtype))
        else:
            read = partial(_read_block, slices, group[0].transpose, group[0].layer is not None, np.dtype(spec.dtype))
        if mesh is not None:
            values.append(jax.make_array_from_callback(spec.shape, NamedSharding(mesh, spec.sharding.spec), read))
        else:
            values.append(jnp.asarray(read(tuple(slice(None) for _ in spec.shape))))
    state = nnx.from_flat_state([(tuple(path), v) for (path, _), v in zip(flat, values, strict=True)])
    model = nnx.merge(graphdef, state)
    model.source_dir = str(model_dir)
    return model


def _checked_slice(reader: _Reader, files: dict[str, Path], model_dir: Path, cfg: ModelConfig, param: HFParam,
                   shape: tuple[int, ...]) -> Any:
    """The memory-mapped slice of ``param``'s tensor, after checking it exists with the right shape."""
    want = param.hf_shape(shape)
    if param.hf_name not in files:
        raise CheckpointError(
            f"{model_dir}: tensor {param.hf_name!r} is missing; expected shape {list(want)} for a "
            f"{cfg.model_type} model"
        )
    file = files[param.hf_name]
    sl = reader.slice(file, param.hf_name)
    got = tuple(sl.get_shape())
    if got != want:
        raise CheckpointError(
            f"{file}: tensor {param.hf_name!r} has shape {list(got)}, expected {list(want)} (from config.json)"
        )
    return sl


def _read_block(slices: list[Any], transpose: bool, stacked: bool, np_dtype: Any,
                index: tuple[slice, ...]) -> np.ndarray:
    """Our parameter's block at ``index`` from its HF tensors: for a stacked parameter the first
    index picks layers (one tensor each), the rest index inside each (transposed if need be)."""

    def one(sl: Any, inner: tuple[slice, ...]) -> np.ndarray:
        part = sl[tuple(reversed(inner))].T if transpose else sl[inner]
        return part.astype(np_dtype, copy=False)

    if not stacked:
        return np.ascontiguousarray(one(slices[0], index))
    layers = range(len(slices))[index[0]]
    return np.ascontiguousarray(np.stack([one(slices[i], index[1:]) for i in layers]))


def _read_fused(group: list[HFParam], slices: list[Any], np_dtype: Any, index: tuple[slice, ...]) -> np.ndarray:
    """A fused parameter's block at ``index`` from its parts' HF tensors: of each layer's parts,
    the span of output columns the block holds (rows of the input axis as ``index`` says) is read,
    and the block's fused columns are picked out of them."""
    layout = group[0].fused
    assert layout is not None
    by_layer: dict[int | None, dict[tuple[int, int], tuple[HFParam, Any]]] = {}
    for p, sl in zip(group, slices, strict=True):
        by_layer.setdefault(p.layer, {})[p.cols] = (p, sl)
    stacked = group[0].layer is not None
    inner = index[1:] if stacked else index
    pick = layout.order_array()[inner[-1]]
    # Of each part, only the span of output columns this block holds (a tensor shard's own).
    spans = {}
    for cols in sorted(by_layer[group[0].layer]):
        mine = pick[(pick >= cols[0]) & (pick < cols[1])]
        if len(mine):
            spans[cols] = (int(mine.min()), int(mine.max()) + 1)
    starts = np.cumsum([0] + [b - a for a, b in spans.values()])
    where = np.empty_like(pick)  # each picked column's place among the spans read
    for (lo, hi), start in zip(spans.values(), starts, strict=False):
        sel = (pick >= lo) & (pick < hi)
        where[sel] = start + pick[sel] - lo

    def one(parts: dict[tuple[int, int], tuple[HFParam, Any]]) -> np.ndarray:
        blocks = []
        for cols, (lo, hi) in spans.items():
            p, sl = parts[cols]
            at = (*inner[:-1], slice(lo - cols[0], hi - cols[0]))
            blocks.append(sl[tuple(reversed(at))].T if p.transpose else sl[at])
        return np.concatenate(blocks, axis=-1)[..., where].astype(np_dtype, copy=False)

    if not stacked:
        return np.ascontiguousarray(one(by_layer[None]))
    layers = range(len(by_layer))[index[0]]
    return np.ascontiguousarray(np.stack([one(by_layer[i]) for i in layers]))


def _hf_params(model: Decoder) -> list[tuple[list[HFParam], nnx.Variable]]:
    """Each of the model's parameters with its HF tensors."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    groups = hf_name_map(model.config, [tuple(p) for p, _ in flat], model.fused_layouts())
    return [(group, var) for group, (_, var) in zip(groups, flat, strict=True)]


# --- writing ----------------------------------------------------------------------------------

class HFTensorStream(Iterator[tuple[str, np.ndarray]]):
    """What ``iter_hf_tensors`` returns: an iterator of ``(hf_name, array)`` whose ``layout``
    (name, shape and dtype of every tensor it will yield, in order) is known before any data is
    gathered, so a writer can lay out a safetensors file and stream the bytes into it."""

    def __init__(self, tensors: Iterator[tuple[str, np.ndarray]], layout: list[tuple[str, tuple[int, ...], np.dtype]],
                 *, hf_layout: bool = True):
        self._tensors = tensors
        self.layout = layout
        self.hf_layout = hf_layout
        """False: the kernels are in our ``[in, out]`` layout (``iter_hf_tensors(hf_layout=False)``),
        for our own servers only; a sink that must write HF refuses such a stream."""

    def __iter__(self) -> HFTensorStream:
        return self

    def __next__(self) -> tuple[str, np.ndarray]:
        return next(self._tensors)


def iter_hf_tensors(model: Decoder, dtype: Any = None, owned: Callable[[str], bool] | None = None, *,
                    hf_layout: bool = True) -> HFTensorStream:
    """Yield ``(hf_name, array)`` one tensor at a time, gathered and cast to ``dtype`` (a name or
    a JAX/NumPy dtype; default the parameters' own); the result's ``layout`` lists them first.
    ``hf_layout=False`` leaves the kernels in our ``[in, out]`` layout (HF names, one tensor per
    layer as ever): what our own servers take over HTTP without a transpose on either side.

    Only one full tensor is held on the host at a time; this is what the weight streamer and
    ``save_pretrained`` build on. In a multi-process run every process must run the whole
    iteration (the gathers are collective); with ``owned``, a tensor it rejects is gathered on
    device but never copied to this host, and not yielded.
    """
    cfg: ModelConfig = model.config
    np_dtype = np.dtype(_NP_DTYPES[dtype_name(dtype if dtype is not None else cfg.param_dtype)])
    params = _hf_params(model)
    layout = [(p.hf_name, p.hf_shape(var.get_value().shape, hf_layout), np_dtype) for group, var in params
              for p in group if owned is None or owned(p.hf_name)]

    def gather() -> Iterator[tuple[str, np.ndarray]]:
        for group, var in params:
            value = var.get_value()
            for param in group:
                fetch = owned is None or owned(param.hf_name)
                # Sliced (one layer of a stacked parameter), transposed and cast on the device, so
                # the host receives one finished tensor at a time.
                cols = None if param.fused is None else param.fused.inverse()[slice(*param.cols)]
                arr = gather_to_host(to_hf(value, param.layer, param.transposed(hf_layout), np_dtype, cols), fetch)
                if arr is not None:
                    yield param.hf_name, arr

    return HFTensorStream(gather(), layout, hf_layout=hf_layout)


def hf_tensor_specs(model: Decoder, *, hf_layout: bool = True) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape for every tensor the model writes (no data moved); our own kernels'
    shapes with ``hf_layout=False``."""
    return {name: shape for name, shape, _ in iter_hf_tensors(model, hf_layout=hf_layout).layout}


def check_hf_tensors(specs: dict[str, tuple[int, ...]], tensors: Mapping[str, np.ndarray], model_type: str) -> None:
    """Raise ``CheckpointError`` for a tensor not in ``specs`` (HF name -> shape, as
    ``hf_tensor_specs`` gives) or one of another shape."""
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise CheckpointError(f"tensors {unknown[:5]} are not parameters of this {model_type} model")
    for name, arr in tensors.items():
        if tuple(arr.shape) != specs[name]:
            raise CheckpointError(f"tensor {name!r} has shape {list(arr.shape)}, expected {list(specs[name])}")


def assign_hf_tensors(model: Decoder, tensors: dict[str, np.ndarray], *, hf_layout: bool = True) -> list[str]:
    """Overwrite the model's parameters named (HF names) in ``tensors``, in place; with
    ``hf_layout=False`` the kernels come in our own ``[in, out]`` layout.

    Each value keeps its parameter's dtype and sharding. Any name the model does not have, or a
    shape that differs from the model's, raises ``CheckpointError`` before anything is changed,
    so a bad update never leaves a half-written model. Returns the names assigned.
    """
    by_name = {p.hf_name: (p, var) for group, var in _hf_params(model) for p in group}
    check_hf_tensors({name: p.hf_shape(var.get_value().shape, hf_layout) for name, (p, var) in by_name.items()},
                     tensors, model.config.model_type)
    per_param: dict[tuple[Any, ...], tuple[nnx.Variable, list[tuple[HFParam, np.ndarray]]]] = {}
    for name, arr in tensors.items():
        param, var = by_name[name]
        per_param.setdefault(param.path, (var, []))[1].append((param, np.asarray(arr)))
    new_flat = []
    for path, (var, items) in per_param.items():
        items.sort(key=lambda item: item[0].layer or 0)
        first = items[0][0]
        if first.fused is not None:  # per part: its blocks and layers, into the fused columns
            parts: dict[tuple[int, int], list[tuple[HFParam, np.ndarray]]] = {}
            for p, arr in items:
                parts.setdefault(p.cols, []).append((p, arr))
            value = from_hf_fused(
                var.get_value(),
                [(cols, [a for _, a in part], None if first.layer is None else [p.layer for p, _ in part])
                 for cols, part in parts.items()],
                first.transposed(hf_layout), first.fused.order_array(), first.fused.inverse())
        else:
            layers = None if first.layer is None else [p.layer for p, _ in items]
            value = from_hf(var.get_value(), [arr for _, arr in items], layers, first.transposed(hf_layout))
        new_flat.append((path, value))
    nnx.update(model, nnx.from_flat_state(new_flat))
    return list(tensors)


def read_hf_dir(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a HF model directory's safetensors files, as views of the files mapped into
    memory (nothing is read until the values are used). Derived buffers (``rotary_emb.inv_freq``)
    are left out."""
    model_dir = Path(model_dir)
    out: dict[str, np.ndarray] = {}
    for f in sorted(set(_weight_files(model_dir).values())):
        try:
            tensors = read_safetensors(f)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        out.update({k: v for k, v in tensors.items() if not _IGNORED_HF.fullmatch(k)})
    return out

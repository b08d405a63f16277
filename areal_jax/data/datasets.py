"""Prompt datasets: rows from JSONL, Parquet, a Hugging Face ``save_to_disk`` directory or a
reasoning-gym generator, in the row formats the field uses, tokenised with the model's own chat
template, served by a grain pipeline (seeded shuffle, epochs, a shard per process) whose
iterator state can be saved and restored, plus a held-out split.

Row formats (``DatasetConfig.format``; ``auto`` picks by the keys present):

* ``gsm8k``: ``question``, ``answer`` ending in ``#### 42``; the reward gets ``answer="42"``.
* ``math``: ``problem``, ``solution`` with a ``\\boxed{...}``; the reward gets ``solution``.
* ``chat``: ``messages`` (a list of ``{"role", "content"}``); a trailing assistant message is
  the reference, given to the reward as ``answer``; other fields pass through.
* ``code``: ``prompt`` and ``tests`` (input/output pairs, ``assert`` code, or a list of it: one test each).
* ``generic``: the prompt from ``prompt_field``, the reward's fields from ``reward_fields``.
* reasoning-gym rows carry the generator's entry (``entry``) and task name for its scorer.

An explicit ``format`` wins over the keys of the rows.

A malformed row (bad JSON, a missing field, a wrong type) is skipped with a warning naming the
file, line and field, and counted; ``strict: true`` makes it an error. A missing file, an empty
dataset or an unknown task fails before any work starts.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

FORMATS = ("auto", "gsm8k", "math", "chat", "code", "generic")


class DatasetError(ValueError):
    """A dataset that cannot be used: the message names the file, row and field."""


@dataclass
class DatasetConfig:
    """The ``data:`` section: where prompts come from and how they become token ids."""

    source: Literal["jsonl", "parquet", "hf_disk", "reasoning_gym"] = "reasoning_gym"
    """Where rows come from."""
    path: str | None = None
    """The file (jsonl, parquet) or directory (hf_disk)."""
    format: Literal["auto", "gsm8k", "math", "chat", "code", "generic"] = "auto"
    """Row format; ``auto`` picks by the keys of each row."""
    prompt_field: str = "prompt"
    """``generic`` format: the field holding the prompt text."""
    reward_fields: list[str] = field(default_factory=list)
    """``generic`` format: the fields the reward function gets as keyword arguments."""
    task: str = "chain_sum"
    """reasoning-gym: the generator's name (``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic``, ...)."""
    size: int = 1000
    """reasoning-gym: how many items to generate (the held-out split included)."""
    seed: int = 0
    """reasoning-gym: the generator's seed."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """reasoning-gym: the generator's own options (``min_terms``, ``max_digits``, ...)."""
    system_prompt: str | None = None
    """Prepended as a system message to every prompt."""
    prompt_suffix: str = ""
    """Appended to every user prompt (e.g. an instruction on the answer format)."""
    apply_chat_template: bool = True
    """Render each prompt with the tokenizer's chat template and its generation prompt. False:
    the prompt text as it is (the system prompt, then the user's text and ``prompt_suffix``,
    one per line), for base models and fixed-format tasks; on a 22-character prompt the
    template made 41 tokens of it. ``multi_turn`` and ``agentic`` need the template."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this (after the chat template) are dropped and counted."""
    strict: bool = False
    """A malformed row is an error instead of a counted, logged skip."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of the training split."""
    num_epochs: int | None = None
    """Epochs over the training split; None repeats forever."""
    eval_path: str | None = None
    """A second file (same source type and format) holding the held-out split."""
    eval_fraction: float = 0.0
    """Without ``eval_path``: this fraction of the rows, chosen by ``shuffle_seed``, is held out."""
    eval_size: int | None = None
    """Without ``eval_path``: this many rows are held out (overrides ``eval_fraction``)."""
    process_index: int | None = None
    """This process's shard of the training split; None: ``jax.process_index()``."""
    process_count: int | None = None
    """Number of shards; None: ``jax.process_count()``."""

    def __post_init__(self) -> None:
        if self.source in ("jsonl", "parquet", "hf_disk") and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.format == "generic" and not self.prompt_field:
            raise ValueError("data.format=generic needs data.prompt_field")


@dataclass
class PromptRow:
    """One prompt, ready for a workflow."""

    id: str
    """Stable id: ``file:line`` or ``task:index``."""
    prompt_ids: list[int]
    """Token ids: the chat template applied, the generation prompt added."""
    messages: list[dict[str, Any]]
    """The chat the prompt was rendered from (multi-turn workflows append to it)."""
    prompt: str
    """The user's prompt text, what the reward function gets as ``prompt``."""
    reward_fields: dict[str, Any]
    """Keyword arguments of the reward function (``answer``, ``solution``, ``tests``, ``entry``, ...)."""


@dataclass
class PromptData:
    """A loaded dataset: the training pipeline, the held-out rows, and what was dropped."""

    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    cfg: DatasetConfig
    stats: Counter = field(default_factory=Counter)
    """``malformed``, ``too_long``, ``train``, ``eval`` counts."""

    def pipeline(self) -> Any:
        """The grain ``MapDataset`` of training rows: shuffled per epoch, repeated, this process's shard."""
        import grain

        ds = grain.MapDataset.source(self.train_rows).seed(self.cfg.shuffle_seed).shuffle()
        ds = ds.repeat(self.cfg.num_epochs)
        index, count = _process_shard(self.cfg)
        return ds[index::count] if count > 1 else ds

    def train_iter(self) -> Iterator[PromptRow]:
        """An iterator over training rows with ``get_state()`` / ``set_state()`` (JSON-serialisable).

        Read in the caller's thread, with no prefetch: the rows are in memory, tokenised, so a
        read is an index shuffle and a list lookup. Grain's default readers (16 threads filling
        a 500-row buffer) cost CPU-seconds at every start and contend for the GIL with the run's
        own threads (figures: CHANGELOG, 2026-11-29)."""
        import grain

        return iter(self.pipeline().to_iter_dataset(grain.ReadOptions(num_threads=0)))


def _process_shard(cfg: DatasetConfig) -> tuple[int, int]:
    if cfg.process_index is not None and cfg.process_count is not None:
        return cfg.process_index, cfg.process_count
    import jax

    return (cfg.process_index if cfg.process_index is not None else jax.process_index(),
            cfg.process_count if cfg.process_count is not None else jax.process_count())


# --- raw rows ----------------------------------------------------------------------------------

class _Malformed(Exception):
    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any] | _Malformed]]:
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                yield f"{path.name}:{i}", _Malformed("<json>", f"bad JSON ({e})")
                continue
            yield f"{path.name}:{i}", row if isinstance(row, dict) else _Malformed("<row>", "not a JSON object")


def _read_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any] | _Malformed]]:
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path.name}:{i}", row


def _read_hf_disk(path: Path) -> Iterator[tuple[str, dict[str, Any] | _Malformed]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError("data.source=hf_disk needs the `datasets` package: pip install 'areal-jax[hf]'") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DatasetError(f"{path}: a DatasetDict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    for i, row in enumerate(ds):
        yield f"{path.name}:{i}", row


def _read_reasoning_gym(cfg: DatasetConfig) -> Iterator[tuple[str, dict[str, Any] | _Malformed]]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(cfg.task, size=cfg.size, seed=cfg.seed, **cfg.task_options)
    except (KeyError, ValueError) as e:
        raise DatasetError(f"data.task={cfg.task!r} with options {cfg.task_options}: {e}") from None
    except TypeError as e:
        raise DatasetError(f"data.task_options {cfg.task_options} do not fit {cfg.task!r}: {e}") from None
    for i in range(len(ds)):
        entry = ds[i]
        yield f"{cfg.task}:{i}", {"question": entry["question"], "entry": _plain(entry), "task": cfg.task}


def _plain(x: Any) -> Any:
    """A reasoning-gym entry as plain data (it travels to reward worker processes)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_plain(v) for v in x)
    return x


def _reader(cfg: DatasetConfig, path: str | None) -> Iterator[tuple[str, dict[str, Any] | _Malformed]]:
    if cfg.source == "reasoning_gym":
        return _read_reasoning_gym(cfg)
    p = Path(path or "")
    if not p.exists():
        raise DatasetError(f"data.path={p}: no such {'directory' if cfg.source == 'hf_disk' else 'file'}")
    return {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf_disk": _read_hf_disk}[cfg.source](p)


# --- row formats -------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _str_field(row: dict[str, Any], name: str) -> str:
    if name not in row:
        raise _Malformed(name, f"missing field {name!r}")
    value = row[name]
    if not isinstance(value, str):
        raise _Malformed(name, f"field {name!r} must be a string, got {type(value).__name__}")
    return value


def _detect(row: dict[str, Any]) -> str:
    if "entry" in row and "question" in row and "task" in row:
        return "reasoning_gym"
    if "messages" in row:
        return "chat"
    if "problem" in row and "solution" in row:
        return "math"
    if "question" in row and "answer" in row:
        return "gsm8k"
    if "prompt" in row and "tests" in row:
        return "code"
    raise _Malformed("<row>", f"cannot tell the row format from its keys {sorted(row)}; set data.format")


def parse_row(row: dict[str, Any], cfg: DatasetConfig) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """``(messages, prompt text, reward fields)`` of one raw row, by format."""
    # The user's explicit format wins over the row's keys (a gsm8k row may well have a field
    # called ``entry``); the reasoning-gym source's rows are its own format.
    fmt = ("reasoning_gym" if cfg.source == "reasoning_gym" else
           _detect(row) if cfg.format == "auto" else cfg.format)
    if fmt == "reasoning_gym":
        prompt, fields = row["question"], {"entry": row["entry"], "task": row["task"]}
    elif fmt == "gsm8k":
        prompt, answer = _str_field(row, "question"), _str_field(row, "answer")
        final = answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()
        if not final:
            raise _Malformed("answer", "field 'answer' has no final answer after '####'")
        fields = {"answer": final.replace(",", ""), "solution": answer}
    elif fmt == "math":
        prompt, solution = _str_field(row, "problem"), _str_field(row, "solution")
        if last_boxed(solution) is None and "answer" not in row:
            raise _Malformed("solution", "field 'solution' has no \\boxed{...} answer (and there is no 'answer')")
        fields = {"solution": solution, **({"answer": str(row["answer"])} if "answer" in row else {})}
    elif fmt == "chat":
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise _Malformed("messages", "field 'messages' must be a non-empty list of {role, content} strings")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        extra = {k: v for k, v in row.items() if k != "messages"}
        if messages[-1]["role"] == "assistant":
            extra.setdefault("answer", messages.pop()["content"])
        if not messages or messages[-1]["role"] != "user":
            raise _Malformed("messages", "the chat must end with a user message (or a user then an assistant one)")
        users = [m["content"] for m in messages if m["role"] == "user"]
        return _with_system(messages, cfg), users[-1], extra
    elif fmt == "code":
        prompt = _str_field(row, "prompt")
        tests = row.get("tests")
        if not (isinstance(tests, str) or (isinstance(tests, list) and (all(
                isinstance(t, dict) and "input" in t and "output" in t for t in tests) or all(
                isinstance(t, str) for t in tests)))):
            raise _Malformed("tests", "field 'tests' must be assert code (a string), a list of assert code strings "
                             "(one test each) or a list of {input, output}")
        fields = {"tests": tests}
    elif fmt == "generic":
        prompt = _str_field(row, cfg.prompt_field)
        missing = [f for f in cfg.reward_fields if f not in row]
        if missing:
            raise _Malformed(missing[0], f"missing field {missing[0]!r} (data.reward_fields)")
        fields = {f: row[f] for f in cfg.reward_fields}
    else:
        raise DatasetError(f"data.format={fmt!r} is not one of {FORMATS}")
    messages = [{"role": "user", "content": prompt + cfg.prompt_suffix}]
    return _with_system(messages, cfg), prompt, fields


def _with_system(messages: list[dict[str, Any]], cfg: DatasetConfig) -> list[dict[str, Any]]:
    if cfg.system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": cfg.system_prompt}, *messages]
    return messages


# --- loading -----------------------------------------------------------------------------------

ParsedRow = tuple[str, list[dict[str, Any]], str, dict[str, Any]]
"""``(row id, messages, prompt text, reward fields)``: a row read and checked, not yet tokenised."""


@dataclass
class ReadPrompts:
    """A dataset's rows read and checked without a tokenizer (``read_prompts``), for
    ``load_prompts`` to tokenise and split."""

    rows: list[ParsedRow]
    eval_rows: list[ParsedRow] | None
    """The rows of ``data.eval_path``; None: the held-out rows are split off ``rows``."""
    stats: Counter


def _parse_rows(cfg: DatasetConfig, path: str | None, stats: Counter) -> list[ParsedRow]:
    rows = []
    for row_id, raw in _reader(cfg, path):
        try:
            if isinstance(raw, _Malformed):
                raise raw
            messages, prompt, fields = parse_row(raw, cfg)
        except _Malformed as e:
            if cfg.strict:
                raise DatasetError(f"{row_id}: field {e.field}: {e} (data.strict is on)") from None
            stats["malformed"] += 1
            log.warning("skipping malformed row %s: field %s: %s", row_id, e.field, e)
            continue
        rows.append((row_id, messages, prompt, fields))
    return rows


def _tokenize_rows(cfg: DatasetConfig, tokenizer: Any, rows: list[ParsedRow], stats: Counter) -> list[PromptRow]:
    from areal_jax.models.tokenizer import encode_chat

    out = []
    for row_id, messages, prompt, fields in rows:
        ids = (encode_chat(tokenizer, messages) if cfg.apply_chat_template else
               list(tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=True)))
        if cfg.max_prompt_tokens is not None and len(ids) > cfg.max_prompt_tokens:
            stats["too_long"] += 1
            continue
        out.append(PromptRow(row_id, ids, messages, prompt, fields))
    return out


def _where(cfg: DatasetConfig) -> str:
    return f"data.path={cfg.path}" if cfg.path else f"data.task={cfg.task!r} (data.size={cfg.size})"


def _check_counts(cfg: DatasetConfig, n_rows: int, stats: Counter) -> int:
    """The number of held-out rows to split off ``n_rows`` usable ones (0 with ``data.eval_path``);
    raises when there is no usable row or nothing would be left to train on."""
    if not n_rows:
        fix = ("point data.path at rows in the data.format it reads (malformed rows are logged with file and "
               "line)" if cfg.path else "raise data.size or loosen data.max_prompt_tokens")
        raise DatasetError(f"{_where(cfg)}: no usable rows ({dict(stats) or 'the source is empty'}); {fix}")
    if cfg.eval_path:
        return 0
    n_eval = cfg.eval_size if cfg.eval_size is not None else int(round(cfg.eval_fraction * n_rows))
    if n_eval >= n_rows:
        raise DatasetError(f"{_where(cfg)}: holding out {n_eval} of {n_rows} rows leaves none to train on; "
                           "lower data.eval_size or data.eval_fraction, or give data.eval_path")
    return n_eval


def read_prompts(cfg: DatasetConfig) -> ReadPrompts:
    """Read and check the rows without a tokenizer: fails on a missing file, an unknown task, a
    malformed row under ``data.strict``, a source with no usable row, or a held-out share that
    leaves none to train on. A run calls it before any model is written or server started (only
    ``data.max_prompt_tokens``, which needs tokens, is checked later, by ``load_prompts``)."""
    stats: Counter = Counter()
    rows = _parse_rows(cfg, cfg.path, stats)
    _check_counts(cfg, len(rows), stats)
    eval_rows = _parse_rows(cfg, cfg.eval_path, stats) if cfg.eval_path else None
    return ReadPrompts(rows, eval_rows, stats)


def load_prompts(cfg: DatasetConfig, tokenizer: Any, read: ReadPrompts | None = None) -> PromptData:
    """Read, check and tokenise the dataset; split off the held-out rows. Fails before any work
    starts on a missing file, an unknown task or a dataset with no usable row. ``read``: the rows
    ``read_prompts`` read already (else they are read here)."""
    read = read_prompts(cfg) if read is None else read
    stats = Counter(read.stats)
    rows = _tokenize_rows(cfg, tokenizer, read.rows, stats)
    n_eval = _check_counts(cfg, len(rows), stats)
    if read.eval_rows is not None:
        eval_rows = _tokenize_rows(cfg, tokenizer, read.eval_rows, stats)
        train_rows = rows
    else:
        import numpy as np

        order = np.random.default_rng(cfg.shuffle_seed).permutation(len(rows))
        held = set(order[:n_eval].tolist())
        eval_rows = [r for i, r in enumerate(rows) if i in held]
        train_rows = [r for i, r in enumerate(rows) if i not in held]
    stats["train"], stats["eval"] = len(train_rows), len(eval_rows)
    if stats["malformed"] or stats["too_long"]:
        log.warning("%s: skipped %d malformed and %d too-long rows", _where(cfg), stats["malformed"], stats["too_long"])
    return PromptData(train_rows, eval_rows, cfg, stats)

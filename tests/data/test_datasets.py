"""Prompt datasets: every row format from a committed fixture, malformed rows counted with file
and line, errors before work starts, the held-out split, process shards, and grain iterator resume."""

import json
import logging
import threading
from pathlib import Path

import pytest

from areal_jax.data import DatasetConfig, DatasetError, load_prompts, read_prompts
from areal_jax.models import encode_chat
from areal_jax.models.tiny import build_char_tokenizer

FIX = Path(__file__).parents[1] / "fixtures" / "data"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _load(tok, name: str, **kw):
    return load_prompts(DatasetConfig(source="jsonl", path=str(FIX / name), **kw), tok)


def test_gsm8k(tok) -> None:
    data = _load(tok, "gsm8k.jsonl")
    rows = data.train_rows
    assert [r.reward_fields["answer"] for r in rows] == ["7", "3000", "3"]
    assert rows[0].id == "gsm8k.jsonl:1" and rows[0].prompt.startswith("Tom has 3 apples")
    assert rows[0].prompt_ids == encode_chat(tok, [{"role": "user", "content": rows[0].prompt}])


def test_math_chat_code_generic(tok) -> None:
    m = _load(tok, "math.jsonl").train_rows
    assert "\\boxed{\\frac{3}{4}}" in m[0].reward_fields["solution"]
    c = _load(tok, "chat.jsonl").train_rows
    assert c[0].messages == [{"role": "user", "content": "Say hi."}] and c[0].reward_fields["answer"] == "hi"
    assert c[1].messages[0]["role"] == "system" and c[1].reward_fields["answer"] == "4"
    k = _load(tok, "code.jsonl").train_rows
    assert k[0].reward_fields["tests"][1] == {"input": "10 -3", "output": "7"}
    assert k[1].reward_fields["tests"].startswith("assert add(1, 2)")
    g = _load(tok, "generic.jsonl", format="generic", prompt_field="instruction",
              reward_fields=["target", "difficulty"]).train_rows
    assert g[1].prompt == "Name the capital of Italy." and g[1].reward_fields == {"target": "Rome", "difficulty": 2}


def test_parquet_and_system_prompt(tok, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIX / "gsm8k.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet")
    data = load_prompts(DatasetConfig(source="parquet", path=str(tmp_path / "g.parquet"),
                                      system_prompt="Answer with a number."), tok)
    r = data.train_rows[2]
    assert r.reward_fields["answer"] == "3"
    assert r.messages[0] == {"role": "system", "content": "Answer with a number."}
    assert r.prompt_ids == encode_chat(tok, r.messages)


def test_hf_save_to_disk(tok, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in (FIX / "math.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    data = load_prompts(DatasetConfig(source="hf_disk", path=str(tmp_path / "ds")), tok)
    assert len(data.train_rows) == 2 and "boxed{3}" in data.train_rows[1].reward_fields["solution"]


def test_malformed_rows_are_counted_with_file_line_and_field(tok, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        data = _load(tok, "malformed.jsonl", format="gsm8k")
    assert [r.id for r in data.train_rows] == ["malformed.jsonl:1", "malformed.jsonl:6"]
    assert data.stats["malformed"] == 4
    text = caplog.text
    assert "malformed.jsonl:2: field <json>" in text.replace("row ", "")
    assert "malformed.jsonl:3" in text and "field question" in text and "must be a string" in text
    assert "malformed.jsonl:4" in text and "missing field 'question'" in text
    with pytest.raises(DatasetError, match=r"malformed.jsonl:2: field <json>: bad JSON"):
        _load(tok, "malformed.jsonl", format="gsm8k", strict=True)


def test_errors_before_any_work(tok, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_prompts(DatasetConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")), tok)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompts(DatasetConfig(source="jsonl", path=str(tmp_path / "empty.jsonl")), tok)
    with pytest.raises(DatasetError, match="data.task='no_such_task'"):
        load_prompts(DatasetConfig(task="no_such_task", size=3), tok)
    with pytest.raises(DatasetError, match="task_options"):
        load_prompts(DatasetConfig(task="chain_sum", size=3, task_options={"bogus": 1}), tok)
    with pytest.raises(ValueError, match="data.source=jsonl needs data.path"):
        DatasetConfig(source="jsonl")


def test_rows_are_read_and_checked_without_a_tokenizer(tok, tmp_path: Path) -> None:
    """``read_prompts`` (what a run does before any model is written or server started) raises
    the same errors as ``load_prompts`` with no tokenizer at hand, and ``load_prompts`` over its
    rows gives the rows, split and counts of a load from scratch."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="no usable rows"):
        read_prompts(DatasetConfig(source="jsonl", path=str(tmp_path / "empty.jsonl")))
    with pytest.raises(DatasetError, match=r"holding out 3 of 3 rows leaves none to train on"):
        read_prompts(DatasetConfig(source="jsonl", path=str(FIX / "gsm8k.jsonl"), eval_size=3))
    with pytest.raises(DatasetError, match="data.strict is on"):
        read_prompts(DatasetConfig(source="jsonl", path=str(FIX / "malformed.jsonl"), format="gsm8k", strict=True))
    cfg = DatasetConfig(task="chain_sum", size=30, seed=1, eval_size=5)
    read = read_prompts(cfg)
    assert len(read.rows) == 30 and read.eval_rows is None
    both, fresh = load_prompts(cfg, tok, read), load_prompts(cfg, tok)
    assert [(r.id, r.prompt_ids) for r in both.eval_rows] == [(r.id, r.prompt_ids) for r in fresh.eval_rows]
    assert [r.id for r in both.train_rows] == [r.id for r in fresh.train_rows] and both.stats == fresh.stats
    # the rows read are not changed by tokenising them: a second load over them is the same
    assert [r.id for r in load_prompts(cfg, tok, read).eval_rows] == [r.id for r in fresh.eval_rows]


def test_too_long_prompts_dropped_and_counted(tok) -> None:
    data = _load(tok, "gsm8k.jsonl", max_prompt_tokens=60)
    assert [r.reward_fields["answer"] for r in data.train_rows] == ["3"]
    assert data.stats["too_long"] == 2


def test_reasoning_gym_rows_and_eval_split(tok) -> None:
    cfg = DatasetConfig(task="chain_sum", size=50, seed=3, task_options={"min_terms": 2, "max_terms": 2},
                        eval_size=10, prompt_suffix=" Answer with the number only.")
    data = load_prompts(cfg, tok)
    assert len(data.train_rows) == 40 and len(data.eval_rows) == 10
    assert not {r.id for r in data.train_rows} & {r.id for r in data.eval_rows}
    r = data.eval_rows[0]
    assert r.reward_fields["task"] == "chain_sum" and r.reward_fields["entry"]["question"] == r.prompt
    assert r.messages[-1]["content"].endswith("Answer with the number only.")
    again = load_prompts(cfg, tok)  # seeded: the same split every time
    assert [x.id for x in again.eval_rows] == [x.id for x in data.eval_rows]
    sep = _load(tok, "gsm8k.jsonl", eval_path=str(FIX / "malformed.jsonl"), format="gsm8k")
    assert len(sep.train_rows) == 3 and len(sep.eval_rows) == 2


def test_restored_iterator_gives_the_next_50_prompts(tok) -> None:
    data = load_prompts(DatasetConfig(task="chain_sum", size=40, seed=1, shuffle_seed=7), tok)
    it = data.train_iter()
    for _ in range(23):  # into the first epoch
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # it goes into a checkpoint as JSON
    expected = [next(it).id for _ in range(50)]  # crosses into the next epoch
    fresh = data.train_iter()
    fresh.set_state(state)
    assert [next(fresh).id for _ in range(50)] == expected
    epoch1 = [next(data.train_iter()).id for _ in range(1)]
    assert len(set(expected)) > 30 and epoch1


def test_the_iterator_reads_in_the_callers_thread(tok) -> None:
    """No prefetch threads (``PromptData.train_iter``): grain's default starts 16 readers."""
    data = load_prompts(DatasetConfig(task="chain_sum", size=12, seed=1), tok)
    before = set(threading.enumerate())
    it = data.train_iter()
    ids = [next(it).id for _ in range(30)]
    assert set(threading.enumerate()) == before
    assert sorted(ids[:12]) == sorted(r.id for r in data.train_rows)


def test_epochs_reshuffle_and_end(tok) -> None:
    data = load_prompts(DatasetConfig(task="chain_sum", size=12, seed=1, num_epochs=2), tok)
    ids = [r.id for r in data.train_iter()]
    assert len(ids) == 24 and sorted(ids[:12]) == sorted(ids[12:]) and ids[:12] != ids[12:]


def test_process_shards_are_disjoint_and_cover(tok) -> None:
    def shard(i: int) -> list[str]:
        cfg = DatasetConfig(task="chain_sum", size=30, seed=1, num_epochs=1, process_index=i, process_count=3)
        return [r.id for r in load_prompts(cfg, tok).train_iter()]

    parts = [shard(i) for i in range(3)]
    assert all(len(p) == 10 for p in parts)
    assert sorted(sum(parts, [])) == sorted(f"chain_sum:{i}" for i in range(30))


def test_explicit_format_wins_over_a_row_field_named_entry(tok, tmp_path: Path) -> None:
    """A gsm8k row with a field called ``entry`` was read as a reasoning-gym row, whatever
    ``data.format`` said, and failed with KeyError 'task'."""
    f = tmp_path / "diary.jsonl"
    f.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7",
                             "entry": "diary page 12"}) + "\n")
    rows = load_prompts(DatasetConfig(source="jsonl", path=str(f), format="gsm8k"), tok).train_rows
    assert rows[0].reward_fields["answer"] == "7" and "entry" not in rows[0].reward_fields
    # auto: a reasoning-gym row has its task too; without one, the other keys decide
    rows = load_prompts(DatasetConfig(source="jsonl", path=str(f)), tok).train_rows
    assert rows[0].reward_fields["answer"] == "7"


def test_raw_prompts_skip_the_chat_template(tok) -> None:
    data = _load(tok, "gsm8k.jsonl", apply_chat_template=False, prompt_suffix=" A:")
    row = data.train_rows[0]
    assert row.prompt_ids == list(tok.encode(row.prompt + " A:", add_special_tokens=True))
    templated = _load(tok, "gsm8k.jsonl", prompt_suffix=" A:").train_rows[0]
    assert len(row.prompt_ids) < len(templated.prompt_ids)  # no role markers, no generation prompt

"""``areal-jax bench --quick``: every part runs end to end and writes JSON with every field, in
range, and its plots."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jax.bench import runs, tasks
from areal_jax.bench.cli import parse_args
from areal_jax.rewards import isolation
from tests import xla_flags

RUN_FIELDS = ("wall_s_per_step", "generated_tokens_per_s", "trained_tokens_per_s", "trainer_idle_fraction",
              "rollout_idle_fraction", "accuracy_before", "accuracy_after", "staleness_mean", "answer_len_max")


def _check_run(row: dict) -> None:
    for key in RUN_FIELDS:
        assert key in row and row[key] is not None and math.isfinite(row[key]), (key, row.get(key))
    assert row["wall_s_per_step"] > 0 and row["generated_tokens_per_s"] > 0 and row["trained_tokens_per_s"] > 0
    for key in ("trainer_idle_fraction", "rollout_idle_fraction", "accuracy_before", "accuracy_after"):
        assert 0.0 <= row[key] <= 1.0, (key, row[key])
    assert 0 <= row["staleness_mean"] <= row.get("max_staleness", 0)
    assert len(row["reward_curve"]) == row["steps"] and all(0.0 <= r <= 1.0 for r in row["reward_curve"])


def test_parse_args_rejects_unknown_parts() -> None:
    assert parse_args(["--parts", "async,components"]).parts == ["async", "components"]
    with pytest.raises(SystemExit):
        parse_args(["--parts", "async,nope"])


def test_parse_args_rejects_steps_that_leave_nothing_timed(capsys: pytest.CaptureFixture) -> None:
    assert parse_args(["--steps", "60"]).steps == 60 and parse_args([]).steps is None
    assert parse_args(["--quick", "--steps", "2"]).steps == 2  # one warm-up step with --quick
    with pytest.raises(SystemExit):
        parse_args(["--steps", "3"])  # three warm-up steps otherwise
    assert "--steps 4 or more" in capsys.readouterr().err


def test_parse_args_keeps_the_warm_start_seed_apart_from_the_rl_seed() -> None:
    """``--seed`` picks the RL seeds; the warm start has its own seed (0 by default), so
    invocations at different ``--seed`` start RL from the same checkpoint and can be pooled."""
    assert parse_args(["--seed", "15"]).warm_start_seed == 0
    args = parse_args(["--seed", "15", "--warm-start-seed", "3"])
    assert (args.seed, args.warm_start_seed) == (15, 3)


def test_parse_args_selects_async_modes_and_seeds_keeping_the_baseline(capsys: pytest.CaptureFixture) -> None:
    from areal_jax.bench.async_sync import modes

    args = parse_args(["--modes", "async_eta4, async_eta2", "--seeds", "6"])
    assert args.modes == ["async_eta4", "async_eta2"] and args.seeds == 6
    # the baseline runs whatever --modes says, and the order stays the part's own
    assert [m[0] for m in modes(False, args.modes)] == ["sync", "async_eta2", "async_eta4"]
    assert [m[0] for m in modes(False, None)] == ["sync", "async_eta1", "async_eta2", "async_eta4",
                                                 "async_eta4_in_place"]
    naive = modes(True, ["async_eta4_naive"])  # on request only, with --quick too
    assert [m[0] for m in naive] == ["sync", "async_eta4_naive"]
    assert naive[1][3] == {"algo.use_decoupled_loss": False}
    both = modes(False, ["async_eta4_m2po", "async_eta4_naive"])
    assert [m[0] for m in both] == ["sync", "async_eta4_naive", "async_eta4_m2po"]
    inline = modes(False, ["async_eta4", "async_eta4_push_inline"])
    assert [m[0] for m in inline] == ["sync", "async_eta4", "async_eta4_push_inline"]
    assert inline[2][3] == {"rollout.overlap_weight_push": False} and inline[1][3] == {}
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--modes", "async_eta2"])  # --quick runs sync and eta 4 only
    assert "unknown mode(s) ['async_eta2']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "0"])
    assert "--seeds 0" in capsys.readouterr().err


def test_scratch_examples_are_long_tailed_and_end_in_the_answer() -> None:
    class Tok:
        eos_token_id = 0

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    class Row:
        id = "basic_arithmetic:0"
        prompt_ids = [1, 2]
        reward_fields = {"entry": {"answer": "12", "metadata": {"expression": "7 + 5"}}}

    p99s = {}
    for name, scratch in (("task", tasks.SCRATCH), ("long", tasks.LONG_TAIL_SCRATCH)):
        ex = tasks.scratch_examples([Row()] * 2000, Tok(), seed=0, scratch=scratch)
        unit = "." if name == "task" else "7+5;"  # dots, or the sum written out again
        pads = [bytes(a[:-4]).decode() for _, a in ex]
        assert all(a[-4:] == [ord("\n"), ord("1"), ord("2"), 0] for _, a in ex)
        assert all(p == unit * (len(p) // len(unit)) for p in pads)
        counts = sorted(len(p) // len(unit) for p in pads)
        median, p99s[name] = counts[len(counts) // 2], counts[int(0.99 * len(counts))] * len(unit)
        assert median <= scratch["median"] + 1 and counts[int(0.99 * len(counts))] >= 4 * median  # a long tail
        assert max(counts) <= scratch["max"]
    assert p99s["long"] >= 2 * p99s["task"]
    Row.reward_fields = {"answer": "12"}  # a GSM8K-style row has no expression to echo: named
    with pytest.raises(ValueError, match="basic_arithmetic:0.*metadata.expression"):
        tasks.scratch_examples([Row()], Tok(), seed=0, scratch=tasks.LONG_TAIL_SCRATCH)


def test_long_tail_task_has_room_for_its_answers() -> None:
    task, scratch = tasks.task_config(False, tasks.LONG_TAIL_TASK), tasks.LONG_TAIL_SCRATCH
    answer = 4 * scratch["max"] + 4  # "a+b;" units, newline, a two-digit sum, eos
    assert task["warm_start"]["max_len"] >= answer + 40  # and the prompt (35 tokens)
    assert task["rollout"]["max_new_tokens"] >= 2 * answer  # RL grows the tail past the warm start's
    context = int(task["rollout"]["server_args"][task["rollout"]["server_args"].index("--context-length") + 1])
    assert context >= task["rollout"]["max_new_tokens"] + 64  # room for the prompt, as in the measured run
    assert task["train"]["max_seq_len"] >= context
    assert tasks.TASK["rollout"]["max_new_tokens"] == 96  # the variant did not change the default task
    assert parse_args(["--long-tail"]).long_tail and not parse_args([]).long_tail


def test_async_modes_are_valid_run_configs_and_only_full_runs_warm_the_server(tmp_path: Path) -> None:
    """Every async-part mode's overrides load as a ``RunConfig`` (a misspelt key would fail), the
    full part adds ``max_staleness`` 4 paused in place beside the default abort, and only full runs
    compile the server's shapes up front."""
    from areal_jax.bench.async_sync import modes
    from areal_jax.config import from_dict
    from areal_jax.trainer.run_config import RunConfig

    for quick in (True, False):
        task = tasks.task_config(quick, tasks.LONG_TAIL_TASK)
        assert ("--server-warmup" in task["rollout"]["server_args"]) is not quick
        # a quick run's server compiles only the shapes its requests meet, not the rest in the background
        assert ("--compile-threads" in task["rollout"]["server_args"]) is quick
        loaded = {}
        on_request = modes(quick, ["async_eta4_naive", "async_eta4_m2po", "async_eta4_push_inline",
                                   "async_eta4_pause_first", "async_eta4_per_answer"])[1:]
        for name, mode, eta, overrides in modes(quick, None) + on_request:
            cfg = tasks.run_config(task, tmp_path, tmp_path / name, **{"rollout.mode": mode,
                                                                      "rollout.max_staleness": eta, **overrides})
            loaded[name] = from_dict(RunConfig, cfg).rollout
        assert list(loaded)[0] == "sync" and loaded["async_eta4"].pause_mode == "abort"
        assert not from_dict(RunConfig, tasks.run_config(task, tmp_path, tmp_path / "n", **{
            "rollout.mode": "async", "rollout.max_staleness": 4, **modes(quick, ["async_eta4_naive"])[1][3]})
        ).algo.use_decoupled_loss
        m2po = from_dict(RunConfig, tasks.run_config(task, tmp_path, tmp_path / "m", **{
            "rollout.mode": "async", "rollout.max_staleness": 4, **on_request[1][3]})).algo
        assert m2po.m2_threshold == 0.04 and m2po.use_decoupled_loss
        if quick:
            assert list(loaded) == ["sync", "async_eta4", "async_eta4_naive", "async_eta4_m2po",
                                    "async_eta4_push_inline", "async_eta4_pause_first", "async_eta4_per_answer"]
        assert loaded["async_eta4"].overlap_weight_push and not loaded["async_eta4_push_inline"].overlap_weight_push
        assert loaded["async_eta4"].push_before_pause and not loaded["async_eta4_pause_first"].push_before_pause
        assert loaded["async_eta4"].batch_group_requests and not loaded["async_eta4_per_answer"].batch_group_requests
        if not quick:
            assert loaded["async_eta4_in_place"].pause_mode == "in_place"
            assert loaded["async_eta4_in_place"].effective_max_staleness == 4


def test_a_run_key_is_the_loaded_config_and_how_it_ran(tmp_path: Path) -> None:
    """Two parts' runs are the same run when their configs load alike (a key given its default
    value changes nothing; the folder is not part of it) and they ran on the same cores with the
    same warm-up; any other difference makes another run."""
    task = tasks.task_config(True, tasks.TASK)
    how = dict(rollout_cores=[1], trainer_cores=[0], warmup_steps=1, own_process=False)

    def key(name: str, **overrides: object) -> str:
        cfg = tasks.run_config(task, tmp_path, tmp_path / name,
                               **{"steps": 3, "seed": 0, "rollout.mode": "async", "rollout.max_staleness": 4,
                                  **overrides})
        return runs.run_key(cfg, **how)

    eta4 = key("async_eta4")
    assert key("update_interrupt", **{"rollout.interruptible": True, "rollout.pause_mode": "abort"}) == eta4
    assert key("update_wait", **{"rollout.interruptible": False}) != eta4
    assert key("update_in_place", **{"rollout.pause_mode": "in_place"}) != eta4
    assert key("other_seed", seed=1) != eta4
    cfg = tasks.run_config(task, tmp_path, tmp_path / "x", steps=3, seed=0,
                           **{"rollout.mode": "async", "rollout.max_staleness": 4})
    assert runs.run_key(cfg, **{**how, "warmup_steps": 2}) != eta4


def test_run_pinned_runs_in_a_new_process_on_the_cores_given() -> None:
    before = os.sched_getaffinity(0)
    core = max(before)
    pid, cores = runs.run_pinned([core], _pid_and_cores)
    assert pid != os.getpid() and cores == [core]
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ZeroDivisionError):  # the child's error is raised here
        runs.run_pinned([core], divmod, 1, 0)


def _pid_and_cores() -> tuple[int, list[int]]:
    return os.getpid(), sorted(os.sched_getaffinity(0))


def test_thread_affinity_reaches_child_processes_and_is_restored() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    with runs.thread_affinity([core]):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str([core])
    assert os.sched_getaffinity(0) == before


def test_summarize_takes_the_window_after_warmup() -> None:
    """Three steps ending at 10, 12 and 15 s, one left out: a 5 s window of two steps, less the
    second step's 1 s held-out evaluation (a step's time is taken before its evaluation, so the
    last step's 0.5 s one falls after the window); the server polled idle in half of its samples
    there and generated 300 tokens, spent 1 of its 4 compiled-call seconds in prefill and 1 of
    the 4 s paused; 4 groups of 2-group batches were filtered over the run."""
    poller = runs.ServerPoller("127.0.0.1:1")
    # (time, running + queued, generated tokens, prefill seconds, decode seconds, paused seconds)
    poller.samples = [(9.0, 5, 0.0, 0.0, 0.0, 0.0), (10.0, 0, 100.0, 0.5, 0.5, 0.2),
                      (12.0, 3, 250.0, 1.0, 1.5, 0.7), (13.0, 0, 300.0, 1.0, 2.0, 0.8),
                      (15.0, 2, 400.0, 1.5, 3.5, 1.2), (16.0, 0, 999.0, 9.0, 9.0, 9.0)]
    step = {"trajectories": 4, "answer_len_mean": 10.0, "batch_wait_seconds": 0.5, "train_seconds": 1.0,
            "weight_sync_seconds": 0.1, "staleness_mean": 1.0, "answer_len_max": 30, "reward_mean": 0.5,
            "prompt_ids": ["a", "b"]}
    metrics = [{**step, "time": t, "step": i + 1, "filtered": 2 * i} for i, t in enumerate((4.0, 6.0, 9.0))]
    metrics[1].update(eval_accuracy=0.2, eval_seconds=1.0)
    metrics[-1].update(eval_accuracy=0.3, eval_seconds=0.5)
    metrics[0]["compile_seconds"] = 3.0  # the warm-up step's compiling is outside the window anyway
    metrics[-1]["compile_seconds"] = 0.5  # a new shape met in a timed step
    out = runs.summarize(metrics, [10.0, 12.0, 15.0], poller, 1, {"eval_accuracy": 0.1, "eval_prompts": 50},
                         {"eval_accuracy": 0.3, "eval_prompts": 50})
    assert out["timed_steps"] == 2 and out["wall_s_per_step"] == pytest.approx(2.0)
    assert out["compile_s_per_step"] == pytest.approx(0.25) and out["steady_s_per_step"] == pytest.approx(1.75)
    assert out["generated_tokens_per_s"] == pytest.approx(300 / 4)
    assert out["trained_tokens_per_s"] == pytest.approx(2 * 40 / 4)
    assert out["trainer_idle_fraction"] == pytest.approx(1.0 / 4)
    assert out["rollout_idle_fraction"] == pytest.approx(0.5)
    assert out["rollout_prefill_share"] == pytest.approx(1.0 / 4)
    assert out["rollout_paused_share"] == pytest.approx(1.0 / 5)  # 1 s of the 10-15 s window
    assert out["step_end_s"] == pytest.approx([4.0, 6.0, 9.0])
    assert (out["accuracy_before"], out["accuracy_after"]) == (0.1, 0.3)
    assert out["accuracy_curve"] == [[0, 0.1], [2, 0.2], [3, 0.3]] and out["eval_prompts"] == 50
    # between polls the token counter is read by interpolation: 250 at 12 s and 350 at 14 s; 175 at
    # 11 s and 275 at 12.5 s, a window with a single (busy) sample inside
    assert poller.window(12.0, 14.0) == (pytest.approx(0.5), pytest.approx(100.0))
    assert poller.window(11.0, 12.5) == (0.0, pytest.approx(100.0))
    assert poller.prefill_share(12.0, 14.0) == pytest.approx(0.25 / (0.25 + 1.25))  # interpolated as well
    assert poller.paused_share(12.0, 14.0) == pytest.approx((1.0 - 0.7) / 2)
    stock = runs.ServerPoller("127.0.0.1:1")  # a stock SGLang server: no such counters, NaN
    stock.samples = [(t, b, g, float("nan"), float("nan"), float("nan")) for t, b, g, *_ in poller.samples]
    assert math.isnan(stock.prefill_share(10.0, 15.0)) and math.isnan(stock.paused_share(10.0, 15.0))
    assert stock.window(10.0, 15.0) == poller.window(10.0, 15.0)
    assert out["filtered_fraction"] == pytest.approx(4 / (4 + 3 * 2))
    # one warm-up step at the steady 2 s; then step 2 ends at 12 s, step 3 at 15 s less step 2's evaluation
    assert [pytest.approx(x) for x in out["accuracy_clock"]] == [[0.0, 0.1], [4.0, 0.2], [6.0, 0.3]]
    assert runs.seconds_to(out["accuracy_clock"], 0.3) == pytest.approx(6.0)
    assert runs.seconds_to(out["accuracy_clock"], 0.05) == 0.0
    assert runs.seconds_to(out["accuracy_clock"], 0.31) is None


def test_compare_takes_ratios_to_the_synchronous_runs_final_accuracy() -> None:
    from areal_jax.bench.async_sync import compare
    from areal_jax.bench.tables import async_table

    def row(wall: float, tokens: float, clock: list, prompts: int = 400, compiling: float = 0.0) -> dict:
        return {"wall_s_per_step": wall, "trained_tokens_per_s": tokens, "accuracy_clock": clock,
                "accuracy_after": clock[-1][1], "eval_prompts": prompts, "steady_s_per_step": wall - compiling}

    rows = [row(2.0, 100.0, [[0, 0.2], [50, 0.3], [100, 0.4]], compiling=0.5),  # sync ends at 40%, first there at 100 s
            row(1.0, 300.0, [[0, 0.2], [25, 0.45], [50, 0.32]], compiling=0.25),  # there at 25 s; ends 8 points lower
            row(0.5, 400.0, [[0, 0.2], [25, 0.3], [50, 0.39]]),  # never there, ends 1 point lower
            row(0.25, 800.0, [[0, 0.2], [25, 0.3], [50, 0.39]], prompts=4000)]
    compare(rows)
    assert [r["accuracy_target"] for r in rows] == [0.4] * 4
    assert [r["sync_over_this_wall"] for r in rows] == [1.0, 2.0, 4.0, 8.0]
    assert [r["sync_over_this_steady"] for r in rows] == [1.0, 2.0, 3.0, 6.0]  # 1.5 s of sync's 2 s was steady
    assert [r["this_over_sync_trained_tokens"] for r in rows] == [1.0, 3.0, 4.0, 8.0]
    assert [r["seconds_to_accuracy"] for r in rows] == [100, 25, None, None]
    assert [r["sync_over_this_first_reach"] for r in rows] == [1.0, 4.0, None, None]
    # binomial errors over 400 prompts: 8 points down is more than 2 se (2 x 3.4 pts) below, 1 point is not
    assert rows[1]["accuracy_difference_se"] == pytest.approx((0.4 * 0.6 / 400 + 0.32 * 0.68 / 400) ** 0.5)
    assert [r["accuracy_within_noise"] for r in rows[:3]] == [True, False, True]
    assert [r["sync_over_this_to_accuracy"] for r in rows[:3]] == [1.0, None, 4.0]
    # the errors add: more prompts for one run still leave the baseline's 2.4-point error
    assert rows[3]["accuracy_within_noise"] and rows[3]["sync_over_this_to_accuracy"] == 8.0
    for r, eta in zip(rows, (0, 1, 2, 4), strict=True):
        r.update(name=f"eta{eta}", train_s_per_step=0.1, generated_tokens_per_s=1.0, trainer_idle_fraction=0.0,
                 rollout_idle_fraction=0.0, staleness_mean=0.0, answer_len_max=10, accuracy_before=0.2)
    table = "\n".join(async_table({"rollout_cores": [1], "trainer_cores": [0], "steps": 3, "warmup_steps": 1,
                                    "accuracy_target": 0.4, "modes": rows}))
    assert "| -8.0 ± 3.4 pts (below) | 2.00x | 3.00x | n/a | 25 s (4.00x) |" in table
    assert "| -1.0 ± 3.5 pts (within noise) | 4.00x | 4.00x | 4.00x | not reached (n/a) |" in table
    flat = [row(2.0, 100.0, [[0, 0.4], [100, 0.4]]), row(1.0, 100.0, [[0, 0.4], [50, 0.5]])]
    compare(flat)  # the baseline did not improve on its start: no first reach of it
    assert [r["sync_over_this_first_reach"] for r in flat] == [None, None]
    assert flat[1]["sync_over_this_to_accuracy"] == 2.0  # ended higher: the same accuracy at least


def test_async_summary_averages_each_mode_over_seeds_against_its_own_sync() -> None:
    from areal_jax.bench.async_sync import compare, summary
    from areal_jax.bench.tables import async_table

    def row(name: str, seed: int, wall: float, acc: float) -> dict:
        return {"name": name, "max_staleness": 0 if name == "sync" else 4, "seed": seed, "wall_s_per_step": wall,
                "steady_s_per_step": wall, "compile_s_per_step": 0.0,
                "trained_tokens_per_s": 100.0 / wall, "accuracy_clock": [[0, 0.2], [10 * wall, acc]],
                "accuracy_after": acc, "eval_prompts": 400, "answer_len_mean": 10.0, "train_s_per_step": 0.1,
                "generated_tokens_per_s": 1.0, "trainer_idle_fraction": 0.0, "rollout_idle_fraction": 0.0,
                "staleness_mean": 0.0, "answer_len_max": 10, "accuracy_before": 0.2}

    # seed 1's sync run is slower: its async run's ratio is taken against it, not against seed 0's
    by_seed = [[row("sync", 0, 2.0, 0.30), row("async_eta4", 0, 1.0, 0.32)],
               [row("sync", 1, 3.0, 0.30), row("async_eta4", 1, 1.0, 0.20)]]
    for rows in by_seed:
        compare(rows)
    sync, eta4 = summary(by_seed)
    assert sync["sync_over_this_wall_mean"] == 1.0 and sync["within_noise"] == 2
    assert eta4["seeds"] == [0, 1] and eta4["sync_over_this_wall_mean"] == pytest.approx(2.5)
    assert eta4["sync_over_this_wall_std"] == pytest.approx(0.7071, abs=1e-4)  # (2, 3): sample sd
    assert eta4["accuracy_difference_mean"] == pytest.approx(-0.04)
    assert eta4["within_noise"] == 1 and eta4["sync_over_this_to_accuracy"] == [2.0, None]  # 10 points below
    d = {"rollout_cores": [1], "trainer_cores": [0], "steps": 3, "warmup_steps": 1, "seed": 0, "seeds": [0, 1],
         "accuracy_target": 0.3, "modes": by_seed[0], "seed_runs": by_seed[0] + by_seed[1],
         "summary": [sync, eta4]}
    table = "\n".join(async_table(d))
    assert "| async_eta4, seed 1 | 1.00 |" in table
    # a step is never shorter than its training (0.1 s here): sync s/step over it is the bound
    assert eta4["split_bound_mean"] == pytest.approx(25.0) and sync["split_bound_mean"] is None
    assert ("| async_eta4 | 1.00 ± 0.00 | 2.50 ± 0.71x | 2.50 ± 0.71x | 25.00 ± 7.07x | 2.50 ± 0.71x | 26.0 ± 8.5% "
            "| -4.0 ± 8.5 pts | 1 of 2 | 2.00x, n/a |") in table
    assert "| sync | 2.50 ± 0.71 | 1.00 ± 0.00x | 1.00 ± 0.00x | n/a |" in table


def test_weight_sync_ratio_is_each_push_against_its_own_bound() -> None:
    """The table quotes the median of each push's ratio to the raw write + read measured right
    after it, not the ratio of two medians taken at different moments; older results without
    the paired ratios fall back to that."""
    from areal_jax.bench.tables import _weight_sync_cells

    paired = {"disk_s": 0.6, "raw_write_read_s": 0.2, "disk_over_bound": 1.7, "http_s": 0.3}
    assert _weight_sync_cells(paired, "disk") == ("0.60 s", "1.7x")
    assert _weight_sync_cells(paired, "http") == ("0.30 s", "1.5x")  # no paired ratio: 0.3 / 0.2
    assert _weight_sync_cells(paired, "http_hf") == ("n/a", "n/a")


def test_staleness_cells_average_over_seeds() -> None:
    from areal_jax.bench.staleness import cells
    from areal_jax.bench.tables import staleness_table

    rows = [{"algorithm": a, "max_staleness": eta, "seed": s, "accuracy_after": acc, "accuracy_before": 0.4,
             "staleness_mean": float(eta), "eval_prompts": 200}
            for a, eta, s, acc in (("naive", 4, 0, 0.5), ("naive", 4, 1, 0.7), ("decoupled", 4, 0, 0.6),
                                   ("decoupled", 4, 1, 0.9))]
    out = cells(rows, [4])
    naive, decoupled = out
    assert naive["accuracy_after"] == [0.5, 0.7] and naive["accuracy_mean"] == pytest.approx(0.6)
    assert naive["accuracy_std"] == pytest.approx(0.1414, abs=1e-3)  # sample sd: (0.1^2 * 2 / 1) ** 0.5
    assert decoupled["accuracy_mean"] == pytest.approx(0.75) and decoupled["seeds"] == [0, 1]
    table = "\n".join(staleness_table({"steps": 40, "seed": 0, "seeds": [0, 1], "max_staleness": [4],
                                       "runs": rows, "cells": out}))
    assert "60.0 ± 14.1% (50, 70)" in table and "75.0 ± 21.2% (60, 90)" in table and "+15.0 pts" in table
    check = [{**c, "ppo_n_minibatches": 4} for c in cells([{**r, "accuracy_after": 1 - r["accuracy_after"]}
                                                           for r in rows], [4])]
    table = "\n".join(staleness_table({"steps": 40, "seed": 0, "seeds": [0, 1], "max_staleness": [4],
                                       "runs": rows, "cells": out, "minibatch_check": check}))
    assert "| 4 | 4 | 40.0 ± 14.1% (50, 30) | 25.0 ± 21.2% (40, 10) | -15.0 pts |" in table


@pytest.mark.slow
def test_bench_quick_writes_every_field(tmp_path: Path) -> None:
    # one CPU device, as a user runs it (compiled fast: a few steps per run, mostly compiling)
    env = {**os.environ, "XLA_FLAGS": xla_flags.FAST_COMPILE}
    # --steps 3 (not --quick's 4) reaches the async and interrupt parts' runs; past --quick's one
    # warm-up step it leaves two timed steps per run, so each figure is still taken over a window.
    # (It was 5: two more steps in each of the five runs, which no assertion reads.)
    # The suite's compilation cache, not the bench's own under --out (new in every tmp_path, so
    # every run of the suite compiled all of it again): a second run of the suite loads the
    # programs, which is all the cache changes, the figures' warm-up steps aside.
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    proc = subprocess.run([sys.executable, "-m", "areal_jax.cli", "bench", "--quick", "--steps", "3",
                           "--compile-cache", cache, "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    load = lambda name: json.loads((tmp_path / f"{name}.json").read_text())  # noqa: E731

    a = load("async")
    assert [m["name"] for m in a["modes"]] == ["sync", "async_eta4"]
    assert a["steps"] == 3 and all(m["steps"] == 3 for m in a["modes"])
    for m in a["modes"]:
        _check_run(m)
        assert m["sync_over_this_wall"] > 0
    assert a["modes"][0]["sync_over_this_wall"] == 1.0
    assert a["accuracy_target"] == a["modes"][0]["accuracy_after"]
    assert a["seeds"] == [0] and [r["name"] for r in a["summary"]] == ["sync", "async_eta4"]
    for m in a["modes"]:
        assert m["accuracy_clock"][0] == [0.0, m["accuracy_before"]] and m["accuracy_clock"][-1][0] > 0
    assert set(a["rollout_cores"]).isdisjoint(a["trainer_cores"])

    s = load("staleness")
    assert {(r["algorithm"], r["max_staleness"]) for r in s["runs"]} == {
        (algo, eta) for algo in ("naive", "decoupled") for eta in s["max_staleness"]}
    for r in s["runs"]:
        _check_run(r)
    assert len(s["cells"]) == 2 * len(s["max_staleness"]) and all(len(c["seeds"]) == len(s["seeds"])
                                                                  for c in s["cells"])

    i = load("interrupt")
    assert [(r["interruptible"], r["pause_mode"]) for r in i["runs"]] == [(False, "abort"), (True, "abort"),
                                                                          (True, "in_place")]
    for r in i["runs"]:
        _check_run(r)
        assert r["steps"] == 3
    # the interruptible run is the async part's async_eta4 run (the same config, seed and cores): not made twice
    assert i["runs"][1]["same_run_as"] == str(tmp_path / "runs" / "async_eta4_seed0")
    assert {k: v for k, v in i["runs"][1].items() if k in RUN_FIELDS} == {
        k: v for k, v in a["modes"][1].items() if k in RUN_FIELDS}
    assert all("same_run_as" not in r for r in (i["runs"][0], i["runs"][2], *a["modes"]))
    assert i["throughput_ratio"] > 0 and i["wall_ratio"] > 0 and i["in_place_throughput_ratio"] > 0
    # --quick's runs alike share a server (same checkpoint, arguments, seed and cores): async_eta4's
    # serves the interrupt part's other two runs, the synchronous run's (every core) the staleness
    # part's two (on the async part's task and warm start), each reset first to the warm start
    # read from disk as version "default"
    runs_dir = tmp_path / "runs"
    assert not (tmp_path / "checkpoint_demo").exists()
    for first, later in (("async_eta4_seed0", ("update_wait", "update_in_place")),
                         ("sync_seed0", ("naive_eta4_seed0", "decoupled_eta4_seed0"))):
        log = (runs_dir / first / "logs" / "server-0.log").read_text()
        assert log.count("serving weights 'default' (update") == len(later), log[-3000:]
        assert log.count("read and swapped") == len(later)
        for name in later:
            assert f"used the server of {runs_dir / first} " in (runs_dir / name / "logs" / "server-0.log").read_text()
    assert "areal_jax.cli serve" in (runs_dir / "sync_seed0" / "logs" / "server-0.log").read_text()

    c = load("components")
    assert all(r["tokens_per_s"] > 0 for r in c["decode"])
    assert all(0 < s["fraction_of_matmul_peak"] <= 1 for s in c["train_step"]["sizes"])
    assert all(r["disk_s"] > 0 and r["http_s"] > 0 and r["raw_write_read_s"] > 0 for r in c["weight_update"])
    assert all(r[f"{k}_over_bound"] > 0 for r in c["weight_update"] for k in ("disk", "http", "http_hf"))
    assert all(r["inline_per_s"] > 0 and r["pool_per_s"] > 0 for r in c["rewards"])
    # code rewards are timed where they can run: in the sandbox
    assert [r["reward"] for r in c["rewards"]] == ["math", "code"][:1 + (isolation.detect().kind != "none")]

    for data in (a, s, i, c):
        assert data["conditions"]["cpu_cores"] >= 2
        for plot in data["plots"]:
            assert Path(plot).stat().st_size > 1000


def test_accelerator_benchmark_runs_every_part_and_its_attention_check_can_see_a_difference(tmp_path: Path) -> None:
    """``benchmarks/accelerator.py`` (meant for a GPU) on the CPU with a small model: every part
    writes its figures, and the attention check separates float32 from bfloat16."""
    env = {**os.environ, "XLA_FLAGS": xla_flags.FAST_COMPILE}  # one device, compiled fast
    out = tmp_path / "acc.json"
    root = Path(__file__).resolve().parents[1]
    args = ("--model small --matmul-n 256 --copy-mib 8 --attention-len 128 --concurrency 2 --new-tokens 64 "
            "--prompt-len 8 --decode-steps 4 --rounds 2 --groups 1 --group-size 4 --max-answer 64 --budget 512 "
            "--batches 1 --attention-backend native auto").split()
    proc = subprocess.run([sys.executable, "benchmarks/accelerator.py", *args, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["platform"] == "cpu" and r["ceilings"]["bf16_matmul_tflops_per_s"] > 0
    a = r["attention_check"]
    # On the CPU both paths are XLA's: the fused path must match dense far more closely than
    # bfloat16 matches float32, which the check must see (else it could not catch a wrong kernel).
    assert a["dense_vs_dense_float32"]["max_abs"] > 1e-3
    assert a["dot_product_vs_dense"]["max_abs"] <= a["dense_vs_dense_float32"]["max_abs"]
    # Each concurrency runs every backend named, side by side; on a CPU auto is the XLA path.
    assert [(d["attention_backend"], d["ran"]) for d in r["decode"]] == [("native", "native"), ("auto", "native")]
    d = r["decode"][0]
    # Decode tokens/s is a difference of two timings; on a loaded 2-core machine one round's noise
    # can exceed it, so only its presence is asserted, and the end-to-end rate's sign.
    assert d["concurrency"] == 2 and d["end_to_end_tokens_per_s"] > 0 and d["roofline_tokens_per_s"] > 0
    assert d["decode_tokens_per_s"] > 0 or math.isnan(d["decode_tokens_per_s"])
    assert len(d["full_s"]) == len(d["short_s"]) == 2
    assert [t["attention_impl"] for t in r["train"]] == ["dense", "dot_product"]
    assert all(t["finite_loss"] and t["tokens_per_s"] > 0 and t["fraction_of_bf16_peak"] > 0 for t in r["train"])


def test_the_shipped_long_tail_warm_start_is_a_trained_model_of_the_task(tmp_path: Path) -> None:
    """``--long-tail`` starts from the shipped warm start by default: the copy is a HF checkpoint
    of the task's model shape whose loss on the task's scratch-pad answers is a fraction of an
    untrained model's (a wrong or untrained file would not be), a second copy into the same
    folder is reused, and a folder holding another checkpoint is refused, naming the way out."""
    import jax.numpy as jnp
    from flax import nnx

    from areal_jax.config import from_dict
    from areal_jax.data import load_prompts
    from areal_jax.data.datasets import DatasetConfig
    from areal_jax.models import Decoder, load_pretrained, load_tokenizer
    from areal_jax.trainer.sft import pad_batch, sft_loss

    assert parse_args(["--long-tail"]).warm_start == "shipped"
    path = tasks.shipped_warm_start("long_tail", tmp_path)
    assert path == tmp_path / "warm_start"
    model, tokenizer = load_pretrained(path), load_tokenizer(path)
    opts = tasks.LONG_TAIL_TASK["model"]["tiny_options"]
    assert {k: getattr(model.config, k) for k in opts} == opts
    task = tasks.task_config(False, tasks.LONG_TAIL_TASK)
    data = from_dict(DatasetConfig, {**task["data"], "size": 80, "eval_size": 8})
    rows = load_prompts(data, tokenizer).train_rows
    examples = [e for e in tasks.scratch_examples(rows, tokenizer, 0, tasks.LONG_TAIL_SCRATCH)
                if len(e[0]) + len(e[1]) <= 160][:32]
    batch = {k: jnp.asarray(v) for k, v in pad_batch(examples, 160).items()}
    trained = float(sft_loss(model, batch))
    untrained = float(sft_loss(Decoder(model.config, rngs=nnx.Rngs(0)), batch))
    assert trained < 0.2 * untrained, (trained, untrained)

    assert tasks.shipped_warm_start("long_tail", tmp_path) == path  # the same files: reused
    (path / "model.safetensors").write_bytes(b"another model")
    with pytest.raises(FileExistsError, match="--warm-start build"):
        tasks.shipped_warm_start("long_tail", tmp_path)

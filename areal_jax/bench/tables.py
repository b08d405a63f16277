"""Markdown tables of a results folder (``<out>/results.md``), written from the parts' JSON so
that every figure in the report is one the benchmark measured."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _acc(p: float | None, n: int | None) -> str:
    """An accuracy with its standard error over ``n`` held-out prompts."""
    if p is None or not n:
        return _pct(p)
    return f"{100 * p:.0f} ± {100 * (p * (1 - p) / n) ** 0.5:.0f}%"


def async_table(d: dict[str, Any]) -> list[str]:
    lines = [f"Rollout on cores {d['rollout_cores']}, trainer on cores {d['trainer_cores']} (asynchronous runs); "
             f"the synchronous run on every core. {d['steps']} steps each, the first {d['warmup_steps']} left out "
             "of the timings.", "",
             "| mode | s / step | train s / step | of which compiling | generated tok/s | trained tok/s | trainer idle "
             "| rollout idle | rollout in prefill | rollout paused | mean staleness | longest answer | groups filtered "
             "| accuracy before -> after "
             "| final accuracy - sync's | sync / this wall-clock | trained tok/s, this / sync "
             "| sync / this, to the same accuracy | first reach of sync's final accuracy: s (sync / this) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    many = len(d.get("seeds", [])) > 1
    for m in d.get("seed_runs", d["modes"]):
        n = m.get("eval_prompts")
        name = f"{m['name']}, seed {m['seed']}" if many else m["name"]
        lines.append(f"| {name} | {m['wall_s_per_step']:.2f} | {m['train_s_per_step']:.2f} | "
                     f"{_num(m.get('compile_s_per_step'))} | {m['generated_tokens_per_s']:.0f} | "
                     f"{m['trained_tokens_per_s']:.0f} | "
                     f"{_pct(m['trainer_idle_fraction'])} | {_pct(m['rollout_idle_fraction'])} | "
                     f"{_pct(m.get('rollout_prefill_share'))} | {_pct(m.get('rollout_paused_share'))} | "
                     f"{m['staleness_mean']:.2f} | {m['answer_len_max']} | {_pct(m.get('filtered_fraction'))} | "
                     f"{_pct(m['accuracy_before'])} -> {_acc(m['accuracy_after'], n)} | {_difference(m)} | "
                     f"{m['sync_over_this_wall']:.2f}x | {m.get('this_over_sync_trained_tokens', float('nan')):.2f}x | "
                     f"{_ratio(m.get('sync_over_this_to_accuracy'))} | "
                     f"{_seconds(m.get('seconds_to_accuracy'))} ({_ratio(m.get('sync_over_this_first_reach'))}) |")
    if "accuracy_target" in d:
        target = "its own seed's" if many else _pct(d["accuracy_target"])
        lines += ["", "Same accuracy: every mode trains the same steps, so where a run's final held-out accuracy is "
                      "within noise of the synchronous run's (above -2 standard errors of the difference) the "
                      "ratio of wall-clock to that accuracy is the ratio of training time; n/a where it ended "
                      f"worse. First reach: training seconds to the first evaluation at or above the synchronous "
                      f"run's final accuracy ({target}), "
                      "evaluations left out and the first "
                      f"{d['warmup_steps']} (compiling) steps counted at the run's steady rate; coarse, with one "
                      "evaluation every few steps."]
    if many and d.get("summary"):
        lines += ["", f"Over the seeds {d['seeds']} (each run against its own seed's synchronous run): mean ± sample "
                      "standard deviation. Most this trainer allows: the synchronous run's s / step over this run's "
                  "train s / step, since a step is never shorter than its own training. Compilation left out: "
                  "each run's s / step less the seconds its trainer spent compiling shapes it met for the first "
                  "time (a one-off a long run pays once, which falls at random in a short one).", "",
                  "| mode | s / step | sync / this wall-clock | sync / this, compilation left out "
                  "| most this trainer allows | trained tok/s, this / sync "
                  "| final accuracy | final accuracy - sync's | within noise of sync "
                  "| sync / this, to the same accuracy, per seed |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["summary"]:
            per_seed = ", ".join(_ratio(x) for x in r["sync_over_this_to_accuracy"])
            lines.append(f"| {r['name']} | {_mean_sd(r, 'wall_s_per_step', '.2f')} | "
                         f"{_mean_sd(r, 'sync_over_this_wall', '.2f', 'x')} | "
                         f"{_mean_sd(r, 'sync_over_this_steady', '.2f', 'x')} | "
                         f"{_mean_sd(r, 'split_bound', '.2f', 'x')} | "
                         f"{_mean_sd(r, 'this_over_sync_trained_tokens', '.2f', 'x')} | "
                         f"{_mean_sd(r, 'accuracy_after', '.1f', '%', 100)} | "
                         f"{_mean_sd(r, 'accuracy_difference', '+.1f', ' pts', 100)} | "
                         f"{r['within_noise']} of {len(r['seeds'])} | {per_seed} |")
    return lines


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _mean_sd(row: dict[str, Any], key: str, fmt: str, unit: str = "", scale: float = 1.0) -> str:
    mean, sd = row.get(f"{key}_mean"), row.get(f"{key}_std")
    if mean is None:
        return "n/a"
    return f"{format(scale * mean, fmt)} ± {format(scale * sd, fmt.lstrip('+'))}{unit}"


def _difference(m: dict[str, Any]) -> str:
    diff = m.get("accuracy_difference")
    if diff is None:
        return "n/a"
    verdict = "within noise" if m.get("accuracy_within_noise") else "below"
    return f"{100 * diff:+.1f} ± {100 * m['accuracy_difference_se']:.1f} pts ({verdict})"


def _seconds(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.0f} s"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def staleness_table(d: dict[str, Any]) -> list[str]:
    seeds = d.get("seeds", [d["seed"]])
    lines = [f"{d['steps']} steps each from the same warm start, RL seeds {seeds}; held-out accuracy as the run "
             f"config evaluates it ({d['runs'][0].get('eval_prompts') or '?'} prompts), before RL "
             f"{_pct(d['runs'][0]['accuracy_before'])}. Each cell: mean ± sample standard deviation over the seeds "
             "(the seeds' own figures in brackets).", "",
             "| max_staleness | naive PPO: accuracy | naive: mean staleness | decoupled PPO: accuracy "
             "| decoupled: mean staleness | decoupled - naive |", "|---|---|---|---|---|---|"]
    for eta in d["max_staleness"]:
        n, c = (next(x for x in d["cells"] if x["algorithm"] == a and x["max_staleness"] == eta)
                for a in ("naive", "decoupled"))
        lines.append(f"| {eta} | {_spread(n)} | {n['staleness_mean']:.2f} | {_spread(c)} | "
                     f"{c['staleness_mean']:.2f} | {100 * (c['accuracy_mean'] - n['accuracy_mean']):+.1f} pts |")
    if d.get("minibatch_check"):
        n, c = (next(x for x in d["minibatch_check"] if x["algorithm"] == a) for a in ("naive", "decoupled"))
        lines += ["", f"The same at max_staleness {n['max_staleness']} with {n['ppo_n_minibatches']} optimizer "
                      "steps per batch (`algo.ppo_n_minibatches`; 1 above):", "",
                  "| max_staleness | minibatches | naive PPO: accuracy | decoupled PPO: accuracy | decoupled - naive |",
                  "|---|---|---|---|---|",
                  f"| {n['max_staleness']} | {n['ppo_n_minibatches']} | {_spread(n)} | {_spread(c)} | "
                  f"{100 * (c['accuracy_mean'] - n['accuracy_mean']):+.1f} pts |"]
    return lines


def _spread(cell: dict[str, Any]) -> str:
    each = ", ".join(f"{100 * a:.0f}" for a in cell["accuracy_after"])
    return f"{100 * cell['accuracy_mean']:.1f} ± {100 * cell['accuracy_std']:.1f}% ({each})"


def interrupt_table(d: dict[str, Any]) -> list[str]:
    lines = [f"max_staleness {d['runs'][0]['max_staleness']}, {d['steps']} steps each (first {d['warmup_steps']} "
             "left out), rollout and trainer on separate cores.", "",
             "| weight update | s / step | generated tok/s | trained tok/s | update s / step (wait + push) "
             "| rollout idle | trainer idle |", "|---|---|---|---|---|---|---|"]
    labels = {"wait": "wait for answers in flight", "interrupt": "interrupt (pause with abort, resume)",
              "in_place": "interrupt in place (stale KV kept)"}
    for r in d["runs"]:
        label = labels.get(r["name"], r["name"])
        lines.append(f"| {label} | {r['wall_s_per_step']:.2f} | {r['generated_tokens_per_s']:.0f} | "
                     f"{r['trained_tokens_per_s']:.0f} | {r['weight_sync_s_per_step']:.2f} | "
                     f"{_pct(r['rollout_idle_fraction'])} | {_pct(r['trainer_idle_fraction'])} |")
    lines += ["", f"Trained tokens/s, interrupt / wait: {d['throughput_ratio']:.2f}x; "
                  f"wall-clock per step, wait / interrupt: {d['wall_ratio']:.2f}x."]
    if "in_place_throughput_ratio" in d:
        lines[-1] += (f" In place: {d['in_place_throughput_ratio']:.2f}x trained tokens/s and "
                      f"{d['in_place_wall_ratio']:.2f}x per step, against waiting.")
    return lines


def _weight_sync_cells(r: dict[str, Any], key: str) -> tuple[str, str]:
    """Path ``key``'s seconds and its ratio to the bound: the median of each push's ratio to the raw
    write + read measured right after it where recorded (older results: the two figures' ratio)."""
    s = r.get(f"{key}_s")
    if s is None:
        return "n/a", "n/a"
    ratio = r.get(f"{key}_over_bound") or s / r["raw_write_read_s"]
    return f"{s:.2f} s", f"{ratio:.1f}x"


def components_table(d: dict[str, Any]) -> list[str]:
    lines = ["| concurrency | decode tok/s (engine lanes) |", "|---|---|"]
    lines += [f"| {r['concurrency']} | {r['tokens_per_s']:,.0f} ({r['lanes']}) |" for r in d["decode"]]
    t = d["train_step"]
    lines += ["", f"Float32 matmul peak measured in the same run: {t['matmul_peak_gflops']:.0f} GFLOP/s.", "",
              "| model | params | train tok/s | of matmul peak | attention's share of a layer's time | attention "
              "scores computed / needed |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['size']} | {s['params'] / 1e6:.2f}M | {s['tokens_per_s']:,.0f} | "
              f"{100 * s['fraction_of_matmul_peak']:.1f}% | {_pct(s.get('attention_share'))} | "
              f"{s.get('scores_computed_over_needed', float('nan')):.1f}x |" for s in t["sizes"]]
    lines += ["", "| model | size | disk path | HTTP buckets | HTTP buckets, HF layout | raw safetensors write "
              "+ read | disk / raw | HTTP / raw | HTTP, HF layout / raw |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["weight_update"]:
        raw = r["raw_write_read_s"]
        (disk_s, disk_x), (http_s, http_x), (hf_s, hf_x) = (_weight_sync_cells(r, k)
                                                            for k in ("disk", "http", "http_hf"))
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['mib']:.1f} MiB | {disk_s} | {http_s} | {hf_s} | "
                     f"{raw:.2f} s | {disk_x} | {http_x} | {hf_x} |")
    lines += ["", "| reward | inline rewards/s | pool rewards/s (workers) |", "|---|---|---|"]
    lines += [f"| {r['reward']} | {r['inline_per_s']:.1f} | {r['pool_per_s']:.1f} ({r['workers']}) |"
              for r in d["rewards"]]
    return lines


SECTIONS = (("async", "Asynchronous against synchronous RL", async_table),
            ("interrupt", "Interruptible weight updates", interrupt_table),
            ("staleness", "Staleness ablation: naive against decoupled PPO", staleness_table),
            ("components", "Components", components_table))


def markdown(out: Path) -> str:
    """Every part found in ``out`` as markdown, with the conditions each ran under."""
    lines: list[str] = []
    for name, title, table in SECTIONS:
        path = out / f"{name}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        c = d["conditions"]
        lines += [f"## {title}", "", f"Measured {c['utc']} UTC on {c['cpu_cores']} cores ({c['cpu']}), load average "
                  f"{c['load_average_1_5_15'][0]} at the end; the part took {d.get('seconds', float('nan')):.0f} s.",
                  "", *table(d), "", *[f"![{name}]({Path(p).name})" for p in d.get("plots", [])], ""]
    return "\n".join(lines)

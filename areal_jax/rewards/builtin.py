"""The built-in reward functions, each ``fn(prompt, completion, **row_fields) -> float | (float, dict)``.

* ``math``: math-verify parses the completion's final answer and checks it against the row's
  ``answer`` (GSM8K: the part after ``####``) or ``solution`` (MATH: its last ``\\boxed{...}``).
  Boxed answers, ``#### 42``, fractions, LaTeX and plain numbers all parse.
* ``reasoning_gym``: the generator's own ``score_answer`` on the completion's answer.
* ``code``: the completion's last fenced Python block runs in the sandbox against ``tests``.

These run in the reward pool's worker processes: math-verify's own timeouts use signals, which
only work in a process's main thread, so they are off here and the pool bounds the time.

Answer extraction for ``reasoning_gym`` (and the ``math`` fallback when nothing parses): the
text inside the last ``<answer>...</answer>``, else the last ``\\boxed{...}``, else the last
non-empty line of the completion.
"""

from __future__ import annotations

import logging
import re
from functools import cache
from typing import Any

from areal_jax.data.datasets import last_boxed

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call with timeouts off


def extract_answer(completion: str) -> str:
    """The completion's final answer, by the convention in the module docstring."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _gold(answer: Any, solution: Any) -> str:
    if answer is not None:
        text = str(answer)
        return text.rsplit("####", 1)[1].strip() if "####" in text else text
    if solution is not None:
        boxed = last_boxed(str(solution))
        return boxed if boxed is not None else str(solution)
    raise ValueError("the math reward needs the row's 'answer' or 'solution' field")


def math_reward(prompt: str, completion: str, answer: Any = None, solution: Any = None,
                **_: Any) -> tuple[float, dict[str, Any]]:
    """1.0 when math-verify finds the completion's answer equal to the ground truth, else 0.0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_text = _gold(answer, solution)
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(f"${gold_text}$", extraction_config=config, parsing_timeout=None)
    if not gold:
        gold = parse(gold_text, extraction_config=config, parsing_timeout=None)
    if "####" in completion:  # GSM8K-style final answer marker
        completion = completion.rsplit("####", 1)[1]
    pred = parse(completion, extraction_config=config, parsing_timeout=None)
    if not pred:
        pred = parse(f"${extract_answer(completion)}$", extraction_config=config, parsing_timeout=None)
    ok = bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    return float(ok), {"parsed": bool(pred)}


@cache
def _rg_dataset(task: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0)


def reasoning_gym_reward(prompt: str, completion: str, entry: dict[str, Any] | None = None, task: str | None = None,
                         **_: Any) -> float:
    """reasoning-gym's own ``score_answer`` for the row's generated entry."""
    if entry is None:
        raise ValueError("the reasoning_gym reward needs the row's 'entry' (rows from data.source=reasoning_gym)")
    task = task or entry.get("metadata", {}).get("source_dataset")
    if not task:
        raise ValueError("the reasoning_gym reward cannot tell the task: no 'task' field, no metadata.source_dataset")
    return float(_rg_dataset(task).score_answer(extract_answer(completion), entry))


def code_reward(prompt: str, completion: str, tests: Any = None, *, all_or_nothing: bool = False,
                timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 16, row_timeout_s: float = 60.0,
                unsandboxed: bool = False, trust_inside_checks: bool = False, **_: Any) -> tuple[float, dict[str, Any]]:
    """The fraction of ``tests`` the completion's last fenced Python block passes (or 1/0 with
    ``all_or_nothing``), run in the sandbox (``sandbox.run_tests``: a list of stdin/stdout pairs,
    assert code, or a list of assert code strings)."""
    from areal_jax.rewards.sandbox import run_tests

    if tests is None:
        raise ValueError("the code reward needs the row's 'tests' field")
    code = last_code_block(completion)
    if code is None:
        return 0.0, {"passed": 0, "total": _count(tests), "error": "no fenced code block"}
    passed, total, detail = run_tests(code, tests, timeout_s=timeout_s, memory_mb=memory_mb,
                                      max_processes=max_processes, row_timeout_s=row_timeout_s,
                                      unsandboxed=unsandboxed, stop_at_first_failure=all_or_nothing,
                                      trust_inside_checks=trust_inside_checks)
    score = float(passed == total) if all_or_nothing else passed / max(total, 1)
    return score, {"passed": passed, "total": total, **detail}


def _count(tests: Any) -> int:
    return len(tests) if isinstance(tests, list) else 1


_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def last_code_block(text: str) -> str | None:
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


BUILTIN = {"math": math_reward, "reasoning_gym": reasoning_gym_reward, "code": code_reward}

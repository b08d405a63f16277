"""The built-in verifiers: math-verify on a table of equivalent forms and near misses,
reasoning-gym's own scorers on generated items, answer extraction, and code tests."""

import functools

import pytest

from areal_jax.rewards import builtin
from areal_jax.rewards.builtin import extract_answer, math_reward, reasoning_gym_reward

# (completion, ground truth as the row gives it, expected reward)
MATH_TABLE = [
    ("The answer is \\boxed{42}.", {"answer": "42"}, 1.0),
    ("so the total is #### 42", {"answer": "He has 42.\n#### 42"}, 1.0),
    ("#### 3000", {"answer": "3,000"}, 1.0),
    ("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}, 1.0),
    ("\\boxed{0.5}", {"solution": "It is $\\boxed{\\frac{1}{2}}$."}, 1.0),
    ("\\boxed{\\frac{3}{4}}", {"solution": "$\\boxed{\\dfrac{3}{4}}$"}, 1.0),
    ("\\boxed{\\sqrt{4}}", {"answer": "2"}, 1.0),
    ("\\boxed{2\\pi}", {"solution": "\\boxed{2 \\pi}"}, 1.0),
    ("\\boxed{x^2 + 2x + 1}", {"solution": "\\boxed{(x+1)^2}"}, 1.0),
    ("The result: $\\boxed{-7}$", {"answer": "-7"}, 1.0),
    ("\\boxed{1/3}", {"answer": "\\frac{1}{3}"}, 1.0),
    ("\\boxed{10\\%}", {"answer": "10\\%"}, 1.0),
    ("\\boxed{3}", {"solution": "Taking the root, $x = \\boxed{3}$."}, 1.0),
    ("I think it's 17.", {"answer": "17"}, 1.0),
    ("\\boxed{\\{1, 2\\}}", {"solution": "\\boxed{\\{2, 1\\}}"}, 1.0),
    ("\\boxed{1.50}", {"answer": "1.5"}, 1.0),
    ("\\boxed{\\frac{6}{8}}", {"answer": "\\frac{3}{4}"}, 1.0),
    ("\\boxed{2^{10}}", {"answer": "1024"}, 1.0),
    ("<answer>12</answer>", {"answer": "12"}, 1.0),
    ("\\boxed{(1, 2)}", {"solution": "\\boxed{(1,2)}"}, 1.0),
    ("\\boxed{e^{0}}", {"answer": "1"}, 1.0),
    # near misses
    ("The answer is \\boxed{43}.", {"answer": "42"}, 0.0),
    ("#### 300", {"answer": "3,000"}, 0.0),
    ("\\boxed{\\frac{1}{3}}", {"answer": "0.5"}, 0.0),
    ("\\boxed{-0.5}", {"solution": "\\boxed{\\frac{1}{2}}"}, 0.0),
    ("\\boxed{x^2 + 2x - 1}", {"solution": "\\boxed{(x+1)^2}"}, 0.0),
    ("\\boxed{7}", {"answer": "-7"}, 0.0),
    ("\\boxed{2\\pi}", {"solution": "\\boxed{\\pi}"}, 0.0),
    ("no idea", {"answer": "5"}, 0.0),
    ("\\boxed{1.51}", {"answer": "1.5"}, 0.0),
    ("\\boxed{\\{1, 3\\}}", {"solution": "\\boxed{\\{1, 2\\}}"}, 0.0),
    ("\\boxed{(2, 1)}", {"solution": "\\boxed{(1,2)}"}, 0.0),
]


@pytest.mark.parametrize("completion,truth,expected", MATH_TABLE)
def test_math_reward_table(completion: str, truth: dict, expected: float) -> None:
    reward, _ = math_reward("q", completion, **truth)
    assert reward == expected


def test_math_table_is_large_enough() -> None:
    assert sum(e == 1.0 for *_, e in MATH_TABLE) >= 15 and sum(e == 0.0 for *_, e in MATH_TABLE) >= 10


def test_extract_answer() -> None:
    assert extract_answer("think...\n<answer> 12 </answer>") == "12"
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("work\n\n  41\n") == "41"
    assert extract_answer("") == ""


def test_reasoning_gym_scores_generated_items() -> None:
    import reasoning_gym

    for task, opts in (("basic_arithmetic", {"max_terms": 3}), ("chain_sum", {}), ("gsm_symbolic", {})):
        ds = reasoning_gym.create_dataset(task, size=5, seed=2, **opts)
        for entry in ds:
            entry = dict(entry)
            assert reasoning_gym_reward("q", f"<answer>{entry['answer']}</answer>", entry=entry, task=task) == 1.0
            assert reasoning_gym_reward("q", f"{entry['answer']}", entry=entry) == 1.0  # task from metadata
            assert reasoning_gym_reward("q", "<answer>not it</answer>", entry=entry, task=task) < 1.0
    with pytest.raises(ValueError, match="needs the row's 'entry'"):
        reasoning_gym_reward("q", "1")


def test_code_reward_pairs_and_asserts() -> None:
    from areal_jax.rewards import isolation

    if isolation.detect().kind == "none":  # these answers are ours: the harness without the sandbox will do
        code_reward = functools.partial(builtin.code_reward, unsandboxed=True)
    else:
        code_reward = builtin.code_reward
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    tests = [{"input": "1 2", "output": "3"}, {"input": "10 -3", "output": "7"}]
    assert code_reward("p", good, tests)[0] == 1.0
    assert code_reward("p", half, tests)[0] == 0.5
    assert code_reward("p", half, tests, all_or_nothing=True)[0] == 0.0
    assert code_reward("p", "no code here", tests) == (0.0, {"passed": 0, "total": 2, "error": "no fenced code block"})
    fn = ("First a draft:\n```python\ndef add(a, b): return 0\n```\n"
          "Fixed:\n```python\ndef add(a, b):\n    return a + b\n```")
    assert code_reward("p", fn, "assert add(1, 2) == 3\nassert add(-1, 1) == 0")[0] == 1.0
    assert code_reward("p", fn.split("Fixed")[0], "assert add(1, 2) == 3")[0] == 0.0

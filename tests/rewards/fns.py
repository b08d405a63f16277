"""Reward functions named by import path in the pool tests (workers import them by name)."""

import os
import time


def echo(prompt: str, completion: str, value: float = 0.0, **_) -> tuple[float, dict]:
    """A well-behaved reward: the row's value plus the completion's length, and a stat."""
    return value + len(completion), {"length": len(completion)}


def full_marks(prompt: str, completion: str, **_) -> float:
    """Every answer is right: what an evaluation reports is then known in advance."""
    return 1.0


def misbehave(prompt: str, completion: str, **_) -> float:
    if completion == "sleep":
        time.sleep(30)
    elif completion == "raise":
        raise RuntimeError("the reward function broke")
    elif completion == "exit":
        os._exit(3)
    elif completion == "oom":
        blob = bytearray(10 * 1024**3)  # 10 GiB, past the worker's address-space limit
        return float(len(blob))
    elif completion == "bad_type":
        return "one"  # type: ignore[return-value]
    return 1.0


def nap(prompt: str, completion: str, seconds: float = 0.0, **_) -> float:
    """Sleeps the row's ``seconds``, then scores 1: a call that is still in flight when wanted."""
    time.sleep(seconds)
    return 1.0


def sandboxed(prompt: str, completion: str, seconds: float = 5.0, **_) -> float:
    """Runs the completion in the code sandbox for up to ``seconds``: a pool timeout shorter than
    that kills this worker while its sandbox runs."""
    from areal_jax.rewards.sandbox import run_program

    run_program(completion, timeout_s=seconds)
    return 1.0


def fingerprint(prompt: str, completion: str, **_) -> float:
    """A number in [0, 1) that follows the completion's every character: the mean over an
    evaluation tells which policy wrote its answers."""
    h = 0
    for c in completion:
        h = (h * 131 + ord(c)) % 1_000_003
    return h / 1_000_003

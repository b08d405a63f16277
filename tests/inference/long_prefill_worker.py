"""The 16k-token prefill of ``test_queue_and_memory.py``, alone in a fresh process, so that its
peak resident memory (the kernel's high-water mark, ``rss_mib``) is that of the prefill and
nothing else the tests did.

Usage: python -m tests.inference.long_prefill_worker CKPT TOKENS CHUNK

Prints one JSON line: the greedy answer of two tokens with its logprobs and top logprobs, the
chunk calls made, resident memory after building the engine and at its peak after the answer,
the peak of running the same prefill again once everything is compiled (Linux),
and XLA's planned temporary memory (compiled after the peak was read, not run) of the largest
middle-chunk call, of the last chunk's call, and of one unchunked call over the whole prompt.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys

import numpy as np

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.steps import DEVICE_STOP_IDS
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import prompts
from tests.procmem import resident_bytes

TOP = 5


def high_water_mib() -> float:
    return resident_bytes(field="VmHWM") / 2**20


def rss_mib() -> float:
    """This process's peak resident memory so far. On Linux the kernel's high-water mark of its
    own memory map: ``ru_maxrss`` also counts the parent's peak, which a process started with
    vfork and exec (as ``subprocess`` does) inherits: under a test worker holding 3.5 GB it
    reported 3.5 GB for this process (2026-11-29)."""
    try:
        return high_water_mib()
    except (OSError, AssertionError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak() -> bool:
    """Start the kernel's high-water mark of this process's resident memory afresh (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    ckpt, n, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    max_len = n + 64
    cfg = EngineConfig(num_slots=2, max_seq_len=max_len, max_prefill_batch=1, decode_steps=2, lanes=1,
                       chunked_prefill_size=chunk, kv_buckets=(chunk, 4096, 8192, 12288, max_len),
                       kv_cache="slots")  # it plans the slot engine's chunk calls
    engine = Engine(load_pretrained(ckpt), cfg)
    built = rss_mib()
    req = GenerateRequest(prompts([n], seed=4)[0], SamplingParams(max_new_tokens=2, temperature=0,
                                                                  top_logprobs_num=TOP))

    async def go():  # noqa: ANN202
        await engine.start()
        try:
            return await engine.generate(req)
        finally:
            await engine.stop()
    out = asyncio.run(go())
    peak, chunks = rss_mib(), engine.stats["prefill_chunks"]
    # The same prefill again, every call compiled by now: what running it holds, without what
    # compiling it took (which depends on whether the compilation cache was warm).
    run_peak = None
    if reset_peak():
        again = asyncio.run(go())
        assert again.output_ids == out.output_ids
        run_peak = high_water_mib()

    def planned_mib(fn, *args, **kw) -> float:  # noqa: ANN001, ANN002, ANN003
        return fn.lower(*args, **kw).compile().memory_analysis().temp_size_in_bytes / 2**20

    lane, rows = engine._lanes[0], np.array([n], np.int32)  # noqa: SLF001
    zero, ones, u32 = np.zeros(1, np.int32), np.ones(1, np.float32), np.zeros(1, np.uint32)
    ids = np.zeros((1, chunk), np.int32)
    middle = planned_mib(engine.prefill_chunk_fn, engine.state, lane.cache, ids, np.int32(n - 2 * chunk), rows, zero,
                         kv_len=max_len)
    last = planned_mib(engine.prefill_fn, engine.state, lane.cache, lane.slot_state, ids, np.int32(n - chunk), rows,
                       zero, zero, ones, ones, np.full(1, -1, np.int32), u32, u32, zero, zero,
                       np.full((1, DEVICE_STOP_IDS), -1, np.int32), kv_len=max_len)
    whole = planned_mib(engine.prefill_chunk_fn, engine.state, lane.cache, np.zeros((1, n), np.int32), np.int32(0),
                        rows, zero, kv_len=n)
    print(json.dumps({"output_ids": out.output_ids, "output_logprobs": out.output_logprobs,
                      "output_top_logprobs": out.output_top_logprobs, "prefill_chunks": chunks,
                      "built_rss_mib": built, "peak_rss_mib": peak, "run_peak_rss_mib": run_peak,
                      "middle_chunk_planned_mib": middle,
                      "last_chunk_planned_mib": last, "unchunked_planned_mib": whole}))


if __name__ == "__main__":
    main()

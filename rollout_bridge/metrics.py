"""The embedded server's ``/metrics``: Prometheus text through ``prometheus_client`` (as SGLang
serves it), with SGLang's metric names where it has them and ``areal_jax:`` ones for what it
lacks. Read from the engine's counters at each scrape."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rollout_bridge.state import STATE, ServerState


class _ServerCollector:
    """One server's metrics, labelled with its model name."""

    def __init__(self, st: ServerState) -> None:
        self.st = st

    def describe(self) -> list[Metric]:
        return []  # registering must not scrape (a scrape moves the throughput mark)

    def collect(self) -> Iterator[Metric]:
        st, e = self.st, self.st.engine
        now, tokens = time.monotonic(), e.stats["generated_tokens"]
        t_prev, tok_prev = st.metrics_mark
        throughput = (tokens - tok_prev) / (now - t_prev) if t_prev else 0.0
        st.metrics_mark = (now, tokens)
        name = st.served_model_name or st.model_path

        def one(kind: Any, metric: str, help_: str, value: float, **labels: str) -> Metric:
            family = kind(metric, help_, labels=["model_name", *labels])
            family.add_metric([name, *labels.values()], float(value))
            return family

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield one(g, "sglang:num_running_reqs", "The number of running requests.", e.num_running)
        yield one(g, "sglang:num_queue_reqs", "The number of requests in the waiting queue.", e.num_waiting)
        yield one(g, "sglang:gen_throughput", "The generation throughput (token/s) since the last scrape.",
                  throughput)
        yield one(c, "sglang:prompt_tokens", "Number of prefill tokens processed.", e.stats["prompt_tokens"])
        yield one(c, "sglang:generation_tokens", "Number of generation tokens processed.", tokens)
        yield one(c, "areal_jax:shared_prompt_tokens", "Prompt tokens not prefilled: copied from a request "
                  "admitted with the same tokens.", e.stats["shared_prompt_tokens"])
        yield one(c, "sglang:cached_tokens", "Prompt tokens read from another request's KV pages instead of "
                  "prefilled (the prefix cache's and a running request's).", e.stats["shared_prompt_tokens"])
        scheduler = getattr(e, "scheduler", None)
        if scheduler is not None:
            yield one(g, "areal_jax:prefix_cache_tokens", "Tokens of KV pages the prefix cache holds (evicted "
                      "when the pool runs short).", scheduler.cached_pages * e.cfg.page_size)
        yield one(c, "areal_jax:prefill_padded_tokens", "Token rows computed by prefill calls, padding included "
                  "(each call pads its rows to one length).", e.stats["prefill_padded_tokens"])
        yield one(c, "areal_jax:prefill_seconds", "Seconds in compiled prefill calls (prompts, and the prefixes "
                  "of requests resumed after a pause), summed over lanes.", e.stats["prefill_seconds"])
        yield one(c, "areal_jax:decode_seconds", "Seconds in compiled decode calls, summed over lanes.",
                  e.stats["decode_seconds"])
        yield one(c, "areal_jax:mixed_seconds", "Seconds in compiled calls that prefill a chunk beside the running "
                  "answers' decode tokens (paged engine), summed over lanes.", e.stats["mixed_seconds"])
        yield one(c, "areal_jax:paused_seconds", "Seconds paused (from each pause_generation to the "
                  "continue_generation after it): weight updates that keep the server from generating.",
                  e.stats["paused_seconds"])
        yield one(c, "sglang:num_requests", "Number of finished requests.", e.stats["finished_requests"])
        yield one(g, "areal_jax:weight_version", "Weight updates applied (internal version); the label is "
                  "weight_version.", e.version, weight_version=st.weight_version)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format (``prometheus_client``'s exposition)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServerCollector(request.app[STATE]))
    return web.Response(body=generate_latest(registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST, "X-Content-Type-Options": "nosniff"})

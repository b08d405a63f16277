"""Workflows: how one prompt becomes a group of trajectories.

A workflow is one async function, ``async def episode(client, row) -> list[Trajectory]``, named
in the config by import path (``my_pkg.flows:episode``) or by a built-in name:

* ``single_turn``: ``group_size`` answers to the prompt, each scored by the reward service (RLVR).
* ``multi_turn``: on a wrong answer the model gets a feedback message and another try, up to
  ``max_turns``; the conversation is one trajectory whose environment tokens carry no loss, and
  its reward is discounted by ``turn_discount`` per extra turn.
* ``agentic``: runs the user's agent, ``async def agent(chat, row) -> float``, against an
  ``openai``-SDK-shaped chat client (``controller/chat.py``) that records every completion.

``client`` is an ``EpisodeClient``: the rollout client plus the run's sampling settings, the
tokenizer and the reward pool, so a workflow never builds those itself. The controller
assigns group ids; a workflow's trajectories are one group.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from areal_jax.config import ConfigError, check_options, resolve_import_path
from areal_jax.data.trajectory import Trajectory

Workflow = Callable[[Any, Any], Awaitable[list[Trajectory]]]


class WorkflowError(ValueError):
    """A workflow name that cannot be resolved, or a workflow that returned the wrong thing."""


@functools.lru_cache(maxsize=64)
def _takes_session(fn: Any) -> bool:
    """Whether a rollout client's ``generate`` (or ``generate_many``) function takes ``session``;
    looked up once per function, not at every request."""
    try:
        return "session" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class EpisodeClient:
    """What a workflow gets as ``client``: generation with the run's settings, rewards, tokenizer."""

    rollout: Any
    """The ``RolloutClient`` (HTTP to SGLang or embedded servers, or in-process)."""
    tokenizer: Any
    reward_pool: Any
    """A ``RewardPool`` (``await score(prompt, completion, reward_fields, row_id=...)``)."""
    sampling: dict[str, Any]
    """SGLang ``sampling_params`` used unless a call overrides them."""
    group_size: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    """The workflow's own options from the config (``rollout.workflow_options``)."""
    reward_failures: int = 0
    batch_groups: bool = True
    """``generate_group`` asks the rollout client for the group at once (``generate_many``: one
    HTTP request per group); False: one ``generate`` per answer."""

    async def generate(self, input_ids: list[int], *, session: str | None = None, **overrides: Any) -> Any:
        """One answer (a ``GenerateResult``): tokens, logprobs, per-token policy versions.
        ``session``: the requests of one conversation (an agent run's turns) name the same one, so
        that a client over several servers sends them where the turns before are cached."""
        return await self.rollout.generate(list(input_ids), {**self.sampling, **overrides},
                                           **self._session_kw(self.rollout.generate, session))

    async def generate_group(self, input_ids: list[int], n: int | None = None, *, session: str | None = None,
                             **overrides: Any) -> list[Any]:
        """``n`` answers (default ``group_size``) to one prompt, asked together: the HTTP client
        sends them as one batch request, to one server."""
        n = self.group_size if n is None else n
        sp = {**self.sampling, **overrides}
        many = getattr(self.rollout, "generate_many", None) if self.batch_groups else None
        if many is None:  # off, or a user's client with generate only
            kw = self._session_kw(self.rollout.generate, session)
            return list(await asyncio.gather(*(self.rollout.generate(list(input_ids), sp, **kw) for _ in range(n))))
        return list(await many([list(input_ids) for _ in range(n)], sp, **self._session_kw(many, session)))

    @staticmethod
    def _session_kw(fn: Any, session: str | None) -> dict[str, Any]:
        """``{"session": session}`` where ``fn`` (a rollout client's method) takes one: a user's
        client without it still works, routing each request on its own."""
        if session is None:
            return {}
        return {"session": session} if _takes_session(getattr(fn, "__func__", fn)) else {}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def reward(self, row: Any, completion: str) -> float:
        """The reward service's score of ``completion`` for ``row``; a failed call scores 0
        (the pool counts and logs it), so one bad answer never takes a run down. A pool that
        cannot score at all raises ``RewardPoolBroken``, which stops the run."""
        result = await self.reward_pool.score(row.prompt, completion, row.reward_fields, row_id=row.id)
        if result.error:
            self.reward_failures += 1
        return float(result.reward)

    @staticmethod
    def trajectory(prompt_ids: list[int], result: Any, reward: float) -> Trajectory:
        """A one-turn trajectory from a ``GenerateResult``."""
        return Trajectory.from_prompt_and_answer(
            np.asarray(prompt_ids), np.asarray(result.output_ids), np.asarray(result.output_logprobs),
            np.asarray(result.output_versions), reward=reward, group_id=0, truncated=truncated(result))


def truncated(result: Any) -> bool:
    """Whether a ``GenerateResult`` stopped at its token budget rather than at a stop token."""
    return (result.finish_reason or {}).get("type") == "length"


async def single_turn(client: EpisodeClient, row: Any) -> list[Trajectory]:
    """``group_size`` independent answers to ``row`` (asked as one group), each scored by the
    reward service."""

    async def scored(result: Any) -> Trajectory | None:
        if not result.output_ids:
            return None
        reward = await client.reward(row, client.decode(result.output_ids))
        return client.trajectory(row.prompt_ids, result, reward)

    done = await asyncio.gather(*(scored(r) for r in await client.generate_group(row.prompt_ids)))
    return [t for t in done if t is not None]


DEFAULT_FEEDBACK = "Your answer is not correct. Think again and give your final answer."


async def multi_turn(client: EpisodeClient, row: Any) -> list[Trajectory]:
    """Up to ``max_turns`` tries per answer, with a feedback message after each wrong one.

    Options: ``max_turns`` (default 2), ``turn_discount`` (0.9), ``feedback`` (the user message).
    A try counts as right when its reward is positive; the trajectory's reward is the last try's
    reward times ``turn_discount ** (tries - 1)``.
    """
    max_turns = int(client.options.get("max_turns", 2))
    discount = float(client.options.get("turn_discount", 0.9))
    feedback = str(client.options.get("feedback", DEFAULT_FEEDBACK))
    if max_turns < 1:
        raise WorkflowError(f"rollout.workflow_options.max_turns must be >= 1, got {max_turns}")

    async def one() -> Trajectory | None:
        messages = list(row.messages)
        ids = list(row.prompt_ids)
        mask, logprobs, versions = [0.0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        reward = 0.0
        for turn in range(max_turns):
            result = await client.generate(ids)
            ids += result.output_ids
            mask += [1.0] * len(result.output_ids)
            logprobs += list(result.output_logprobs)
            versions += list(result.output_versions)
            text = client.decode(result.output_ids)
            reward = await client.reward(row, text)
            if reward > 0 or turn == max_turns - 1 or result.finish_reason.get("type") != "stop":
                reward *= discount ** turn
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
            env = environment_tokens(client.tokenizer, messages, ids)
            ids += env
            mask += [0.0] * len(env)
            logprobs += [0.0] * len(env)
            versions += [-1] * len(env)
        if not any(mask):
            return None
        return Trajectory(input_ids=np.asarray(ids), loss_mask=np.asarray(mask),
                          behavior_logprobs=np.asarray(logprobs), versions=np.asarray(versions),
                          reward=reward, group_id=0, prompt_len=len(row.prompt_ids), truncated=truncated(result))

    done = await asyncio.gather(*(one() for _ in range(client.group_size)))
    return [t for t in done if t is not None]


def environment_tokens(tokenizer: Any, messages: list[dict[str, Any]], so_far: list[int]) -> list[int]:
    """Tokens the chat template puts after ``so_far`` (the conversation up to the last generated
    token) to render ``messages`` (ending in the new user turn) plus a generation prompt: the end
    of the assistant turn, the feedback message, the next assistant header. The template is the
    tokenizer's own, so training sees exactly what a chat server would have fed the model."""
    full = _ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    if full[:len(so_far)] == so_far:
        return full[len(so_far):]
    # The template re-tokenises the answer differently: keep the generated tokens as they were
    # and append the template's text after the answer, tokenised on its own.
    answer = messages[-2]["content"]
    before = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=False)
    after = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before) or answer not in before:
        raise WorkflowError("the chat template does not render a conversation as a prefix of its continuation; "
                            "multi_turn needs a template that appends turns")
    tail = before[before.rindex(answer) + len(answer):] + after[len(before):]
    eos = tokenizer.eos_token or ""
    if eos and so_far and so_far[-1] == tokenizer.eos_token_id and tail.startswith(eos):
        tail = tail[len(eos):]  # the answer already ends with the end-of-turn token
    return list(tokenizer.encode(tail, add_special_tokens=False))


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


AGENT_TRAJECTORIES = ("concat", "per_turn")


async def agentic(client: EpisodeClient, row: Any) -> list[Trajectory]:
    """``group_size`` runs of the user's agent (option ``agent``: ``pkg.mod:fn``), each against
    a fresh recording chat client, scored by what the agent returned (or ``chat.set_reward``).

    Option ``trajectory``: ``concat`` (default) makes each run one trajectory, its turns
    concatenated, the model's tokens trained and the environment's masked (AReaL's
    ``export_interactions(style="concat")``), so a group is ``group_size`` trajectories whatever
    the number of calls each run made. ``per_turn`` makes every completion a trajectory of its
    own, rewarded ``reward * turn_discount ** (later completions)`` (option ``turn_discount``,
    default 1), so a group's runs leave different numbers of trajectories. Option
    ``group_stats`` says what a group-relative estimator (GRPO, Dr.GRPO, RLOO) normalises over:
    ``run`` (default) counts each run once, by its final turn's reward, and gives each turn its
    run's score times the turn's discount (verl-agent's GRPO over ``(uid, traj_uid)`` pairs);
    ``turn`` counts every turn with its discounted reward as a member of its own (AReaL's
    order: discount, then normalise), so runs that made more calls weigh more.
    Either way groups of uneven size train with every estimator.
    Option ``tool_parser``: how tool calls are read from answers (``auto``: by the chat
    template; ``hermes``, ``llama3_json``; see ``controller/chat.py``)."""
    from areal_jax.controller.chat import RecordingChat

    name = client.options.get("agent")
    if not name:
        raise WorkflowError("rollout.workflow=agentic needs rollout.workflow_options.agent: 'pkg.module:function'")
    agent = resolve_callable(str(name), "rollout.workflow_options.agent")
    style = client.options.get("trajectory", "concat")
    if style not in AGENT_TRAJECTORIES:
        raise WorkflowError(f"rollout.workflow_options.trajectory={style!r}: choose one of {list(AGENT_TRAJECTORIES)}")
    discount = float(client.options.get("turn_discount", 1.0))
    per_run = client.options.get("group_stats", "run") == "run"

    async def one() -> list[Trajectory]:
        chat = RecordingChat(client, tool_parser=str(client.options.get("tool_parser", "auto")))
        reward = await agent(chat, row)
        reward = None if reward is None else float(reward)
        if style == "per_turn":
            return chat.export(reward=reward, turn_discount=discount)
        run = chat.export_concat(reward)
        return [] if run is None else [run]

    runs = await asyncio.gather(*(one() for _ in range(client.group_size)))
    out = [t for run in runs for t in run]
    if style == "per_turn":
        # Each run's turns share a run id (statistics per run), or each turn is its own run.
        ids = ([k for k, run in enumerate(runs) for _ in run] if per_run else range(len(out)))
        for t, k in zip(out, ids, strict=True):
            t.run_id = k
            if not per_run:
                t.discount = 1.0  # a member of its own: its discounted reward is all it has
    return out


BUILTIN: dict[str, Workflow] = {"single_turn": single_turn, "multi_turn": multi_turn, "agentic": agentic}

WORKFLOW_OPTIONS: dict[str, dict[str, Any]] = {
    "single_turn": {},
    "multi_turn": {"max_turns": int, "turn_discount": float, "feedback": str},
    "agentic": {"agent": str, "trajectory": Literal["concat", "per_turn"], "turn_discount": float,
                "group_stats": Literal["run", "turn"],
                "tool_parser": Literal["auto", "hermes", "llama3_json"]},
}
"""The options each built-in workflow reads from ``rollout.workflow_options``, with their types;
a user's workflow takes any (only it knows them)."""


def check_workflow_options(workflow: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked (and ints widened to floats) for built-in ``workflow``, at config load:
    a misspelt key (``max_turn``) would otherwise be ignored and its default used."""
    schema = WORKFLOW_OPTIONS.get(workflow)
    if schema is None:
        return options
    where = "rollout.workflow_options"
    options = check_options(options, schema, where, owner=f"rollout.workflow={workflow}")
    if options.get("max_turns", 1) < 1:
        raise ConfigError(f"{where}.max_turns must be >= 1, got {options['max_turns']}")
    if options.get("turn_discount", 1.0) < 0:
        raise ConfigError(f"{where}.turn_discount must be >= 0, got {options['turn_discount']}")
    if workflow == "agentic" and not options.get("agent"):
        raise ConfigError(f"rollout.workflow=agentic needs {where}.agent: 'pkg.module:function', an "
                          "async def agent(chat, row) -> reward")
    return options


def resolve_callable(name: str, field_name: str) -> Callable[..., Any]:
    try:
        return resolve_import_path(name, field_name)
    except ConfigError as e:
        raise WorkflowError(str(e)) from None


def get_workflow(name: str) -> Workflow:
    """A built-in workflow by name, or a user's ``async def episode(client, row)`` by import path."""
    if name in BUILTIN:
        return BUILTIN[name]
    fn = resolve_callable(name, "rollout.workflow")
    if not asyncio.iscoroutinefunction(fn):
        raise WorkflowError(f"rollout.workflow={name!r} must be an async function: async def episode(client, row)")
    return fn

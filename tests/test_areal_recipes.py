"""``configs/gsm8k_*.yaml``, AReaL's GSM8K example runs: each loads with AReaL's recipe values
(``examples/math/gsm8k_*.yaml`` at inclusionAI/AReaL 4aef98d8, key by key as README "Coming from
AReaL" maps them), and each trains for two steps through ``areal-jax train`` on a tiny HF-format
model with a byte-level BPE tokenizer trained here with ``tokenizers`` and the shipped
GSM8K-format rows, scored by the math reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_jax.trainer.run_config import RunConfig, load_run_config

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs"
ROWS = ROOT / "tests" / "fixtures" / "data" / "gsm8k_train.jsonl"

# What every run shares with AReaL's gsm8k_grpo.yaml, as (our key, value, AReaL's key).
SHARED = [
    ("batch_size", 256, "train_dataset.batch_size"),
    ("rollout.group_size", 4, "gconfig.n_samples"),
    ("rollout.temperature", 1.0, "gconfig.temperature"),
    ("rollout.max_staleness", 2, "rollout.max_head_offpolicyness"),
    ("rollout.max_concurrent_rollouts", 256, "rollout.max_concurrent_rollouts"),
    ("reward.name", "math", "gsm8k_reward_fn"),
    ("data.format", "gsm8k", "train_dataset.path: openai/gsm8k"),
    ("train.lr", 1.7e-5, "actor.optimizer.lr"),
    ("train.weight_decay", 0.017, "actor.optimizer.weight_decay"),
    ("train.grad_clip", 1.0, "actor.optimizer.gradient_clipping"),
    ("train.micro_batch_tokens", 10240, "actor.mb_spec.max_tokens_per_mb"),
    ("algo.reward_scale", 10.0, "actor.reward_scaling"),
    ("algo.reward_bias", -0.5, "actor.reward_bias"),
    ("algo.reward_clip", 20.0, "actor.reward_clip"),
    ("algo.adv_norm", True, "actor.adv_norm: {mean_level: batch, std_level: batch}"),
    ("algo.ppo_n_minibatches", 1, "actor.ppo_n_minibatches"),
    ("algo.use_decoupled_loss", True, "actor.use_decoupled_loss"),
    ("algo.use_behavior_imp_weight", True, "actor.rejection_sampling"),
    ("algo.behavior_imp_weight_cap", 5.0, "actor.rejection_sampling.upper"),
    ("algo.gamma", 1.0, "actor.discount"),
    ("algo.gae_lambda", 1.0, "actor.gae_lambda"),
]
RECIPES = {
    "grpo": {"model.path": "models/Qwen2.5-1.5B-Instruct", "rollout.max_new_tokens": 1024,
             "algo.adv_estimator": "grpo", "algo.eps_clip": 0.4, "algo.kl_coef": 0.0},
    "gspo": {"algo.ratio_level": "sequence", "algo.eps_clip": 0.4},
    "m2po": {"algo.eps_clip": 0.0, "algo.m2_threshold": 0.04},
    "drgrpo": {"algo.adv_estimator": "dr_grpo", "algo.loss_aggregation": "token_mean"},
    "reinforce": {"algo.adv_estimator": "reinforce_pp", "algo.kl_coef": 0.001, "algo.kl_estimator": "k1"},
    "ppo": {"algo.adv_estimator": "gae", "algo.value_eps_clip": 0.5},
    "dapo": {"model.path": "models/Qwen2.5-1.5B", "rollout.max_new_tokens": 4096, "algo.eps_clip": 0.2,
             "algo.eps_clip_higher": 0.28, "algo.overlong_penalty.buffer_len": 512,
             "algo.overlong_penalty.penalty_factor": 1.0, "algo.overlong_penalty.max_len": 4096},
}  # fmt: skip
STAT = {"m2po": "m2_dropped_fraction", "reinforce": "kl_ref_mean", "ppo": "value_loss"}
"""A statistic only that run's algorithm produces, to see the algorithm ran."""


def _get(cfg: RunConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def test_every_gsm8k_config_is_checked():
    assert {p.stem.removeprefix("gsm8k_") for p in CONFIGS.glob("gsm8k_*.yaml")} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_gsm8k_config_carries_areal_recipe(name: str):
    cfg = load_run_config(CONFIGS / f"gsm8k_{name}.yaml")
    for key, value, areal in [*SHARED, *((k, v, k) for k, v in {**RECIPES["grpo"], **RECIPES[name]}.items())]:
        expected = pytest.approx(value) if isinstance(value, float) else value
        assert _get(cfg, key) == expected, (key, areal)
    assert cfg.run_dir == f"runs/gsm8k-{name}"


def _byte_level_bpe(rows: Path):
    """A Qwen-style tokenizer (byte-level BPE, ChatML template) trained on the rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from areal_jax.models.tiny import CHAT_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    texts = [v for line in rows.read_text().splitlines() for v in json.loads(line).values()]
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _tiny_model(out: Path) -> Path:
    from flax import nnx

    from areal_jax.models.config import ModelConfig
    from areal_jax.models.decoder import Decoder
    from areal_jax.models.hf_write import save_pretrained

    tok = _byte_level_bpe(ROWS)
    cfg = ModelConfig(model_type="qwen2", vocab_size=-(-len(tok) // 8) * 8, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), out)
    tok.save_pretrained(str(out))  # after the model: save_pretrained writes a fresh directory
    return out


@pytest.mark.slow
def test_gsm8k_configs_train_two_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """All seven runs in one process, each through the CLI, with only sizes overridden: the
    model, the rows, the batch, the lengths and the in-process engine. No held-out evaluation
    (``NO_EVAL``; the one before RL took 4.4 s of a 15 s run); tests/trainer/test_evaluate.py
    tests it."""
    from areal_jax.cli import main
    from tests.trainer.helpers import NO_EVAL

    model = _tiny_model(tmp_path / "model")
    small = [f"model.path={model}", f"data.path={ROWS}", "data.eval_path=null", *NO_EVAL, "steps=2", "batch_size=2",
             "rollout.backend=local", "rollout.max_new_tokens=16", "rollout.max_concurrent_rollouts=null",
             'rollout.server_args=["--max-running-requests", "8", "--context-length", "256"]',
             "reward.num_workers=1", "train.micro_batch_tokens=512", "train.length_buckets=[256,512]",
             "train.max_seq_len=256", "train.remat=false", "eval.every=0",
             "checkpoint.every_steps=0", "log.progress=false", "log.tensorboard=false", "export=false"]
    for name in sorted(RECIPES):
        run = tmp_path / name
        extra = ["algo.overlong_penalty.buffer_len=8"] if name == "dapo" else []
        main(["train", "--config", str(CONFIGS / f"gsm8k_{name}.yaml"), *small, *extra, f"run_dir={run}"])
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [x for x in lines if "loss" in x or "policy_loss" in x]
        assert len(steps) == 2, (name, lines[-1])
        if name in STAT:
            assert any(STAT[name] in x for x in steps), (name, sorted(steps[-1]))
    capsys.readouterr()

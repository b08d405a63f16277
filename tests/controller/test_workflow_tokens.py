"""Multi-turn token accounting: what the chat template adds between turns, for a tokenizer that
re-tokenises the answer the same way (the character tokenizer) and for a BPE one that does not."""

import pytest

from areal_jax.controller.workflow import WorkflowError, environment_tokens, get_workflow
from areal_jax.models import encode_chat
from areal_jax.models.tiny import CHAT_TEMPLATE, build_char_tokenizer

FEEDBACK = {"role": "user", "content": "Wrong. Try again."}


def test_char_tokenizer_prefix_path() -> None:
    tok = build_char_tokenizer()
    messages = [{"role": "user", "content": "12+7="}]
    so_far = encode_chat(tok, messages) + tok.encode("19", add_special_tokens=False) + [tok.eos_token_id]
    messages += [{"role": "assistant", "content": "19"}, FEEDBACK]
    env = environment_tokens(tok, messages, so_far)
    assert so_far + env == encode_chat(tok, messages)
    assert tok.decode(env).startswith("\n<|im_start|>user\nWrong.")


def _bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["the answer is forty two", "user assistant try again wrong"] * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_bpe_answer_sampled_as_unmerged_pieces_keeps_its_tokens() -> None:
    tok = _bpe_tokenizer()
    messages = [{"role": "user", "content": "what is the answer"}]
    canonical = tok.encode("forty", add_special_tokens=False)
    pieces = [t for ch in "forty" for t in tok.encode(ch, add_special_tokens=False)]
    assert len(canonical) < len(pieces)  # the model sampled a non-canonical split
    so_far = encode_chat(tok, messages) + pieces + [tok.eos_token_id]
    messages += [{"role": "assistant", "content": "forty"}, FEEDBACK]
    env = environment_tokens(tok, messages, so_far)
    # the sampled tokens stay as they were; the text is exactly the template's
    assert tok.decode(so_far + env) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_unknown_workflow_names_the_field() -> None:
    with pytest.raises(WorkflowError, match="rollout.workflow='no_such_module:episode'"):
        get_workflow("no_such_module:episode")
    with pytest.raises(WorkflowError, match="must be an async function"):
        get_workflow("json:dumps")

"""Tiny offline models: a tokenizer trained with `tokenizers` on the data, a ~1M-parameter Llama.

No hub access anywhere: the tokenizer vocabulary is learnt from the prepared text and the
model is built from a config with a fixed seed, then both are saved as an ordinary
Hugging Face directory that reloads with ``AutoTokenizer``, ``AutoModelForCausalLM`` and
``AutoModelForSequenceClassification`` (``local_files_only=True``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Chat markers are single tokens; <|end|> closes every turn and is the EOS the policy
# learns to emit, so generation stops on its own.
PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "<|end|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS, SYSTEM, USER, ASSISTANT]

# Jinja chat template in the transformers format. The {% generation %} markers let TRL
# mask everything but assistant turns (assistant_only_loss) if a caller wants it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    + ASSISTANT
    + "{% generation %}{{ message['content'] }}"
    + EOS
    + "{% endgeneration %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

# With tools (stages/base/config: tokenizer.tools): a tool turn, assistant turns that call tools
# in the <tool_call>{"name", "arguments"}</tool_call> form alignpipe.tools parses, and the tools
# offered, by name only (a schema would cost the tiny model more tokens than the question).
# ``<tool_call>`` tokens are plain (decoding keeps them: the rollout parses the decoded text).
TOOL = "<|tool|>"
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}"
    + SYSTEM
    + "tools:{% for t in tools %} {{ (t.function or t).name }}{% endfor %}"
    + EOS
    + "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'tool' %}" + TOOL + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'assistant' %}" + ASSISTANT + "{% generation %}{{ message['content'] or '' }}"
    "{% for c in message['tool_calls'] or [] %}<tool_call>{\"name\": {{ c.function.name | tojson }}, "
    '"arguments": {% if c.function.arguments is string %}{{ c.function.arguments }}'
    "{% else %}{{ c.function.arguments | tojson }}{% endif %}}</tool_call>{% endfor %}"
    + EOS
    + "{% endgeneration %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
# The literal text TOOL_CHAT_TEMPLATE writes around a call, for the tokenizer to learn its words.
TOOL_FORMAT_TEXT = '{"name": "", "arguments": {}} tools:'


# How the tiny tokenizer cuts text (stages/base/config: tokenizer.kind). Every digit stays one
# token either way: the builtin tasks are digit manipulation, learnt digit by digit.
TOKENIZER_KINDS = {
    "char": "one token per character",
    "words": "one token per digit, punctuation mark or space; a run of letters is one token when the data "
    "has that word (its pieces otherwise)",
}


def train_tokenizer(texts: Iterable[str], kind: str = "words", min_frequency: int = 1, tools: bool = False):
    """A tokenizer whose vocabulary is learnt from ``texts``, with the tiny chat template.

    ``char``: one token per character (WordLevel). ``words``: BPE merges only inside runs of
    letters, so ``sort``, ``reverse`` or a system turn's words are one token each while digits,
    punctuation and spaces stay single characters; an unseen word falls back to the pieces
    the data taught (as BPE does), not to ``<unk>``. ``words`` reads a ``chat`` row in two
    thirds of the tokens ``char`` needs: the model does the same arithmetic per token either way.
    ``tools``: the tool-call template (``TOOL_CHAT_TEMPLATE``) and its tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer.kind {kind!r} is not one of {sorted(TOKENIZER_KINDS)}")
    texts = list(texts) + ([TOOL_FORMAT_TEXT] if tools else [])
    if kind == "char":
        tok = Tokenizer(models.WordLevel(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=min_frequency)
    else:
        tok = Tokenizer(models.BPE(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("[A-Za-z]+|."), behavior="isolated")
        alphabet = sorted({c for text in texts for c in text})
        # Large enough never to bind: merges stop when every word is one token.
        trainer = trainers.BpeTrainer(
            vocab_size=1 << 20, min_frequency=max(min_frequency, 1), special_tokens=SPECIAL_TOKENS,
            initial_alphabet=alphabet, show_progress=False,
        )  # fmt: skip
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT] + ([TOOL] if tools else []),
        model_max_length=512,
    )
    if tools:
        fast.add_tokens(TOOL_CALL_TOKENS)
    fast.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return fast


def build_causal_lm(tokenizer, model_cfg: dict[str, Any], seed: int):
    """A randomly initialised Llama or Qwen2 causal LM sized by ``model_cfg``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch = model_cfg.get("architecture", "llama")
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in classes:
        raise ValueError(f"base.model.architecture '{arch}' is not one of {sorted(classes)}")
    config_cls, model_cls = classes[arch]
    cfg = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg["hidden_size"],
        intermediate_size=model_cfg["intermediate_size"],
        num_hidden_layers=model_cfg["num_hidden_layers"],
        num_attention_heads=model_cfg["num_attention_heads"],
        num_key_value_heads=model_cfg.get("num_key_value_heads", model_cfg["num_attention_heads"]),
        max_position_embeddings=model_cfg.get("max_position_embeddings", 256),
        tie_word_embeddings=model_cfg.get("tie_word_embeddings", False),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

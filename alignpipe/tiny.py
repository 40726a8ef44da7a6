"""Tiny offline models: a character tokenizer trained with `tokenizers`, a ~1M-parameter Llama.

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


def train_char_tokenizer(texts: Iterable[str], min_frequency: int = 1):
    """A character-level WordLevel tokenizer whose vocabulary is learnt from ``texts``.

    Characters, not BPE merges: the builtin tasks are digit manipulation, and a model
    that sees one token per digit learns them with far fewer parameters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=min_frequency)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
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

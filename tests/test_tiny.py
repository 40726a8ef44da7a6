"""The tiny offline tokenizer and model reload with the standard Auto classes."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from alignpipe import tiny

MODEL_CFG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def test_char_tokenizer_round_trips_and_formats_chat():
    tok = tiny.train_tokenizer(["sort:52813", "12358", "add:37+48"], "char")
    for text in ["sort:321", "add:3+4", "85"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "sort:21"}, {"role": "assistant", "content": "12"}], tokenize=False
    )
    assert chat == "<|user|>sort:21<|end|><|assistant|>12<|end|>"
    assert tok.eos_token == "<|end|>"
    # one token per character, so digit tasks are learnable by a tiny model
    assert len(tok("52813", add_special_tokens=False)["input_ids"]) == 5


def test_words_tokenizer_keeps_digits_single_and_words_whole():
    texts = ["Digits only.", "sort:52813", "12358", "reverse:907", "add:37+48"]
    tok = tiny.train_tokenizer(texts, "words")
    pieces = tok.convert_ids_to_tokens(tok("Digits only. sort:5281", add_special_tokens=False)["input_ids"])
    assert pieces == ["Digits", " ", "only", ".", " ", "sort", ":", "5", "2", "8", "1"]
    # an unseen word falls back to the letters the data taught, not to <unk>; it still round-trips
    assert tok.unk_token not in tok.convert_ids_to_tokens(tok("rose", add_special_tokens=False)["input_ids"])
    for text in ["add:3+4", "reverse:0907", "Digits sort"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # a chat turn costs fewer tokens than one per character
    chat = [{"role": "system", "content": "Digits only."}, {"role": "user", "content": "reverse:907"}]
    words = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    chars = tiny.train_tokenizer(texts, "char").apply_chat_template(chat, tokenize=True, return_dict=True)
    assert len(words) == 13 and len(chars["input_ids"]) == 27


def test_unknown_tokenizer_kind_is_refused():
    with pytest.raises(ValueError, match="'bpe' is not one of"):
        tiny.train_tokenizer(["abc"], "bpe")


def test_model_saves_and_reloads_offline_with_auto_classes(tmp_path):
    tok = tiny.train_tokenizer(["sort:52813", "12358"], "char")
    model = tiny.build_causal_lm(tok, MODEL_CFG, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded_tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded_tok.chat_template == tok.chat_template
    causal = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert causal.config.eos_token_id == tok.eos_token_id
    scorer = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1, local_files_only=True)
    assert scorer.config.num_labels == 1


def test_same_seed_same_weights_different_seed_different():
    tok = tiny.train_tokenizer(["abc"], "char")
    a, b, c = (tiny.build_causal_lm(tok, MODEL_CFG, seed=s) for s in (0, 0, 1))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert (wa == wb).all() and not (wa == wc).all()

"""The tiny offline tokenizer and model reload with the standard Auto classes."""

from __future__ import annotations

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
    tok = tiny.train_char_tokenizer(["sort:52813", "12358", "add:37+48"])
    for text in ["sort:321", "add:3+4", "85"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "sort:21"}, {"role": "assistant", "content": "12"}], tokenize=False
    )
    assert chat == "<|user|>sort:21<|end|><|assistant|>12<|end|>"
    assert tok.eos_token == "<|end|>"
    # one token per character, so digit tasks are learnable by a tiny model
    assert len(tok("52813", add_special_tokens=False)["input_ids"]) == 5


def test_model_saves_and_reloads_offline_with_auto_classes(tmp_path):
    tok = tiny.train_char_tokenizer(["sort:52813", "12358"])
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
    tok = tiny.train_char_tokenizer(["abc"])
    a, b, c = (tiny.build_causal_lm(tok, MODEL_CFG, seed=s) for s in (0, 0, 1))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert (wa == wb).all() and not (wa == wc).all()

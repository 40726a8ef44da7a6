"""DPO on both engines: the local trainer's own loss (TRL's preference term on NeMo-RL's tokens,
plus NeMo-RL's SFT term) against NeMo-RL v0.7.0's DPOLossFn built from the rendered ``dpo``
section, on one real batch: the same loss and the same gradient. (GRPO's loss:
test_equivalence_grpo.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_nemo_rl_render import rendered

PAIRS = [
    {"prompt": "sort 312", "chosen": "123", "rejected": "321"},
    {"prompt": "reverse abcd", "chosen": "dcba", "rejected": "abcd dcba"},
    {"prompt": "add 2 3", "chosen": "5", "rejected": "six"},
]
VARIANTS = {  # dpo knobs over the rendered tiny section
    "as_rendered": {},
    "summed_sft": {"sft_loss_weight": 0.5, "sft_average_log_probs": False},
    "averaged_preference": {"preference_average_log_probs": True, "sft_loss_weight": 0.0},
    "weighted": {"preference_loss_weight": 0.3, "sft_loss_weight": 1.5, "reference_policy_kl_penalty": 0.5},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two different tiny Llamas (policy, reference) sharing a tokenizer."""
    from alignpipe.tiny import build_causal_lm, train_tokenizer

    tokenizer = train_tokenizer(["".join(chr(c) for c in range(32, 127))], "char")
    dims = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    out = []
    for seed in (0, 1):
        where = tmp_path_factory.mktemp(f"model{seed}")
        build_causal_lm(tokenizer, dims, seed=seed).save_pretrained(where)
        tokenizer.save_pretrained(where)
        out.append(where)
    return out[0], out[1]


def test_dpo_loss_and_gradient_equal_nemo_rls(models, nemo_rl_runtime, tmp_path: Path) -> None:
    from trl import DPOConfig

    from alignpipe.engines.local import nemo_rl_keys as K
    from alignpipe.engines.local.preference_pairs import preference_examples
    from alignpipe.engines.local.stages import dpo as D
    from alignpipe.measure.logprobs import load_policy

    policy_dir, reference_dir = models
    base = rendered("dpo", "tiny", tmp_path)
    cases, ours = [], []
    for name, knobs in VARIANTS.items():
        cfg = {**base, "dpo": {**base["dpo"], **knobs}}
        policy, tokenizer = load_policy(policy_dir)
        reference, _ = load_policy(reference_dir)
        settings = D.loss_settings(K.read_stage_keys(cfg, "dpo", "the rendered dpo config").algorithm)
        sft = settings.pop("sft")
        args = DPOConfig(output_dir=str(tmp_path / name), report_to=[], use_cpu=True, disable_dropout=True,
                         precompute_ref_log_probs=False, **settings)  # fmt: skip
        pairs = preference_examples(tokenizer, PAIRS, K.preference_data_keys(K.ProfileKeys(cfg, "dpo")))
        rows = D.trl_pairs(pairs)
        trainer = D.make_trainer_class()(
            sft=sft, model=policy, ref_model=reference, args=args, processing_class=tokenizer,
            train_dataset=__import__("datasets").Dataset.from_list(rows),
        )  # fmt: skip
        inputs = trainer.data_collator(rows)
        policy.eval()
        seen = {}
        hook = policy.model.norm.register_forward_hook(
            lambda module, args, output, seen=seen: seen.setdefault("hidden", output)
        )
        loss = trainer._compute_loss(policy, inputs, False)
        hook.remove()
        hidden = seen["hidden"]
        hidden.retain_grad()
        loss.backward()
        ours.append({"loss": loss.detach(), "grad": hidden.grad.clone()})

        # NeMo-RL's layout: pairs interleaved [c0, r0, c1, r1, ...]
        n = len(rows)
        order = [i for k in range(n) for i in (k, n + k)]
        weight = policy.lm_head.weight.detach()
        with torch.no_grad():
            ref_logits = reference(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            ).logits
        ref_lp = torch.log_softmax(ref_logits[:, :-1].float(), -1).gather(
            -1, inputs["input_ids"][:, 1:, None]
        )[..., 0]
        cases.append({
            "dpo": cfg["dpo"],
            "logits": (hidden.detach() @ weight.T)[order],
            "input_ids": inputs["input_ids"][order],
            "token_mask": inputs["completion_mask"][order].float(),
            "reference_logprobs": torch.cat([ref_lp, torch.zeros_like(ref_lp[:, :1])], 1)[order],
            "order": order, "weight": weight,
        })  # fmt: skip

    upstream = nemo_rl_runtime(
        "dpo_loss", {"cases": [{k: v for k, v in c.items() if k not in ("order", "weight")} for c in cases]}
    )
    for name, mine, case, theirs in zip(VARIANTS, ours, cases, upstream, strict=True):
        torch.testing.assert_close(
            mine["loss"], theirs["loss"].to(mine["loss"].dtype), rtol=0, atol=1e-5, msg=name
        )
        inverse = torch.argsort(torch.tensor(case["order"]))
        grad_hidden = theirs["grad"][inverse] @ case["weight"]
        assert grad_hidden.abs().max() > 1e-4, name
        torch.testing.assert_close(mine["grad"], grad_hidden, rtol=0, atol=1e-5, msg=name)


def test_sft_loss_and_gradient_equal_nemo_rls_nll(models, nemo_rl_runtime, tmp_path: Path) -> None:
    """The local SFT trainer's loss on one batch of its own rows (NeMo-RL's tokens, a weight-0
    row among them) against NeMo-RL's NLLLossFn on the same logits: loss 1e-5, gradient 1e-5."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from alignpipe.engines.local.nemo_rl_keys import ProfileKeys, sft_data_keys
    from alignpipe.engines.local.stages.sft import sft_examples
    from alignpipe.measure.logprobs import load_policy

    policy, tokenizer = load_policy(models[0])
    cfg = rendered("sft", "tiny", tmp_path)
    limit = int(cfg["data"]["max_input_seq_length"])
    conversations = [
        [{"role": "user", "content": "sort 312"}, {"role": "assistant", "content": "123"}],
        [{"role": "user", "content": "reverse abcdef"}, {"role": "assistant", "content": "fedcba"}],
        [{"role": "user", "content": "9" * limit}, {"role": "assistant", "content": "1"}],  # weight 0
    ]
    rows = sft_examples(
        tokenizer, [{"messages": m} for m in conversations], sft_data_keys(ProfileKeys(cfg, "sft"))
    )
    args = SFTConfig(output_dir=str(tmp_path / "sft"), report_to=[], use_cpu=True, completion_only_loss=True,
                     packing=False, max_length=None)  # as sft.run: the rows already follow NeMo-RL's length rule  # fmt: skip
    trainer = SFTTrainer(
        model=policy, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    inputs = trainer.data_collator([dict(r) for r in trainer.train_dataset])
    policy.eval()
    seen = {}
    hook = policy.model.norm.register_forward_hook(lambda m, a, out: seen.setdefault("hidden", out))
    loss = trainer.compute_loss(policy, inputs)
    hook.remove()
    seen["hidden"].retain_grad()
    loss.backward()
    weight = policy.lm_head.weight.detach()
    theirs = nemo_rl_runtime("sft_loss", {
        "logits": seen["hidden"].detach() @ weight.T,
        "input_ids": inputs["input_ids"],
        "token_mask": (inputs["labels"] != -100).float(),  # the collator's view of completion_mask
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),  # sft_processor's loss_multiplier
    })  # fmt: skip
    assert inputs["labels"][2].eq(-100).all()  # the weight-0 row trains nothing locally either
    torch.testing.assert_close(loss.detach(), theirs["loss"].to(loss.dtype), rtol=0, atol=1e-5)
    torch.testing.assert_close(seen["hidden"].grad, theirs["grad"] @ weight, rtol=0, atol=1e-5)


def test_rm_loss_and_gradient_equal_nemo_rls_preference_loss(models, nemo_rl_runtime, tmp_path: Path) -> None:
    """The local RM trainer's Bradley-Terry loss on one batch of pairs against NeMo-RL's
    PreferenceLossFn on the same rewards: loss and gradient with respect to each reward."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from alignpipe.engines.local.nemo_rl_keys import ProfileKeys, preference_data_keys
    from alignpipe.engines.local.preference_pairs import preference_examples
    from alignpipe.engines.local.stages.rm import load_reward_model

    tokenizer = AutoTokenizer.from_pretrained(models[0], local_files_only=True)
    torch.manual_seed(0)
    model = load_reward_model(str(models[0]), tokenizer)
    cfg = rendered("rm", "tiny", tmp_path)
    pairs = preference_examples(tokenizer, PAIRS, preference_data_keys(ProfileKeys(cfg, "rm")))
    rows = [{"chosen_ids": p["chosen_input_ids"], "rejected_ids": p["rejected_input_ids"]} for p in pairs]
    args = RewardConfig(output_dir=str(tmp_path / "rm"), report_to=[], use_cpu=True, disable_dropout=True,
                        max_length=int(cfg["policy"]["max_total_sequence_length"]))  # fmt: skip
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    inputs = trainer.data_collator([dict(r) for r in trainer.train_dataset])
    model.eval()
    seen = {}
    hook = model.score.register_forward_hook(lambda m, a, out: seen.setdefault("scores", out))
    loss = trainer.compute_loss(model, inputs)
    hook.remove()
    scores = seen["scores"]  # [2B, T, 1]: the head at every position; the model reads each row's last token
    scores.retain_grad()
    loss.backward()
    last = inputs["attention_mask"].sum(-1) - 1
    rewards = scores.detach()[torch.arange(len(last)), last, 0]
    n = len(rows)
    order = [i for k in range(n) for i in (k, n + k)]  # NeMo-RL interleaves [chosen, rejected, ...]
    theirs = nemo_rl_runtime("rm_loss", {"rewards": rewards[order]})
    torch.testing.assert_close(loss.detach(), theirs["loss"].to(loss.dtype), rtol=0, atol=1e-6)
    grad = scores.grad[torch.arange(len(last)), last, 0]
    torch.testing.assert_close(grad, theirs["grad"][torch.argsort(torch.tensor(order))], rtol=0, atol=1e-6)
    assert scores.grad.abs().sum() == pytest.approx(grad.abs().sum().item())  # only the last tokens train

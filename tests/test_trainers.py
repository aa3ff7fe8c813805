"""actoff under the trainers people use: the Hugging Face Trainer (with and without gradient
checkpointing), PEFT (LoRA with dropout, prefix and prompt tuning), TRL's SFT and DPO trainers
(gradient checkpointing on, their default), TRL's GRPO (generation between steps) and an
accelerate loop.

Each run is the same run without actoff, from the same initial tiny random Llama (nothing is
downloaded; the tokenizer is built here): whole-tensor tiers bit for bit, token-wise recompute
within float32 reassociation (``RECOMPUTE_TOL``), and under gradient checkpointing bit for bit
with one warning (Note [under checkpointing]: checkpoint keeps the inputs only, which actoff
places). Each test runs a few steps on a few sequences of 32 tokens.
"""

import copy
import warnings

import pytest
import torch
from _helpers import RECOMPUTE_TOL

import actoff

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")

pytestmark = [
    # transformers 5 renamed gradient checkpointing to activation checkpointing; TRL and the
    # Trainer still set the old names, which warn.
    pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated:FutureWarning"),
    # PEFT's prefix tuning passes its prefix as `past_key_values`, which transformers 5 renamed `cache`.
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]

POLICIES = [{"policy": "cpu"}, {"policy": "tokenwise", "cpu_fraction": 0.5}]
POLICY_IDS = ["cpu", "tokenwise"]
LAYER = "LlamaDecoderLayer"  # by name, as a model's _no_split_modules gives it


def _model():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=3,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _tokenizer():
    """A word-level tokenizer over ``w0`` ... ``w59`` (TRL tokenizes text itself)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "[EOS]", "[BOS]"] + [f"w{i}" for i in range(60)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]", bos_token="[BOS]"
    )


def _sentences(count: int, words: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    return [
        " ".join(f"w{i}" for i in torch.randint(0, 60, (words,), generator=generator).tolist())
        for _ in range(count)
    ]


def _parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same_parameters(expected, actual, exact: bool) -> None:
    tolerance = {"rtol": 0, "atol": 0} if exact else RECOMPUTE_TOL
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **tolerance, msg=name)


def _run(train, overrides):
    """``train(offload)`` without actoff, then with ``offload_(..., **overrides)``; the actoff
    warnings of the second run."""
    expected = train(lambda model: model)
    actoff.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(lambda model: actoff.offload_(model, block_cls=LAYER, min_bytes=0, **overrides))
    messages = [str(w.message) for w in caught if str(w.message).startswith("actoff")]
    return expected, actual, messages


def _recomputed() -> bool:
    return all(block.bytes_per_tier["recompute"] > 0 for block in actoff.stats().blocks.values())


def _arguments(cls, tmp_path, **options):
    common = {
        "output_dir": str(tmp_path), "max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-3,
        "report_to": [], "save_strategy": "no", "use_cpu": True, "seed": 0, "disable_tqdm": True,
    }  # fmt: skip
    return cls(**{**common, **options})


# ---------------------------------------------------------------------------------- Trainer
@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_hugging_face_trainer(checkpointing, overrides, tmp_path):
    """The Trainer's AdamW steps on a tiny Llama (its default ``use_cache=True``: the KV cache of
    a training forward is never written by a re-run)."""
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(4, 64, (6, 32), generator=generator)]

    def train(offload):
        model = offload(_model())
        args = _arguments(transformers.TrainingArguments, tmp_path, gradient_checkpointing=checkpointing)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return _parameters(model), [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    (expected, expected_losses), (actual, losses), messages = _run(train, overrides)
    tokenwise = overrides["policy"] == "tokenwise"
    _assert_same_parameters(expected, actual, exact=not tokenwise or checkpointing)
    assert actoff.stats().steps == 3
    if checkpointing:  # the layer inputs placed, nothing recomputed token-wise, said once if asked for
        assert len(messages) == int(tokenwise) and all("recomputes nothing token-wise" in m for m in messages)
        assert losses == expected_losses
    else:
        assert messages == [] and _recomputed() == tokenwise


# ---------------------------------------------------------------------------------- PEFT
def _peft_config(kind):
    peft = pytest.importorskip("peft", reason="PEFT is not installed")
    if kind == "lora":  # the usual recipe: dropout on the adapters' input
        return peft.LoraConfig(
            task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1
        )
    if kind == "prefix":  # a key/value prefix per layer, given to the layers as a cache
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("kind", ["lora", "prefix", "prompt"])
def test_peft_adapters(kind, overrides):
    """LoRA with ``lora_dropout=0.1`` is recomputed token-wise with the forward's masks (it was
    placed whole: Note [dropout in a re-run]); prefix tuning's cache is never written by a
    re-run; prompt tuning's virtual tokens are more tokens."""
    import peft

    def train(offload):
        model = offload(peft.get_peft_model(_model(), _peft_config(kind)))
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        generator = torch.Generator().manual_seed(1)
        torch.manual_seed(5)  # the dropout masks
        for _ in range(3):
            tokens = torch.randint(4, 64, (2, 32), generator=generator)
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return _parameters(model)

    expected, actual, messages = _run(train, overrides)
    tokenwise = overrides["policy"] == "tokenwise"
    _assert_same_parameters(expected, actual, exact=not tokenwise)
    assert messages == [] and _recomputed() == tokenwise


# ---------------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("checkpointing", [True, False], ids=["default", "no_checkpointing"])
def test_trl_sft_trainer(checkpointing, overrides, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL is not installed")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    if not checkpointing and overrides["policy"] == "cpu":
        pytest.skip("the Trainer's test covers cpu without checkpointing")
    data = datasets.Dataset.from_dict({"text": _sentences(6, 24, seed=0)})

    def train(offload):
        model = offload(_model())
        args = _arguments(
            trl.SFTConfig, tmp_path, max_length=32, bf16=False, gradient_checkpointing=checkpointing
        )
        trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer()).train()
        return _parameters(model)

    expected, actual, messages = _run(train, overrides)
    tokenwise = overrides["policy"] == "tokenwise"
    _assert_same_parameters(expected, actual, exact=not tokenwise or checkpointing)
    assert len(messages) == int(tokenwise and checkpointing), messages
    assert _recomputed() == (tokenwise and not checkpointing)


def _probes_and_recompute_per_step(log):
    """A Trainer callback that notes, at each step's end, the blocks' probes and recomputed bytes."""

    class Log(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            blocks = actoff.stats().blocks.values()
            if blocks:  # (none in the run without actoff)
                log.append(
                    (sum(b.probes for b in blocks), min(b.bytes_per_tier["recompute"] for b in blocks))
                )

    return Log()


@pytest.mark.parametrize("collator", ["packing", "padding_free"])
def test_trl_sft_packed_batches_are_recomputed_token_wise(collator, tmp_path):
    """TRL's ``packing=True`` (several documents a row, position ids restarting at each, a
    block-diagonal mask) recomputed nothing: every batch had other metadata (the documents' count,
    their longest) and saved tensors of other sizes, so each was probed again or placed whole. Now
    one probe, then every step recomputes (Note [what a key keeps])."""
    trl = pytest.importorskip("trl", reason="TRL is not installed")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    lengths = [5, 9, 14, 20, 7, 11, 16, 6, 12, 18, 8, 10, 13, 17, 4, 19, 9, 15, 6, 21, 11, 8, 14, 10]
    data = datasets.Dataset.from_dict({"text": [_sentences(1, n, seed=i)[0] for i, n in enumerate(lengths)]})
    # padding-free without packing: each batch's documents flattened into one row, untruncated
    options = (
        {"packing": True, "max_length": 32}
        if collator == "packing"
        else {"padding_free": True, "max_length": None}
    )
    logs: list[list] = []

    def train(offload):
        model = offload(_model())
        args = _arguments(
            trl.SFTConfig, tmp_path, max_steps=6, bf16=False, gradient_checkpointing=False, **options
        )
        logs.append([])  # the run without actoff, then the one with
        trainer = trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=data,
            processing_class=_tokenizer(),
            callbacks=[_probes_and_recompute_per_step(logs[-1])],
        )
        trainer.train()
        return _parameters(model)

    expected, actual, messages = _run(train, {"policy": "tokenwise", "cpu_fraction": 0.5})
    _assert_same_parameters(expected, actual, exact=False)  # recomputed: float32 reassociation
    assert messages == []
    log = logs[1]
    probes = [count for count, _ in log]
    assert probes[0] > 0 and probes[1:] == [0] * 5, log  # one probe, in the first step
    assert all(recomputed > 0 for _, recomputed in log[1:]), log


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_trl_dpo_trainer(overrides, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL is not installed")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    prompts, chosen, rejected = (_sentences(6, 8, seed) for seed in (0, 1, 2))
    data = datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})

    def train(offload):
        model = _model()
        reference = copy.deepcopy(model)  # the frozen reference model: no_grad, never a scope
        offload(model)
        args = _arguments(trl.DPOConfig, tmp_path, max_steps=2, max_length=32, bf16=False)
        trl.DPOTrainer(
            model=model, ref_model=reference, args=args, train_dataset=data, processing_class=_tokenizer()
        ).train()
        return _parameters(model)

    expected, actual, messages = _run(train, overrides)
    _assert_same_parameters(expected, actual, exact=True)  # checkpointing on: inputs only, exact
    assert len(messages) == int(overrides["policy"] == "tokenwise"), messages
    assert actoff.stats().steps == 2


# ---------------------------------------------------------------------------------- TRL GRPO
def _says_w1(prompts, completions, **kwargs):
    """GRPO's reward: completions that say ``w1``, and a little for every word; rewards that differ
    within a group, so each step has advantages to learn from."""
    return [completion.count("w1") + 0.1 * len(completion.split()) for completion in completions]


def _calls_per_step(log):
    """A Trainer callback that notes, at each step's end, each block's scope calls in the step."""

    class Log(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.append([block.calls for block in actoff.stats().blocks.values()])

    return Log()


@pytest.mark.parametrize(
    "overrides",
    [
        {"policy": "cpu"},
        {"policy": "tokenwise", "cpu_fraction": 0.5},
        # A budget under the blocks' bytes (2 x 257 KiB) forces a plan that moves some; on the plain
        # CPU device, whose memory is not counted, the budget is for the blocks' bytes alone.
        pytest.param({"policy": "auto", "gpu_budget": "400KiB"}, marks=pytest.mark.no_sim_device),
    ],
    ids=["cpu", "tokenwise", "auto"],
)
def test_trl_grpo_trainer(overrides, tmp_path):
    """TRL's GRPO (issue 38, item 8): completions generated between steps (``model.generate``
    under ``no_grad``, with a KV cache, no vLLM), rewarded by a function, then one training step.
    Generation passes through actoff's scopes, so the same completions come out (the same rewards
    every step: nothing actoff did moved the random stream) and each block runs one scope a step.
    Checkpointing off (on by default in GRPO): the policies place the activations themselves
    (under checkpointing they place its inputs only, as the SFT test shows)."""
    trl = pytest.importorskip("trl", reason="TRL is not installed")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    data = datasets.Dataset.from_dict({"prompt": _sentences(8, 6, seed=0)})
    calls: list[list] = []

    def train(offload):
        model = offload(_model())
        args = _arguments(
            trl.GRPOConfig, tmp_path, max_steps=4, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, generation_kwargs={"min_new_tokens": 8}, bf16=False,
            gradient_checkpointing=False, logging_steps=1,
        )  # fmt: skip
        calls.append([])
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=_says_w1, args=args, train_dataset=data, processing_class=_tokenizer(),
            callbacks=[_calls_per_step(calls[-1])],
        )  # fmt: skip
        trainer.train()
        return _parameters(model), [
            entry["reward"] for entry in trainer.state.log_history if "reward" in entry
        ]

    (expected, expected_rewards), (actual, rewards), messages = _run(train, overrides)
    assert len(rewards) == 4 and rewards == expected_rewards  # the same completions, step by step
    _assert_same_parameters(expected, actual, exact=overrides["policy"] == "cpu")
    assert messages == []
    assert calls[1] == [[1, 1]] * 4  # the training forward only: generation passed through
    stats = actoff.stats()
    moved = [b.bytes_offloaded + b.bytes_per_tier["recompute"] for b in stats.blocks.values()]
    assert all(moved) if overrides["policy"] != "auto" else any(moved) and stats.plan != "none"
    assert _recomputed() == (overrides["policy"] == "tokenwise")


# ---------------------------------------------------------------------------------- accelerate
@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_accelerate_training_loop(overrides):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")

    def train(offload):
        model = offload(_model())
        accelerator = accelerate.Accelerator(cpu=True)
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randint(4, 64, (6, 32), generator=generator))
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for (tokens,) in loader:
            accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
            optimizer.step()
            optimizer.zero_grad()
        return _parameters(accelerator.unwrap_model(model))

    expected, actual, messages = _run(train, overrides)
    tokenwise = overrides["policy"] == "tokenwise"
    _assert_same_parameters(expected, actual, exact=not tokenwise)
    assert messages == [] and _recomputed() == tokenwise
    assert actoff.stats().steps == 3

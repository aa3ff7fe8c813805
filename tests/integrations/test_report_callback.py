"""`actoff.integrations.huggingface.ReportCallback` in a Hugging Face Trainer: the report's
figures join each training log (a tiny random Llama, nothing downloaded)."""

import pytest
import torch
from _helpers import tiny_llama

import actoff
from actoff.testing import simulated_device

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")

pytestmark = [  # the Trainer still sets the old name of activation checkpointing, which warns
    pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated:FutureWarning"),
]


class _Recorder(transformers.TrainerCallback):
    """A callback after the report's: the logs as the callbacks after it see them, and the bytes
    actoff sent to the host in that step."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        placed = sum(block.bytes_per_tier["cpu"] for block in actoff.stats().blocks.values())
        self.logs.append((dict(logs), placed))


def test_the_trainers_logs_carry_the_report(tmp_path):
    from actoff.integrations.huggingface import ReportCallback

    model = actoff.offload_(tiny_llama(), block_cls="LlamaDecoderLayer", policy="cpu", min_bytes=0)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(4, 128, (8, 32), generator=generator)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, logging_steps=2, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    callback, recorder = ReportCallback(), _Recorder()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, recorder])
    with simulated_device(seed=0):  # a device that counts its memory: the peak is in the logs
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [2, 4]
    seen_after = [(logs, placed) for logs, placed in recorder.logs if "loss" in logs]
    for entry, (seen, placed) in zip(logged, seen_after, strict=True):
        assert seen["actoff/host_bytes"] == entry["actoff/host_bytes"] == placed > 0
        assert entry["actoff/offloaded_bytes"] == placed and entry["actoff/nvme_bytes"] == 0
        assert 0 < entry["actoff/device_peak_bytes"] < entry["actoff/kept_peak_bytes"]
        assert "actoff/plan" not in entry  # numbers only: the cpu policy has no plan anyway
    assert [entry["actoff/steps"] for entry in logged] == [2, 4]  # one backward per step
    assert callback.last.steps == 4 and "device peak" in str(callback.last)

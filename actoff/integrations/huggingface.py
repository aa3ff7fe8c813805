"""`ReportCallback`: `actoff.report`'s figures in the Hugging Face Trainer's logs (imports transformers)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from actoff.reporting import Report, report

__all__ = ["ReportCallback"]

#: The prefix of the figures' names in the logs (``actoff/device_peak_bytes``).
PREFIX = "actoff/"


class ReportCallback(TrainerCallback):
    """Adds `actoff.report`'s numbers to each training log of a Hugging Face ``Trainer`` (every
    ``logging_steps``), named ``actoff/device_peak_bytes``, ``actoff/kept_peak_bytes``,
    ``actoff/host_bytes`` and so on; the last report is ``callback.last`` (its ``str`` names the
    ``auto`` plan too). The device peak covers the steps since the log before.

    The Trainer hands the logs to its callbacks in turn. Its progress bar or printer comes after
    the callbacks given to it and shows the figures; its reporting integrations (``report_to``:
    TensorBoard, W&B) come before them and log the figures only if this one is put first
    (``trainer.callback_handler.callbacks.insert(0, ReportCallback())``). Either way the figures
    join the log entry in ``trainer.state.log_history``.

    Example:
        >>> import transformers
        >>> from actoff.integrations.huggingface import ReportCallback
        >>> callback = ReportCallback()
        >>> isinstance(callback, transformers.TrainerCallback), callback.last
        (True, None)
    """

    def __init__(self, device: Any = None) -> None:
        self.device = device  # as `actoff.report`'s: None picks the device scopes run on
        self.last: Report | None = None
        self._pending: Report | None = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The Trainer decides here whether this step logs (its flow callback runs first); the
        # report is taken now, after the step's backward, for that log only (not an evaluation's).
        if control.should_log:
            self._pending = self.last = report(self.device)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._pending is None or logs is None:
            return
        figures = {
            PREFIX + name: value
            for name, value in self._pending.to_dict().items()
            if isinstance(value, (int, float))  # loggers take numbers; the plan is in str(report)
        }
        self._pending = None
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)  # the entry the Trainer made of these logs

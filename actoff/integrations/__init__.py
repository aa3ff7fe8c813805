"""Adapters between actoff and the libraries people train with; each module imports its library
when it is imported itself, so ``import actoff`` imports none of them.

- `huggingface`: ``ReportCallback``, `actoff.report`'s figures in the Hugging Face Trainer's logs.
"""

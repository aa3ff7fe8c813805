"""Long-context training benchmark: actoff's policies side by side with the alternatives.

The entry point: ``python benchmarks/long_context.py --help`` tells the command line. The code is
in ``benchmarks/longctx/``, a module per question (its ``__init__`` says which); the names below
are re-exported for whoever loads this script as a module.
"""

import os
import sys

# This checkout's actoff (and _common) before any installed copy: a benchmark measures the
# code it sits next to, also when the package is installed elsewhere or not at all.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from longctx import emulate, lora, maxseq, snapshot, tunnel
from longctx.cli import build_parser, main, parse_lengths
from longctx.maxseq import (
    _verdict,
    add_max_seq_ratios,
    find_max_seq,
    max_seq_ratio,
    max_seq_summary,
    where_memory_goes,
)
from longctx.paired import summarize
from longctx.policies import check_policies, split_variants
from longctx.table import add_derived
from longctx.worker import run_one

__all__ = [
    "_verdict",
    "add_derived",
    "add_max_seq_ratios",
    "build_parser",
    "check_policies",
    "emulate",
    "find_max_seq",
    "lora",
    "main",
    "max_seq_ratio",
    "max_seq_summary",
    "maxseq",
    "parse_lengths",
    "run_one",
    "snapshot",
    "split_variants",
    "summarize",
    "tunnel",
    "where_memory_goes",
]

if __name__ == "__main__":
    sys.exit(main())

"""`--smoke`, every benchmark's flag: the smallest sizes that still run each of its code paths,
quickly, ending with its usual last line of JSON (tests/bench/test_benchmarks.py runs each so, and
checks that line's keys against docs/benchmarks.md). A smoke run measures nothing worth reading.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

# The tiny preset shrunk to seconds a stage (bench/harness/runs.py SHORT, the end-to-end tests', still takes
# a minute or more a run): what a smoke run gives `gristmill run configs/tiny.yaml` when it runs the
# pipeline itself.
RUN = ["collect.max_docs_per_source=40", "tokenize.vocab_size=512", "pretrain.max_steps=2", "pretrain.val_windows=2",
       "sft.max_steps=2", "align.grpo.max_steps=1", "align.grpo.batch_size=2", "align.grpo.num_generations=2",
       "align.grpo.heldout_prompts=2", "evaluate.arith_problems=2", "evaluate.max_eval_tokens=1024"]
# The align stage's three methods at a step or two each, on a few pairs: `bench claims --smoke`.
ALIGN = ["align.grpo.max_steps=1", "align.grpo.batch_size=2", "align.grpo.num_generations=2",
         "align.grpo.heldout_prompts=2", "align.dpo.max_steps=1", "align.dpo.batch_size=2", "align.dpo.max_pairs=16",
         "align.ppo.max_pairs=16", "align.ppo.reward_model.max_steps=1", "align.ppo.reward_model.batch_size=2",
         "align.ppo.policy.max_steps=1", "align.ppo.policy.batch_size=2", "align.ppo.policy.minibatch_size=2",
         "align.ppo.policy.max_new_tokens=4"]


def _flag(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None, note: str = "",
          **smallest: Any) -> argparse.Namespace:
    """`parser`'s arguments parsed from `argv`, with `--smoke` added: given, the options named in
    `smallest` (by dest) default to those values (options given on the command line still win).
    `note` says what else the benchmark's smoke run changes."""
    named = {action.dest: (action.option_strings or [action.dest])[0] for action in parser._actions}
    said = ", ".join(f"{named[dest]} {_flag(value)}" for dest, value in smallest.items())
    parser.add_argument("--smoke", action="store_true", help="a smoke run: the smallest sizes that run every code "
                        "path, quickly, for CI (" + "; ".join(filter(None, [said, note])) + ")")
    asked = argparse.ArgumentParser(add_help=False)
    asked.add_argument("--smoke", action="store_true")
    if asked.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**smallest)
    return parser.parse_args(argv)

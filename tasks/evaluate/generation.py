"""GSM8K by generation: a few-shot prompt, greedy decoding, the final number matched exactly;
optionally n sampled answers per problem for pass@k.

The prompt and answer extraction are lm-eval's gsm8k task ("Question: …\\nAnswer:", examples
joined by a blank line, generation stopped at "Question:", its "flexible-extract" filter: the
last number in the completion, commas, "$" and a final "." ignored). The few-shot examples live
in one place, our gsm8k YAML under lm_eval_tasks/, read here so both tools ask the same prompt.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from gristmill.tasks.evaluate.formats import Item

YAML_PATH = Path(__file__).with_name("lm_eval_tasks") / "gristmill_gsm8k.yaml"
NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
STOP = ("Question:", "</s>", "<|im_end|>")


class _TaggedLoader(yaml.SafeLoader):
    """Reads lm-eval YAML: `!function module.name` tags come back as plain strings."""


def _tag_text(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    if not isinstance(node, yaml.ScalarNode):
        raise yaml.constructor.ConstructorError(None, None, "!function takes a name", node.start_mark)
    return str(loader.construct_scalar(node))


_TaggedLoader.add_constructor("!function", _tag_text)


@lru_cache(maxsize=1)
def fewshot_examples() -> tuple[tuple[str, str], ...]:
    """(question, answer) pairs of the gsm8k YAML's `fewshot_config.samples`."""
    config = yaml.load(YAML_PATH.read_text(), Loader=_TaggedLoader)  # a safe loader: SafeLoader plus one tag
    return tuple((s["question"], s["answer"]) for s in config["fewshot_config"]["samples"])


def fewshot_prompt(question: str, shots: int) -> str:
    """lm-eval's few-shot context: solved examples, then the question, each "Question: …\\nAnswer:"."""
    examples = fewshot_examples()
    if shots > len(examples):
        raise ValueError(f"gsm8k has {len(examples)} few-shot examples in {YAML_PATH.name}; asked for {shots}")
    solved = [f"Question: {q}\nAnswer: {a}" for q, a in examples[:shots]]
    return "\n\n".join([*solved, f"Question: {question}\nAnswer:"])


def final_number(completion: str) -> str:
    """The last number in a completion, normalised like the gold answer ("[invalid]" when none)."""
    found = [a or b for a, b in NUMBER.findall(completion)]
    if not found:
        return "[invalid]"
    return found[-1].replace(",", "").replace("$", "").removesuffix(".").strip()


def generate_answers(model: Any, tokenizer: Any, items: Sequence[Item], shots: int, max_new_tokens: int,
                     device: str, batch_size: int, num_samples: int = 1, temperature: float = 0.0,
                     max_length: int | None = None) -> list[list[str]]:
    """Completions per item (one greedy, or `num_samples` sampled)."""
    from gristmill.model.generate import generate_text

    prompts = [fewshot_prompt(item.prompt, shots) for item in items]
    return generate_text(model, tokenizer, prompts, max_new_tokens, device, batch_size, STOP,
                         num_samples, temperature, max_length)

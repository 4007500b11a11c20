"""The built-in demo task: integer addition written as text, checked exactly.

    prompt "3+4="  ->  completion "7" then end-of-sequence

It comes with a character-level tokenizer (digits, '+', '=', and BOS/EOS/PAD), so a model
initialised from scratch can learn it on a CPU in minutes. Two rewards, logged apart:
`correct` (1 when the completion is exactly the sum) and `format` (1 when it is a bare
integer no longer than the largest possible answer, so it must stop in time; weighted lower
so that form never outweighs a right answer).
"""

from __future__ import annotations

import functools
import re

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from jgrpo.rewards.scoring import completion_text
from jgrpo.tasks.base import Task

_INTEGER = re.compile(r"\d+")


def char_tokenizer(alphabet: str = "0123456789+=") -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, plus <pad>=0, <s>=1 (prepended), </s>=2."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({char: i + 3 for i, char in enumerate(alphabet)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


_PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"
_SIMPLE_CHAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def text_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character and newline, with a plain chat template.

    For models initialised from scratch on tasks without their own tokenizer (smoke runs of
    the GSM8K and JSON recipes): characters outside the alphabet become <pad>.
    """
    tokenizer = char_tokenizer(_PRINTABLE)
    tokenizer.chat_template = _SIMPLE_CHAT
    return tokenizer


def correct_reward(completions, answer, **_) -> list[float]:
    """1.0 when the completion is exactly the expected integer, else 0.0."""
    return [
        float(completion_text(c).strip() == str(a))
        for c, a in zip(completions, answer, strict=True)
    ]


def format_reward(completions, *, max_digits: int, **_) -> list[float]:
    """1.0 when the completion is a bare integer of at most max_digits digits (so it must
    stop in time), whatever its value."""
    return [
        float(_INTEGER.fullmatch(text) is not None and len(text) <= max_digits)
        for text in (completion_text(c).strip() for c in completions)
    ]


def addition_task(
    max_operand: int = 9,
    held_out: int = 0,
    seed: int = 0,
    chat: bool = False,
    max_problems: int = 20_000,
) -> Task:
    """Sums a + b with 0 <= a, b <= max_operand: every one, or max_problems drawn by the seed.

    held_out > 0 keeps that many problems (chosen by the seed) out of training for the eval
    split; with 0 the eval split is the whole training table, answered greedily. chat=True
    asks the question as a chat message, for instruct models with a chat template.
    """
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}.")
    rng = np.random.default_rng(seed)
    size = (max_operand + 1) ** 2
    indices = np.arange(size) if size <= max_problems else rng.choice(size, max_problems, False)
    if not 0 <= held_out < len(indices):
        raise ValueError(f"held_out must be in [0, {len(indices)}), got {held_out}.")

    def problem(index: int) -> dict:
        a, b = divmod(int(index), max_operand + 1)
        if chat:
            question = f"What is {a} + {b}? Reply with the number only."
            prompt = [{"role": "user", "content": question}]
        else:
            prompt = f"{a}+{b}="
        return {"prompt": prompt, "answer": str(a + b)}

    order = rng.permutation(len(indices))
    held = np.sort(indices[order[:held_out]])
    train = [problem(i) for i in np.sort(indices[order[held_out:]])]
    evaluation = [problem(i) for i in held] if held_out else train
    return Task(
        name="addition",
        train=train,
        eval=evaluation,
        reward_fns={
            "correct": correct_reward,
            "format": functools.partial(format_reward, max_digits=len(str(2 * max_operand))),
        },
        reward_weights={"correct": 1.0, "format": 0.2},
        correctness="correct",
        # Digits, "+" and "=" for a model from scratch; chat messages need a chat template,
        # so a chat task leaves a from-scratch model the general character tokenizer.
        tokenizer=None if chat else char_tokenizer(),
    )

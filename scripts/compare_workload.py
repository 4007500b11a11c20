"""The fixed workload of `python scripts/benchmark.py compare`, shared by every library timed.

One GRPO step: 4 chat prompts of 39 tokens, G = 8 completions each of exactly 64 new tokens
(the stop tokens blocked), temperature 1.0, beta 0.04 (a reference pass), one pass over one
minibatch (mu = 1), AdamW, f32 parameters. The model has the SmolLM2-135M architecture with
random weights (speed does not depend on them), written once as a Hugging Face checkpoint so
that every library loads the same weights and tokenizer.

This module needs only torch, transformers and tokenizers: the peers' separate virtual
environments import it too (`scripts/peers/`).
"""

from __future__ import annotations

import json
import pathlib
import random
import time

PROMPTS = 4
GENERATIONS = 8
NEW_TOKENS = 64
PROMPT_WORDS = 34  # + the chat template's 5 tokens = 39 prompt tokens
TEMPERATURE = 1.0
BETA = 0.04
LEARNING_RATE = 1e-6
SEED = 0

SMOLLM2_135M = dict(
    vocab_size=49_152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# `--model tiny`: the same workload on the tests' tiny Llama (overheads, not arithmetic).
TINY = dict(
    SMOLLM2_135M,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)
ARCHITECTURES = {"smollm2-135m": SMOLLM2_135M, "tiny": TINY}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
# ChatML with words for tokens: <|im_start|> user ... <|im_end|> <|im_start|> assistant
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
MARKER = "workload.json"


def words(vocab: int = SMOLLM2_135M["vocab_size"]) -> list[str]:
    """The tokenizer's vocabulary in id order: specials, roles, then w6 ... w{vocab - 1}."""
    return [*SPECIALS, *ROLES, *(f"w{i}" for i in range(len(SPECIALS) + len(ROLES), vocab))]


def prompts() -> list[list[dict[str, str]]]:
    """The 4 chat prompts (one user message of PROMPT_WORDS random words each, drawn from the
    first 256 ids so that every architecture's vocabulary holds them)."""
    rng = random.Random(SEED)
    vocab = words(256)[len(SPECIALS) + len(ROLES) :]
    return [
        [{"role": "user", "content": " ".join(rng.choice(vocab) for _ in range(PROMPT_WORDS))}]
        for _ in range(PROMPTS)
    ]


def distinct_words_reward(prompts, completions, **_) -> list[float]:
    """A cheap verifier whose scores differ within a group: distinct words / NEW_TOKENS."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(set(text.split())) / NEW_TOKENS for text in texts]


def make_tokenizer(vocab_size: int = SMOLLM2_135M["vocab_size"]):
    """A word-level tokenizer over the model's ids with a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(words(vocab_size))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_checkpoint(directory: str | pathlib.Path, model: str = "smollm2-135m") -> pathlib.Path:
    """Writes the random checkpoint of `model` (a key of ARCHITECTURES) and its tokenizer
    once; returns the directory (reused when its marker says it holds this workload)."""
    directory = pathlib.Path(directory)
    marker = directory / MARKER
    architecture = ARCHITECTURES[model]
    description = {"architecture": architecture, "seed": SEED}
    if marker.exists() and json.loads(marker.read_text()) == description:
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch_model = LlamaForCausalLM(LlamaConfig(**architecture, torch_dtype="float32"))
    directory.mkdir(parents=True, exist_ok=True)
    torch_model.save_pretrained(directory)
    make_tokenizer(architecture["vocab_size"]).save_pretrained(directory)
    marker.write_text(json.dumps(description))
    return directory


def timed(method, on_done):
    """Wraps a bound method of a library under test: on_done(start, args, result) after each
    call, where `start` is the call's time.perf_counter() (so a JAX caller can block on the
    result before reading the clock)."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        on_done(start, args, out)
        return out

    return wrapper


def result_line(library: str, steps: list[dict], tokens: list[int], **extra) -> str:
    """The `RESULT {json}` line every library's run prints: the first step (warm-up) apart,
    then per-step seconds of each stage of the others; `steps` hold "step", "sampling",
    "reference" and "update" seconds, `tokens` the completion tokens of each step."""
    first, timed_steps = steps[0], steps[1:]
    result = {
        "library": library,
        "warmup_s": first["step"],
        **{
            f"{key}_s": [s[key] for s in timed_steps]
            for key in ("step", "sampling", "reference", "update")
        },
        "completion_tokens": tokens[1:],
        **extra,
    }
    return "RESULT " + json.dumps(result)

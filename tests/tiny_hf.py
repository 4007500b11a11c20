"""Tiny random Hugging Face checkpoints, built offline with torch, for parity tests.

Each family exercises its switches: Llama with Llama 3 rope scaling and untied embeddings,
Qwen2 with q/k/v bias and tied embeddings, Qwen3 with q/k norm and head_dim != E / H, Mistral
with a sliding window shorter than the tests' sequences; Gemma 2 with a sliding layer before a
full one, both soft-caps and a query scale of its own; Gemma 3 with q/k norm, five layers of
both kinds in an uneven order (so the layer loop scans), a RoPE base per kind and linear
scaling on the full layers; Qwen3-MoE with 4 experts, 2 per token; all with grouped-query
attention (2 kv heads for 4 query heads).
"""

import pathlib

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than HF's 0.02, so logits are O(1) and differences show
    bos_token_id=1,
    eos_token_id=2,
)
SLIDE, FULL = "sliding_attention", "full_attention"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_scaling=LLAMA3_ROPE, rope_theta=500_000.0, tie_word_embeddings=False),
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=32)),
    "qwen3_moe": (  # 4 experts of 24, 2 per token, renormalised; q/k norm
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
        ),
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(tie_word_embeddings=False, sliding_window=6),
    ),
    "gemma2": (  # layer_types by default: sliding, full
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # small caps, so that they change the tiny model
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            head_dim=32,
            num_hidden_layers=5,
            layer_types=[SLIDE, SLIDE, FULL, SLIDE, FULL],
            sliding_window=4,
            query_pre_attn_scalar=20,
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                SLIDE: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
}


def make_torch_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A random f32 model; norm scales and biases are perturbed so they matter."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**{**COMMON, **extra})
    config._attn_implementation = "eager"  # soft-capping and windows as written, no kernels
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB tokens, with BOS/EOS/PAD specials."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def save_checkpoint(family: str, directory: pathlib.Path, *, with_tokenizer=False, seed=0):
    """Writes a checkpoint (safetensors) and returns the torch model it holds."""
    model = make_torch_model(family, seed)
    model.save_pretrained(directory)
    if with_tokenizer:
        make_tokenizer().save_pretrained(directory)
    return model


def save_char_checkpoint(
    directory: pathlib.Path, *, tied: bool = False, gemma3: bool = False, moe: bool = False
) -> pathlib.Path:
    """A tiny random jgrpo model saved in HF format with a character tokenizer that has a chat
    template: what a real instruct checkpoint offers, loadable through `model.path=`;
    `tied`: with tied input and output embeddings (as the small Qwen and Llama 3.2 have);
    `gemma3`: a Gemma 3 (text) of the same size, a sliding layer before a full one; `moe`: a
    Qwen3-MoE, 4 experts of 32 in each layer, 2 per token."""
    from flax import nnx

    from jgrpo import models
    from jgrpo.tasks.arithmetic import text_tokenizer

    tokenizer = text_tokenizer()
    config = models.preset("tiny").replace(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
    )
    if moe:
        config = config.replace(
            model_type="qwen3_moe",
            qk_norm=True,
            num_experts=4,
            experts_per_token=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    if gemma3:
        config = config.replace(
            model_type="gemma3_text",
            qk_norm=True,
            tie_word_embeddings=True,
            sliding_window=16,
            layer_types=("sliding_attention", "full_attention"),
            rope_local_theta=10_000.0,
            hidden_act="gelu_pytorch_tanh",
            norm_weight_offset=1.0,
            post_norms=True,
            scale_embeddings=True,
            query_pre_attn_scalar=16,
        )
    models.save_pretrained(models.Transformer(config, rngs=nnx.Rngs(0)), directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_generation_config(directory: pathlib.Path, eos_token_id) -> pathlib.Path:
    """Writes the checkpoint's generation_config.json with transformers' own writer, as
    instruct checkpoints ship it: `eos_token_id` an int or a list (Qwen2.5-Instruct lists
    <|im_end|> and <|endoftext|>)."""
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=eos_token_id).save_pretrained(directory)
    return directory / "generation_config.json"

"""The `model` section: the policy."""

from __future__ import annotations

import dataclasses

from jgrpo.config.fields import ConfigError, check_dtype, option
from jgrpo.models.lora import LoraConfig, parse_targets
from jgrpo.update import KEEP_LOGITS_MIB


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy: a Hugging Face checkpoint, or a `jgrpo.models` preset initialised at random."""

    path: str | None = option(None, "HF checkpoint directory or hub name; None: the preset")
    preset: str = option("tiny", "models preset used when path is None (random init)")
    dtype: str = option("float32", "parameter dtype: float32 or bfloat16")
    remat: bool = option(False, "recompute each layer in the backward pass (less memory)")
    keep_logits_mib: float = option(
        KEEP_LOGITS_MIB,
        "the update keeps a micro-batch's log-prob logits (tokens x vocabulary x 4 bytes, "
        "divided by the devices its rows are split over) for the backward pass up to this many "
        "MiB per device, else recomputes them (0: always recompute)",
    )
    matmul_dtype: str = option(
        "float32",
        "operands of the update's weight-matrix products: float32, or bfloat16 (mixed precision: "
        "bf16 products summed in f32; parameters, optimizer state and activations stay f32)",
    )
    reference_dtype: str = option(
        "float32",
        "weights of the frozen reference (algorithm.beta > 0): float32 (a copy of the initial "
        "parameters), or bfloat16 (matrices and embeddings rounded once: half its memory, bf16 "
        "products summed in f32; its log-probs, and so the KL, move by the rounding); with "
        "LoRA, the stored frozen base's, which is the reference",
    )
    lora_rank: int = option(
        0,
        "LoRA: train rank-r adapters on a frozen base (which is also the KL reference); "
        "0 = full fine-tuning",
    )
    lora_alpha: float = option(32.0, "LoRA: the adapters' product is scaled by alpha / rank")
    lora_targets: str = option(
        "all-linear",
        "LoRA: the projections to adapt, by their HF / PEFT names (q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj), comma-separated; all-linear = all of them",
    )

    def check(self):
        for name in ("dtype", "matmul_dtype", "reference_dtype"):
            check_dtype(f"model.{name}", getattr(self, name))
        if self.lora_rank < 0:
            raise ConfigError(
                f"model.lora_rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}."
            )
        if self.lora_rank:
            try:
                _ = self.lora
            except ValueError as error:
                raise ConfigError(f"model.lora_{error}") from None
        if not self.keep_logits_mib >= 0:
            raise ConfigError(
                f"model.keep_logits_mib must be >= 0 (0: recompute the logits in the backward "
                f"pass), got {self.keep_logits_mib}."
            )

    @property
    def lora(self) -> LoraConfig | None:
        """The LoRA settings, or None for full fine-tuning (lora_rank = 0)."""
        if not self.lora_rank:
            return None
        return LoraConfig(
            rank=self.lora_rank, alpha=self.lora_alpha, targets=parse_targets(self.lora_targets)
        )

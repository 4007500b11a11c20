"""LoRA: low-rank adapters on the layers' weight matrices, trained while the base stays frozen.

A targeted kernel W [*I, *O] (I its input axes, O its output axes, as `layer_param_specs`
lays it out) becomes

    W' = W + s * A B,    A [*I, r],  B [r, *O],  s = alpha / r

with A drawn as PEFT draws it (uniform in +-1 / sqrt(fan_in)) and B = 0, so training starts
from the base model exactly. The adapters are a pytree {"layers": {kernel: {"a", "b"}}} of
[L, ...] stacks, like the layers' parameters; `with_adapters` puts them beside the base as
`LoraKernel`s, which the forward pass multiplies without forming W' (no gradient for W), and
`merge_adapters` forms W' for sampling and export. The base with no adapters is the model
the run started from, the KL's reference.

Targets use the Hugging Face / PEFT module names (`q_proj`, ..., `down_proj`), and
`save_peft_adapter` writes the adapters in PEFT's format, which `peft.PeftModel` loads onto
the base checkpoint in transformers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jgrpo.models.config import ModelConfig
from jgrpo.models.projection import LoraKernel
from jgrpo.models.transformer import layer_param_specs

# PEFT's module name -> our kernel, and the module's place in an HF decoder layer.
TARGETS: dict[str, str] = {
    "q_proj": "q_kernel",
    "k_proj": "k_kernel",
    "v_proj": "v_kernel",
    "o_proj": "o_kernel",
    "gate_proj": "gate_kernel",
    "up_proj": "up_kernel",
    "down_proj": "down_kernel",
}
_HF_MODULE = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
ALL_LINEAR = ",".join(TARGETS)  # PEFT's "all-linear" for these models (lm_head excluded)


def input_axes(kernel: str) -> int:
    """How many leading axes of the kernel are its input: 2 for o [H, D, E], else 1."""
    return 2 if kernel == "o_kernel" else 1


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank r, alpha (the adapters' product is scaled by alpha / r) and the target modules
    by their HF / PEFT names."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(TARGETS)

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}.")
        unknown = [name for name in self.targets if name not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(
                f"targets must be some of {', '.join(TARGETS)} (or 'all-linear'), got "
                f"{', '.join(self.targets) or 'none'}."
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def kernels(self) -> tuple[str, ...]:
        """Our names of the targeted kernels, in layer order."""
        return tuple(kernel for name, kernel in TARGETS.items() if name in self.targets)


def parse_targets(spec: str) -> tuple[str, ...]:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); 'all-linear' -> every projection."""
    spec = ALL_LINEAR if spec.strip() == "all-linear" else spec
    return tuple(name.strip() for name in spec.split(",") if name.strip())


def adapter_specs(config: ModelConfig, lora: LoraConfig) -> dict:
    """kernel -> {"a": (shape, logical axes), "b": ...} of one layer's adapters; stacking adds
    a leading L. The rank axis `lora_rank` is replicated; the others split as the kernel's."""
    specs = {}
    layer = layer_param_specs(config)
    absent = [
        name for name, kernel in TARGETS.items() if name in lora.targets and kernel not in layer
    ]
    if absent:
        raise ValueError(
            f"model.lora_targets names {', '.join(absent)}, which this {config.model_type} "
            "model does not have: its MLP is a mixture of experts, whose weights LoRA does not "
            "adapt yet. Set model.lora_targets=q_proj,k_proj,v_proj,o_proj."
        )
    for kernel in lora.kernels:
        shape, axes = layer[kernel]
        c = input_axes(kernel)
        specs[kernel] = {
            "a": ((*shape[:c], lora.rank), (*axes[:c], "lora_rank")),
            "b": ((lora.rank, *shape[c:]), ("lora_rank", *axes[c:])),
        }
    return specs


def adapter_axes(config: ModelConfig, lora: LoraConfig) -> dict:
    """The logical axes of every adapter, a pytree shaped like `init_adapters`' result."""
    return {
        "layers": {
            kernel: {part: ("layers", *axes) for part, (_, axes) in parts.items()}
            for kernel, parts in adapter_specs(config, lora).items()
        }
    }


def init_adapters(config: ModelConfig, lora: LoraConfig, key: jax.Array) -> dict:
    """f32 adapters for every layer: A ~ U(+-1 / sqrt(fan_in)) (PEFT's default, a Kaiming
    uniform with a = sqrt(5)), B = 0, so that the adapted model starts as the base."""
    layers = {}
    for kernel, parts in adapter_specs(config, lora).items():
        key, draw = jax.random.split(key)
        (a_shape, _), (b_shape, _) = parts["a"], parts["b"]
        bound = 1 / math.sqrt(math.prod(a_shape[:-1]))
        layers[kernel] = {
            "a": jax.random.uniform(
                draw, (config.num_layers, *a_shape), jnp.float32, -bound, bound
            ),
            "b": jnp.zeros((config.num_layers, *b_shape), jnp.float32),
        }
    return {"layers": layers}


def with_adapters(base: dict, adapters: dict, scale: float) -> dict:
    """The base parameters with each adapted kernel as a `LoraKernel` (nothing copied): the
    pytree `forward` and the update take, differentiable in the adapters."""
    layers = dict(base["layers"])
    for kernel, parts in adapters["layers"].items():
        layers[kernel] = LoraKernel(base["layers"][kernel], parts["a"], parts["b"], scale)
    return dict(base, layers=layers)


def merge_adapters(base: dict, adapters: dict, scale: float, dtype=jnp.float32) -> dict:
    """The base parameters with W + scale * A B in place of each adapted kernel, summed in
    f32 and stored in `dtype` (f32 by default: a bf16 base alone would round the small early
    adapters away; bf16 for a rollout that samples with bf16 weights anyway); the rest of the
    base as it is."""
    adapted = with_adapters(base, adapters, scale)["layers"]
    layers = dict(base["layers"])
    for kernel in adapters["layers"]:  # each layer's LoraKernel.merged, over the stack
        layers[kernel] = jax.vmap(LoraKernel.merged)(adapted[kernel]).astype(dtype)
    return dict(base, layers=layers)


def peft_tensors(adapters: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """The adapters as PEFT names them, f32: lora_A.weight [r, in], lora_B.weight [out, r]
    per layer and module (PEFT stores Linear weights [out, in], as HF does)."""
    kernels = {kernel: name for name, kernel in TARGETS.items()}
    tensors = {}
    for kernel, parts in adapters["layers"].items():
        a = np.asarray(jax.device_get(parts["a"]), np.float32)  # [L, *I, r]
        b = np.asarray(jax.device_get(parts["b"]), np.float32)  # [L, r, *O]
        module = _HF_MODULE[kernels[kernel]]
        for i in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
                a[i].reshape(-1, a.shape[-1]).T
            )
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
                b[i].reshape(b.shape[1], -1).T
            )
    return tensors


def save_peft_adapter(
    directory: str | pathlib.Path,
    adapters: dict,
    config: ModelConfig,
    lora: LoraConfig,
    base_model: str | None,
) -> pathlib.Path:
    """Writes adapter_config.json and adapter_model.safetensors, which
    `peft.PeftModel.from_pretrained(base, directory)` loads onto the base checkpoint
    `base_model` (its path or hub name, recorded in the config)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": list(lora.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(peft_tensors(adapters, config), directory / "adapter_model.safetensors")
    return directory

"""Hugging Face checkpoints in and out: config.json + safetensors, strictly checked.

One table maps every parameter of `Transformer` to its HF tensor name. HF stores linear
weights as [out, in]; ours are [in, ...out] kernels, so 2-D HF weights other than the
embedding table ([V, E] on both sides) are transposed, and every tensor is reshaped to the
other side's shape.

Only safetensors are read: pickle-based `.bin` files are refused, `trust_remote_code` never
happens. Loading goes tensor by tensor (each file mapped only while one tensor is copied out)
into one stacked host buffer per parameter, which is moved to the device and freed before the
next, so host memory peaks near one copy of the model plus its largest parameter.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jgrpo.models.config import ModelConfig
from jgrpo.models.transformer import Transformer, layer_param_specs

# Our parameter -> HF tensor name; "{i}" is the layer index of a stacked layer parameter.
_LAYER = "model.layers.{i}."
PARAM_TO_HF: dict[str, str] = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "layers.attn_norm": _LAYER + "input_layernorm.weight",
    "layers.q_kernel": _LAYER + "self_attn.q_proj.weight",
    "layers.k_kernel": _LAYER + "self_attn.k_proj.weight",
    "layers.v_kernel": _LAYER + "self_attn.v_proj.weight",
    "layers.o_kernel": _LAYER + "self_attn.o_proj.weight",
    "layers.q_bias": _LAYER + "self_attn.q_proj.bias",
    "layers.k_bias": _LAYER + "self_attn.k_proj.bias",
    "layers.v_bias": _LAYER + "self_attn.v_proj.bias",
    "layers.q_norm": _LAYER + "self_attn.q_norm.weight",
    "layers.k_norm": _LAYER + "self_attn.k_norm.weight",
    "layers.mlp_norm": _LAYER + "post_attention_layernorm.weight",
    "layers.gate_kernel": _LAYER + "mlp.gate_proj.weight",
    "layers.up_kernel": _LAYER + "mlp.up_proj.weight",
    "layers.down_kernel": _LAYER + "mlp.down_proj.weight",
    # mixture of experts (Qwen3-MoE): the router, and expert {x}'s projections, one HF tensor
    # each, stacked into one [X, ...] weight per projection on our side
    "layers.router": _LAYER + "mlp.gate.weight",
    "layers.expert_gate_kernel": _LAYER + "mlp.experts.{x}.gate_proj.weight",
    "layers.expert_up_kernel": _LAYER + "mlp.experts.{x}.up_proj.weight",
    "layers.expert_down_kernel": _LAYER + "mlp.experts.{x}.down_proj.weight",
    "score": "score.weight",  # the head of *ForSequenceClassification (reward models)
}
# Gemma 2/3 normalise both sides of each sub-block: their `post_attention_layernorm` is the
# attention output's norm, and the MLP's input norm is `pre_feedforward_layernorm`.
POST_NORM_TO_HF: dict[str, str] = {
    "layers.post_attn_norm": _LAYER + "post_attention_layernorm.weight",
    "layers.mlp_norm": _LAYER + "pre_feedforward_layernorm.weight",
    "layers.post_mlp_norm": _LAYER + "post_feedforward_layernorm.weight",
}
# Tensors some checkpoints carry that hold nothing to load (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(ValueError):
    """A checkpoint that does not match the architecture its config.json declares."""


def _param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of Transformer(config), by its path in PARAM_TO_HF."""
    shapes = {
        "embed": (config.vocab_size, config.hidden_size),
        "final_norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    for name, (shape, _) in layer_param_specs(config).items():
        shapes[f"layers.{name}"] = shape  # per layer; stacked along a leading axis
    return shapes


def _hf_entries(path: str, config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, index into our stacked parameter) of every tensor `path` gathers:
    one per layer for a layer parameter, one per layer and expert for an expert's."""
    if config.post_norms and path in POST_NORM_TO_HF:
        template = POST_NORM_TO_HF[path]
    else:
        template = PARAM_TO_HF[path]
    if path.startswith("layers.expert_"):
        return [
            (template.format(i=i, x=x), (i, x))
            for i in range(config.num_layers)
            for x in range(config.num_experts)
        ]
    if path.startswith("layers."):
        return [(template.format(i=i), (i,)) for i in range(config.num_layers)]
    return [(template, ())]


def _item_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one HF tensor's part of a (per-layer) parameter: an expert's kernel."""
    return shape[1:] if path.startswith("layers.expert_") else shape


def _hf_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF layout of one (per-layer, per-expert) parameter: kernels are [out, in], the rest
    flattened."""
    if path.endswith("kernel") or path in ("lm_head", "score", "layers.router"):
        inputs = shape[0] if path != "layers.o_kernel" else shape[0] * shape[1]
        return (int(np.prod(shape)) // inputs, inputs)
    if path.endswith("bias"):
        return (int(np.prod(shape)),)
    return shape


def _to_ours(tensor: np.ndarray, path: str, shape: tuple[int, ...]) -> np.ndarray:
    return (tensor.T if tensor.ndim == 2 and path != "embed" else tensor).reshape(shape)


def _to_hf(value: np.ndarray, path: str, shape: tuple[int, ...]) -> np.ndarray:
    hf_shape = _hf_shape(path, shape)
    if len(hf_shape) == 2 and path != "embed":
        return np.ascontiguousarray(value.reshape(hf_shape[::-1]).T)
    return value.reshape(hf_shape)


def resolve(path: str | os.PathLike) -> pathlib.Path:
    """A local directory, or a hub name downloaded (or found in the HF cache).

    Each way it fails is one line naming the local route: a path that is neither a directory
    nor a hub name (FileNotFoundError), a hub name while the hub cannot be reached and the
    model is not in the cache (ConnectionError, at once: huggingface_hub gives up quickly).
    """
    local = pathlib.Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or str(path).startswith((".", "/", "~")):
        raise FileNotFoundError(f"{path} is not a directory with config.json and safetensors.")
    from huggingface_hub import snapshot_download  # only for hub names
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
    local_route = "give a local HF checkpoint directory instead (model.path=, reward_model.path=)"
    try:
        return pathlib.Path(snapshot_download(str(path), allow_patterns=patterns))
    except HFValidationError:
        problem = "is neither a local directory nor a hub name (owner/name)"
    except GatedRepoError:
        raise  # its own message says how to ask for access and log in
    except RepositoryNotFoundError:
        problem = "is neither a local directory nor a model on the Hugging Face hub you can access"
    except LocalEntryNotFoundError:
        raise ConnectionError(
            f"{path} is not a local directory, and the Hugging Face hub, where it would be "
            f"downloaded from, cannot be reached (offline?): {local_route}."
        ) from None
    raise FileNotFoundError(f"{path} {problem}: {local_route}.")


def _tensor_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (
            f" It has {', '.join(others)}: pickle checkpoints are not read (they can run code); "
            "convert them with transformers' save_pretrained(..., safe_serialization=True)."
            if others
            else ""
        )
        raise CheckpointError(f"no .safetensors files in {directory}.{hint}")
    names = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _check_names(expected: set[str], available: set[str], directory, tied: bool) -> None:
    unexpected = {n for n in available - expected if not n.endswith(_IGNORED_SUFFIXES)}
    if tied:
        unexpected.discard("lm_head.weight")  # a tied model may also store its copy
    missing = expected - available
    if missing or unexpected:

        def listing(names):
            names = sorted(names)
            more = f" (+{len(names) - 10} more)" if len(names) > 10 else ""
            return ", ".join(names[:10]) + more

        parts = []
        if missing:
            parts.append(f"missing tensors: {listing(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {listing(unexpected)}")
        raise CheckpointError(
            f"checkpoint {directory} does not match its config.json: {'; '.join(parts)}."
        )


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of an HF directory (or hub name), from its config.json alone."""
    directory = resolve(path)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{directory} has no config.json.")
    return ModelConfig.from_hf_config(json.loads(config_file.read_text()))


def from_pretrained(
    path: str | os.PathLike, *, dtype=jnp.float32, shardings: dict | None = None
) -> Transformer:
    """A ready Transformer from an HF directory (or hub name) with safetensors weights.

    Every checkpoint tensor must be used and every parameter filled; shapes are checked.
    Parameters are stored in `dtype` (f32 or bf16). `shardings`, a pytree shaped like
    `Transformer.params()` of `jax.sharding.Sharding`s, sends each tensor from host memory
    straight to its shards (no device ever holds a whole copy); default: the default device.
    """
    directory = resolve(path)
    config = read_config(directory)
    files = _tensor_files(directory)
    shapes = _param_shapes(config)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), param_dtype=dtype))
    graphdef, state = nnx.split(abstract)
    for param_path, value in read_parameters(directory, files, config, shapes, dtype, shardings):
        _state_leaf(state, param_path).set_value(value)
    model = nnx.merge(graphdef, state)
    model.source_dir = str(directory)
    return model


def read_parameters(directory, files, config: ModelConfig, shapes, dtype, shardings=None):
    """Yields (path, device array) for every parameter in `shapes` (paths of PARAM_TO_HF),
    after checking that the checkpoint holds exactly those tensors with those shapes.

    Each tensor is read into one stacked host buffer per parameter that goes to the device
    (or to its shards, `shardings` being a pytree of shardings keyed like the paths) before
    the next is read."""
    expected = {name for p in shapes for name, _ in _hf_entries(p, config)}
    _check_names(expected, set(files), directory, config.tie_word_embeddings)
    np_dtype = np.dtype(jnp.dtype(dtype))
    for path, shape in shapes.items():
        stacked = (config.num_layers,) if path.startswith("layers.") else ()
        buffer = np.empty(stacked + shape, np_dtype)
        item = _item_shape(path, shape)
        for name, index in _hf_entries(path, config):
            # One open (memory map) per tensor: mapped pages are released as soon as the
            # tensor is copied out, instead of the whole checkpoint staying resident.
            with safe_open(files[name], framework="np") as f:
                tensor = f.get_tensor(name)
            if tensor.shape != _hf_shape(path, item):
                raise CheckpointError(
                    f"tensor {name} has shape {tensor.shape}, expected "
                    f"{_hf_shape(path, item)} for this config.json."
                )
            buffer[index] = _to_ours(tensor, path, item)
            del tensor
        sharding = None
        if shardings is not None:
            sharding = functools.reduce(lambda node, key: node[key], path.split("."), shardings)
        yield path, jax.device_put(buffer, sharding)
        del buffer


def _state_leaf(state, path: str):
    node = state
    for part in path.split("."):
        node = node[part]
    return node


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    dtype=None,
    max_shard_bytes: int = 2 * 1024**3,
) -> pathlib.Path:
    """Writes config.json + safetensors that transformers' from_pretrained loads.

    Shards of at most `max_shard_bytes` (with a `model.safetensors.index.json` when there is
    more than one) are converted and written one at a time, so host memory holds at most one
    shard beyond the model. The tokenizer files of the checkpoint the model came from are
    copied along.
    """
    config: ModelConfig = model.config
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    param_dtype = _state_leaf(state, "embed").get_value().dtype
    np_dtype = np.dtype(jnp.dtype(dtype or param_dtype))

    # Plan the shards from shapes alone, then convert and write one shard at a time.
    shapes = _param_shapes(config)
    entries = []  # (HF name, our parameter path, index into it, bytes)
    for param_path, shape in shapes.items():
        nbytes = int(np.prod(_item_shape(param_path, shape))) * np_dtype.itemsize
        for name, index in _hf_entries(param_path, config):
            entries.append((name, param_path, index, nbytes))
    shards: list[list] = [[]]
    shard_bytes = 0
    for entry in entries:
        if shard_bytes and shard_bytes + entry[3] > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += entry[3]

    weight_map = {}
    for k, shard in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, param_path, index, _ in shard:
            value = _state_leaf(state, param_path).get_value()
            value = np.asarray(jax.device_get(value[index]))
            item = _item_shape(param_path, shapes[param_path])
            tensors[name] = _to_hf(value.astype(np_dtype), param_path, item)
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(shards) > 1:
        total = sum(entry[3] for entry in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    hf_config = config.to_hf_config()
    hf_config["torch_dtype"] = hf_config["dtype"] = np_dtype.name
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    source = getattr(model, "source_dir", None)
    if source:
        for name in TOKENIZER_FILES:
            if (pathlib.Path(source) / name).exists():
                shutil.copy2(pathlib.Path(source) / name, out / name)
    return out

"""Token ids to vectors and back: the embedding lookup, the output projection and the logits.

Dimension letters in shape comments as in `jgrpo.models.transformer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo.models.config import ModelConfig
from jgrpo.models.primitives import constrain, soft_cap


def input_embeddings(params: dict, ids: jax.Array, config: ModelConfig) -> jax.Array:
    """The embedding rows of `ids` [...] as [..., E] in the activations' dtype, the norms': a
    table rounded to bf16 beside f32 norms (`with_rounded_weights`) is read back as f32.
    Gemma multiplies them by sqrt(E), a factor rounded to that dtype as transformers does."""
    rows = embed_tokens(params["embed"], ids).astype(params["final_norm"].dtype)
    if config.scale_embeddings:
        rows = rows * jnp.asarray(config.hidden_size**0.5, rows.dtype)
    return rows


def embed_tokens(table: jax.Array, ids: jax.Array) -> jax.Array:  # [V, E], [B, T] -> [B, T, E]
    """Embedding rows of `ids`, split by batch rows on a mesh.

    The table's `embed` shards are gathered first, as FSDP gathers every weight where it is
    used: a lookup straight from an embed-split table gives rows split along `embed`, which
    XLA cannot re-split by batch without replicating them.
    """
    table = constrain(table, ("vocab", None))
    rows = jnp.take(table, ids, axis=0)
    return constrain(rows, ("batch",) + (None,) * (ids.ndim - 1) + ("embed",))


def unembedding(params: dict) -> jax.Array:  # [E, V]
    """The output projection: lm_head, or the transposed embedding table when tied (its
    lower-precision copy `tied_unembedding` when `with_matmul_weights` made one)."""
    if "lm_head" in params:
        return params["lm_head"]
    return params.get("tied_unembedding", params["embed"]).T


def logits_from_hidden(params: dict, hidden: jax.Array, softcap: float | None = None) -> jax.Array:
    """f32 logits [..., V] from final hidden states [..., E], multiplied in the table's dtype,
    soft-capped to (-softcap, softcap) when given (`config.final_logit_softcapping`).

    A tied table is read as its [V, E] rows, never transposed: XLA:CPU ran a transposed bf16
    copy made inside the program 2-3x slower.
    """
    if "lm_head" in params:
        table, spec = params["lm_head"], "...e,ev->...v"  # [E, V]
    else:
        table = params.get("tied_unembedding", params["embed"])  # [V, E]
        spec = "...e,ve->...v"
    logits = jnp.einsum(spec, hidden.astype(table.dtype), table, preferred_element_type=jnp.float32)
    logits = soft_cap(logits, softcap)
    if logits.ndim == 3:
        logits = constrain(logits, ("batch", "length", "vocab"))
    return logits

"""The GRPO objective on a toy batch: rewards -> group advantages -> loss and its gradient.

Run: python scripts/quickstart.py
"""

import jax
import jax.numpy as jnp

import jgrpo

# Two prompts, four sampled completions each; group_ids say which prompt a completion answers.
rewards = jnp.array([2.0, 4.0, 6.0, 8.0, 1.0, 1.0, 1.0, 1.0])  # [B]
group_ids = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])  # [B]
advantages = jgrpo.group_advantages(rewards, group_ids, num_groups=2)
print(
    "advantages:", [round(float(a), 2) for a in advantages]
)  # [-1.34, -0.45, 0.45, 1.34, 0.0, ...]

# A stand-in policy: logits over a 32-token vocabulary for 5 completion positions.
key_policy, key_ref, key_tokens = jax.random.split(jax.random.key(0), 3)
logits = jax.random.normal(key_policy, (8, 5, 32))  # [B, T, V]
ref_logits = logits + 0.1 * jax.random.normal(key_ref, logits.shape)  # frozen reference
tokens = jax.random.randint(key_tokens, (8, 5), 0, 32)  # [B, T] sampled completions
lengths = jnp.array([5, 3, 4, 5, 2, 5, 5, 1])
mask = jnp.arange(5)[None, :] < lengths[:, None]  # [B, T] completion tokens
ref_logprobs, _ = jgrpo.token_logprobs(ref_logits, tokens)


def loss_fn(logits):
    logprobs, entropy = jgrpo.token_logprobs(logits, tokens)
    # On-policy: the sampling policy is the current one, so the ratio is 1 (with gradient).
    return jgrpo.grpo_loss(
        logprobs, jax.lax.stop_gradient(logprobs), advantages, mask, ref_logprobs=ref_logprobs
    )


(loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logits)
print("loss:", float(loss))
print("metrics:", {name: round(float(value), 4) for name, value in metrics.items()})
print("gradient norm:", float(jnp.linalg.norm(grad)))

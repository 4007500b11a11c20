"""Times the compare workload (`scripts/compare_workload.py`) with Tunix's GRPO learner.

    python scripts/peers/tunix_step.py --checkpoint /tmp/jgrpo-compare/smollm2-135m --steps 3

Runs in its own virtual environment (google-tunix with its CPU jax, see docs), on CPU in
float32. Tunix's Llama3 model (`tunix.models.llama3`) is configured from the checkpoint's
config.json (SmolLM2-135M, tied embeddings; or the tiny model) and loaded by Tunix's own
safetensors loader, once for the actor and once for the reference. `GRPOLearner`
(`tunix.rl.grpo`) on an `RLCluster` with one single-device mesh for every role, so the
vanilla rollout shares the actor's weights (no weight sync, no overlap);
mini_batch_size = train_micro_batch_size = 4 prompts x G=8 (one optimizer step),
num_iterations=1, beta=0.04, AdamW (optax, clip_by_global_norm(1.0), no weight decay, like
jgrpo). Prompts are chat-templated strings of 39 tokens (max_prompt_length=39, KV cache
39 + 64). Tunix's sampler has no min_new_tokens: `eos_tokens=[vocab_size]`, an id that
cannot be sampled, makes every completion run its 64 steps (a sampled <|im_end|>, the pad
id here, no longer stops it, though Tunix's loss masks it as padding). temperature=1.0 with
top_p=1.0 and no top_k samples the full distribution (without top_p Tunix is greedy). The
rollout seed is an int, so every step samples with the same key (Tunix's default, None,
does the same with key 0).

Stages, wall time per step, each wrapped with time.perf_counter and, where the result is a
jax array, jax.block_until_ready (Tunix's own perf tracer is off; it is not installed
without a custom export function):
- step: `GRPOLearner._run_global_step` (data, rollout, reference pass, rewards, advantages,
  update), blocked on the actor's parameters.
- sampling: `RLCluster.generate` (returns host numpy tokens, hence already synchronous).
- reference: `RLCluster.get_ref_per_token_logps`.
- update: `RLCluster.update_actor` (policy forward/backward and AdamW step), blocked on the
  actor's parameters.
Prints one final line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compare_workload as workload  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.llama3 import params as llama3_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

PROMPT_TOKENS = 39


def model_config(checkpoint: Path) -> llama3.ModelConfig:
    """Tunix's Llama3 config for the checkpoint's (HF) config.json."""
    hf = json.loads((checkpoint / "config.json").read_text())
    rope_theta = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta"))
    return llama3.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope_theta),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=hf["tie_word_embeddings"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint)  # written by compare_workload.build_checkpoint
    steps = args.steps + 1

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = model_config(checkpoint)
    load = lambda: llama3_params.create_model_from_safe_tensors(  # noqa: E731
        str(checkpoint), config, mesh, dtype=jnp.float32
    )
    actor, reference = load(), load()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        for p in workload.prompts()
    ]
    assert all(len(tokenizer.encode(t)) == PROMPT_TOKENS for t in texts)

    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=workload.NEW_TOKENS,
        max_prompt_length=PROMPT_TOKENS,
        kv_cache_size=PROMPT_TOKENS + workload.NEW_TOKENS,
        temperature=workload.TEMPERATURE,
        top_p=1.0,
        top_k=None,
        eos_tokens=[config.vocab_size],  # never sampled: no early stop
        seed=workload.SEED,  # an int: a jax key would be donated by the first call
    )
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(workload.LEARNING_RATE, weight_decay=0.0),
        ),
        eval_every_n_steps=10**9,
        max_steps=steps,
        mini_batch_size=workload.PROMPTS,
        train_micro_batch_size=workload.PROMPTS,
        pbar_description=None,
    )
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training,
            rollout_config=rollout,
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=workload.GENERATIONS, num_iterations=1, beta=workload.BETA
        ),
        reward_fns=[workload.distinct_words_reward],
    )

    rows, tokens = [], []

    def actor_params():
        return nnx.state(cluster.actor_trainer.model, nnx.Param)

    def on_step(start, _args, _):
        jax.block_until_ready(actor_params())
        rows[-1]["step"] = time.perf_counter() - start

    def on_generate(start, _args, out):
        rows[-1]["sampling"] = time.perf_counter() - start
        tokens.append(sum(len(t) for t in out.tokens))  # generated, before Tunix's pad mask

    def on_reference(start, _args, out):
        jax.block_until_ready(out)
        rows[-1]["reference"] = time.perf_counter() - start

    def on_update(start, _args, _):
        jax.block_until_ready(actor_params())
        rows[-1]["update"] = time.perf_counter() - start

    run_global_step = workload.timed(learner._run_global_step, on_step)

    def global_step(*a, **k):
        rows.append({})
        return run_global_step(*a, **k)

    learner._run_global_step = global_step
    cluster.generate = workload.timed(cluster.generate, on_generate)
    cluster.get_ref_per_token_logps = workload.timed(cluster.get_ref_per_token_logps, on_reference)
    cluster.update_actor = workload.timed(cluster.update_actor, on_update)

    learner.train([{"prompts": np.array(texts)}] * steps)

    print(workload.result_line(f"Tunix {version('google-tunix')}", rows, tokens))


if __name__ == "__main__":
    main()

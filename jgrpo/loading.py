"""The task and the policy a config names: built-in or your own data, an HF checkpoint or a
preset initialised at random, placed straight into their shards on the mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo import tasks
from jgrpo.config import Config
from jgrpo.sharding import tree_shardings


def load_policy(config: Config, task: tasks.Task, mesh=None):
    """The policy model and its tokenizer: an HF checkpoint, or a preset initialised at random.

    With a mesh, every parameter goes straight to its shards (by `jgrpo.sharding`'s rules):
    checkpoint tensors from host memory, a preset's initial values from a jitted init.
    """
    from flax import nnx

    from jgrpo import models

    dtype = jnp.dtype(config.model.dtype)

    def shardings_for(model_config):
        if mesh is None:
            return None
        shapes = jax.eval_shape(
            lambda: models.Transformer(model_config, rngs=nnx.Rngs(0), param_dtype=dtype).params()
        )
        return tree_shardings(shapes, models.transformer.param_axes(model_config), mesh)

    if config.model.path is not None:
        from transformers import AutoTokenizer

        shardings = shardings_for(models.hf.read_config(config.model.path))
        model = models.from_pretrained(config.model.path, dtype=dtype, shardings=shardings)
        tokenizer = AutoTokenizer.from_pretrained(models.hf.resolve(config.model.path))
    else:
        from jgrpo.tasks.arithmetic import text_tokenizer

        # A model from scratch uses the task's tokenizer, else one token per character.
        tokenizer = task.tokenizer if task.tokenizer is not None else text_tokenizer()
        model_config = models.preset(config.model.preset).replace(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

        def initial():
            seed = config.train.seed
            return models.Transformer(model_config, rngs=nnx.Rngs(seed), param_dtype=dtype)

        # Shapes first, then the values computed in place by one jitted program.
        model = nnx.eval_shape(initial)
        model.load_params(
            jax.jit(lambda: initial().params(), out_shardings=shardings_for(model_config))()
        )
    if config.model.remat:
        model.config = model.config.replace(remat=True)
    return model, tokenizer


def build_task(config: Config) -> tasks.Task:
    """The task the config names, with `task.rewards` replacing its rewards when set."""
    t, seed = config.task, config.train.seed
    if t.name == "addition":
        from jgrpo.tasks.arithmetic import addition_task

        task = addition_task(t.max_operand, held_out=t.held_out, seed=seed, chat=t.chat)
    elif t.name == "lookup":
        from jgrpo.tasks.lookup import lookup_task

        task = lookup_task(t.num_examples, held_out=t.held_out, seed=seed)
    elif t.name == "json_extraction":
        from jgrpo.tasks.json_extraction import json_extraction_task

        task = json_extraction_task(t.num_examples, held_out=t.held_out, seed=seed, chat=t.chat)
    elif t.name == "gsm8k":
        from jgrpo.tasks.gsm8k import DEFAULT_SYSTEM, gsm8k_task

        task = gsm8k_task(
            data_dir=t.data_dir,
            split=t.split,
            eval_split=t.eval_split,
            system_prompt=DEFAULT_SYSTEM if t.system_prompt is None else t.system_prompt,
            source="tfds" if t.path is None else "jsonl",
            path=t.path,
            on_error=t.on_error,
        )
    else:  # your own data: a JSONL file or a TFDS dataset, scored by built-in rewards
        from jgrpo.tasks.datasets import jsonl_task, tfds_task

        options = dict(
            rewards=t.rewards,
            prompt_field=t.prompt_field,
            held_out=t.held_out,
            seed=seed,
            on_error=t.on_error,
            chat=t.chat,
            system_prompt=t.system_prompt,
        )
        if t.name == "jsonl":
            task = jsonl_task(t.path, eval_path=t.eval_path, **options)
        else:
            task = tfds_task(
                t.dataset,
                split=t.split,
                eval_split=t.eval_split,
                data_dir=t.data_dir,
                **options,
            )
    if t.tools is not None:
        from jgrpo.tools import parse_tool_spec

        task.tools = parse_tool_spec(t.tools)
    if t.rewards is not None and t.name not in ("jsonl", "tfds"):
        from jgrpo.rewards.registry import parse_reward_spec

        task.reward_fns, task.reward_weights = parse_reward_spec(t.rewards)
        if task.correctness not in task.reward_fns:
            task.correctness = next(iter(task.reward_fns))
    return task

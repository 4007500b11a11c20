"""The jitted programs of a run, and the cache that shares them between runs in one process.

`Programs` is the part of `jgrpo.setup.Setup` that compiles: the rollout and the update with
explicit in/out shardings on the run's mesh (the update compiled ahead, in a background
thread, for every completion width it may meet), the reference's log-probs and its sync,
and the abstract arguments (shapes with shardings) that `jgrpo.plan` compiles without
running anything. Its methods read the Setup's mesh, shardings and settings.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jgrpo.advantages import group_advantages, zero_signal_groups
from jgrpo.models.group_forward import PackedCompletions
from jgrpo.rollout import Rollout, SamplingConfig, rollout
from jgrpo.sharding import abstract_arrays, replicated, rules_context
from jgrpo.update import Batch, TrainState, UpdateConfig, completion_logprobs, train_step

# Jitted programs shared by every Trainer with the same mesh and settings (their shardings
# follow from these), so a second run in one process, in a notebook or the tests, reuses
# the compiled update and rollouts.
PROGRAMS: dict[tuple, Callable] = {}


def shared_program(key: tuple, build: Callable[[], Callable]) -> Callable:
    if key not in PROGRAMS:
        PROGRAMS[key] = build()
    return PROGRAMS[key]


# One compiled program instead of a dispatch per operation, every step.
group_advantages_program = jax.jit(
    group_advantages, static_argnums=2, static_argnames=("scale", "std_ddof", "eps", "clip")
)
zero_signal_program = jax.jit(zero_signal_groups, static_argnums=2)


def frozen_logprobs_of(
    params, batch: Batch, *, model_config, temperature, shared_prompt_rows, matmul_dtype
) -> jax.Array:
    return completion_logprobs(
        params,
        batch,
        model_config=model_config,
        temperature=temperature,
        chunk_size=4096,
        shared_prompt_rows=shared_prompt_rows,
        matmul_dtype=matmul_dtype,
    )[0]


class Programs:
    """The jitted programs of a `Setup` (see the module's docstring)."""

    def update_program(self, update_config: UpdateConfig) -> Callable:
        """`jgrpo.train_step` jitted with explicit in/out shardings, the state donated."""
        key = ("update", self.mesh, self.model_config, self.config.model.dtype, update_config)
        key += (self.config.algorithm.pack_completions,)  # the batch's shardings differ
        key += (self.lora,)  # the adapters' tree and shardings
        return shared_program((*key, self.optimizer), lambda: self._jit_update(update_config))

    def _jit_update(self, update_config: UpdateConfig) -> Callable:
        """(state, batch, frozen) -> (state, metrics): `frozen` is the KL reference (None when
        beta is 0), or with LoRA the frozen base the adapters apply to (also the reference)."""
        step = functools.partial(
            train_step.__wrapped__,
            model_config=self.model_config,
            update_config=update_config,
            optimizer=self.optimizer,
        )
        lora = update_config.lora_scale is not None
        takes_frozen = update_config.beta > 0 or lora
        return jax.jit(
            (lambda state, batch, base: step(state, batch, None, base)) if lora else step,
            in_shardings=(
                self.state_shardings,
                self.batch_shardings,
                self.model_shardings if takes_frozen else None,
            ),
            out_shardings=(self.state_shardings, replicated(self.mesh)),
            donate_argnums=0,
        )

    def update_arguments(
        self, width: int | None = None, packed_rows: int | None = None
    ) -> tuple[TrainState, Batch, dict | None]:
        """The update's arguments as ShapeDtypeStructs with their shardings: the state, the
        batch `to_batch` makes (`batch_arguments`) and the reference parameters (None when
        beta is 0; with LoRA the frozen base, always)."""
        params = abstract_arrays(self.trained_shapes(), self.param_shardings)
        opt_state = abstract_arrays(
            jax.eval_shape(self.optimizer.init, params), self.state_shardings.opt_state
        )
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.state_shardings.step)
        takes_frozen = self.update_config.beta > 0 or self.lora is not None
        reference = self.reference_arguments() if takes_frozen else None
        batch = self.batch_arguments(width, packed_rows)
        return TrainState(params, opt_state, step), batch, reference

    def batch_arguments(self, width: int | None = None, packed_rows: int | None = None) -> Batch:
        """The batch `to_batch` makes as ShapeDtypeStructs: prompts_per_step x G rows of
        the train prompts' width + `width` tokens (None: `completion_tokens`), packed into
        `packed_rows` per group with `algorithm.pack_completions` (None: G)."""
        r = self.config.rollout
        width = r.completion_tokens if width is None else width
        prompts, rows = r.prompts_per_step, r.prompts_per_step * r.num_generations
        tokens = self.prompt_widths["train"] + width
        packed = None
        if self.config.algorithm.pack_completions:
            packed_rows = self.group_size if packed_rows is None else packed_rows
            packed = PackedCompletions(
                source=jax.ShapeDtypeStruct((prompts * packed_rows, width), jnp.int32),
                predictor=jax.ShapeDtypeStruct((rows, width), jnp.int32),
            )
        return abstract_arrays(
            Batch(
                input_ids=jax.ShapeDtypeStruct((rows, tokens), jnp.int32),
                attention_mask=jax.ShapeDtypeStruct((rows, tokens), jnp.int32),
                completion_mask=jax.ShapeDtypeStruct((rows, width), jnp.bool_),
                advantages=jax.ShapeDtypeStruct((rows,), jnp.float32),
                packed=packed,
                sampler_logprobs=jax.ShapeDtypeStruct((rows, width), jnp.float32),
            ),
            self.batch_shardings,
        )

    def compile_update_ahead(self) -> None:
        """Starts compiling the update in a background thread, for every completion width
        (`algorithm.completion_buckets`) and packed row count (`algorithm.pack_completions`),
        the widest and most rows first.

        XLA compiles without holding the GIL, so the update compiles while the first rollout
        compiles and samples (on an accelerator, while the device works). The programs land
        in jit's cache: a step waits for its width's program and its call compiles nothing.
        """
        if self._update_compiling:
            return

        state, _, reference = self.update_arguments()

        def compile_update(width: int, packed_rows: int | None) -> jax.stages.Compiled:
            batch = self.batch_arguments(width, packed_rows)
            with rules_context(self.mesh):  # its rules are per thread
                return self.update.lower(state, batch, reference).compile()

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jgrpo-compile")
        for shape in reversed(self.update_shapes):  # ascending: the largest first
            self._update_compiling[shape] = pool.submit(compile_update, *shape)
        pool.shutdown(wait=False)  # the thread ends with its tasks

    def compiled_update(
        self, width: int | None = None, packed_rows: int | None = None
    ) -> jax.stages.Compiled:
        """The update compiled for this run's batch of `width` completion columns (None:
        `completion_tokens`) and `packed_rows` per group (None: G, or no packing): waits for
        `compile_update_ahead` (started here if it was not) and raises what its compilation
        raised."""
        self.compile_update_ahead()
        width = self.config.rollout.completion_tokens if width is None else width
        if self.config.algorithm.pack_completions and packed_rows is None:
            packed_rows = self.group_size
        return self._update_compiling[width, packed_rows].result()

    def rollout_program(self, sampling: SamplingConfig, num_generations: int) -> Callable:
        """`jgrpo.rollout.rollout` jitted with the prompts split over the batch axes."""
        key = ("rollout", self.mesh, self.model_config, self.config.model.dtype, self.lora)
        return shared_program(
            (*key, sampling, num_generations), lambda: self._jit_rollout(sampling, num_generations)
        )

    def _jit_rollout(self, sampling: SamplingConfig, num_generations: int) -> Callable:
        return jax.jit(
            functools.partial(
                rollout.__wrapped__,
                model_config=self.model_config,
                num_generations=num_generations,
                sampling=sampling,
            ),
            in_shardings=(
                self.policy_shardings,
                self.row_matrix,
                self.row_matrix,
                replicated(self.mesh),
            ),
            out_shardings=Rollout(*(self.row_matrix,) * 4, *(self.rows,) * 4),
        )

    @functools.cached_property
    def synced_reference(self) -> Callable[[dict, dict], dict]:
        """(reference, params) -> alpha x params + (1 - alpha) x reference, summed in f32 and
        kept in each reference leaf's dtype (algorithm.ref_sync_alpha); the old reference's
        buffers are donated."""
        alpha = self.config.algorithm.ref_sync_alpha

        def mix(reference, params):
            return jax.tree.map(
                lambda ref, new: (
                    alpha * new.astype(jnp.float32) + (1 - alpha) * ref.astype(jnp.float32)
                ).astype(ref.dtype),
                reference,
                params,
            )

        return jax.jit(mix, donate_argnums=0)

    def reference_arguments(self) -> dict | None:
        """`reference_params`' result as ShapeDtypeStructs in the model's shardings (None
        when beta is 0; the reference exists with `kl_in_reward` too, which the update does
        not take; with LoRA it is the frozen base)."""
        params = abstract_arrays(self.trained_shapes(), self.param_shardings)
        reference = jax.eval_shape(self.reference_params, params)
        return None if reference is None else abstract_arrays(reference, self.model_shardings)

    def policy_arguments(self) -> dict:
        """The rollout's parameters as ShapeDtypeStructs (`policy_params`' result)."""
        params = abstract_arrays(self.trained_shapes(), self.param_shardings)
        return abstract_arrays(jax.eval_shape(self.policy_params, params), self.policy_shardings)

    def frozen_logprobs(self, params, batch: Batch) -> jax.Array:
        """f32[R, N] log-probs of the batch's completions under `params`, split by rows."""
        temperature = self.config.rollout.temperature
        # The whole batch: whole groups on every batch shard.
        rows = self.group_size if self.config.algorithm.shared_prompt_forward else 1
        matmul_dtype = self.config.model.matmul_dtype
        program = shared_program(
            ("frozen_logprobs", self.mesh, self.model_config, temperature, rows, matmul_dtype),
            lambda: jax.jit(
                functools.partial(
                    frozen_logprobs_of,
                    model_config=self.model_config,
                    temperature=temperature,
                    shared_prompt_rows=rows,
                    matmul_dtype=matmul_dtype,
                ),
                out_shardings=self.row_matrix,
            ),
        )
        with rules_context(self.mesh):
            return program(params, batch)

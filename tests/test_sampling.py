"""The rollout engine: parity with transformers' generate, log-probs, filters, stops, compiles."""

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_hf import VOCAB

import jgrpo
from jgrpo.generation import bucket_length, pad_prompts
from jgrpo.models.group_decode import cache_bytes_per_slot
from jgrpo.models.hf import from_pretrained
from jgrpo.models.precision import with_matmul_weights
from jgrpo.models.transformer import forward
from jgrpo.rollout import (
    SamplingConfig,
    attention_phases,
    categorical,
    filter_logits,
    kv_cache_bytes,
    rollout,
)
from jgrpo.rollout import memory as phases_module
from jgrpo.rollout import sampler as sampling_module
from jgrpo.sharding import make_mesh, rules_context

PROMPT_LENGTHS = [5, 9, 3]
EOS = 2


def prompts(seed=0, lengths=PROMPT_LENGTHS):
    """Left-padded prompts of different lengths, bucketed as generate() would."""
    rng = np.random.default_rng(seed)
    return pad_prompts([rng.integers(3, VOCAB, n).tolist() for n in lengths])


def run(model, ids, mask, *, key=0, num_generations=2, **sampling):
    sampling.setdefault("stop_token_ids", (EOS,))
    return rollout(
        model.params(),
        jnp.asarray(ids),
        jnp.asarray(mask),
        jax.random.key(key),
        model_config=model.config,
        num_generations=num_generations,
        sampling=SamplingConfig(**sampling),
    )


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma2", "gemma3"])
def test_greedy_equals_transformers_generate(family, hf_checkpoint):
    """Windows shorter than the rows (gemma: sliding and full layers), soft-capped logits
    (gemma2)."""
    directory, torch_model = hf_checkpoint(family)
    model = from_pretrained(directory)
    ids, mask = prompts()
    result = run(model, ids, mask, max_new_tokens=12, temperature=0.0)
    with torch.no_grad():
        expected = torch_model.generate(
            torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=EOS,
            pad_token_id=0,
        )[:, ids.shape[1] :].numpy()
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    for row in range(len(PROMPT_LENGTHS)):
        for g in range(2):  # both generations of a greedy group are the same
            n = lengths[row * 2 + g]
            np.testing.assert_array_equal(tokens[row * 2 + g, :n], expected[row, :n])
    np.testing.assert_array_equal(np.asarray(result.group_ids), [0, 0, 1, 1, 2, 2])


def full_forward_logits(model, ids, mask, result, num_generations):
    """Logits at the positions that predicted each completion token: f32[P*G, N, V]."""
    prompt_ids = np.repeat(ids, num_generations, axis=0)
    prompt_mask = np.repeat(mask, num_generations, axis=0)
    sequence = np.concatenate([prompt_ids, np.asarray(result.tokens)], axis=1)
    sequence_mask = np.concatenate([prompt_mask, np.asarray(result.mask)], axis=1)
    logits = model(jnp.asarray(sequence), attention_mask=jnp.asarray(sequence_mask))
    return np.asarray(logits[:, ids.shape[1] - 1 : -1])


@pytest.mark.parametrize(
    ("family", "temperature"), [("qwen3", 1.0), ("qwen3", 0.7), ("gemma2", 0.7)]
)
def test_logprobs_equal_a_full_forward_recompute(family, temperature, hf_checkpoint):
    model = from_pretrained(hf_checkpoint(family)[0])
    ids, mask = prompts(seed=1)
    result = run(model, ids, mask, max_new_tokens=10, temperature=temperature, num_generations=3)
    logits = full_forward_logits(model, ids, mask, result, 3)
    expected, _ = jgrpo.token_logprobs(jnp.asarray(logits), result.tokens, temperature=temperature)
    real = np.asarray(result.mask)
    np.testing.assert_allclose(
        np.asarray(result.logprobs)[real], np.asarray(expected)[real], atol=1e-4
    )
    np.testing.assert_array_equal(np.asarray(result.logprobs)[~real], 0.0)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])  # an lm_head, tied embeddings
def test_bf16_weights_sample_from_the_policy_with_rounded_matrices(family, hf_checkpoint):
    """weights_dtype="bfloat16": the returned log-probs are those of the policy whose weight
    matrices are rounded to bf16 (products summed in f32), close to the f32 policy's."""
    model = from_pretrained(hf_checkpoint(family)[0])
    ids, mask = prompts(seed=2)
    result = run(model, ids, mask, max_new_tokens=10, num_generations=3, weights_dtype="bfloat16")
    real = np.asarray(result.mask)
    sequence = np.concatenate([np.repeat(ids, 3, axis=0), np.asarray(result.tokens)], axis=1)
    sequence_mask = np.concatenate([np.repeat(mask, 3, axis=0), real], axis=1)

    def logprobs_under(params):
        logits = forward(
            params,
            jnp.asarray(sequence),
            attention_mask=jnp.asarray(sequence_mask),
            config=model.config,
        )[:, ids.shape[1] - 1 : -1]
        return np.asarray(jgrpo.token_logprobs(logits, result.tokens)[0])[real]

    rounded = logprobs_under(with_matmul_weights(model.params(), jnp.bfloat16))
    exact = logprobs_under(model.params())
    sampled = np.asarray(result.logprobs)[real]
    # The same policy: equal but for the rare bf16 rounding step that a last-bit difference
    # between the decode's and the full forward's f32 sums flips (measured mean 1e-8-2e-5).
    assert np.abs(sampled - rounded).mean() < 1e-4 and np.abs(sampled - rounded).max() < 2e-3
    # The f32 policy: measured mean 0.004, max 0.018 on these models; rounding did take place.
    off = np.abs(sampled - exact)
    assert 1e-3 < off.mean() < 0.01 and off.max() < 0.05


def allowed_sets(logits, *, top_k=0, top_p=1.0, min_p=0.0):
    """numpy reference of filter_logits: bool[B, V] of the tokens that may be drawn."""
    allowed = np.ones(logits.shape, bool)
    for row, z in enumerate(logits.astype(np.float64)):
        keep = np.ones(len(z), bool)
        if top_k:
            keep &= z >= np.sort(z)[-top_k]
        if top_p < 1:
            p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
            p /= p.sum()
            order = np.argsort(-p)
            before = np.cumsum(p[order]) - p[order]
            in_nucleus = np.zeros(len(z), bool)
            in_nucleus[order[before < top_p]] = True
            keep &= in_nucleus
        if min_p:
            p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
            p /= p.sum()
            keep &= p >= min_p * p.max()
        allowed[row] = keep
    return allowed


FILTERS = [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=10, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("filters", FILTERS)
def test_filters_never_emit_a_token_outside_the_allowed_set(filters, hf_checkpoint):
    model = from_pretrained(hf_checkpoint("llama3")[0])
    ids, mask = prompts(seed=2)
    result = run(model, ids, mask, max_new_tokens=8, temperature=1.0, num_generations=16, **filters)
    logits = full_forward_logits(model, ids, mask, result, 16)  # the model's own distribution
    tokens, real = np.asarray(result.tokens), np.asarray(result.mask)
    allowed = allowed_sets(logits.reshape(-1, logits.shape[-1]), **filters)
    drawn = allowed[np.arange(tokens.size), tokens.reshape(-1)].reshape(tokens.shape)
    assert drawn[real].all()
    assert real.sum() > 300  # many draws were checked


@pytest.mark.parametrize("filters", FILTERS)
def test_filter_logits_against_reference(filters):
    logits = jax.random.normal(jax.random.key(0), (64, 50)) * 2.0
    got = np.isfinite(
        np.asarray(filter_logits(logits, **{**dict(top_k=0, top_p=1.0, min_p=0.0), **filters}))
    )
    np.testing.assert_array_equal(got, allowed_sets(np.asarray(logits), **filters))
    # Every allowed token is reachable: 4000 draws of one row cover its allowed set.
    row = jnp.tile(logits[:1], (4000, 1))
    draws = categorical(
        jax.random.key(1), filter_logits(row, **{**dict(top_k=0, top_p=1.0, min_p=0.0), **filters})
    )
    assert set(np.asarray(draws).tolist()) == set(np.flatnonzero(got[0]).tolist())


def log_softmax_over(logits, kept):
    """numpy reference: log_softmax of logits [B, V] over the kept tokens (-inf elsewhere)."""
    z = np.where(kept, logits.astype(np.float64), -np.inf)
    top = z.max(-1, keepdims=True)
    return z - top - np.log(np.exp(z - top).sum(-1, keepdims=True))


@pytest.mark.parametrize(
    "logits, config, uniform, token, kept",
    [
        # top-k 2 of [2, 1, 0, -1]: the kept mass e^2 + e^1; u = 0.9 lies past p_0 = 0.731
        ([2.0, 1.0, 0.0, -1.0], dict(top_k=2), 0.9, 1, [0, 1]),
        # T = 0.5: z = [2, 1, 0, -6]; top-p 0.8 keeps {0, 1} (mass before token 2: 0.910)
        ([1.0, 0.5, 0.0, -3.0], dict(temperature=0.5, top_p=0.8), 0.1, 0, [0, 1]),
        # min-p 0.2 keeps p >= 0.2 p_max: e^-1 = 0.37 stays, e^-3 = 0.05 goes
        ([0.0, -1.0, -3.0, -3.0], dict(min_p=0.2), 0.99, 1, [0, 1]),
    ],
)
def test_sampler_logprob_is_over_the_kept_tokens_by_hand(logits, config, uniform, token, kept):
    """The drawn token's sampler log-prob is z_y - log sum_{v in K} exp(z_v); its policy
    log-prob stays z_y - log sum_v exp(z_v), z = logits / T."""
    sampling = SamplingConfig(max_new_tokens=1, **config)
    drawn, logprob, sampler_logprob = sampling_module.sample_tokens(
        jnp.asarray([logits]), jnp.asarray([uniform]), sampling
    )
    z = [x / sampling.temperature for x in logits]
    assert int(drawn[0]) == token
    expected_sampler = z[token] - math.log(sum(math.exp(z[v]) for v in kept))
    expected_policy = z[token] - math.log(sum(math.exp(v) for v in z))
    np.testing.assert_allclose(float(sampler_logprob[0]), expected_sampler, rtol=1e-6)
    np.testing.assert_allclose(float(logprob[0]), expected_policy, rtol=1e-6)
    unfiltered = SamplingConfig(max_new_tokens=1, temperature=sampling.temperature)
    _, logprob, sampler_logprob = sampling_module.sample_tokens(
        jnp.asarray([logits]), jnp.asarray([uniform]), unfiltered
    )
    assert float(logprob[0]) == float(sampler_logprob[0])  # no filter: one distribution


@pytest.mark.parametrize("filters", FILTERS)
def test_sampler_logprobs_are_those_of_the_distribution_drawn_from(filters):
    """Uniforms on a grid of M points through the sampler: each token is drawn for its share
    of the grid, which is its probability to 1/M; exp(sampler log-prob) is that probability,
    and those of the kept tokens add up to 1."""
    grid = 20_000
    logits = jax.random.normal(jax.random.key(4), (1, 300)) * 2.0  # 300: not a block multiple
    sampling = SamplingConfig(max_new_tokens=1, temperature=0.8, **filters)
    uniform = (jnp.arange(grid) + 0.5) / grid
    tokens, logprobs, sampler_logprobs = sampling_module.sample_tokens(
        jnp.tile(logits, (grid, 1)), uniform, sampling
    )
    tokens, sampler_logprobs = np.asarray(tokens), np.asarray(sampler_logprobs)
    kept = allowed_sets(np.asarray(logits) / 0.8, **filters)[0]
    assert set(tokens.tolist()) == set(np.flatnonzero(kept).tolist())
    share = np.bincount(tokens, minlength=300) / grid
    probability = {  # token -> exp(its sampler log-prob), the same at each of its draws
        int(t): float(np.exp(sampler_logprobs[tokens == t][0])) for t in np.unique(tokens)
    }
    for t, p in probability.items():
        assert abs(share[t] - p) <= 1 / grid + 1e-6, (t, share[t], p)
    np.testing.assert_allclose(sum(probability.values()), 1.0, atol=1e-5)
    expected = log_softmax_over(np.asarray(logits) / 0.8, kept[None])[0, tokens]
    np.testing.assert_allclose(sampler_logprobs, expected, atol=1e-5)
    policy = jax.nn.log_softmax(logits[0] / 0.8)[tokens]
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(policy), atol=1e-5)


@pytest.mark.parametrize("filters", FILTERS)
def test_rollout_records_both_log_probs_under_filters(filters, hf_checkpoint):
    """Against a full forward: `logprobs` are the policy's log_softmax(logits / T) and
    `sampler_logprobs` the log_softmax over the tokens the filters kept, never below them."""
    model = from_pretrained(hf_checkpoint("llama3")[0])
    ids, mask = prompts(seed=2)
    result = run(model, ids, mask, max_new_tokens=8, temperature=0.7, num_generations=4, **filters)
    logits = full_forward_logits(model, ids, mask, result, 4) / 0.7  # [P*G, N, V]
    flat = logits.reshape(-1, logits.shape[-1])
    tokens, real = np.asarray(result.tokens).reshape(-1), np.asarray(result.mask).reshape(-1)
    rows = np.arange(tokens.size)
    kept = allowed_sets(flat, **filters)
    expected_sampler = log_softmax_over(flat, kept)[rows, tokens]
    expected_policy = log_softmax_over(flat, np.ones_like(kept))[rows, tokens]
    sampler = np.asarray(result.sampler_logprobs).reshape(-1)
    policy = np.asarray(result.logprobs).reshape(-1)
    np.testing.assert_allclose(sampler[real], expected_sampler[real], atol=1e-4)
    np.testing.assert_allclose(policy[real], expected_policy[real], atol=1e-4)
    assert (sampler[real] >= policy[real] - 1e-5).all()
    assert (sampler[real] - policy[real]).mean() > 0.01  # the filters did cut mass
    np.testing.assert_array_equal(sampler[~real], 0.0)


def test_the_update_gets_the_sampler_log_probs_of_the_filtered_distribution():
    """With rollout.top_k=3 the trainer's batch carries the log-probs of the distribution the
    tokens were drawn from (for the sampler correction, the off-policy mask and sampler/gap):
    above the policy's (the update's old log-probs) by -log(kept mass) > 0 at every token."""
    from jgrpo import tasks
    from jgrpo.config import load_config
    from jgrpo.train import Trainer

    overrides = ["rollout.top_k=3", "mesh.devices=1", "task.reward_workers=0"]
    trainer = Trainer(load_config(None, [*overrides, "rollout.max_new_tokens=6"]))
    params = trainer.initial_params()
    examples = tasks.take(trainer.task.train, 8, position=0, seed=0)
    groups, _ = trainer.sample_and_score(params, None, examples, jax.random.key(0))
    batch = trainer.to_batch(groups, np.zeros(len(groups.rewards), np.float32))
    policy = trainer.block.local(trainer.frozen_logprobs(params, batch))
    sampler = trainer.block.local(batch.sampler_logprobs)
    real = groups.mask
    assert real.sum() > 40
    cut = sampler[real] - policy[real]  # -log(mass of the 3 kept tokens) per token
    assert (cut > 0.05).all(), cut.min()


@pytest.mark.parametrize("vocab", [5, 300, 1000])
def test_categorical_draws_follow_the_softmax(vocab):
    """The inverse-CDF sampler's frequencies match softmax(logits) within 5 standard errors
    per token; tokens at -inf never come. 300 and 1000 are not multiples of its block size."""
    logits = np.asarray(jax.random.normal(jax.random.key(2), (vocab,))) * 2.0
    logits[::7] = -np.inf
    draws = 50_000
    tokens = np.asarray(categorical(jax.random.key(3), jnp.tile(jnp.asarray(logits), (draws, 1))))
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    frequencies = np.bincount(tokens, minlength=vocab) / draws
    assert frequencies[probs == 0].sum() == 0
    np.testing.assert_array_less(
        np.abs(frequencies - probs), 5 * np.sqrt(probs * (1 - probs) / draws) + 1e-9
    )


def test_stop_tokens_end_the_mask_exactly_there(hf_checkpoint):
    model = from_pretrained(hf_checkpoint("qwen2")[0])
    ids, mask = prompts(seed=3)
    stops = tuple(range(3, VOCAB, 16))  # a 16th of the vocabulary stops a row
    result = run(
        model,
        ids,
        mask,
        max_new_tokens=16,
        temperature=1.0,
        num_generations=8,
        stop_token_ids=stops,
    )
    tokens, real = np.asarray(result.tokens), np.asarray(result.mask)
    lengths, truncated = np.asarray(result.lengths), np.asarray(result.truncated)
    for row in range(tokens.shape[0]):
        is_stop = np.isin(tokens[row], stops)
        first = int(np.argmax(is_stop)) if is_stop[: lengths[row]].any() else None
        if first is None:  # never stopped: all 16 tokens are real and the row is flagged
            assert truncated[row] and lengths[row] == 16 and real[row].all()
        else:  # the stop token is the last real token; after it only padding
            assert not truncated[row] and lengths[row] == first + 1
            np.testing.assert_array_equal(real[row], np.arange(16) <= first)
            np.testing.assert_array_equal(tokens[row, first + 1 :], 0)
    assert 0 < truncated.sum() < len(truncated)  # both cases occurred

    everything_stops = run(model, ids, mask, max_new_tokens=5, stop_token_ids=tuple(range(VOCAB)))
    np.testing.assert_array_equal(np.asarray(everything_stops.lengths), 1)
    nothing_stops = run(model, ids, mask, max_new_tokens=5, stop_token_ids=())
    np.testing.assert_array_equal(np.asarray(nothing_stops.truncated), True)


def test_attention_phases():
    assert attention_phases(1) == [1]
    assert attention_phases(63) == [63]  # short completions: one phase
    assert attention_phases(64) == [16, 32, 48, 64]
    assert attention_phases(256) == [64, 128, 192, 256]
    assert attention_phases(300) == [80, 160, 240, 300]  # windows of ceil(300 / 4) -> 80 slots
    assert attention_phases(257) == [72, 144, 216, 257]
    # A small completion cache decodes in one phase; from the threshold on, in four.
    threshold = phases_module.PHASED_DECODE_MIN_CACHE_BYTES
    assert attention_phases(64, cache_bytes=threshold - 1) == [64]
    assert attention_phases(64, cache_bytes=threshold) == [16, 32, 48, 64]


def test_the_phase_rule_weighs_the_completion_caches_one_device_holds(hf_checkpoint, monkeypatch):
    """On a mesh a device holds a share of the completion caches (rows split over data x fsdp,
    the 2 kv heads over tensor): the rule for phased decoding weighs that share."""
    model = from_pretrained(hf_checkpoint("qwen2")[0])
    config = model.config
    rows, slots = 16, 24
    whole = rows * slots * cache_bytes_per_slot(config, jnp.float32)
    assert whole == rows * slots * 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads of 16, f32
    assert kv_cache_bytes(rows, slots, config, jnp.float32) == whole  # no mesh
    shares = {(8, 1, 1): 8, (1, 8, 1): 8, (2, 2, 2): 8, (1, 1, 8): 1, (1, 4, 2): 8, (1, 2, 4): 2}
    for shape, share in shares.items():  # tensor = 8 or 4 does not divide 2 kv heads
        with rules_context(make_mesh(shape)):
            assert kv_cache_bytes(rows, slots, config, jnp.float32) == whole // share

    # Threshold between one device's share and the whole: one phase on data = 8, three alone.
    monkeypatch.setattr(phases_module, "PHASED_DECODE_MIN_TOKENS", 1)
    monkeypatch.setattr(phases_module, "PHASED_DECODE_MIN_CACHE_BYTES", whole // 2)
    ids, mask = prompts(lengths=[5, 9, 3, 4, 6, 7, 2, 8])  # 8 prompts x G = 2: 16 rows
    args = (model.params(), jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0))
    kwargs = dict(
        model_config=config,
        num_generations=2,
        sampling=SamplingConfig(max_new_tokens=slots, stop_token_ids=(EOS,)),
    )
    loops = {}
    for name, mesh in (("one device", None), ("data=8", make_mesh((8, 1, 1)))):
        program = jax.jit(  # a new function: jit traces it anew
            lambda *a, **k: rollout.__wrapped__(*a, **k), static_argnames=tuple(kwargs)
        )
        with rules_context(mesh) if mesh else contextlib.nullcontext():
            loops[name] = program.lower(*args, **kwargs).as_text().count("stablehlo.while")
    assert loops["one device"] == loops["data=8"] + 2  # decode loops ending at 8, 16, 24 slots


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_phased_decode_samples_exactly_what_one_phase_samples(family, hf_checkpoint, monkeypatch):
    """The decode loop in phases of growing completion buffers (forced here at 24 tokens:
    phases end at 8, 16 and 24 slots) draws the same tokens with the same log-probs (gemma3:
    its sliding layers' rings of 4 slots stay 4 in every phase)."""
    model = from_pretrained(hf_checkpoint(family)[0])
    ids, mask = prompts(seed=5)
    args = (model.params(), jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3))
    config = SamplingConfig(max_new_tokens=24, temperature=1.0, stop_token_ids=(EOS, 7))
    kwargs = dict(model_config=model.config, num_generations=4, sampling=config)
    results, phases, loops = {}, {}, {}
    for name, threshold in (("phased", 1), ("one phase", 10**6)):
        monkeypatch.setattr(phases_module, "PHASED_DECODE_MIN_TOKENS", threshold)
        monkeypatch.setattr(phases_module, "PHASED_DECODE_MIN_CACHE_BYTES", 0)
        phases[name] = attention_phases(24, cache_bytes=1)
        # A new function, so that jit traces it anew (its trace cache is keyed by function).
        program = jax.jit(
            lambda *a, **k: rollout.__wrapped__(*a, **k), static_argnames=tuple(kwargs)
        )
        loops[name] = program.lower(*args, **kwargs).as_text().count("stablehlo.while")
        results[name] = program(*args, **kwargs)
    assert phases == {"phased": [8, 16, 24], "one phase": [24]}
    assert loops["phased"] == loops["one phase"] + 2  # three decode loops instead of one
    phased, single = results["phased"], results["one phase"]
    np.testing.assert_array_equal(phased.tokens, single.tokens)
    np.testing.assert_array_equal(phased.lengths, single.lengths)
    # Float rounding only: the full layers' buffers differ in size, so their sums run in
    # another order (measured: qwen2 under 1e-6; gemma3's 5 layers one log-prob of 288 off
    # by 1.4e-6 at -4.26, two float32 ulps).
    atol = 1e-6 if family == "qwen2" else 2e-6
    np.testing.assert_allclose(phased.logprobs, single.logprobs, rtol=0, atol=atol)
    lengths = np.asarray(single.lengths)
    assert lengths.max() > 16 and lengths.min() < 24  # rows reached the last phase; some stopped


def loop_computations(hlo: str) -> str:
    """The text of every computation that a compiled program's while loops run (their bodies
    and conditions, and the fusions and calls in them)."""
    computations = dict(re.findall(r"^(?:ENTRY )?%([\w.\-]+) \(.*?\n(.*?)\n\}", hlo, re.S | re.M))
    called = r"(?:calls|to_apply|body|condition)=%([\w.\-]+)"
    pending, seen = re.findall(r"(?:body|condition)=%([\w.\-]+)", hlo), set()
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            pending += re.findall(called, computations[name])
    return "\n".join(computations[name] for name in seen)


def compiled_rollout(model, ids, mask, *, num_generations=2, **sampling):
    """The rollout program for these prompts, compiled; `sampling` are SamplingConfig fields."""
    lowered = rollout.lower(
        model.params(),
        jnp.asarray(ids),
        jnp.asarray(mask),
        jax.random.key(0),
        model_config=model.config,
        num_generations=num_generations,
        sampling=SamplingConfig(**sampling),
    )
    return lowered.compile()


def test_the_decode_loop_evaluates_no_sine_or_cosine(hf_checkpoint):
    """RoPE's tables are built once before the decode loop (`decode_step`'s `rope`): computed
    in the step, XLA:CPU fused their sines and cosines into each layer's rotations instead."""
    model = from_pretrained(hf_checkpoint("qwen2")[0])
    hlo = compiled_rollout(model, *prompts(), max_new_tokens=8, stop_token_ids=(EOS,)).as_text()
    loop = loop_computations(hlo)
    assert " dot(" in loop  # the decode step runs in the loop
    assert "cosine(" in hlo  # the prefill and the tables
    assert "cosine(" not in loop and " sine(" not in loop


def test_a_bf16_cache_is_written_in_place(hf_checkpoint):
    """A bf16 model's decode loop writes its slot of each completion buffer without widening
    the buffer to f32: XLA:CPU did so around a bf16 dynamic-update-slice, two copies of the
    whole cache for every token (`jgrpo.models.precision.write_slice`)."""
    model = from_pretrained(hf_checkpoint("qwen2")[0], dtype=jnp.bfloat16)
    c, generations, new_tokens = model.config, 2, 8
    ids, mask = prompts()
    hlo = compiled_rollout(
        model, ids, mask, num_generations=generations, max_new_tokens=new_tokens
    ).as_text()
    loop = loop_computations(hlo)
    rows = len(ids) * generations
    keys = f"{rows},{c.num_kv_heads},{c.head_dim},{new_tokens}]"  # [B, K, D, N]
    values = f"{rows},{c.num_kv_heads},{new_tokens},{c.head_dim}]"  # [B, K, N, D]
    writes = re.findall(r"= (\w+)\[([\d,]+\])\S* dynamic-update-slice\(", loop)
    cache_writes = [dtype for dtype, shape in writes if shape in (keys, values)]
    assert len(cache_writes) >= 2 * c.num_layers  # every layer's keys and values
    assert "f32" not in cache_writes, cache_writes  # 16 bits wide (bf16, or its bits)


def test_randomness_is_a_function_of_the_key(hf_checkpoint):
    model = from_pretrained(hf_checkpoint("qwen2")[0])
    ids, mask = prompts()
    first = run(model, ids, mask, key=7, max_new_tokens=6)
    again = run(model, ids, mask, key=7, max_new_tokens=6)
    other = run(model, ids, mask, key=8, max_new_tokens=6)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    # The G rows of a group are independent draws, not copies.
    tokens = np.asarray(first.tokens)
    assert not np.array_equal(tokens[0], tokens[1])


def test_new_prompts_in_the_same_bucket_do_not_recompile(hf_checkpoint, count_compiles):
    model = from_pretrained(hf_checkpoint("llama3")[0])
    run(model, *prompts(seed=4, lengths=[5, 9, 3]), max_new_tokens=4)  # compiles
    before = count_compiles()
    ids, mask = prompts(seed=5, lengths=[12, 2, 7])  # other lengths, same bucket of 16
    assert ids.shape == (3, bucket_length(12)) == (3, 16)
    run(model, ids, mask, key=3, max_new_tokens=4)
    assert count_compiles() == before


def compiled_prefill(model, num_generations):
    """The rollout of two 60-token prompts (a 64 bucket) with one new token, compiled."""
    ids, mask = pad_prompts([list(range(3, 63))] * 2)
    return compiled_rollout(model, ids, mask, num_generations=num_generations, max_new_tokens=1)


def test_prefill_runs_once_per_prompt_not_per_generation(hf_checkpoint):
    """Compiled FLOPs barely grow with G: the long prefill is not repeated G times."""
    model = from_pretrained(hf_checkpoint("llama3")[0])
    flops = {g: compiled_prefill(model, g).cost_analysis()["flops"] for g in (1, 16)}
    ratio = flops[16] / flops[1]
    # One decode step per row costs about 1/60 of a prefill: 16 rows add ~15/60. Prefilling
    # each generation would multiply the total by ~16.
    assert ratio < 1.6, ratio


def test_prompt_cache_is_shared_by_the_group_not_copied(hf_checkpoint):
    """The compiled rollout's scratch memory does not grow by even one prompt KV cache from
    G = 1 to G = 16: the G rows read their prompt's cache, nothing copies it to them."""
    model = from_pretrained(hf_checkpoint("llama3")[0])
    c = model.config
    scratch = {g: compiled_prefill(model, g).memory_analysis().temp_size_in_bytes for g in (1, 16)}
    prompt_cache = 2 * c.num_layers * 2 * c.num_kv_heads * 64 * c.head_dim * 4  # k+v, f32
    # Copying it to each row would add 15 of them.
    assert scratch[16] - scratch[1] < prompt_cache


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_new_tokens", 0, "max_new_tokens must be an int >= 1"),
        ("temperature", -1.0, "temperature must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_k", -1, "top_k must be an int >= 0"),
        ("min_p", 1.0, r"min_p must be in \[0, 1\)"),
        ("weights_dtype", "float16", "weights_dtype must be 'float32' or 'bfloat16'"),
    ],
)
def test_bad_sampling_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**{"max_new_tokens": 4, field: value})

"""Multi-turn rollouts: the KV cache carried across turns, context tokens fed and not trained,
the limits, the template's context between turns, and an update that trains only the model's
own tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_hf import save_char_checkpoint
from transformers import AutoTokenizer

import jgrpo
from jgrpo import train as train_module
from jgrpo.config import load_config
from jgrpo.generation import pad_prompts
from jgrpo.metrics import read_metrics
from jgrpo.models.config import preset
from jgrpo.models.hf import from_pretrained
from jgrpo.models.transformer import Transformer
from jgrpo.rollout import SamplingConfig
from jgrpo.rollout.turns import context_after_turn, run_episodes
from jgrpo.tasks.arithmetic import text_tokenizer
from jgrpo.tools import EnvironmentStep
from jgrpo.update import Batch, UpdateConfig, init_state, train_step


class Counter:
    """Answers each turn with a tool message 'n<turn>'; the episode ends after `turns` turns."""

    def __init__(self, turns: int):
        self.turns = turns

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages):
        done = sum(m["role"] == "assistant" for m in messages)
        answer = [{"role": "tool", "content": f"n{done}"}]
        return EnvironmentStep(answer, done=done >= self.turns, tool_calls=1)


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    directory = save_char_checkpoint(tmp_path_factory.mktemp("char"))
    return from_pretrained(directory), AutoTokenizer.from_pretrained(directory)


PROMPTS = ["1+2=", "30+4="]


def episodes(
    char_model,
    *,
    max_turns=4,
    total_tokens=96,
    max_new_tokens=12,
    turns=3,
    key=0,
    max_concurrent=0,
):
    model, tokenizer = char_model
    stops = (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["x", "q", "7"]))
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        pad_token_id=tokenizer.pad_token_id,
        max_concurrent=max_concurrent,
    )
    return run_episodes(
        model.params(),
        [{"prompt": prompt} for prompt in PROMPTS],
        jax.random.key(key),
        new_environment=lambda: Counter(turns),
        tokenizer=tokenizer,
        model_config=model.config,
        num_generations=3,
        sampling=sampling,
        max_turns=max_turns,
        total_tokens=total_tokens,
        prompt_width=24,
    )


def full_forward_logprobs(char_model, result):
    """Log-probs of every written token under one forward pass over prompt + the whole area."""
    model, tokenizer = char_model
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    ids, mask = pad_prompts(
        [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts], buckets=(16,)
    )
    ids, mask = np.repeat(ids, 3, axis=0), np.repeat(mask, 3, axis=0)
    sequence = np.concatenate([ids, result.tokens], axis=1)
    sequence_mask = np.concatenate([mask, result.mask.astype(np.int32)], axis=1)
    logits = model(jnp.asarray(sequence), attention_mask=jnp.asarray(sequence_mask))
    logprobs, _ = jgrpo.token_logprobs(logits[:, ids.shape[1] - 1 : -1], jnp.asarray(result.tokens))
    return np.asarray(logprobs)


def test_turns_continue_one_sequence_whose_cache_survives_between_turns(char_model):
    """Every model token's log-prob equals a full forward pass over the prompt and the whole
    area (turns and context): the cache kept across turns holds the fed context. Context
    tokens are the template's rendering of the tool answer, with mask 1, model_mask 0 and
    log-prob 0."""
    _, tokenizer = char_model
    result = episodes(char_model)
    model_mask, mask = result.model_mask, result.mask
    expected = full_forward_logprobs(char_model, result)
    np.testing.assert_allclose(result.logprobs[model_mask], expected[model_mask], atol=2e-5)
    context = mask & ~model_mask
    assert context.any() and np.all(result.logprobs[context] == 0)
    assert np.all(~mask[:, 1:] | mask[:, :-1])  # written tokens are a prefix of the area
    assert set(result.turns.tolist()) >= {3}  # some rows played every turn
    for row in range(len(result.lengths)):
        text = tokenizer.decode(
            result.tokens[row, : result.lengths[row]], skip_special_tokens=False
        )
        conversation = result.conversations[row]
        turns = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert len(turns) == result.turns[row]
        tools = [m["content"] for m in conversation if m["role"] == "tool"]
        assert tools == [f"n{k}" for k in range(1, len(tools) + 1)]
        for reply in tools:  # the simple template renders "\ntool: n1\nassistant: "
            assert f"tool: {reply}\nassistant: " in text
        # the context tokens are exactly the template's text between turns
        context_text = tokenizer.decode(result.tokens[row][context[row]], skip_special_tokens=False)
        assert context_text == "".join(f"\ntool: {reply}\nassistant: " for reply in tools)


def test_limits_end_episodes_as_truncated(char_model):
    by_turns = episodes(char_model, max_turns=2, turns=5, max_new_tokens=40)
    # with a 2-turn limit a row still calling tools after its second turn is cut off
    assert np.all(by_turns.turns <= 2)
    # (the environment never ends an episode before 5 turns: every row is cut off by a limit)
    np.testing.assert_array_equal(
        by_turns.out_of_turns, (by_turns.turns == 2) & ~by_turns.out_of_tokens
    )
    assert by_turns.out_of_turns.any() and (by_turns.out_of_turns | by_turns.out_of_tokens).all()
    np.testing.assert_array_equal(
        by_turns.truncated, by_turns.out_of_turns | by_turns.out_of_tokens
    )
    by_tokens = episodes(char_model, total_tokens=40, turns=9, max_turns=9, max_new_tokens=40)
    assert by_tokens.out_of_tokens.all() and np.all(by_tokens.lengths <= 40)
    per_turn = episodes(char_model, max_new_tokens=3, turns=9, max_turns=9)
    drawn = [m["content"] for c in per_turn.conversations for m in c if m["role"] == "assistant"]
    assert max(len(text) for text in drawn) <= 3  # a turn holds at most max_new_tokens tokens


EPISODE_RECORDS = (
    "tokens",
    "mask",
    "model_mask",
    "lengths",
    "truncated",
    "turns",
    "tool_calls",
    "out_of_turns",
    "out_of_tokens",
)


@pytest.mark.parametrize("slots", [1, 4])
def test_episodes_in_slots_write_what_every_row_at_once_writes(char_model, slots):
    """Episodes in S slots (each holds its slot from its first turn to its last, and the next
    episode takes it when it ends; the host answers the turns of the slots that wait) give
    the same records and conversations as every row at once: a row's tokens depend on the
    seed, the prompt and the row only. Log-probs to float rounding (the decode step's
    shapes change with S, `test_slots`). One slot idles only while the host answers it, so
    its decode steps are exactly the tokens fed: every written token but each row's last."""
    everything = episodes(char_model, turns=4, max_turns=4)
    result = episodes(char_model, turns=4, max_turns=4, max_concurrent=slots)
    assert len(set(everything.lengths.tolist())) >= 4 and set(everything.turns.tolist()) >= {1, 4}
    for name in EPISODE_RECORDS:
        np.testing.assert_array_equal(getattr(result, name), getattr(everything, name), name)
    assert result.conversations == everything.conversations
    for name in ("logprobs", "sampler_logprobs"):
        np.testing.assert_allclose(
            getattr(result, name), getattr(everything, name), atol=2e-6, rtol=0
        )
    assert (everything.slots, result.slots) == (6, slots)
    if slots == 1:
        assert result.decode_steps == int((everything.lengths - 1).sum())


def test_the_same_key_gives_the_same_episodes(char_model):
    first, again = episodes(char_model, key=4), episodes(char_model, key=4)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)


QWEN_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_context_is_what_the_template_renders_between_turns():
    tokenizer = text_tokenizer()
    history = [{"role": "user", "content": "How old is Ada?"}]
    answer = [{"role": "tool", "content": "36"}]
    # The simple template renders no end-of-turn text: the model's stop token stays as it is.
    assert context_after_turn(tokenizer, history, answer, "</s>", None) == (
        "\ntool: 36\nassistant: "
    )
    tokenizer.chat_template = QWEN_LIKE  # <|im_end|> is the model's stop token: not repeated
    assert context_after_turn(tokenizer, history, answer, "<|im_end|>", None) == (
        "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_update_trains_the_models_tokens_with_the_tool_tokens_as_fixed_context():
    """One multi-turn row (prompt, turn 1, tool answer, turn 2; the answer masked out of the
    loss) updates the policy exactly as two single-turn rows do: turn 1 after the prompt, and
    turn 2 after the prompt, turn 1 and the answer as its fixed prompt (token-level loss, KL
    to a reference, two passes)."""
    config = preset("tiny")
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    reference = Transformer(config, rngs=nnx.Rngs(1)).params()
    rng = np.random.default_rng(0)
    prompt, turn1, answer, turn2 = (rng.integers(3, config.vocab_size, n) for n in (4, 3, 4, 3))
    area = np.concatenate([turn1, answer, turn2])
    model_mask = np.array([1, 1, 1, 0, 0, 0, 0, 1, 1, 1], bool)
    multi = Batch(
        input_ids=jnp.asarray(np.concatenate([prompt, area])[None], jnp.int32),
        attention_mask=jnp.ones((1, 14), jnp.int32),
        completion_mask=jnp.asarray(model_mask[None]),
        advantages=jnp.asarray([0.7], jnp.float32),
    )
    context = np.concatenate([prompt, turn1, answer])  # 11 tokens: turn 2's fixed prompt
    single = Batch(
        input_ids=jnp.asarray(
            [np.concatenate([np.zeros(7, int), prompt, turn1]), np.concatenate([context, turn2])],
            jnp.int32,
        ),
        attention_mask=jnp.asarray([[0] * 7 + [1] * 7, [1] * 14], jnp.int32),
        completion_mask=jnp.ones((2, 3), bool),
        advantages=jnp.asarray([0.7, 0.7], jnp.float32),
    )
    optimizer = optax.sgd(1.0)  # the new parameters show the gradients themselves
    settings = UpdateConfig(loss_type="dapo", beta=0.04, num_iterations=2)
    results = [
        train_step(
            init_state(jax.tree.map(jnp.copy, params), optimizer),
            batch,
            reference,
            model_config=config,
            update_config=settings,
            optimizer=optimizer,
        )
        for batch in (multi, single)
    ]
    (multi_state, multi_metrics), (single_state, single_metrics) = results
    for name in ("loss", "kl_mean", "grad_norm", "ratio_mean"):
        np.testing.assert_allclose(multi_metrics[name], single_metrics[name], rtol=2e-5, atol=1e-7)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        multi_state.params,
        single_state.params,
    )


LOOKUP = [
    "task.name=lookup",
    "task.num_examples=64",
    "rollout.prompts_per_step=4",
    "rollout.num_generations=4",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=3",
    "rollout.max_total_tokens=12",
    "rollout.max_prompt_length=8",
    "algorithm.beta=0.04",
    "optim.lr=1e-3",
    "train.steps=3",
    "train.eval_every=1",
    "task.eval_size=4",
    "train.export=false",
    "train.progress=false",
    "train.tensorboard=false",
    "task.reward_workers=0",
    "mesh.devices=1",
]


def test_a_multi_turn_task_trains_on_its_episodes(tmp_path, count_compiles):
    """The lookup demo's task through the trainer: episodes collected with its environment,
    the update trained on the model's tokens only, the episode metrics logged, greedy
    episodes evaluated; nothing compiles after step 1."""
    config = load_config(None, [*LOOKUP, f"train.run_dir={tmp_path}"])
    trainer = train_module.Trainer(config)
    params = trainer.initial_params()
    groups, metrics, _ = trainer.collect(params, None, jax.random.key(0), 0)
    context = groups.mask & ~groups.model_mask
    looked_up = [text.count("tool: ") for text in groups.texts]
    # rows whose first turn was "?" got the value as context; the others have none
    np.testing.assert_array_equal(context.any(1), np.array(looked_up) > 0)
    batch = trainer.to_batch(groups, np.ones(16, np.float32))
    np.testing.assert_array_equal(np.asarray(batch.completion_mask), groups.model_mask)
    prompt_width = groups.prompt_ids.shape[1]
    np.testing.assert_array_equal(
        np.asarray(batch.attention_mask)[:, prompt_width:], groups.mask.astype(np.int32)
    )
    assert metrics["tools/calls_per_completion"] == pytest.approx(np.mean(looked_up))
    compiles = {}
    train_module.train(config, on_step=lambda step, _: compiles.update({step: count_compiles()}))
    assert compiles[3] == compiles[1]
    lines = read_metrics(tmp_path)
    for name in (
        "turns/mean",
        "tools/calls_per_completion",
        "tools/errors",
        "truncated/turns",
        "truncated/tokens",
        "model_tokens/mean",
        "reward/lookup/mean",
        "eval/accuracy",
    ):
        assert all(name in line for line in lines), name
    assert all(1 <= line["turns/mean"] <= 2 for line in lines)


def test_training_on_episodes_in_slots_equals_every_row_at_once(tmp_path, count_compiles):
    """The lookup task's training (episodes of 2 turns, greedy eval episodes) with
    rollout.max_concurrent=3 gives the parameters and training metrics of every row at once;
    only the rollout's own figures differ (slots, decode steps, efficiency, speeds;
    `sampler/gap` to float rounding). Nothing compiles after step 1."""
    runs = {}
    for slots in (0, 3):
        run_dir = tmp_path / str(slots)
        config = load_config(
            None, [*LOOKUP, f"rollout.max_concurrent={slots}", f"train.run_dir={run_dir}"]
        )
        compiles = {}
        on_step = lambda step, _, compiles=compiles: compiles.update(  # noqa: E731
            {step: count_compiles()}
        )
        result = train_module.train(config, on_step=on_step)
        assert compiles[3] == compiles[1]
        runs[slots] = (read_metrics(run_dir), result.state.params)
    jax.tree.map(np.testing.assert_array_equal, runs[0][1], runs[3][1])
    for every_row, slotted in zip(runs[0][0], runs[3][0], strict=True):
        assert every_row.keys() == slotted.keys()
        for name in every_row:
            if name.startswith(("time/", "rollout/")) or name in ("sampler/gap", "tokens_per_s"):
                continue
            assert every_row[name] == slotted[name], (every_row["step"], name)
        assert abs(every_row["sampler/gap"] - slotted["sampler/gap"]) < 1e-6
        assert (every_row["rollout/concurrent"], slotted["rollout/concurrent"]) == (16, 3)
        rows = 16
        tokens = every_row["completion_len/mean"] * rows
        for line in (every_row, slotted):
            steps = line["rollout/concurrent"] * line["rollout/decode_steps"]
            assert line["rollout/slot_efficiency"] == pytest.approx((tokens - rows) / steps)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task.name=addition", "rollout.max_turns=2"],
            "needs a task with tools or an environment",
        ),
        (["rollout.max_turns=1"], "gives tools or an environment, which answer the model's turns"),
    ],
)
def test_turn_settings_must_match_the_task(tmp_path, overrides, message):
    from jgrpo.config import ConfigError
    from jgrpo.setup import Setup

    with pytest.raises(ConfigError, match=message):
        Setup(load_config(None, [*LOOKUP, f"train.run_dir={tmp_path}", *overrides]))


def test_multi_turn_episodes_hold_their_turns_and_answers():
    assert load_config(None, ["rollout.max_turns=3"]).rollout.completion_tokens == 3 * 128
    assert (
        load_config(
            None, ["rollout.max_turns=3", "rollout.max_total_tokens=200"]
        ).rollout.completion_tokens
        == 200
    )

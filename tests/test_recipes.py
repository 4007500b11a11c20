"""The recipes in configs/ run end to end as CPU smoke checks, and a JSONL task from a config."""

import json
import pathlib

import pytest

from jgrpo import train as train_module
from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.rewards.registry import parse_reward_spec

ROOT = pathlib.Path(__file__).parent.parent


def smoke(recipe: str, run_dir, *extra) -> list[dict]:
    code = train_module.main(
        [
            str(ROOT / "configs" / recipe),
            "smoke",
            f"train.run_dir={run_dir}",
            "train.progress=false",
            *extra,
        ]
    )
    assert code == 0
    return read_metrics(run_dir)


def test_json_extraction_recipe_logs_every_reward_component(tmp_path):
    lines = smoke("json-extraction-qwen2.5-0.5b.yaml", tmp_path)
    assert [line["step"] for line in lines] == [1, 2]
    for name in (
        "json_parses",
        "json_schema_valid",
        "json_required_fields",
        "json_answer_correct",
        "json_extra_text",
    ):
        assert f"reward/{name}/mean" in lines[-1]
    assert "eval/accuracy" in lines[-1]


def test_gsm8k_recipe_runs_on_local_rows(tmp_path):
    data = ROOT / "tests" / "data" / "gsm8k"
    lines = smoke("gsm8k-qwen2.5-0.5b.yaml", tmp_path / "run", f"task.path={data}")
    assert {"reward/correct/mean", "reward/format/mean", "eval/accuracy"} <= lines[-1].keys()


def test_the_multi_turn_demo_recipe_runs_episodes(tmp_path):
    lines = smoke("tool-demo.yaml", tmp_path)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert 1 <= line["turns/mean"] <= 2 and 0 <= line["tools/calls_per_completion"] <= 1
        assert "reward/lookup/mean" in line
    assert "eval/accuracy" in lines[-1]  # smoke evaluates at step 2


def test_the_gsm8k_tools_recipe_runs_episodes_with_the_python_tool(tmp_path):
    data = ROOT / "tests" / "data" / "gsm8k"
    lines = smoke(
        "gsm8k-tools-qwen2.5-0.5b.yaml",
        tmp_path,
        f"task.path={data}",
        "rollout.max_total_tokens=32",  # the smoke model's turns are 8 tokens
        "rollout.max_prompt_length=1024",  # system prompt and question, a token per character
    )
    assert [line["step"] for line in lines] == [1, 2]
    assert all("turns/mean" in line and "reward/correct/mean" in line for line in lines)


def test_the_gemma3_recipe_trains_and_exports_a_gemma3_checkpoint(tmp_path):
    """The recipe on a tiny Gemma 3 checkpoint (sliding and full layers, the window shorter
    than its rows): two steps, and the export loads in transformers with our logits."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from tiny_hf import save_char_checkpoint
    from transformers import AutoModelForCausalLM

    from jgrpo.models.hf import from_pretrained

    checkpoint = save_char_checkpoint(tmp_path / "gemma3", gemma3=True)
    data = ROOT / "tests" / "data" / "gsm8k"
    run_dir = tmp_path / "run"
    lines = smoke(
        "gsm8k-gemma3-1b.yaml",
        run_dir,
        f"task.path={data}",
        f"model.path={checkpoint}",
        "rollout.max_prompt_length=1024",  # system prompt and question, a token per character
    )
    assert [line["step"] for line in lines] == [1, 2]
    assert {"reward/correct/mean", "eval/accuracy"} <= lines[-1].keys()
    exported = from_pretrained(run_dir / "hf")
    assert exported.config == from_pretrained(checkpoint).config
    ids = np.arange(3, 43).reshape(2, 20)  # longer than the window of 16
    torch_model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", attn_implementation="eager")
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(exported(jnp.asarray(ids)), expected, atol=1e-4, rtol=0)


def test_the_qwen3_moe_recipe_trains_a_mixture_of_experts(tmp_path):
    """The recipe on a tiny Qwen3-MoE checkpoint (4 experts, 2 per token): two steps with the
    load-balancing loss, whose value and the experts' loads are logged."""
    from tiny_hf import save_char_checkpoint

    checkpoint = save_char_checkpoint(tmp_path / "moe", moe=True)
    lines = smoke(
        "gsm8k-qwen3-30b-a3b.yaml",
        tmp_path / "run",
        f"task.path={ROOT / 'tests' / 'data' / 'gsm8k'}",
        f"model.path={checkpoint}",
        "model.dtype=float32",
        "rollout.max_prompt_length=1024",  # system prompt and question, a token per character
    )
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["moe/aux_loss"] > 0 and line["moe/expert_load_max"] >= 1.0


def test_a_jsonl_task_from_the_config(tmp_path):
    rows = [{"question": f"What is {n} + 1?", "answer": str(n + 1)} for n in range(6)]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    config = load_config(
        None,
        [
            "task.name=jsonl",
            f"task.path={path}",
            "task.prompt_field=question",
            "task.rewards=math:1.0, tag_count:0.25",
            "task.held_out=2",
        ],
    )
    task = train_module.build_task(config)
    assert task.reward_weights == {"math": 1.0, "tag_count": 0.25}
    assert task.correctness == "math" and len(task.train) == 4 and len(task.eval) == 2
    assert task.train[0]["prompt"].startswith("What is")
    with pytest.raises(ConfigError, match="needs task.path"):
        load_config(None, ["task.name=jsonl"])


def test_reward_specs_name_the_known_rewards():
    functions, weights = parse_reward_spec("math, think_answer_format:0.2")
    assert list(functions) == ["math", "think_answer_format"]
    assert weights == {"math": 1.0, "think_answer_format": 0.2}
    with pytest.raises(ValueError, match="unknown reward 'maths'.*built-in rewards: math"):
        parse_reward_spec("maths:1")
    with pytest.raises(ValueError, match="'x' for 'math' .* is not a number"):
        parse_reward_spec("math:x")

"""The training config: YAML + overrides, strict validation, help text, round trip."""

import dataclasses
import json

import pytest
import yaml

from jgrpo.config import (
    Config,
    ConfigError,
    changed_settings,
    field_names,
    format_help,
    load_config,
    to_dict,
)


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid():
    assert load_config() == Config()


def test_yaml_then_overrides(tmp_path):
    path = write(
        tmp_path,
        "rollout:\n  num_generations: 4\n  temperature: 0.7\noptim:\n  lr: 1e-6\n"
        "algorithm:\n  clip_eps_high: 0.28\n",
    )
    config = load_config(path, ["rollout.num_generations=16", "model.dtype=bfloat16"])
    assert config.rollout.num_generations == 16  # the override wins
    assert config.rollout.temperature == 0.7  # the file's value stays
    assert config.optim.lr == 1e-6  # YAML 1.1 reads "1e-6" as a string: accepted for floats
    assert config.algorithm.clip_eps_high == 0.28
    assert config.model.dtype == "bfloat16"
    assert config.optim.schedule == "constant"  # untouched default
    assert load_config(path, ["algorithm.clip_eps_high=null"]).algorithm.clip_eps_high is None


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["rollout.top_k=20", "train.steps=7", "algorithm.beta=0.04"])
    path = write(tmp_path, yaml.safe_dump(to_dict(config)))
    assert load_config(path) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.num_generation=4"],
            r"unknown config key 'rollout\.num_generation'\. Did you mean rollout\.num_generations",
        ),
        (["optim.learning_rate=1e-5"], r"unknown config key 'optim\.learning_rate'"),
        (["rollout.num_generations=1"], r"rollout\.num_generations must be >= 2"),
        (["algorithm.completion_buckets=0"], r"algorithm\.completion_buckets must be >= 1"),
        (["rollout.num_generations=abc"], r"rollout\.num_generations must be int, got 'abc'"),
        (["model.remat=1"], r"model\.remat must be bool, got 1"),
        (["optim.lr=-1"], r"optim\.lr must be > 0"),
        (["optim.lr=fast"], r"optim\.lr must be float, got 'fast'"),
        (
            ["algorithm.loss_type=ppo"],
            r"algorithm\.loss_type must be one of 'grpo', 'bnpo', 'dapo', 'dr_grpo'",
        ),
        (["algorithm.std_ddof=2"], r"algorithm\.std_ddof must be one of 0, 1"),
        (["rollout.temperature=0"], r"rollout\.temperature must be > 0 for training"),
        (["algorithm.num_minibatches=3"], r"64 sequences must divide into .* = 3 equal parts"),
        (["optim.lr"], r"override 'optim\.lr' must look like section\.key=value"),
        (
            ["train.steps=["],
            r"override 'train\.steps=\[': the value is not valid YAML \(expected the node "
            r"content, but found '<stream end>' at line 1, column 2\); fix it, or quote",
        ),
        (["model.dtype=float16"], r"model\.dtype must be 'float32' or 'bfloat16'"),
        (["rollout.weights_dtype=fp8"], r"rollout\.weights_dtype must be 'float32' or 'bfloat16'"),
        (["model.matmul_dtype=fp16"], r"model\.matmul_dtype must be 'float32' or 'bfloat16'"),
        (
            ["model.reference_dtype=float16"],
            r"model\.reference_dtype must be 'float32' or 'bfloat16'",
        ),
        (["model.keep_logits_mib=-1"], r"model\.keep_logits_mib must be >= 0 \(0: recompute"),
        (
            ["algorithm.sampler_correction=tis"],
            r"algorithm\.sampler_correction must be one of 'auto', 'none', 'token', 'sequence'",
        ),
        (
            ["algorithm.sampler_correction_cap=0.9"],
            r"algorithm\.sampler_correction_cap must be >= 1",
        ),
        (
            ["algorithm.sampler_correction_mode=clip"],
            r"algorithm\.sampler_correction_mode must be one of 'truncate', 'mask'",
        ),
        (
            ["algorithm.sampler_correction_floor=1.2"],
            r"algorithm\.sampler_correction_floor must be in \[0, 1\]",
        ),
        (
            ["algorithm.kl_bias_correction=true"],
            r"algorithm\.kl_bias_correction weights the KL term in the loss, so it needs "
            r"algorithm\.beta > 0",
        ),
        (
            [
                "algorithm.beta=0.04",
                "algorithm.kl_in_reward=true",
                "algorithm.kl_bias_correction=true",
            ],
            r"algorithm\.kl_in_reward=false: set those, or algorithm\.kl_bias_correction=false",
        ),
        (
            ["algorithm.clip_eps_high=0.28", "algorithm.dual_clip=1.25"],
            r"algorithm\.dual_clip must be > 1 \+ clip_eps_high = 1\.28 .*verl uses 3\.0",
        ),
        (
            ["algorithm.top_entropy_quantile=0"],
            r"algorithm\.top_entropy_quantile must be in \(0, 1\]",
        ),
        (
            ["algorithm.off_policy_mask_threshold=-0.5"],
            r"algorithm\.off_policy_mask_threshold must be >= 0",
        ),
        (["algorithm.ref_sync_steps=-1"], r"algorithm\.ref_sync_steps must be >= 0"),
        (
            ["algorithm.ref_sync_steps=10"],
            r"algorithm\.ref_sync_steps moves the KL reference, which exists only with "
            r"algorithm\.beta > 0",
        ),
        (
            ["algorithm.beta=0.1", "algorithm.ref_sync_alpha=0"],
            r"algorithm\.ref_sync_alpha must be in \(0, 1\], got 0",
        ),
        (["algorithm.policy_loss=ppo"], r"algorithm\.policy_loss must be one of 'clip', 'cispo'"),
        (
            ["algorithm.policy_loss=cispo", "algorithm.dual_clip=3"],
            r"algorithm\.dual_clip bounds the clipped policy term, so it needs "
            r"algorithm\.policy_loss=clip, not cispo",
        ),
        (["algorithm.cispo_max_ratio=0.5"], r"algorithm\.cispo_max_ratio must be >= 1"),
        (["algorithm.sapo_temperature_neg=0"], r"algorithm\.sapo_temperature_neg must be > 0"),
        (["train.profile_steps=-1"], r"train\.profile_steps must be >= 0"),
        (
            ["train.steps=3", "train.profile_steps=2", "train.profile_start=5"],
            r"train\.profile_start=5 is after the last step \(train\.steps=3\)",
        ),
    ],
)
def test_bad_overrides_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=.inf",  # YAML's infinity
        "optim.lr=inf",  # a string, read as a float
        "optim.lr=1e999",  # overflows to inf
        "algorithm.beta=.nan",  # passes `beta < 0`
        "algorithm.clip_eps_high=nan",  # an optional float
        "task.reward_timeout_s=.inf",
    ],
)
def test_nan_and_inf_float_values_name_the_field(tmp_path, override):
    key, value = override.split("=")
    message = rf"{key} must be a finite number, got (inf|nan)"
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=message):  # from a YAML file too
        load_config(write(tmp_path, f"{section}:\n  {name}: {value}\n"))


def test_a_config_built_in_python_is_checked_for_nan_too():
    from jgrpo.config import OptimSection

    with pytest.raises(ConfigError, match=r"optim\.lr must be a finite number, got nan"):
        Config(optim=OptimSection(lr=float("nan"))).check()


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.groups'"):
        load_config(write(tmp_path, "rollout:\n  groups: 4\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer'\. Did you mean"):
        load_config(write(tmp_path, "optimizer:\n  lr: 0.1\n"))
    with pytest.raises(ConfigError, match="rollout must be a mapping"):
        load_config(write(tmp_path, "rollout: 4\n"))
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_unreadable_config_files_are_config_errors_naming_the_file(tmp_path):
    """What the CLI prints as one line (`config error: ...`) instead of a traceback."""
    path = write(tmp_path, "rollout:\n  num_generations: [4,\n")
    with pytest.raises(
        ConfigError, match=rf"{path} is not valid YAML: .* at line 3, column 1; fix it\."
    ):
        load_config(path)
    path.write_bytes("train:\n  run_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{path} is not UTF-8 text \(byte 21: .*save it as"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"{tmp_path} is a folder, not a config file"):
        load_config(tmp_path)


def test_help_lists_every_field_with_default_and_description():
    text = format_help()
    for key in field_names():
        assert f"  {key} (" in text, key
    assert "rollout.num_generations (int, default 8): G: completions per prompt" in text
    sections = [getattr(Config(), f.name) for f in dataclasses.fields(Config)]
    assert len(field_names()) == sum(len(dataclasses.fields(s)) for s in sections)


def test_every_preset_in_configs_is_valid():
    import pathlib

    presets = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(presets) >= 2
    for preset in presets:
        load_config(preset)  # raises ConfigError naming the field


def test_the_demo_preset_file_matches_the_built_in_demo():
    import pathlib

    from jgrpo.config import DEMO_OVERRIDES

    path = pathlib.Path(__file__).parent.parent / "configs" / "demo.yaml"
    assert load_config(path) == load_config(None, DEMO_OVERRIDES)


def test_demo_config_is_the_cli_default_and_load_config_none_the_plain_defaults():
    from jgrpo.config import DEMO_OVERRIDES, SMOKE_OVERRIDES, demo_config

    assert demo_config() == load_config(None, DEMO_OVERRIDES)
    assert demo_config(["optim.lr=5e-4"]).optim.lr == 5e-4  # overrides go on top
    # `smoke` comes after the demo's overrides (it wins), the user's after both.
    smoke = demo_config(["smoke", "train.steps=3"])
    assert smoke == load_config(None, [*DEMO_OVERRIDES, *SMOKE_OVERRIDES, "train.steps=3"])
    # The plain defaults are another task: sums of 0-9, the demo's of 0-4.
    assert load_config(None).task.max_operand == 9 and demo_config().task.max_operand == 4


def test_changed_settings_name_what_differs_from_a_saved_config():
    saved = json.loads(json.dumps(to_dict(load_config(None, ["algorithm.beta=0.04"]))))
    assert changed_settings(saved, load_config(None, ["algorithm.beta=0.04"])) == []
    now = load_config(None, ["optim.lr=5e-4", "rollout.weights_dtype=bfloat16"])
    assert changed_settings(saved, now) == [
        "rollout.weights_dtype: 'float32' -> 'bfloat16'",
        "algorithm.beta: 0.04 -> 0.0",
        "optim.lr: 1e-06 -> 0.0005",
    ]
    del saved["algorithm"]["beta"]  # a key the checkpoint's version did not have
    assert changed_settings(saved, load_config(None, [])) == []

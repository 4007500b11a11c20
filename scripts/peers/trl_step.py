"""Times the compare workload (`scripts/compare_workload.py`) with TRL's `GRPOTrainer`.

    python scripts/peers/trl_step.py --checkpoint /tmp/jgrpo-compare/smollm2-135m --steps 3

Runs in its own virtual environment (torch + trl, see docs), on CPU in float32 with 2 torch
threads. TRL loads the checkpoint itself (`GRPOTrainer(model=path)`, which also loads the
reference model from the same path because beta > 0). One optimizer step = 4 prompts x 8
generations: per_device_train_batch_size=32, gradient_accumulation_steps=1, num_iterations=1.
`min_new_tokens=64` (generation_kwargs) blocks EOS so every completion has 64 tokens.
Gradient checkpointing (TRL's default) is turned off: the workload does not recompute layers.
`--bf16` turns on TRL's mixed precision (`bf16=True`: torch autocast to bf16 on CPU, f32
parameters), the counterpart of jgrpo's bf16 matmuls.
Optimizer: TRL's defaults, fused torch AdamW, no weight decay, grad-norm clip 1.0.

Stages, wall time per optimizer step (torch on CPU is synchronous, so no device sync needed):
- step: a `TrainerCallback` from `on_step_begin` to `on_step_end` (generation, scoring,
  reference pass, loss forward/backward, grad clipping, AdamW step).
- sampling: the policy model's `generate` call (wrapped on the model instance).
- reference: `GRPOTrainer._get_per_token_logps_and_entropies` when called with the reference
  model (wrapped on the trainer instance).
- update: from the end of `GRPOTrainer._prepare_inputs` (generation + rewards + reference
  pass + advantages) to `on_step_end`: the policy forward/backward and the optimizer step.
Prints one final line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compare_workload as workload  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self):
        self.rows, self.current = [], {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = {"start": time.perf_counter(), "sampling": 0.0, "reference": 0.0}

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        row = self.current
        row["step"] = end - row["start"]
        row["update"] = end - row["prepared"]
        self.rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16 mixed precision")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(workload.SEED)
    checkpoint = args.checkpoint  # written by compare_workload.build_checkpoint
    steps = args.steps + 1
    dataset = Dataset.from_list([{"prompt": p} for p in workload.prompts()] * steps)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-step-"),
        per_device_train_batch_size=workload.PROMPTS * workload.GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=workload.GENERATIONS,
        max_completion_length=workload.NEW_TOKENS,
        generation_kwargs={"min_new_tokens": workload.NEW_TOKENS},
        temperature=workload.TEMPERATURE,
        beta=workload.BETA,
        learning_rate=workload.LEARNING_RATE,
        num_iterations=1,
        max_steps=steps,
        use_cpu=True,
        bf16=args.bf16,
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,
        use_vllm=False,
        shuffle_dataset=False,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        seed=workload.SEED,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=checkpoint,
        reward_funcs=workload.distinct_words_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
    )

    tokens = []

    def on_generate(start, _, out):
        timer.current["sampling"] += time.perf_counter() - start

    def on_logps(start, call_args, _):
        if call_args[0] is trainer.ref_model:
            timer.current["reference"] += time.perf_counter() - start

    def on_prepared(start, _, inputs):
        timer.current["prepared"] = time.perf_counter()
        tokens.append(int(inputs["completion_mask"].sum()))

    trainer.model.generate = workload.timed(trainer.model.generate, on_generate)
    trainer._get_per_token_logps_and_entropies = workload.timed(
        trainer._get_per_token_logps_and_entropies, on_logps
    )
    trainer._prepare_inputs = workload.timed(trainer._prepare_inputs, on_prepared)
    trainer.train()

    label = f"TRL {trl.__version__}" + (", bf16 mixed precision" if args.bf16 else "")
    print(workload.result_line(label, timer.rows, tokens))


if __name__ == "__main__":
    main()

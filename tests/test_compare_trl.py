"""tools/compare_trl.py (runs only where trl and transformers are installed): TRL's trained folder comes back into our
evaluation unchanged, and TRL sees our prompt ids and our reward."""
import json
import os

import pytest

import train

pytest.importorskip("trl")
pytest.importorskip("transformers")
from tools import compare_trl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
TINY = ["--config", SMOKE, "--threads=1", "--eval_n=8", "--eval_k=2", "--sft_direct_frac=0"]


@pytest.mark.slow
def test_trl_at_lr_zero_scores_as_the_cold_start(tmp_path):
    cold = tmp_path / "cold"
    train.main(train.parse_args(TINY + [f"--out_dir={cold}", "--rl_steps=0"]))
    init = cold / "step_6"
    want = train.evaluate(train.build_run(train.parse_args(TINY + [f"--init_from={init}"])), 0)
    out = tmp_path / "trl"
    got = compare_trl.train_and_evaluate(compare_trl.cli.parse_config(compare_trl.TrlConfig, TINY + [
        f"--init_from={init}", f"--out_dir={out}", "--rl_steps=2", "--lr=0"]))
    assert got["trl_steps"] == 2
    # lr 0: TRL's saved folder holds the cold-start weights, so our evaluation of it is the cold start's, exactly
    assert {k: got[k] for k in want} == want
    assert json.load(open(out / "eval.json"))["eval/pass@1"] == want["eval/pass@1"]


def test_trl_reward_is_our_score(tmp_path):
    cold = tmp_path / "cold"
    train.main(train.parse_args(TINY + [f"--out_dir={cold}", "--rl_steps=0", "--sft_steps=1", "--ckpt_every=1"]))
    cfg = compare_trl.cli.parse_config(compare_trl.TrlConfig, TINY + [f"--init_from={cold / 'step_1'}"])
    run = train.build_run(cfg)
    trainer = compare_trl.trainer_for(cfg, run, cfg.init_from, str(tmp_path / "t"), 1, 4, None)
    p = run.task.problem("rl", 2)[1]
    right, wrong = run.task.target_ids(p.solution), run.task.target_ids("#### 99999")
    assert trainer.reward_funcs[0]([""] * 2, [""] * 2, [right, wrong], [2, 2]) == [1.0, 0.0]


def test_bench_takes_a_model_folder(tmp_path):
    """--bench=FOLDER times both whole steps on that folder's own weights (the real-model row of RESULTS §11)."""
    model = compare_trl.random_checkpoint(str(tmp_path), dict(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                              intermediate_size=64))
    cfg = compare_trl.cli.parse_config(compare_trl.TrlConfig, TINY + [f"--bench={tmp_path}", "--bench_steps=1"])
    got = compare_trl.bench(cfg)[str(tmp_path)]
    assert got["params"] == sum(p.numel() for p in model.parameters())
    assert got["ours_s"] > 0 and got["trl_s"] > 0
    with pytest.raises(SystemExit, match="neither a size"):
        compare_trl.bench(compare_trl.cli.parse_config(compare_trl.TrlConfig, TINY + ["--bench=no/such/folder"]))


def test_trl_micro_rows_accumulates_one_generation_per_step(tmp_path):
    """trl_micro_rows splits TRL's backward (memory) but not its generation: P·G completions per optimizer step."""
    _, trl, _ = compare_trl.import_trl()
    cfg = compare_trl.cli.parse_config(compare_trl.TrlConfig, TINY + ["--trl_micro_rows=4"])
    args = compare_trl.grpo_config(trl, cfg, str(tmp_path), 2)
    P, G = cfg.prompts_per_step, cfg.group_size
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, P * G // 4)
    assert args.generation_batch_size == P * G and args.num_generations == G
    with pytest.raises(SystemExit, match="does not divide"):
        compare_trl.grpo_config(trl, compare_trl.cli.parse_config(
            compare_trl.TrlConfig, TINY + [f"--trl_micro_rows={P * G - 1}"]), str(tmp_path), 2)


def test_the_trl_clock_leaves_the_evaluations_out(monkeypatch):
    """trl_minutes counts training as rl_minutes does: steps of 10 s, each followed by a 10-minute evaluation, stop
    once 60 s of steps have run (the 7th step), not after the first evaluation."""
    import transformers
    now = [0.0]
    monkeypatch.setattr(compare_trl.time, "time", lambda: now[0])

    def evaluate():
        now[0] += 600

    clock, control = compare_trl.step_clock(transformers)(1.0, evaluate), type("Control", (), {})()
    control.should_training_stop = False
    clock.on_train_begin(None, None, control)
    steps = 0
    while not control.should_training_stop:
        clock.on_step_begin(None, None, control)
        now[0] += 10
        clock.on_step_end(None, None, control)
        steps += 1
    assert steps == 7 and clock.paused == 7 * 600

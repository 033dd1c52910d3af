"""train.py: config errors, a few steps of sft then rl, checkpoints, 2-rank equivalence, kill-and-resume."""
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections import deque

import pytest
import torch
from safetensors.torch import load_file

from conftest import records

import checks
import decode
import grpo
import infra
import objective
import rollout
import tasks
import train
import verify
from logger import Logger, phase_seconds
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def deterministic(recs):  # timings differ from run to run; everything else must not
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in recs]


def test_config_errors_name_the_key_and_suggest(tmp_path):
    with pytest.raises(SystemExit, match="unknown config key 'rl_stpes'.*did you mean 'rl_steps'"):
        train.parse_args(["--rl_stpes=3"])
    with pytest.raises(SystemExit, match="'lr'.*needs a float.*'fast'"):
        train.parse_args(["--lr=fast"])
    with pytest.raises(SystemExit, match="'resume'.*needs a bool"):
        train.parse_args(["--resume=maybe"])
    with pytest.raises(SystemExit, match="'agg'.*'token_sum'.*choose one of"):
        train.parse_args(["--agg=token_sum"])
    with pytest.raises(SystemExit, match="--config needs an existing TOML file"):
        train.parse_args(["--config", str(tmp_path / "missing.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("group_size = 4\nbeta = 'high'\n")
    with pytest.raises(SystemExit, match=f"'beta' \\({bad}\\)"):
        train.parse_args(["--config", str(bad)])
    cfg = train.parse_args(["--config", SMOKE, "--rl_steps=7", "--beta", "0.1", "--resume"])
    assert (cfg.rl_steps, cfg.beta, cfg.resume, cfg.group_size, cfg.lr) == (7, 0.1, True, 4, train.Config.lr)


def test_objective_names_the_paper():
    for preset, name in [("gspo", "GSPO"), ("cispo", "CISPO"), ("rloo", "RLOO"), ("grpo", "GRPO"), ("dapo", "DAPO"),
                         ("dr_grpo", "Dr. GRPO")]:
        assert train.objective(train.parse_args(["--config", os.path.join(ROOT, "configs", f"{preset}.toml")])
                               ).startswith(name + ":" if name != "GRPO" else "GRPO (DeepSeekMath)"), preset
    assert train.objective(train.Config(adv_scale="reinforce_pp")).startswith("REINFORCE++")
    assert "w^TIS_sequence" in train.objective(train.Config(tis="sequence"))
    assert "top 0.2" in train.objective(train.Config(top_entropy_q=0.2))
    assert train.objective(train.Config()).startswith("DAPO")
    assert train.objective(train.Config(agg="seq_mean_token_mean", eps_high=0.2, beta=0.04)).startswith("GRPO")
    assert train.objective(train.Config(adv_scale="none", agg="seq_mean_token_sum_norm")).startswith("Dr. GRPO")
    for preset, name in [("dppo", "DPPO-TV"), ("maxrl", "MaxRL"), ("sapo", "SAPO"), ("gmpo", "GMPO")]:
        assert train.objective(train.parse_args(["--config", os.path.join(ROOT, "configs", f"{preset}.toml")])
                               ).startswith(name + ":"), preset
    # a sequence ratio without seq_mean_token_mean is not GSPO's eq. 5, and the name says so
    assert train.objective(train.Config(ratio_level="sequence")).startswith("sequence-ratio clip, not GSPO")
    assert "0.04·k3 [∇ → ∇KL(π_ref‖π_θ)]" in train.objective(train.Config(beta=0.04))
    assert "r_i ← r_i − 0.04·Σ_t k1" in train.objective(train.Config(beta=0.04, kl_in="reward"))
    assert "k3" not in train.objective(train.Config(beta=0.04, kl_in="reward"))
    assert train.objective(train.Config(cov="kl")).startswith("DAPO + KL-Cov")


def micro_batches(lengths: list[int], budget: int):
    """infra.micro_batches of rows of these prompt + completion lengths (split 1 : rest)."""
    return infra.micro_batches([[7] * min(n, 1) for n in lengths], [[5] * (n - 1) for n in lengths],
                               budget)


def test_micro_batches_respect_budget_and_pack_rows_of_similar_length():
    assert micro_batches([5, 5, 9, 2, 2, 2], budget=12) == ([[2], [0, 1], [3, 4, 5]], 0)
    assert micro_batches([13], budget=12) == ([[0]], 0)  # a row alone may exceed the budget
    assert micro_batches([], budget=12) == ([], 0)
    lengths = [2, 10, 3, 9, 2, 10, 3, 9]  # prompt + completion lengths, long and short rows interleaved
    plan, pad = micro_batches(lengths, 40)
    assert sorted(i for rows in plan for i in rows) == list(range(8)) and pad == 0  # every row once
    assert all(len(rows) * max(lengths[i] for i in rows) <= 40 for rows in plan)
    padded = sum(len(rows) * max(lengths[i] for i in rows) for rows in plan)
    # rows in their order, 40 tokens a micro-batch: [2, 10, 3, 9] and [2, 10, 3, 9], 4 × 10 each
    assert plan == [[1, 5, 3, 7], [2, 6, 0, 4]] and padded == 52 < 80  # 28 pad tokens fewer


def test_collectives_hand_the_backend_tensors_on_the_run_device(monkeypatch):
    """NCCL rejects CPU tensors, gloo does not: infra's collectives move whatever they get to infra.DEVICE (here a
    fake device), and train.py / star.py reach torch.distributed only through infra."""
    seen = []
    monkeypatch.setattr(infra, "DEVICE", torch.device("meta"))
    monkeypatch.setattr(infra.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(infra.dist, "all_reduce", lambda x, op=None, group=None: seen.append((x.device.type, op)))
    for x in (3.0, 7, torch.tensor(1.5), torch.zeros(3)):
        assert infra.all_sum(x).device.type == "meta" and infra.all_sum(x, infra.dist.ReduceOp.MAX).device.type == "meta"
    assert [d for d, _ in seen] == ["meta"] * 8 and seen[1][1] == infra.dist.ReduceOp.MAX
    for name in ("train.py", "star.py"):
        assert "dist." not in open(os.path.join(ROOT, name)).read(), name


def test_a_loss_registered_in_grpo_trains_the_smoke_config(tmp_path):
    """A new policy loss is one function registered in grpo.PG_LOSSES: the Config accepts it, the
    checks pass, objective.py prints its formula, and rl_step trains with it. The toy surrogate is
    ½·ρ_t·Â_t: on the first RL step (ρ = 1, μ = 1) its gradient is exactly half the clip loss's, on
    the same samples (both runs share the SFT weights and seeds)."""
    calls = []

    @grpo.register("toy_half", "½ {rho} Â", "TOY")
    def toy_half(r: grpo.Ratios) -> grpo.Surrogate:
        calls.append(r.ratio.shape)
        return grpo.Surrogate(0.5 * r.ratio * r.adv, *grpo.outside(r), {})

    try:
        first = {}
        for loss in ("clip", "toy_half"):
            cfg = train.parse_args(["--config", SMOKE, f"--out_dir={tmp_path / loss}",
                                    f"--pg_loss={loss}", "--rl_steps=1", "--eval_n=4",
                                    "--overlong_buffer=24", "--threads=1"])
            checks.check_settings(cfg)
            train.main(cfg)
            first[loss] = next(r for r in records(tmp_path / loss) if "train/grad_norm" in r
                               and r["stage"] == "rl")
        assert train.objective(cfg).startswith("TOY: J = E[1/Σ|o_i| Σ_i Σ_t ½ ρ_t Â]"), train.objective(cfg)
        assert calls and first["toy_half"]["train/kept_groups_frac"] == 1
        assert first["toy_half"]["train/grad_norm"] == pytest.approx(
            0.5 * first["clip"]["train/grad_norm"], rel=1e-4)
        assert first["toy_half"]["train/loss"] == pytest.approx(0.5 * first["clip"]["train/loss"],
                                                                rel=1e-4, abs=1e-7)
    finally:
        del grpo.PG_LOSSES["toy_half"]
    with pytest.raises(SystemExit, match="toy_half"):
        train.parse_args(["--config", SMOKE, "--pg_loss=toy_half"])  # gone again: not a choice


def test_lr_schedule_is_stepped_once_per_rl_step_whatever_ppo_epochs(tmp_path):
    lrs = {}
    for mu in (1, 2):
        out = tmp_path / f"mu{mu}"
        # overlong_buffer = max_new_tokens: every completion's reward falls with its length, so groups have spread,
        # dynamic sampling keeps them all and every RL step runs the μ-epoch loop (no early return)
        train.main(train.parse_args(["--config", SMOKE, f"--out_dir={out}", f"--ppo_epochs={mu}", "--lr=1e-3",
                                     "--warmup_steps=2", "--eval_every=100", "--eval_n=4", "--ckpt_every=100",
                                     "--overlong_buffer=24"]))
        rl = [r for r in records(out) if r["stage"] == "rl" and "train/lr" in r]
        assert len(rl) == 4 and all(r["train/kept_groups_frac"] == 1 for r in rl), rl
        assert all(r["train/grad_norm"] > 0 and r["train/loss"] != 0 for r in rl), rl  # the loop ran and stepped
        lrs[mu] = [r["train/lr"] for r in rl]
    # 4 RL steps, warmup 2, cosine from step 2 to the floor 0.1 · lr at step 4: factor(s) after s steps
    assert lrs[1] == pytest.approx([1e-3, 1e-3, 0.55e-3, 1e-4]) and lrs[2] == lrs[1]


def test_phase_seconds_charges_each_phase_the_time_since_the_mark_before():
    marks = [("", 10.0), ("sample", 13.0), ("reward", 13.5), ("sample", 15.0), ("reward", 15.25), ("forward", 16.0),
             ("backward", 18.0), ("forward", 18.5), ("backward", 19.5), ("optimizer", 19.75)]
    assert phase_seconds(deque(marks)) == {"time/sample_s": 3 + 1.5, "time/reward_s": 0.5 + 0.25,
                                           "time/forward_s": 0.75 + 0.5, "time/backward_s": 2 + 1,
                                           "time/optimizer_s": 0.25}


def test_an_rl_step_marks_its_phases_in_the_order_they_run(tmp_path, monkeypatch):
    """Where a step's time goes (issue 50): per sampling try "sample" then "reward", per micro-batch "forward" then
    "backward", per epoch "optimizer" (ppo_epochs = 2, micro-batches small enough to split the batch); the logged
    phases are those marks' seconds, within the step's sampling and training times."""
    plans, marked, real = [], [], train.phase_seconds
    micro_batches = infra.micro_batches
    monkeypatch.setattr(infra, "micro_batches", lambda *a: plans.append(micro_batches(*a)) or plans[-1])
    monkeypatch.setattr(train, "phase_seconds", lambda laps: marked.append([p for p, _ in laps]) or real(laps))
    out = tmp_path / "phases"
    train.main(train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--ppo_epochs=2", "--micro_batch_tokens=64",
                                 "--eval_every=100", "--eval_n=4", "--ckpt_every=100", "--overlong_buffer=24"]))
    rl = [r for r in records(out) if r["stage"] == "rl" and "train/loss" in r]
    rl_plans = plans[-len(rl):]  # the SFT steps' plans came first, one per step
    assert len(rl) == len(marked) == 4
    for r, names, (plan, _) in zip(rl, marked, rl_plans):
        tries = int(r["train/sample_tries"])
        assert len(plan) > 1  # the batch is split
        assert names == [""] + ["sample", "reward"] * tries + (["forward", "backward"] * len(plan) + ["optimizer"]) * 2
        assert r["time/sample_s"] + r["time/reward_s"] <= r["time/rollout_s"] + 1e-3
        assert r["time/forward_s"] + r["time/backward_s"] + r["time/optimizer_s"] <= r["time/train_s"] + 1e-3
        assert min(r[f"time/{p}_s"] for p in ("sample", "reward", "forward", "backward", "optimizer")) > 0


def test_optimizer_step_clips_the_gradient_norm_before_adamw():
    # a gradient of norm 130 against grad_clip = 1: the step uses g · 1/130 (torch's clip_grad_norm_ divides by
    # norm + 1e-6). By hand: SGD moves w by exactly −lr · g_clipped; two AdamW steps (make_optimizer's) move w as
    # torch.optim.AdamW does when fed the clipped gradients (Adam's first step is nearly scale-free, the second
    # is not: its moments mix the two steps' gradients)
    cfg = train.parse_args(["--config", SMOKE, "--grad_clip=1.0", "--weight_decay=0.1", "--warmup_steps=0"])
    g1, g2 = torch.tensor([[50.0, -120.0], [0.0, 0.0]]), torch.tensor([[0.1, 0.2], [-0.3, 0.05]])  # |g2| < 1
    clipped = g1 / (130 + 1e-6)
    w0 = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    model = torch.nn.Linear(2, 2, bias=False)
    run = train.Run(cfg, infra.Proc(0, 1, torch.device("cpu")), model, None)

    with torch.no_grad():
        model.weight.copy_(w0)
    model.weight.grad = g1.clone()
    norm = train.optimizer_step(run, torch.optim.SGD(model.parameters(), lr=0.5))
    assert float(norm) == pytest.approx(130.0)  # the norm before clipping, as logged
    torch.testing.assert_close(model.weight.detach(), w0 - 0.5 * clipped, rtol=0, atol=1e-7)
    assert model.weight.grad is None  # zeroed for the next step

    with torch.no_grad():
        model.weight.copy_(w0)
    opt, _ = train.make_optimizer(run, 1e-2, 10)
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=0.1)
    for g, used in ((g1, clipped), (g2, g2)):
        model.weight.grad = g.clone()
        train.optimizer_step(run, opt)
        ref.grad = used.clone()
        ref_opt.step()
        torch.testing.assert_close(model.weight.detach(), ref.detach(), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_smoke_run_sft_then_rl(tmp_path):
    out = str(tmp_path / "run")
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--ckpt_every=5"])
    results = train.main(cfg)
    recs = records(out)
    steps = [r["step"] for r in recs if "train/loss" in r]
    assert steps == list(range(1, 11))
    assert recs[0]["stage"] == "base" and {r["stage"] for r in recs if 1 <= r["step"] <= 6} == {"sft"}
    assert recs[-1]["stage"] == "rl"
    rl = [r for r in recs if r["stage"] == "rl" and "train/reward" in r]
    assert len(rl) == 4 and all(0 <= r["train/reward"] <= 1 for r in rl)
    for r in rl:  # how the step's samples ended: fractions that add up
        assert abs(sum(r[f"train/finish_{f}"] for f in rollout.FINISH) - 1) < 1e-9
    assert any(r["train/finish_length"] > 0 for r in rl) and any(r["train/finish_stop"] > 0 for r in rl)
    evals = [r for r in recs if "eval/pass@1" in r]
    # the untrained baseline at step 0 (issue 13), then every 5 steps and at the end of each stage
    assert [r["step"] for r in evals] == [0, 5, 6, 10]
    for r in evals:
        assert all(0 <= r[k] <= 1 for k in ("eval/pass@1", "eval/pass@1_sampled", "eval/maj@4", "eval/truncated_frac"))
    assert set(results) == {"base", "sft", "rl"}
    # checkpoints are Hugging Face folders that our loader (and transformers) read
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "step_10", "step_5"]
    m = Transformer.from_pretrained(os.path.join(out, "step_10"))
    assert m.config.hidden_size == 32 and os.path.exists(os.path.join(out, "step_10", "tokenizer.json"))


def test_cpu_compile_samples_with_the_static_step_and_the_same_tokens(tmp_path, monkeypatch):
    """--cpu_compile=true routes train's sampling through the compiled step on CPU (here its plain-PyTorch body:
    decode.step without the compiler, as tests/test_rollout.py runs it), false never does, and the default, auto,
    does from decode.CPU_COMPILE_RL_STEPS planned RL steps (smoke.toml plans 4) unless rl_minutes times the run; the
    same groups every way."""
    calls = []
    monkeypatch.setattr(rollout, "compiled_step", lambda dev: lambda m, d: calls.append(len(d.tok)) or
                        decode.step(m, d))
    got = {}
    cases = (("false", 1, 0, False), ("true", 10**6, 0, True), ("auto", 5, 0, False), ("auto", 4, 0, True),
             ("auto", 4, 3, False))  # (cpu_compile, CPU_COMPILE_RL_STEPS, rl_minutes, compiled?)
    for flag, threshold, minutes, static in cases:
        monkeypatch.setattr(decode, "CPU_COMPILE_RL_STEPS", threshold)
        run = train.build_run(train.parse_args(["--config", SMOKE, f"--out_dir={tmp_path}", "--threads=1",
                                                f"--cpu_compile={flag}", f"--rl_minutes={minutes}"]))
        problems = [run.task.problem("rl", k) for k in range(3)]
        calls.clear()
        got[flag, threshold, minutes] = [(g.comps, g.scores)
                                         for g in train.sample_groups(run, problems, 4, 1.0, (0, 1))]
        assert bool(calls) == static, (flag, threshold, minutes, calls)
    first = got["false", 1, 0]
    assert all(v == first for v in got.values()) and any(len(c) > 1 for comps, _ in first for c in comps)
    with pytest.raises(SystemExit, match="cpu_compile"):
        train.parse_args(["--config", SMOKE, "--cpu_compile=yes"])


def run_cli(args, nproc=1, timeout=300, env=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + [os.path.join(ROOT, "train.py")] + args
    p = subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def one_and_two_ranks(args, tmp_path):
    """Run args on 1 rank (in this process: no start-up) and 2 gloo ranks: every RL step's gradient is nonzero, and
    every train/ (but the grad norm) and eval/ metric agrees within 1e-4."""
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'one'}"]))
    run_cli(args + [f"--out_dir={tmp_path / 'two'}"], nproc=2)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert len(one) == len(two)
    assert all(r["train/grad_norm"] > 1e-3 for r in one if r["stage"] == "rl" and "train/loss" in r)
    for a, b in zip(one, two):
        for k in a:
            if k.startswith("train/") and k != "train/grad_norm" or k.startswith("eval/"):
                assert abs(a[k] - b[k]) <= 1e-4, (k, a[k], b[k])


@pytest.mark.slow
@pytest.mark.parametrize("agg,P,extra", [
    ("token_mean", 4, []), ("seq_mean_token_mean", 3, []), ("seq_mean_token_sum_norm", 1, []),
    ("token_mean", 3, ["--adv_scale=reinforce_pp", "--tis=sequence", "--top_entropy_q=0.5", "--dual_clip=3",
                       "--kl_estimator=k2"]),  # whitening over the global batch's tokens, τ over its entropies
    ("seq_mean_token_mean", 3, ["--ratio_level=sequence", "--pg_loss=clip", "--adv_scale=rloo", "--tis=token",
                                "--tis_mode=mask", "--reward=process"]),
    ("token_mean", 1, ["--pg_loss=cispo", "--eps_low=1.0", "--kl_estimator=k1"]),
    ("token_mean", 3, ["--pg_loss=dppo_tv", "--eps_low=0.01", "--eps_high=0.01", "--kl_old=0.1", "--kl_in=reward",
                       "--cov=kl", "--cov_frac=0.1"]),  # KL in the reward and KL-Cov's picks over the global batch
    ("seq_mean_token_mean", 3, ["--pg_loss=gmpo", "--eps_low=0.1", "--eps_high=0.1", "--cov=clip", "--cov_frac=0.2",
                                "--cov_low=-100", "--cov_high=100"])])  # Clip-Cov's random draw, rank-invariant
def test_two_ranks_match_one_rank(tmp_path, agg, P, extra):
    """The same global batch on 2 gloo ranks (FSDP2) and on 1 rank: same rewards, losses and weights. With P = 3
    the ranks hold 2 and 1 groups, with P = 1 rank 1 holds none and runs padding passes only."""
    args = extra + ["--config", SMOKE, f"--agg={agg}", f"--prompts_per_step={P}", "--sft_steps=2", "--rl_steps=2",
                    "--eval_every=100",
            "--eval_n=8", "--ckpt_every=100", "--dynamic_sampling=false", "--lr=1e-3", "--beta=0.05", "--ppo_epochs=2",
            "--overlong_buffer=20"]  # length shaping gives every group reward spread even before the model is good
    one_and_two_ranks(args, tmp_path)
    wa, wb = (load_file(tmp_path / d / "step_4" / "model.safetensors") for d in ("one", "two"))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path):
    args = ["--config", SMOKE, "--sft_steps=4", "--rl_steps=8", "--ckpt_every=3", "--eval_every=4", "--keep_ckpts=0",
            "--overlong_buffer=20", "--train_size=6"]
    run_cli(args + [f"--out_dir={tmp_path / 'full'}"])
    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py")] + args + [f"--out_dir={out}"],
                         cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:  # kill once step 7 is logged (checkpoint at step 6)
        if os.path.exists(out / "step_6") and any(r["step"] >= 7 for r in records(out, live=True)):
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert p.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    run_cli(args + [f"--out_dir={out}", "--resume"])
    assert deterministic(records(out)) == deterministic(records(tmp_path / "full"))
    a = load_file(tmp_path / "full" / "step_12" / "model.safetensors")
    b = load_file(out / "step_12" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_steps_skip_then_stop_with_checkpoint_intact(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = train.grpo.sft_loss

    def poisoned(logp, mask, loss_scale=None):  # from the 3rd step on, the loss is NaN
        calls["n"] += 1
        loss = real(logp, mask, loss_scale=loss_scale)
        return loss * float("nan") if calls["n"] > 2 else loss
    monkeypatch.setattr(train.grpo, "sft_loss", poisoned)
    out = tmp_path / "nan"
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--ckpt_every=2", "--micro_batch_tokens=100000",
                            "--max_bad_steps=3", "--sft_steps=8"])
    with pytest.raises(RuntimeError, match="3 non-finite steps in a row"):
        train.main(cfg)
    assert infra.complete_checkpoints(out) == [2]  # steps 3-5 were skipped, nothing bad was saved
    m = Transformer.from_pretrained(out / "step_2")
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_nan_loss_with_finite_gradient_skips_the_rl_step_names_its_rows_and_stops(tmp_path, monkeypatch, capsys):
    """A NaN loss VALUE whose gradient is finite (loss + NaN constant) from the 2nd RL step on, in micro-batch 1:
    the optimizer must not step on it (before the guard it did, the gradient norm being finite), the console names
    the step, micro-batch and rows, train/bad_steps counts it, and after max_bad_steps the run stops with the last
    good checkpoint on disk."""
    real, seen, steps = train.grpo.policy_loss, {"step": 0, "b": 0}, {"n": 0}
    real_rl, real_step = train.rl_step, torch.optim.AdamW.step

    def rl_step(run, opt, sched, state, step):
        seen["step"], seen["b"] = step, 0
        return real_rl(run, opt, sched, state, step)

    def poisoned(*a, **kw):
        loss, met = real(*a, **kw)
        seen["b"] += 1
        return (loss + float("nan") if seen["step"] >= 4 and seen["b"] == 2 else loss), met

    def counted(self, *a, **kw):  # the steps that update: a skipped one calls step() without gradients
        steps["n"] += any(p.grad is not None for g in self.param_groups for p in g["params"])
        return real_step(self, *a, **kw)
    monkeypatch.setattr(train, "rl_step", rl_step)
    monkeypatch.setattr(train.grpo, "policy_loss", poisoned)
    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    out = tmp_path / "nan_rl"
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--sft_steps=2", "--rl_steps=4", "--ckpt_every=1",
                            "--overlong_buffer=20", "--micro_batch_tokens=200", "--max_bad_steps=2", "--eval_every=0"])
    with pytest.raises(RuntimeError, match="2 non-finite steps in a row"):
        train.main(cfg)
    assert steps["n"] == 3  # 2 SFT steps and RL step 3; steps 4 and 5 were skipped
    assert infra.complete_checkpoints(out) == [2, 3]
    text = capsys.readouterr().out
    assert "step 4, rank 0: non-finite loss in micro-batch 1 (epoch 0), rows " in text and "step 5, rank 0" in text
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [(r["step"], r["train/bad_steps"]) for r in recs if "train/bad_steps" in r] == [(4, 1)]


def test_a_non_finite_weight_never_reaches_the_sampler(tmp_path, monkeypatch):
    """An optimizer step that leaves an inf weight although the loss and gradient norm were finite (here: AdamW's
    step poisoned on the 3rd RL update): the run stops before any sampling with it, the sampler's copy is not
    refreshed, and the last checkpoint on disk is finite. Once with a sampling copy (LoRA: a merged copy), once
    with the policy sampling itself."""
    real_step, real_generate = torch.optim.AdamW.step, train.generate
    for extra in (["--lora_rank=4"], []):
        seen = {"updates": 0, "bad": False}

        def poisoned(self, *a, **kw):
            out = real_step(self, *a, **kw)
            updates = any(p.grad is not None for g in self.param_groups for p in g["params"])
            seen["updates"] += updates
            if updates and seen["updates"] == 5:  # 2 SFT steps, then the 3rd RL step
                with torch.no_grad():
                    self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
                seen["bad"] = True
            return out

        def generate(model, *a, **kw):
            assert not seen["bad"], "a sampler read non-finite weights"
            assert all(torch.isfinite(p).all() for p in model.parameters())
            return real_generate(model, *a, **kw)
        monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
        monkeypatch.setattr(train, "generate", generate)
        out = tmp_path / f"inf{len(extra)}"
        cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--sft_steps=2", "--rl_steps=4",
                                "--ckpt_every=1", "--dynamic_sampling=false", "--eval_every=0"] + extra)
        with pytest.raises(RuntimeError, match="1 of the policy's weights are not finite"):
            train.main(cfg)
        assert seen["bad"] and max(infra.complete_checkpoints(out)) == 4
        m = Transformer.from_pretrained(out / "step_4")
        assert all(torch.isfinite(p).all() for p in m.parameters())


def test_a_skipped_first_step_steps_the_schedule_without_torchs_warning(tmp_path, monkeypatch):
    """The first RL step's loss is NaN: the step is skipped (weights unchanged), the LR schedule still advances, and
    torch does not warn "lr_scheduler.step() before optimizer.step()" (it did: the skip never called opt.step)."""
    real = train.grpo.policy_loss
    monkeypatch.setattr(train.grpo, "policy_loss", lambda *a, **kw: (lambda r: (r[0] + float("nan"), r[1]))(
        real(*a, **kw)))
    out = tmp_path / "skip"
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--sft_steps=0", "--rl_steps=2", "--ckpt_every=0",
                            "--overlong_buffer=20", "--max_bad_steps=5", "--eval_every=0", "--eval_n=4",
                            "--warmup_steps=3"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.main(cfg)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    recs = [r for r in records(out) if "train/lr" in r]
    assert [r["train/bad_steps"] for r in recs] == [1, 2] and recs[0]["train/lr"] < recs[1]["train/lr"]  # warmup


class FakeRun:
    """A smoke-sized Run with no model: train.sample_groups is replaced by a fake sampler whose groups score
    `outcomes(pid)` (a list of G 0/1 rewards) per problem, and which records the problem ids it was asked for."""

    def __init__(self, monkeypatch, outcomes, **kw):
        cfg = train.parse_args(["--config", SMOKE] + [f"--{k}={v}" for k, v in kw.items()])
        self.run = train.Run(cfg, infra.Proc(0, 1, torch.device("cpu")), None,
                             tasks.Task(cfg, train.build_char_tokenizer(tasks.CHARS), [2]))
        self.state, self.asked = train.TrainState(), []

        def sample_groups(run, problems, G, temperature, keys, first=0, model=None):
            self.asked.append([pid for pid, _ in problems])
            return [train.Group(pos=j, pid=pid, problem=p, prompt=[1], comps=[[3]] * G, texts=["x"] * G,
                                logprobs=[torch.zeros(1)] * G, truncated=[False] * G,
                                scores=list(map(float, outcomes(pid))), rewards=list(map(float, outcomes(pid))))
                    for j, (pid, p) in enumerate(problems)]
        monkeypatch.setattr(train, "sample_groups", sample_groups)

    def collect(self, step):
        return train.dynamic_sampling(self.run, self.state, step)


def test_wandb_auto_follows_WANDB_MODE(monkeypatch, tmp_path):
    import wandb
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw["mode"]))
    monkeypatch.setattr(wandb, "login", lambda **kw: False)  # no stored credentials
    inits = []
    for env, want in [("disabled", []), ("offline", ["offline"]), ("online", ["online"]), (None, ["offline"])]:
        if env is None:
            monkeypatch.delenv("WANDB_MODE", raising=False)
        else:
            monkeypatch.setenv("WANDB_MODE", env)
        inits.clear()
        cfg = train.parse_args(["--config", SMOKE, "--wandb_mode=auto", f"--out_dir={tmp_path / str(env)}"])
        Logger(infra.Proc(0, 1, torch.device("cpu")), cfg.out_dir, {}, cfg.wandb_mode, "p", 0, 1).file.close()
        assert inits == want, env


def test_the_eta_honours_rl_minutes(tmp_path, capsys, monkeypatch):
    """A 200-step run timed by rl_minutes = 12: after 1 step of 60 s, the step count alone says 199 min to go;
    the console says what the clock allows (11 min), and without rl_minutes it keeps the step count's ETA."""
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    for minutes, want in ((12, "eta 11.0 min"), (0, "eta 199.0 min")):
        log = Logger(infra.Proc(0, 1, torch.device("cpu")), str(tmp_path / str(minutes)), {}, "disabled", "p", 0,
                     200)
        log.deadline = clock[0] + 60 * minutes if minutes else None
        clock[0] += 60
        log.log(1, "rl", {"train/loss": 0.0})
        clock[0] -= 60
        assert want in capsys.readouterr().out
        log.file.close()


def test_rl_minutes_counts_training_not_evaluations(tmp_path, monkeypatch):
    """rl_minutes = 1 with an evaluation after every step that takes 1000 s on the clock: the run still trains its
    4 RL steps (evaluations do not count), time/train_wall_s stays below a minute while time/wall_s passes 3000 s,
    and the eval record's training minute is the step's (the clock stopped while it ran)."""
    offset, real_time, real_row = [0.0], time.time, train.eval_row
    monkeypatch.setattr(time, "time", lambda: real_time() + offset[0])

    def slow_row(*a):  # each evaluation (16 problems) takes 16 · 62.5 s = 1000 s more
        offset[0] += 62.5
        return real_row(*a)
    monkeypatch.setattr(train, "eval_row", slow_row)
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={tmp_path}", "--sft_steps=0", "--rl_steps=4",
                            "--rl_minutes=1", "--eval_every=1", "--threads=1", "--ckpt_every=0"])
    train.main(cfg)
    recs = records(tmp_path)
    evals = [r for r in recs if "eval/pass@1" in r]
    assert [r["step"] for r in recs if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4]
    assert recs[-1]["time/wall_s"] > 3000 and recs[-1]["time/train_wall_s"] < 60
    steps = {r["step"]: r["time/train_wall_s"] for r in recs if "train/loss" in r}
    assert all(r["time/train_wall_s"] - steps[r["step"]] < 5 for r in evals[1:])


def test_dynamic_sampling_refills_to_the_configured_number_of_groups(monkeypatch):
    # even problem ids are informative (1 of 4 right), odd ids are all wrong: half of each draw is kept
    tr = FakeRun(monkeypatch, lambda pid: [1, 0, 0, 0] if pid % 2 == 0 else [0, 0, 0, 0],
                      prompts_per_step=4, max_sample_tries=4)
    kept, stats = tr.collect(step=1)
    assert len(kept) == 4 and all(g.pid % 2 == 0 for g in kept)
    # try 1 draws P = 4 (no rate yet; keeps 2, rate 1/2); try 2 draws for 2 missing at r = 1/2 with two standard
    # deviations to spare, ceil((2 + 2·sqrt(2·(1 − 1/2))) / (1/2)) = 8, and keeps 4: done, 6 kept of 12
    assert [len(a) for a in tr.asked] == [4, 8] and stats["train/sample_tries"] == 2
    assert stats["train/discarded_rollouts"] == (12 - 4) * 4  # all but P = 4 groups, G = 4 samples each
    assert stats["train/kept_groups_frac"] == 0.5
    # the next step's first try is sized by this step's keep rate: ceil((4 + 2·sqrt(4·(1/2))) / (1/2)) = 14
    kept, stats = tr.collect(step=2)
    assert len(tr.asked[2]) == 14 and len(kept) == 4 and stats["train/sample_tries"] == 1
    assert tr.state.keep_rate == 0.5 and tr.asked[2][0] == tr.asked[1][-1] + 1  # the stream goes on
    bare = FakeRun(monkeypatch, lambda pid: [1, 0, 0, 0] if pid % 2 == 0 else [0, 0, 0, 0], prompts_per_step=4,
                   max_sample_tries=4, sample_margin=0)  # no margin: ceil(missing / r), 2 / 0.5 then 4 / 0.5
    bare.collect(step=1)
    bare.collect(step=2)
    assert [len(a) for a in bare.asked] == [4, 4, 8]


def test_dynamic_sampling_gives_up_at_the_cap(monkeypatch):
    tr = FakeRun(monkeypatch, lambda pid: [1, 1, 1, 1], prompts_per_step=4, max_sample_tries=3)
    kept, stats = tr.collect(step=1)
    assert kept == [] and stats["train/sample_tries"] == 3 and len(tr.asked) == 3
    assert [len(a) for a in tr.asked] == [4, 16, 16]  # refills grow to the cap of 4·P per try
    tr.collect(step=2)  # nothing kept last step: the first try starts at the cap
    assert tr.state.keep_rate == 0 and len(tr.asked[3]) == 16
    one = FakeRun(monkeypatch, lambda pid: [1, 0, 0, 0] if pid % 2 == 0 else [0, 0, 0, 0], prompts_per_step=4,
                  max_sample_tries=1)  # one try a step: every draw is P, the size the memory plan assumes
    for step in range(3):
        one.collect(step)
    assert [len(a) for a in one.asked] == [4, 4, 4] and one.state.keep_rate == 0.5
    without = FakeRun(monkeypatch, lambda pid: [1, 1, 1, 1], prompts_per_step=4, dynamic_sampling=False)
    kept, stats = without.collect(step=1)
    assert len(kept) == 4 and stats["train/sample_tries"] == 1  # plain GRPO trains on whatever it drew


def test_pass_rate_memory_skips_a_prompt_after_k_saturated_visits(monkeypatch):
    # 3 training problems cycled; problem 0 is always solved by every sample, the others are mixed
    tr = FakeRun(monkeypatch, lambda pid: [1, 1, 1, 1] if pid == 0 else [1, 0, 1, 0],
                      prompts_per_step=3, train_size=3, skip_saturated_k=2, dynamic_sampling=False)
    seen = []
    for step in range(4):
        tr.collect(step)
        seen.append(tr.asked[-1])
    # visits 1 and 2 of problem 0 are saturated, so from its 3rd turn on it is skipped before any sampling
    assert seen[0] == [0, 1, 2] and seen[1] == [0, 1, 2] and 0 not in seen[2] + seen[3]
    _, stats = tr.collect(5)
    assert stats["train/skip_rate"] > 0


def test_cold_start_direct_answer_share_and_disjoint_heldout():
    cfg = train.Config(sft_direct_frac=0.5, sft_flaw_frac=0.0, eval_n=200)  # a correct teacher, half bare answers
    task = tasks.Task(cfg, train.build_char_tokenizer(tasks.CHARS), [2])
    demos = [task.cold_start_target(k, task.problem("sft", k)[1]) for k in range(2000)]
    direct = [d for d in demos if d.startswith("####")]
    assert 0.45 < len(direct) / len(demos) < 0.55  # a seeded coin per demo index
    assert demos == [task.cold_start_target(k, task.problem("sft", k)[1]) for k in range(2000)]  # and deterministic
    p = task.problem("sft", 3)[1]
    assert task.cold_start_target(3, p) in (p.solution, f"#### {p.gold}") and p.solution.endswith(f"#### {p.gold}")
    train_prompts = {task.problem("rl", k)[1].prompt for k in range(3000)}
    assert not train_prompts & task.heldout_prompts  # the held-out set is never trained on
    assert {p.level for p in task.heldout} == {2, 3, 4}



@pytest.mark.parametrize("flaw", ["sign", "random"])
def test_sloppy_teacher_share_and_answer_filter(flaw):
    kw = dict(sft_direct_frac=0.0, sft_flaw_frac=0.6, sft_flaw=flaw, eval_n=200)
    task = tasks.Task(train.Config(**kw), train.build_char_tokenizer(tasks.CHARS), [2])
    probs = [task.problem("sft", k)[1] for k in range(2000)]
    demos = [task.cold_start_target(k, p) for k, p in enumerate(probs)]
    assert demos == [task.cold_start_target(k, p) for k, p in enumerate(probs)]  # seeded per demo
    flawed = [d != p.solution for d, p in zip(demos, probs)]
    wrong = [verify.reward(d, p.gold) < 1 for d, p in zip(demos, probs)]
    assert flawed == wrong  # every altered demonstration ends on a wrong answer (the error is carried on)
    # random: 60% of the demos; sign: 60% of those whose chain goes below zero (about 42% of them)
    assert 0.55 < sum(wrong) / 2000 < 0.65 if flaw == "random" else 0.2 < sum(wrong) / 2000 < 0.3
    filt = tasks.Task(train.Config(**kw, sft_answer_filter=True), train.build_char_tokenizer(tasks.CHARS), [2])
    fprobs = [filt.problem("sft", k)[1] for k in range(2000)]
    assert all(verify.reward(filt.cold_start_target(k, p), p.gold) == 1 for k, p in enumerate(fprobs))
    assert all(q == p for q, p, w in zip(fprobs, probs, wrong) if not w)  # a right demonstration is kept as is
    assert not {p.prompt for p in fprobs} & filt.heldout_prompts
    direct = tasks.Task(train.Config(**{**kw, "sft_direct_frac": 1.0}), train.build_char_tokenizer(tasks.CHARS), [2])
    assert [direct.cold_start_target(k, p) for k, p in enumerate(probs[:200])] == \
        [d[d.index("####"):] for d in demos[:200]]  # a bare answer is the sloppy teacher's answer too


def test_sloppy_teacher_flaws_arithmetic_demonstrations_only():
    task = tasks.Task(train.Config(task="countdown", sft_flaw_frac=1.0, sft_direct_frac=0.0),
                      train.build_char_tokenizer(tasks.CHARS), [2])
    probs = [task.problem("sft", k)[1] for k in range(50)]
    assert [task.cold_start_target(k, p) for k, p in enumerate(probs)] == [p.solution for p in probs]
    with pytest.raises(SystemExit, match="sft_flaw"):
        train.parse_args(["--sft_flaw=typo"])

def test_rl_minutes_stops_the_run_with_a_final_eval_and_checkpoint(tmp_path):
    out = tmp_path / "timed"
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--rl_steps=10000", "--rl_minutes=0.001"])
    results = train.main(cfg)
    recs = records(out)
    last = max(r["step"] for r in recs)
    assert last < 6 + 10000 and recs[-1]["step"] == last and "eval/pass@1" in recs[-1]
    assert "rl" in results and infra.complete_checkpoints(out)[-1] == last


def test_eval_and_ckpt_every_zero_mean_only_at_the_ends(tmp_path):
    out = tmp_path / "ends"
    train.main(train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--eval_every=0", "--ckpt_every=0"]))
    assert [r["step"] for r in records(out) if "eval/pass@1" in r] == [0, 6, 10]  # baseline, end of SFT, end of RL
    assert infra.complete_checkpoints(out) == [10]


def test_process_reward_puts_each_step_reward_at_its_last_token():
    """reward = "process": per-step rewards (verify.step_rewards) at each step's last token, the outcome reward at
    the completion's last, normalised over the group's steps and summed over later steps (DeepSeekMath §4.1.3)."""
    cfg = train.parse_args(["--config", SMOKE, "--reward=process", "--group_size=2"])
    tok = train.build_char_tokenizer(tasks.CHARS)
    run = train.Run(cfg, infra.Proc(0, 1, torch.device("cpu")), None, tasks.Task(cfg, tok, [2]))
    texts = ["1+2=3;3+4=8 #### 8", "1+2=4 #### 4"]  # step 1 right then wrong; one wrong step
    comps = [tok.encode(x, add_special_tokens=False).ids + [2] for x in texts]
    g = train.Group(pos=0, pid=0, problem=None, prompt=[1], comps=comps, texts=texts, logprobs=[],
                    truncated=[False, False], scores=[0.0, 0.0], rewards=[0.0, 0.0])
    adv = objective.process_advantages(cfg, [g], torch.tensor(g.rewards), run.task)
    # steps: row 0 ends at chars 5 ("1+2=3") and 11 ("3+4=8"), rewards 1, 0, outcome 0 at token 18; row 1: 0 at 5,
    # outcome 0 at token 12. Over the group's 5 step rewards [1, 0, 0, 0, 0]: mean 0.2, std 0.4472
    norm = [(x - 0.2) / (0.4472136 + 1e-4) for x in (1, 0, 0, 0, 0)]
    want0 = [norm[0] + norm[1] + norm[2]] * 5 + [norm[1] + norm[2]] * 6 + [norm[2]] * 8
    want1 = [norm[3] + norm[4]] * 5 + [norm[4]] * 8
    assert adv.shape == (2, 19)
    assert torch.allclose(adv[0], torch.tensor(want0), atol=1e-5)
    assert torch.allclose(adv[1, :13], torch.tensor(want1), atol=1e-5)


QWEN_PRESET = os.path.join(ROOT, "configs", "qwen2.5-0.5b-gsm8k.toml")


def test_stop_ids_come_from_the_checkpoint(hf_folder, gsm8k_file, tmp_path):
    def stops(folder, **kw):
        cfg = train.Config(init_from=folder, task="gsm8k", train_file=gsm8k_file, eval_file=gsm8k_file, **kw)
        tok = train.load_tokenizer(folder)
        return [tok.id_to_token(i) for i in train.build_run(cfg).task.stop_ids]
    # the tokenizer's eos, then generation_config.json's eos_token_id (a list, or an int), no repeats
    assert stops(hf_folder("qwen")) == ["<|im_end|>", "<|endoftext|>"]
    assert stops(hf_folder("llama")) == ["<|eot_id|>", "<|end_of_text|>"]
    assert stops(hf_folder("qwen", base=True)) == ["<|endoftext|>"]
    assert stops(hf_folder("qwen", base=True), template="chat") == ["<|endoftext|>", "<|im_end|>"]  # + end of turn
    m = Transformer(train.ModelConfig(vocab_size=24, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1))
    m.save_pretrained(tmp_path / "char", tokenizer=train.build_char_tokenizer(tasks.CHARS))
    assert stops(str(tmp_path / "char")) == ["<eos>"]  # our own folder names its eos too
    for name in ("tokenizer_config.json", "generation_config.json"):
        os.remove(tmp_path / "char" / name)
    assert stops(str(tmp_path / "char")) == ["<eos>"]  # an older char folder: rollout.STOP_NAMES


@pytest.mark.slow
def test_qwen_preset_two_rl_steps_from_a_bf16_folder(hf_folder, gsm8k_file, tmp_path):
    """The Qwen2.5 preset from a bf16 Qwen2.5-Instruct-shaped folder; its step_N/ is that folder to transformers."""
    src, out = hf_folder("qwen", torch.bfloat16), tmp_path / "run"
    cfg = train.parse_args(["--config", QWEN_PRESET, f"--init_from={src}", f"--train_file={gsm8k_file}",
                            f"--eval_file={gsm8k_file}", f"--out_dir={out}", "--wandb_mode=disabled", "--rl_steps=2",
                            "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=8", "--overlong_buffer=4",
                            "--max_sample_tries=1", "--eval_n=2", "--eval_k=2", "--ckpt_every=4", "--sft_steps=2",
                            "--sft_batch_size=2"])  # a cold start on chat-rendered GSM8K solutions moves the weights
    assert cfg.template == "chat" and cfg.system_prompt.startswith("A conversation")
    train.main(cfg)
    recs = records(out)
    assert [(r["step"], r["stage"]) for r in recs if "train/loss" in r] == [(1, "sft"), (2, "sft"), (3, "rl"),
                                                                             (4, "rl")]
    assert recs[0]["step"] == 0 and recs[0]["stage"] == "base" and "eval/pass@1" in recs[0]
    step = out / "step_4"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (step / name).read_bytes() == open(os.path.join(src, name), "rb").read()
    weights, before = load_file(step / "model.safetensors"), load_file(os.path.join(src, "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert any(not torch.equal(weights[k], before[k]) for k in weights)  # trained, and still bf16
    tr = pytest.importorskip("transformers")
    a, b = tr.AutoTokenizer.from_pretrained(src), tr.AutoTokenizer.from_pretrained(step)
    assert type(a) is type(b) and a.special_tokens_map == b.special_tokens_map and a.chat_template == b.chat_template
    assert a.all_special_ids == b.all_special_ids and a.eos_token == b.eos_token == "<|im_end|>"
    eos = [tr.GenerationConfig.from_pretrained(d).eos_token_id for d in (src, step)]
    assert eos[0] == eos[1] == [402, 400]  # <|im_end|>, <|endoftext|>
    assert tr.AutoModelForCausalLM.from_pretrained(step).dtype == torch.bfloat16
    hf = tr.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(step, dtype=torch.float32).eval()
    idx = torch.tensor([b.apply_chat_template([{"role": "user", "content": "How many clips?"}],
                                              add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)).abs().max() < 1e-5


REFRESH = """
import sys, torch
sys.path.insert(0, {root!r})
import infra
from model import ModelConfig, Transformer
proc = infra.setup("cpu", 1)
torch.manual_seed(0)
model = infra.shard(Transformer(ModelConfig(vocab_size=23, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                            intermediate_size=48, max_seq_len=32)), proc)
copy = infra.frozen_copy(model, proc.device)
before, ptrs = copy.state_dict(), [p.data_ptr() for p in copy.parameters()]
before = {{k: v.clone() for k, v in before.items()}}
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
idx = torch.randint(0, 23, (4, 9), generator=torch.Generator().manual_seed(1))
model(idx).logsumexp(-1).mean().backward()
opt.step()
infra.refresh(copy, model, lazy=True)  # what an optimizer step does: mark the copy stale, gather nothing yet
assert copy.stale and all(torch.equal(copy.state_dict()[k], v) for k, v in before.items()), "a lazy refresh gathered"
assert infra.sampling(copy, model) is copy and not copy.stale  # the next sampling gathers, once
full = infra.full_state(model, rank0_only=False)[0]
assert ptrs == [p.data_ptr() for p in copy.parameters()], "refresh moved the copy's tensors"
assert all(torch.equal(copy.state_dict()[k], v) for k, v in full.items()), "copy != trained weights"
assert not any(torch.equal(before[k], v) for k, v in full.items() if "norm" not in k), "no step was taken"
if proc.rank == 0:
    torch.save(copy.state_dict(), sys.argv[1])
infra.teardown()
"""


@pytest.mark.slow
def test_sampling_copy_equals_the_trained_weights_at_1_and_2_ranks(tmp_path):
    """The plain sampling copy, marked stale by an AdamW step of the (FSDP2-sharded at 2 gloo ranks) policy and
    refreshed in place before sampling, equals the full trained weights on every rank, keeps its tensors' addresses,
    and 2 ranks train what 1 rank does."""
    script = tmp_path / "refresh.py"
    script.write_text(REFRESH.format(root=ROOT))
    for n in (1, 2):
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if n == 2 \
            else [sys.executable]
        p = subprocess.run(launch + [str(script), str(tmp_path / f"w{n}.pt")], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    one, two = (torch.load(tmp_path / f"w{n}.pt") for n in (1, 2))
    assert one.keys() == two.keys() and max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6


def test_rows_the_sampler_ends_at_non_finite_logits_are_counted(tmp_path, monkeypatch):
    build, gen, ended = train.build_run, train.generate, []

    def poisoned_build(cfg, adapter=""):  # batch row 0's final hidden state turns NaN at every decode step (length-1 input)
        run = build(cfg, adapter)
        run.model.model.norm.register_forward_hook(
            lambda m, i, out: out.index_fill(0, torch.tensor([0]), float("nan")) if out.shape[1] == 1 else out)
        return run

    def counted(*a, **kw):  # the rows each RL sampling call ended, counted from the Rollout itself
        ro = gen(*a, **kw)
        if inspect.stack()[2].function == "dynamic_sampling":
            ended.append(float(ro.nonfinite.sum()))
            assert ro.truncated[ro.nonfinite].all() and torch.isfinite(ro.logprobs[ro.completion_mask]).all()
        return ro
    monkeypatch.setattr(train, "build_run", poisoned_build)
    monkeypatch.setattr(train, "generate", counted)
    out = tmp_path / "nan_rows"
    train.main(train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--rl_steps=2", "--dynamic_sampling=false"]))
    rl = [r for r in records(out) if r["stage"] == "rl" and "train/loss" in r]
    assert len(ended) == 2 and min(ended) >= 1  # one sampling call per step; compaction moves rows into slot 0
    cfg = train.parse_args(["--config", SMOKE])  # no filter: every step's samples are P·G rows
    assert [round(r["train/finish_nonfinite"] * cfg.prompts_per_step * cfg.group_size) for r in rl] == ended
    assert all(math.isfinite(r["train/loss"]) for r in rl)

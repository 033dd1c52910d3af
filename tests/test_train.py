"""train.py: config errors, a few steps of sft then rl, checkpoints, 2-rank equivalence, kill-and-resume."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import infra
import tasks
import train
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f]


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
    assert train.objective(train.Config()).startswith("DAPO")
    assert train.objective(train.Config(agg="seq_mean_token_mean", eps_high=0.2, beta=0.04)).startswith("GRPO")
    assert train.objective(train.Config(adv_scale="none", agg="seq_mean_token_sum_norm")).startswith("Dr. GRPO")


def test_micro_batches_respect_budget_and_pad():
    mb = train.micro_batches([5, 5, 9, 2, 2, 2], budget=12)
    assert mb == [[0, 1], [2], [3, 4, 5]]
    assert train.micro_batches([5], 12, n_micro=3) == [[0], [], []]


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


def run_cli(args, nproc=1, timeout=300):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + [os.path.join(ROOT, "train.py")] + args
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_two_ranks_match_one_rank(tmp_path, agg):
    """The same global batch on 2 gloo ranks (FSDP2) and on 1 rank: same rewards, losses and weights."""
    args = ["--config", SMOKE, f"--agg={agg}", "--sft_steps=2", "--rl_steps=2", "--eval_every=100",
            "--eval_n=8", "--ckpt_every=100", "--dynamic_sampling=false", "--lr=1e-3", "--beta=0.05", "--ppo_epochs=2",
            "--overlong_buffer=20"]  # length shaping gives every group reward spread even before the model is good
    run_cli(args + [f"--out_dir={tmp_path / 'one'}"])
    run_cli(args + [f"--out_dir={tmp_path / 'two'}"], nproc=2)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert len(one) == len(two) and all(r["train/grad_norm"] > 1e-3 for r in one if r["stage"] == "rl" and "train/loss" in r)
    for a, b in zip(one, two):
        for k in a:
            if k.startswith("train/") and k != "train/grad_norm" or k.startswith("eval/"):
                assert abs(a[k] - b[k]) <= 1e-4, (k, a[k], b[k])
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
        if os.path.exists(out / "step_6") and any(r["step"] >= 7 for r in records(out)):
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


class FakeRun:
    """A smoke-sized Run with no model: train.sample_groups is replaced by a fake sampler whose groups score
    `outcomes(pid)` (a list of G 0/1 rewards) per problem, and which records the problem ids it was asked for."""

    def __init__(self, monkeypatch, outcomes, **kw):
        cfg = train.parse_args(["--config", SMOKE] + [f"--{k}={v}" for k, v in kw.items()])
        self.run = train.Run(cfg, infra.Proc(0, 1, torch.device("cpu")), None,
                             tasks.Task(cfg, train.build_char_tokenizer(tasks.CHARS), [2]))
        self.state, self.asked = train.TrainState(), []

        def sample_groups(run, problems, G, temperature, seed_keys, max_new_tokens):
            self.asked.append([pid for pid, _ in problems])
            return [train.Group(j, pid, p, [1], [[3]] * G, ["x"] * G, [torch.zeros(1)] * G, [False] * G,
                                list(map(float, outcomes(pid)))) for j, (pid, p) in enumerate(problems)]
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
        infra.Logger(infra.Proc(0, 1, torch.device("cpu")), cfg.out_dir, {}, cfg.wandb_mode, "p", 0, 1).file.close()
        assert inits == want, env


def test_dynamic_sampling_refills_to_the_configured_number_of_groups(monkeypatch):
    # even problem ids are informative (1 of 4 right), odd ids are all wrong: half of each draw is kept
    tr = FakeRun(monkeypatch, lambda pid: [1, 0, 0, 0] if pid % 2 == 0 else [0, 0, 0, 0],
                      prompts_per_step=4, max_sample_tries=4)
    kept, stats = tr.collect(step=1)
    assert len(kept) == 4 and all(g.pid % 2 == 0 for g in kept)
    # try 1 draws 4 (keeps 2, rate 1/2); try 2 draws ceil(2 / 0.5) = 4 more and keeps 2: done
    assert [len(a) for a in tr.asked] == [4, 4] and stats["train/sample_tries"] == 2
    assert stats["train/discarded_rollouts"] == 4 * 4  # the 4 all-wrong groups of G = 4
    assert stats["train/kept_groups_frac"] == 0.5


def test_dynamic_sampling_gives_up_at_the_cap(monkeypatch):
    tr = FakeRun(monkeypatch, lambda pid: [1, 1, 1, 1], prompts_per_step=4, max_sample_tries=3)
    kept, stats = tr.collect(step=1)
    assert kept == [] and stats["train/sample_tries"] == 3 and len(tr.asked) == 3
    assert [len(a) for a in tr.asked] == [4, 16, 16]  # refills grow to the cap of 4·P per try
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
    cfg = train.Config(sft_direct_frac=0.5, eval_n=200)
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


def test_rl_minutes_stops_the_run_with_a_final_eval_and_checkpoint(tmp_path):
    out = tmp_path / "timed"
    cfg = train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--rl_steps=10000", "--rl_minutes=0.001"])
    results = train.main(cfg)
    recs = records(out)
    last = max(r["step"] for r in recs)
    assert last < 6 + 10000 and recs[-1]["step"] == last and "eval/pass@1" in recs[-1]
    assert "rl" in results and infra.complete_checkpoints(out)[-1] == last


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

"""distill.py: on-policy distillation's per-token advantage (hand values, the gradient against a float64 loop), the
exact full-vocabulary KL, and train.py runs with a teacher (micro-batch and rank invariance, a teacher equal to the
student gives no gradient, a teacher with another tokenizer is refused)."""
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import records

import checks
import distill
import grpo
import infra
import tasks
import train
from model import ModelConfig, Transformer, build_char_tokenizer
from rollout import completion_logprobs, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def smoke_folder(path, seed: int, chars: str = tasks.CHARS) -> str:
    """A random model of the smoke config's shape with the char tokenizer (of `chars`), as a Hugging Face folder."""
    tok = build_char_tokenizer(chars)
    torch.manual_seed(seed)
    Transformer(ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                            intermediate_size=64, max_seq_len=64)).save_pretrained(str(path), tokenizer=tok)
    return str(path)


def rl_records(out_dir):
    return [r for r in records(out_dir) if r["stage"] == "rl" and "train/loss" in r]


def test_opd_advantage_hand_computed():
    adv = torch.tensor([1.0, -0.5])
    teacher = torch.tensor([[-0.1, -2.0, -0.7], [-1.0, -0.2, 0.0]])
    old = torch.tensor([[-0.5, -1.0, -0.7], [-0.3, -0.2, -9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = distill.opd_advantage(adv, teacher, old, mask, 0.5)
    # row 0: 1 + 0.5·(0.4, −1.0, 0.0); row 1: −0.5 + 0.5·(−0.7, 0.0), padding keeps −0.5
    assert torch.allclose(out, torch.tensor([[1.2, 0.5, 1.0], [-0.85, -0.5, -0.5]]))
    tok = torch.tensor([[0.3, 0.1, 0.0], [0.2, 0.4, 0.0]])  # a per-token verifier advantage (process reward)
    assert torch.allclose(distill.opd_advantage(tok, teacher, old, mask, 2.0),
                          tok + torch.tensor([[0.8, -2.0, 0.0], [-1.4, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="adv"):
        distill.opd_advantage(adv[:1], teacher, old, mask, 1.0)


@pytest.mark.parametrize("agg", grpo.AGGS)
def test_gradient_matches_a_float64_loop(agg):
    """∂loss/∂log π_θ(o_t) of policy_loss with the OPD advantage, against a loop over tokens: PPO-clip's min with
    Â_t = Â_i + w (log π_T − log π_old)_t, ρ_t off-policy, the aggregation's normaliser written out."""
    g = torch.Generator().manual_seed(0)
    N, L, w, eps_l, eps_h = 4, 5, 0.7, 0.2, 0.28
    old = -torch.rand(N, L, generator=g, dtype=torch.float64) * 2
    logp = (old + 0.3 * torch.randn(N, L, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = -torch.rand(N, L, generator=g, dtype=torch.float64) * 2
    mask = torch.arange(L) < torch.tensor([5, 3, 1, 4])[:, None]
    adv_i = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    a = distill.opd_advantage(adv_i, teacher, old, mask, w).double()
    loss, _ = grpo.policy_loss(logp, old, a, mask, eps_low=eps_l, eps_high=eps_h, agg=agg, max_len=L)
    grad, = torch.autograd.grad(loss, logp)
    want = torch.zeros(N, L, dtype=torch.float64)
    n_tok, n_seq = int(mask.sum()), int(mask.any(1).sum())
    for i in range(N):
        for t in range(L):
            if not mask[i, t]:
                continue
            A = float(adv_i[i]) + w * (float(teacher[i, t]) - float(old[i, t]))
            rho = float(torch.exp(logp[i, t].detach() - old[i, t]))
            clipped = A > 0 and rho > 1 + eps_h or A < 0 and rho < 1 - eps_l  # min() takes the constant
            d = 0.0 if clipped else -A * rho  # ∂(−ρA)/∂log π = −ρA
            norm = {"token_mean": n_tok, "seq_mean_token_mean": n_seq * int(mask[i].sum()),
                    "seq_mean_token_sum_norm": N * L}[agg]
            want[i, t] = d / norm
    assert torch.allclose(grad, want, atol=1e-12)


def test_a_teacher_equal_to_pi_old_gives_zero_gradient():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=g)
    logp = old.clone().requires_grad_()
    mask = torch.ones(3, 4, dtype=torch.bool)
    a = distill.opd_advantage(torch.zeros(3), old.clone(), old, mask, 1.0)
    loss, _ = grpo.policy_loss(logp, old, a, mask, agg="token_mean")
    assert torch.equal(torch.autograd.grad(loss, logp)[0], torch.zeros(3, 4))


def test_exact_kl_against_a_float64_loop():
    """distill.teacher_logprobs with the exact KL: Σ_v π(v) log(π(v)/π_T(v)) at each completion position, π at T = 0.8
    with top-k 3 (the sampling distribution), π_T tempered only, and log π_T(o_t), against full forwards of each
    prompt + completion, one at a time; log π_T bitwise rollout.completion_logprobs' (the path without exact KL)."""
    torch.manual_seed(0)
    cfgs = dict(vocab_size=7, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=32,
                max_seq_len=32)
    student, teacher = Transformer(ModelConfig(**cfgs)), Transformer(ModelConfig(**cfgs))
    run = SimpleNamespace(cfg=SimpleNamespace(temperature=0.8, top_k=3, top_p=1.0), proc=SimpleNamespace(
        device=torch.device("cpu")), model=student, teacher=teacher, sampler=None)
    prompts, comps = [[1, 2, 3], [4], [5, 6]], [[2, 2], [3, 1, 0, 6], [1]]
    ps, cs = [prompts[i] for i in (2, 0, 1)], [comps[i] for i in (2, 0, 1)]
    got = distill.teacher_logprobs(run, ps, cs)
    with torch.no_grad():
        want_logp = completion_logprobs(teacher, ps, cs, 0.8)[0]
        assert torch.equal(got.logp, want_logp)
        for row, i in enumerate([2, 0, 1]):
            seq = torch.tensor([prompts[i] + comps[i]])
            zs, zt = (m(seq)[0].double() / 0.8 for m in (student, teacher))
            for t in range(4):
                if t >= len(comps[i]):
                    assert got.kl_exact[row, t] == 0 and got.logp[row, t] == 0
                    continue
                p = len(prompts[i]) - 1 + t
                z = zs[p].clone()
                z[z < z.topk(3).values[-1]] = -float("inf")
                ls, lt = z.log_softmax(-1), zt[p].log_softmax(-1)
                want = sum(float(ls[v].exp() * (ls[v] - lt[v])) for v in range(7) if ls[v] > -float("inf"))
                assert abs(float(got.kl_exact[row, t]) - want) < 1e-5
                assert abs(float(got.logp[row, t]) - float(lt[comps[i][t]])) < 1e-5


def test_tokenizer_mismatch_names_both_folders(tmp_path, hf_folder):
    qwen = hf_folder()  # a byte-level BPE: not the fresh model's character tokenizer
    with pytest.raises(ValueError, match=f"teacher '{qwen}' and student \\(the fresh model's character tokenizer\\)"):
        train.build_run(train.parse_args(["--config", SMOKE, f"--teacher={qwen}", "--device=cpu"]))
    other = smoke_folder(tmp_path / "digits", 0, "0123456789+-*=#; ")  # a char tokenizer with other ids
    student = smoke_folder(tmp_path / "student", 0)
    with pytest.raises(ValueError, match=f"teacher '{other}' and student \\({student}\\) have different tokenizers"):
        train.build_run(train.parse_args(["--config", SMOKE, f"--teacher={other}", f"--init_from={student}"]))
    with pytest.raises(ValueError, match=f"teacher = '{tmp_path / 'missing'}': no such folder"):  # cli.UserError
        train.build_run(train.parse_args(["--config", SMOKE, f"--teacher={tmp_path / 'missing'}"]))
    with pytest.raises(ValueError, match="dynamic_sampling = false"):
        train.build_run(train.parse_args(["--config", SMOKE, f"--teacher={student}", "--reward=none"]))
    pure = ["--config", SMOKE, f"--teacher={student}", "--reward=none", "--dynamic_sampling=false", "--task=countdown"]
    checks.check(train.parse_args(pure))  # pure distillation needs no checkable steps: any task
    with pytest.raises(ValueError, match="reward = 'process' needs task = 'arithmetic'"):
        checks.check(train.parse_args(pure[:-3] + ["--reward=process", "--task=countdown"]))


def opd_args(tmp_path, *extra):
    teacher = smoke_folder(tmp_path / "teacher", seed=7)
    return ["--config", SMOKE, f"--teacher={teacher}", "--sft_steps=2", "--rl_steps=2", "--eval_every=100",
            "--eval_n=4", "--ckpt_every=100", "--dynamic_sampling=false", "--lr=1e-3", "--opd_weight=0.5",
            "--prompts_per_step=3", "--overlong_buffer=20", *extra]


def test_a_teacher_equal_to_the_student_gives_no_gradient(tmp_path):
    student = smoke_folder(tmp_path / "student", seed=3)
    other = smoke_folder(tmp_path / "other", seed=4)
    recs = []
    for teacher, out in ((student, "o"), (other, "p")):  # the student itself, then another teacher
        train.main(train.parse_args(["--config", SMOKE, f"--init_from={student}", f"--teacher={teacher}",
                                     "--sft_steps=0", "--rl_steps=1", "--reward=none", "--dynamic_sampling=false",
                                     f"--out_dir={tmp_path / out}", "--eval_n=4"]))
        recs += rl_records(tmp_path / out)
    same, learns = recs
    assert same["train/opd_kl"] == 0 and same["train/opd_kl_exact"] == 0 and same["train/grad_norm"] == 0
    assert learns["train/opd_kl_exact"] > 0.01 and learns["train/grad_norm"] > 1e-3  # another teacher: it learns


def test_micro_batch_split_changes_nothing(tmp_path):
    """The teacher's per-token term beside the verifier's Â (length shaping gives every group reward spread), μ = 2,
    in micro-batches of one row and in one of all rows: the same losses, KLs and weights."""
    args = opd_args(tmp_path, "--agg=seq_mean_token_mean", "--ppo_epochs=2")
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'one'}"]))
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'many'}", "--micro_batch_tokens=64"]))
    one, many = rl_records(tmp_path / "one"), rl_records(tmp_path / "many")
    assert len(one) == 2 and all(r["train/grad_norm"] > 1e-3 and r["train/opd_kl_exact"] > 0 for r in one)
    for a, b in zip(one, many):
        for k in ("train/loss", "train/opd_kl", "train/opd_kl_exact", "train/grad_norm", "train/entropy"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1, abs(a[k])), (k, a[k], b[k])
    wa, wb = (load_file(tmp_path / d / "step_4" / "model.safetensors") for d in ("one", "many"))
    # Adam's normalised step turns rounding-level differences of near-zero gradient entries into ~1e-5 (lr 1e-3)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


def test_one_teacher_forward_per_micro_batch_feeds_both(tmp_path, monkeypatch):
    """With the exact KL logged (V ≤ EXACT_KL_MAX_V), one forward of the teacher per micro-batch of epoch 0 gives both
    log π_T(o_t) and the full-vocabulary KL; the losses, gradient norms, sampled-token KL and weights are those of a
    run without the exact KL (EXACT_KL_MAX_V = 0: log π_T from rollout.completion_logprobs, a path the exact KL
    never took)."""
    counts = {"forward": 0, "micro_batches": 0}
    load, plan = distill.load_teacher, infra.micro_batches

    def counted_teacher(*a):
        teacher = load(*a)
        forward = teacher.forward

        def counted(*x, **k):
            counts["forward"] += 1
            return forward(*x, **k)
        teacher.forward = counted
        return teacher

    def counted_plan(*a):
        out = plan(*a)
        counts["micro_batches"] += len(out[0])
        return out
    monkeypatch.setattr(distill, "load_teacher", counted_teacher)
    monkeypatch.setattr(infra, "micro_batches", counted_plan)
    args = opd_args(tmp_path, "--ppo_epochs=2", "--micro_batch_tokens=64", "--rl_steps=3", "--sft_steps=0",
                    "--teacher_pass_every=0")  # RL only; no teacher generate
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'exact'}"]))
    assert counts["micro_batches"] > 3 and counts["forward"] == counts["micro_batches"]  # one per micro-batch, 3 steps
    monkeypatch.setattr(distill, "EXACT_KL_MAX_V", 0)
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'sampled'}"]))
    exact, sampled = rl_records(tmp_path / "exact"), rl_records(tmp_path / "sampled")
    assert len(exact) == 3 and all(r["train/opd_kl_exact"] > 0 and "train/opd_kl_exact" not in s
                                   for r, s in zip(exact, sampled))
    for a, b in zip(exact, sampled):
        for k in ("train/loss", "train/opd_kl", "train/grad_norm", "train/entropy", "train/reward"):
            assert a[k] == b[k], (k, a[k], b[k])
    wa, wb = (load_file(tmp_path / d / "step_3" / "model.safetensors") for d in ("exact", "sampled"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def hashes_then(path, digit: str, sharp: float = 1.0) -> str:
    """A hand-made teacher whose greedy completion of any prompt is "#" up to position 16, `digit` at 17, then <eos>:
    "####...#7", the answer `digit` whatever the problem. One layer: one-hot embeddings; q = k = 0, so attention is
    uniform over the row's tokens, and v carries only <bos>, which makes the residual's dimension 24 a = √C / (t + 1) at
    position t; no MLP; an untied head gives "#" after any token but "#" or the digit, after "#" the digit once
    a < √C / 16.5 (from the token at t = 16 on), and <eos> after the digit. sharp scales the head: at sharp = 10
    sampling at T = 1 gives "#" * k + digit, k ≥ 4, with the digit's position random near t = 17 only."""
    tok = build_char_tokenizer(tasks.CHARS)
    V, C, ids = tok.get_vocab_size(), 32, tok.get_vocab()
    m = Transformer(ModelConfig(vocab_size=V, hidden_size=C, n_layers=1, n_heads=2, n_kv_heads=1,
                                intermediate_size=8, max_seq_len=64, tie_embeddings=False))
    h, d, a0 = ids["#"], ids[digit], C ** 0.5 / 16.5
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                mod.weight.zero_()
        m.model.embed_tokens.weight[:, :V] = torch.eye(V)
        m.model.layers[0].self_attn.v_proj.weight[0, ids["<bos>"]] = 1.0  # rmsnorm(e_bos) = √C e_bos: v = √C
        m.model.layers[0].self_attn.o_proj.weight[24, 0] = 1.0
        w = m.lm_head.weight                                                 # [V, C]
        w[h, :V] = 2.0
        w[h, h] = w[h, d] = 0.0
        w[h, 24] = 1 / a0  # after "#": logit("#") = a / a0 against logit(digit) = 1
        w[d, h] = 1.0
        w[ids["<eos>"], d] = 3.0
        w *= sharp
    m.save_pretrained(str(path), tokenizer=tok)
    return str(path)


def test_teacher_pass_against_the_golds(tmp_path):
    """train/teacher_pass with a teacher that answers `digit` to every problem: the share of each logged step's P
    prompts (the RL stream's, in order, without dynamic sampling) whose gold is that digit; logged every 2nd step."""
    args = ["--config", SMOKE, f"--init_from={smoke_folder(tmp_path / 's', 3)}", "--sft_steps=0", "--rl_steps=4",
            "--dynamic_sampling=false", "--prompts_per_step=8", "--rl_min_ops=2", "--rl_max_ops=2",
            "--max_operand=4", "--eval_n=4", "--teacher_pass_every=2", "--opd_weight=0", f"--out_dir={tmp_path / 'o'}"]
    run = train.build_run(train.parse_args(args))
    golds = [[run.task.problem("rl", i)[1].gold for i in range(8 * (s - 1), 8 * s)] for s in (1, 2, 3, 4)]
    digit = Counter(g for gs in golds for g in gs if g in "0123456789").most_common(1)[0][0]
    teacher = hashes_then(tmp_path / "t", digit)
    model = Transformer.from_pretrained(teacher)
    prompts = [run.task.prompt_ids(run.task.problem("rl", i)[1]) for i in range(3)]
    ro = generate(model, prompts, 1, 24, temperature=0.0, stop_ids=run.task.stop_ids)
    assert [run.task.text(ro.completion_ids[i][ro.completion_mask[i]].tolist()) for i in range(3)] == [
        "#" * (17 - len(p)) + digit for p in prompts]  # the construction: "#" at positions len(p)..16, then digit
    train.main(train.parse_args(args + [f"--teacher={teacher}"]))
    got = {r["step"]: r.get("train/teacher_pass") for r in rl_records(tmp_path / "o")}
    want = [sum(g == digit for g in gs) / 8 for gs in golds]
    assert got == {1: None, 2: want[1], 3: None, 4: want[3]} and 0 < want[1] + want[3] < 2, (got, want, digit)


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    """P = 3 groups on 2 gloo ranks (FSDP2; the teacher a plain copy on each) and on 1: the same log and weights;
    the teacher's pass rate (step 4) from its prompts split 2 + 1 over the ranks."""
    args = opd_args(tmp_path, "--teacher_pass_every=4")
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'one'}"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py")] + args + [f"--out_dir={tmp_path / 'two'}"]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    one, two = rl_records(tmp_path / "one"), rl_records(tmp_path / "two")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for k in ("train/loss", "train/opd_kl", "train/opd_kl_exact", "train/reward", "train/teacher_pass"):
            assert abs(a.get(k, -1) - b.get(k, -1)) <= 1e-4, (k, a.get(k), b.get(k))
    assert "train/teacher_pass" in one[1] and "train/teacher_pass" not in one[0]
    wa, wb = (load_file(tmp_path / d / "step_4" / "model.safetensors") for d in ("one", "two"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_opd_preset_composes_with_smoke_and_prints_its_formula(tmp_path):
    opd = os.path.join(ROOT, "configs", "opd.toml")
    cfg = train.parse_args(["--config", SMOKE, "--config", opd])
    assert (cfg.teacher, cfg.opd_weight, cfg.dynamic_sampling, cfg.n_layers) == ("runs/smoke/step_5", 1.0, False, 1)
    text = train.objective(cfg)
    assert text.startswith("DAPO + on-policy distillation:") and "Â_t += 1·(log π_T(o_t) − log π_old(o_t))" in text
    pure = train.objective(train.Config(teacher="t", reward="none", dynamic_sampling=False, opd_weight=0.5))
    assert pure.startswith("on-policy distillation:") and "Â_i = 0 (reward off),  Â_t += 0.5·(log π_T" in pure
    assert "π_T" not in train.objective(train.Config(teacher="t", opd_weight=0.0))  # a teacher only measured
    cfg = train.parse_args(["--config", SMOKE, "--config", opd, f"--teacher={smoke_folder(tmp_path / 't', 5)}",
                            f"--out_dir={tmp_path / 'o'}", "--sft_steps=2", "--rl_steps=2", "--eval_n=4"])
    train.main(cfg)
    assert [r["step"] for r in rl_records(tmp_path / "o")] == [3, 4]
    assert all(r["train/opd_kl_exact"] > 0 for r in rl_records(tmp_path / "o"))

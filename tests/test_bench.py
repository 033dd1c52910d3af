"""tools/bench.py's full-vocabulary log-probs and entropy (its --logprobs baseline, the path before
rollout's chunked head) against naive float64 ones."""
import pytest
import torch

import rollout
from tools import bench


def test_token_logprobs_chunked_and_differentiable():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 4, 11, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 11, (5, 4), generator=g)
    expect = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    for chunk in (1, 2, 3, 5, 8):  # 2 and 3 do not divide B = 5
        got = bench.token_logprobs(logits, targets, chunk=chunk)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expect.float())
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    g1, = torch.autograd.grad((expect * w).sum(), logits)
    g2, = torch.autograd.grad((bench.token_logprobs(logits, targets, chunk=2).double() * w).sum(), logits)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    # a non-contiguous bf16 slice, as a model's logits[:, :-1] would be
    half = torch.randn(3, 6, 11, generator=g).bfloat16()[:, :-1]
    tgt = torch.randint(0, 11, (3, 5), generator=g)
    torch.testing.assert_close(bench.token_logprobs(half, tgt, chunk=2),
                               half.float().log_softmax(-1).gather(-1, tgt[..., None])[..., 0])


def test_entropy_against_naive():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, 13, generator=g) * 3
    p = logits.double().softmax(-1)
    ent = bench.token_entropy(logits, chunk=2).double()
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert bench.token_entropy(logits).shape == (5, 3)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="targets"):
        bench.token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        bench.token_entropy(torch.zeros(2, 3))


def test_rows_apart_logprobs_are_the_shared_forwards_and_bench_shared_runs(tmp_path, capsys):
    """--shared's baseline (each row its own prompt, the path before model.Prefix) gives the same log-probs and
    gradients as rollout.completion_logprobs (float64); the bench prints both times on a tiny --ckpt."""
    from model import ModelConfig, Transformer
    from rollout import completion_logprobs
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=31, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1,
                                intermediate_size=24, max_seq_len=64)).double()
    prompts = [[1, 2, 3]] * 3 + [[4, 5]] * 2
    comps = [[6, 7], [8], [9, 10, 11], [12, 13], [14]]
    grads = []
    for fn in (bench.rows_apart_logprobs, completion_logprobs):
        logp = fn(m, prompts, comps, 1.0)[0]
        logp.sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        m.zero_grad()
        if fn is completion_logprobs:
            torch.testing.assert_close(logp[logp != 0].sum(), first.sum(), rtol=0, atol=1e-10)
        first = logp
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(*grads))
    m.float().save_pretrained(tmp_path / "ckpt")
    bench.bench_shared(str(tmp_path / "ckpt"), repeats=1, P=2, G=3, S=(3, 5), L=(2, 6))
    out = capsys.readouterr().out
    assert "shared / rows_apart: time" in out and "rows_apart:" in out


def test_refill_policies_replayed_on_fixed_keep_rates():
    """tools/refill_sim.py: with every group kept, each policy takes one try of P prompts; with none kept, every
    try runs and the step ends short; at p = 1/2 the two-sigma policy needs fewer tries than the old one."""
    import random
    from tools import refill_sim
    for policy in refill_sim.POLICIES:
        assert refill_sim.replay([1.0] * 5, policy, 8, 4, random.Random(0)) == {
            "tries": 5, "one_try": 5, "drawn": 40, "short": 0}
        out = refill_sim.replay([0.0] * 2, policy, 8, 3, random.Random(0))
        assert out["tries"] == 6 and out["short"] == 2 and out["one_try"] == 0
    old, new = (refill_sim.replay([0.5] * 300, p, 16, 4, random.Random(1)) for p in ("old", "2sigma"))
    assert new["tries"] < 0.7 * old["tries"] and new["short"] <= old["short"]


def test_profile_splits_a_decode_call_by_op(capsys, monkeypatch):
    """--profile on a tiny model: both temperatures, the matrix products' share, ops named by the profiler, shares
    that are fractions (the largest first)."""
    import re
    import model
    from model import ModelConfig, Transformer
    monkeypatch.setattr(model, "PACK_FROM", 0)  # the packed GEMM counts as matrix products too
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1,
                                intermediate_size=24, max_seq_len=64)).eval()
    bench.bench_profile(m, "4x2x8", prompt_len=5, top=5)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["T = 0.0", "T = 1.0"]
    for ln in lines:
        assert "matrix products" in ln and ("mkldnn::_linear_pointwise" if model.PACKED_GEMM else "aten::mm") in ln
        assert float(re.search(r"matrix products ([\d.]+)%", ln).group(1)) > 10
        shares = [float(x) for x in re.findall(r"(?:aten|mkldnn)::\w+ ([\d.]+)%", ln)]
        assert len(shares) == 5 and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100


def test_fused_times_the_same_products_apart_and_fused(capsys):
    """--fused on a tiny Qwen2-shaped model (q/k/v biases, GQA): the fused path computes what the seven products do
    (bench_fused checks it before timing), one line per row count with a ratio of the two times."""
    import re
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    m = Transformer(ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=64, hidden_size=16, n_layers=2,
                                n_heads=4, n_kv_heads=2, intermediate_size=24, max_seq_len=64)).eval()
    bench.bench_fused(m, repeats=1, rows_list=(3, 8))
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(" rows")[0] for ln in lines] == ["3", "8"]
    for ln in lines:
        apart, fused, ratio = map(float, re.search(r"products ([\d.]+) ms, fused ([\d.]+) ms, fused / apart ([\d.]+)",
                                                   ln).groups())
        assert apart > 0 and fused > 0 and ratio > 0


def test_best_times_reports_each_jobs_first_call_apart():
    """A job slow only on its first call (a compile): `first` holds that call, the best time the later ones."""
    import time
    calls = []

    def job():
        calls.append(1)
        time.sleep(0.2 if len(calls) == 1 else 0.0)
    first = {}
    best = bench.best_times({"compiled": job}, repeats=2, first=first)
    assert len(calls) == 3 and first["compiled"] >= 0.2 and best["compiled"] < 0.1


def test_sampling_with_unpacked_times_both_gemms_side_by_side(capsys, linear_calls):
    """--unpacked: each eager setting again with model.PACKED_GEMM off (plain F.linear), a packed / unpacked line
    per setting; the unpacked job really multiplies unpacked and the flag is back on afterwards."""
    import model as model_py
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1,
                                intermediate_size=24, max_seq_len=64)).eval()
    args = bench.parser().parse_args(["--settings", "2x2x4,3x1x4", "--prompt_len", "5", "--repeats", "1",
                                      "--naive_tokens", "2", "--no_hf", "--unpacked"])
    before = model_py.PACKED_GEMM
    try:
        bench.bench_sampling(m, args)
    finally:
        torch.set_grad_enabled(True)  # bench_sampling switches autograd off for the process
    out = capsys.readouterr().out
    ratios = [ln for ln in out.splitlines() if ln.startswith("packed / unpacked")]
    assert [ln.split()[3] for ln in ratios] == ["2x2x4", "3x1x4"]
    assert all(float(x.rstrip("x")) > 0 for ln in ratios for x in ln.split()[4:])
    assert set(linear_calls) == ({True, False} if before else {False}) and model_py.PACKED_GEMM == before


@pytest.mark.skipif(not __import__("model").PACKED_GEMM, reason="oneDNN's packed GEMM: x86 CPUs")
def test_gemm_times_plain_against_packed_per_weight_shape(capsys):
    """--gemm: a line per input width, a plain / packed ratio per (weight, rows), after the products matched."""
    import re
    bench.bench_gemm(repeats=1, widths=(8, 16), rows_list=(2, 3), calls=1)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["in 8", "in 16"]
    for ln, k in zip(lines, (8, 16)):
        cells = re.findall(r"(\d+) x (\d+) \([\d.e+-]+ x 2\^17\), (\d) rows ([\d.]+)", ln)
        assert [(int(n), int(i), int(r)) for n, i, r, _ in cells] == [
            (n, k, r) for n in (k, 4 * k, 50_000) for r in (2, 3)]
        assert all(float(x) > 0 for *_, x in cells)


@pytest.mark.skipif(not __import__("model").PACKED_GEMM, reason="oneDNN's packed GEMM: x86 CPUs")
def test_step_packed_alternates_the_rl_step_unpacked_and_packed(tmp_path, capsys, linear_calls):
    """--step_packed on a tiny folder: train.rl_step timed with the packed GEMM off and on (every product packed
    here), medians of each, their ratio; the switch is back on afterwards."""
    import model as model_py
    from tools import compare_trl
    from test_train import SMOKE
    before = model_py.PACKED_GEMM
    compare_trl.random_checkpoint(str(tmp_path), dict(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                      intermediate_size=64))
    torch.set_num_threads(1)
    med = bench.bench_step_ab(SMOKE, str(tmp_path), 1, {"unpacked": lambda run, fn: bench.unpacked(fn),
                                                        "packed": lambda run, fn: fn()})
    out = capsys.readouterr().out
    assert "unpacked: step" in out and "packed: step" in out and "unpacked / packed: step" in out
    assert set(med) == {"unpacked", "packed"} and all(x > 0 for v in med.values() for x in v[:3])
    assert set(linear_calls) == {True, False} and model_py.PACKED_GEMM == before


def test_step_bf16_alternates_the_rl_step_in_float32_and_cpu_bf16(tmp_path, capsys, monkeypatch):
    """--step_bf16's modes on a tiny folder: the trainer's log-prob forward runs with "cpu" in rollout.BF16 in one
    mode and without it in the other, a step each after the warm-up round, and rollout.BF16 is as before after."""
    import train
    from tools import compare_trl
    from test_train import SMOKE
    compare_trl.random_checkpoint(str(tmp_path), dict(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                      intermediate_size=64))
    seen, logprobs = [], train.completion_logprobs
    monkeypatch.setattr(train, "completion_logprobs", lambda *a: seen.append("cpu" in rollout.BF16) or logprobs(*a))
    monkeypatch.setattr(rollout, "BF16", {"cuda"})
    torch.set_num_threads(1)
    med = bench.bench_step_ab(SMOKE, str(tmp_path), 1, {"float32": bench.cpu_bf16(False),
                                                        "cpu_bf16": bench.cpu_bf16(True)})
    out = capsys.readouterr().out
    assert "float32: step" in out and "cpu_bf16: step" in out and "float32 / cpu_bf16: step" in out
    assert set(med) == {"float32", "cpu_bf16"} and all(x > 0 for v in med.values() for x in v[:3])
    assert set(seen) == {False, True} and rollout.BF16 == {"cuda"}

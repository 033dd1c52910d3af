"""grpo.py against hand-computed numbers, naive loops and float64 references."""
import math

import pytest
import torch

import grpo

AGGS = grpo.AGGS


def ragged_batch(n=6, length=7, seed=0, dtype=torch.float64):
    # random log-probs, a ragged mask with one empty row, and advantages; all leaves in float64
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, length, generator=g, dtype=dtype) * 2
    old = logp + 0.3 * torch.randn(n, length, generator=g, dtype=dtype)
    ref = logp + 0.3 * torch.randn(n, length, generator=g, dtype=dtype)
    lens = torch.tensor([7, 3, 0, 5, 1, 6][:n])
    mask = torch.arange(length)[None, :] < lens[:, None]
    adv = torch.randn(n, generator=g, dtype=dtype)
    return logp, old, ref, mask, adv


def slow_loss(logp, old, ref, mask, adv, eps_low, eps_high, beta, agg, max_len=None):
    # a per-token python loop, written independently of grpo.py
    n, length = logp.shape
    per_row, all_tok = [], []
    for i in range(n):
        row = []
        for t in range(length):
            if not mask[i, t]:
                continue
            r = math.exp(logp[i, t] - old[i, t])
            a = float(adv[i])
            s = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            d = float(ref[i, t] - logp[i, t])
            row.append(-s + beta * (math.exp(d) - d - 1))
        all_tok += row
        if row:
            per_row.append(sum(row) / len(row))
    if agg == "token_mean":
        return sum(all_tok) / len(all_tok)
    if agg == "seq_mean_token_mean":
        return sum(per_row) / len(per_row)
    return sum(all_tok) / (n * (max_len or length))


# ---------------------------------------------------------------- advantages

def test_worked_example_advantages():
    for r in ([1.0, 0, 0, 1], [0.0, 0, 1, 1]):
        a = grpo.group_advantages(torch.tensor(r), 4, eps=1e-8)
        expect = [0.8660254 if x == 1 else -0.8660254 for x in r]
        torch.testing.assert_close(a, torch.tensor(expect), rtol=0, atol=1e-6)
    # two prompts in one batch, prompt-major
    a = grpo.group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1]), 4, eps=1e-8)
    torch.testing.assert_close(a.abs(), torch.full((8,), 0.8660254), rtol=0, atol=1e-6)


def test_scale_batch_and_none_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # groups [1, 0] and [0, 0], G = 2
    none = grpo.group_advantages(r, 2, scale="none")
    assert none.tolist() == [0.5, -0.5, 0.0, 0.0]
    # batch std (Bessel) of [1, 0, 0, 0] = sqrt(0.75 / 3) = 0.5
    batch = grpo.group_advantages(r, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(batch, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    # group std of [1, 0] = sqrt(0.5)
    group = grpo.group_advantages(r, 2, eps=0.0)
    torch.testing.assert_close(group, torch.tensor([0.5, -0.5, 0, 0]) / math.sqrt(0.5))


def test_equal_groups_zero_advantage_and_finite_loss():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0])
    for scale in ("group", "batch", "none"):
        assert torch.equal(grpo.group_advantages(r, 3, scale=scale), torch.zeros(6))
        assert torch.equal(grpo.group_advantages(r, 1, scale=scale), torch.zeros(6))  # G = 1
    assert torch.equal(grpo.group_advantages(torch.tensor([2.0]), 1, scale="batch"), torch.zeros(1))
    logp, old, ref, mask, _ = ragged_batch()
    adv = grpo.group_advantages(r, 3).double()
    for agg in AGGS:
        loss, m = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1, agg=agg)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())


def test_keep_groups():
    r = torch.tensor([0.0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0])  # none, some, all, some correct
    assert grpo.keep_groups(r, 3).tolist() == [False, True, False, True]


def test_overlong_penalty_boundaries():
    lengths = torch.tensor([0, 12, 16, 17, 18, 20, 21, 100])  # max_len 20, cache 4: ramp over (16, 20]
    got = grpo.overlong_penalty(lengths, max_len=20, cache_len=4)
    torch.testing.assert_close(got, torch.tensor([0, 0, 0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    # no cache: a hard cut at max_len
    assert grpo.overlong_penalty(torch.tensor([20, 21]), 20, 0).tolist() == [0.0, -1.0]


# ---------------------------------------------------------------- process supervision

def test_process_advantages_hand_example():
    # one prompt, G = 2, L = 5; row 0 has steps ending at tokens 1 and 3, row 1 one step ending at 2
    rewards = torch.tensor([[1.0, 0.0], [0.0, 9.0]])
    ends = torch.tensor([[1, 3], [2, 0]])
    smask = torch.tensor([[True, True], [True, False]])
    got = grpo.process_advantages(rewards, ends, smask, group_size=2, length=5, eps=0.0)
    # steps {1, 0, 0}: mean 1/3, Bessel std sqrt(1/3) -> normalised 2/sqrt(3) and -1/sqrt(3)
    hi, lo = 2 / math.sqrt(3), -1 / math.sqrt(3)
    expect = torch.tensor([[hi + lo, hi + lo, lo, lo, 0.0], [lo, lo, lo, 0.0, 0.0]])
    torch.testing.assert_close(got, expect)


def test_process_advantages_naive_loop():
    g = torch.Generator().manual_seed(1)
    n, k, length, group = 6, 4, 9, 3
    rewards = torch.randn(n, k, generator=g)
    ends = torch.randint(0, length + 2, (n, k), generator=g)  # some ends past L: they cover every token
    smask = torch.rand(n, k, generator=g) > 0.3
    got = grpo.process_advantages(rewards, ends, smask, group, length, eps=1e-4)
    expect = torch.zeros(n, length)
    for p in range(n // group):
        rows = range(p * group, (p + 1) * group)
        vals = [float(rewards[i, j]) for i in rows for j in range(k) if smask[i, j]]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in rows:
            for t in range(length):
                expect[i, t] = sum((float(rewards[i, j]) - mean) / (std + 1e-4)
                                   for j in range(k) if smask[i, j] and ends[i, j] >= t)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- clipped surrogate

def one_token(ratios, adv, **kw):
    # one valid token per row, logp chosen so that exp(logp - old) is the given ratio
    logp = torch.tensor(ratios, dtype=torch.float64).log()[:, None].requires_grad_()
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, m = grpo.policy_loss(logp, old, torch.tensor(adv, dtype=torch.float64), mask, agg="token_mean", **kw)
    loss.backward()
    return loss, m, logp.grad[:, 0]


def test_clip_worked_example():
    # A > 0 with ratio 1.8 -> 1.2; A < 0 with ratio 0.4 -> 0.8; both clipped, so zero gradient
    loss, m, grad = one_token([1.8, 0.4], [1.0, -1.0])
    torch.testing.assert_close(loss, torch.tensor(-(1.2 * 1.0 + 0.8 * -1.0) / 2, dtype=torch.float64))
    assert grad.tolist() == [0.0, 0.0]
    assert m["clip_high"] == 0.5 and m["clip_low"] == 0.5
    # the pessimistic min leaves the other side unclipped: ratio 1.8 with A < 0 keeps its gradient
    loss, m, grad = one_token([1.8, 0.4], [-1.0, 1.0])
    torch.testing.assert_close(loss, torch.tensor(-(-1.8 + 0.4) / 2, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([1.8 / 2, -0.4 / 2], dtype=torch.float64))
    assert m["clip_high"] == 0 and m["clip_low"] == 0


def test_clip_higher():
    loss, _, grad = one_token([1.25, 1.3], [1.0, 1.0], eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor(-(1.25 + 1.28) / 2, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([-1.25 / 2, 0.0], dtype=torch.float64))
    # the symmetric 0.2 clip stops both
    _, _, grad = one_token([1.25, 1.3], [1.0, 1.0])
    assert grad.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_aggregation_matches_loop(agg, beta):
    logp, old, ref, mask, adv = ragged_batch()
    kw = dict(eps_low=0.2, eps_high=0.28, beta=beta, agg=agg)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, **kw)
    assert loss.item() == pytest.approx(slow_loss(logp, old, ref, mask, adv, 0.2, 0.28, beta, agg), rel=1e-12)
    if agg == "seq_mean_token_sum_norm":
        loss, _ = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, max_len=20, **kw)
        expect = slow_loss(logp, old, ref, mask, adv, 0.2, 0.28, beta, agg, max_len=20)
        assert loss.item() == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("agg", AGGS)
def test_gradient_identity_at_ratio_one(agg):
    logp, _, _, mask, adv = ragged_batch()
    logp.requires_grad_()
    loss, m = grpo.policy_loss(logp, logp.detach().clone(), adv, mask.float(), agg=agg, max_len=10)
    loss.backward()
    lens = mask.sum(1, keepdim=True).double()
    norm = {"token_mean": mask.sum().double(), "seq_mean_token_sum_norm": torch.tensor(6.0 * 10),
            "seq_mean_token_mean": lens.clamp(min=1) * (lens > 0).sum()}[agg]
    expect = torch.where(mask, -adv[:, None] / norm, 0.0)
    torch.testing.assert_close(logp.grad, expect)
    assert m["ratio"] == 1.0 and m["tokens"] == mask.sum()


def test_k3_kl_nonnegative_and_zero_at_ref():
    logp, old, ref, mask, adv = ragged_batch()
    zero_adv = torch.zeros_like(adv)
    _, m = grpo.policy_loss(logp, old, zero_adv, mask, ref_logp=logp.clone(), beta=0.1)
    assert m["kl"] == 0.0
    loss, m = grpo.policy_loss(logp, old, zero_adv, mask, ref_logp=ref, beta=1.0, agg="token_mean")
    assert m["kl"] > 0 and loss > 0
    d = (ref - logp)[mask]
    torch.testing.assert_close(m["kl"], (d.exp() - d - 1).mean())


def test_metrics_are_detached_scalars_and_token_advantages():
    logp, old, ref, mask, adv = ragged_batch()
    logp.requires_grad_()
    loss, m = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    assert set(m) == {"clip_low", "clip_high", "ratio", "tokens", "kl"}
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    ratio = (logp - old).exp()[mask]
    torch.testing.assert_close(m["ratio"], ratio.mean().detach())
    # [N, L] advantages equal to the broadcast [N] ones give the same loss
    loss2, _ = grpo.policy_loss(logp, old, adv[:, None].expand(-1, 7), mask, ref_logp=ref, beta=0.1)
    torch.testing.assert_close(loss, loss2)
    # garbage (inf) under the padding must not leak into the loss or the gradient
    bad = logp.detach().masked_fill(~mask, -math.inf).requires_grad_()
    loss3, _ = grpo.policy_loss(bad, old, adv, mask, ref_logp=ref, beta=0.1)
    loss3.backward()
    torch.testing.assert_close(loss3, loss)
    assert torch.isfinite(bad.grad).all()


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_split_is_exact(agg):
    logp, old, ref, mask, adv = ragged_batch()
    kw = dict(eps_high=0.28, ref_logp=None, beta=0.05, agg=agg)
    full_logp = logp.clone().requires_grad_()
    full, _ = grpo.policy_loss(full_logp, old, adv, mask, **{**kw, "ref_logp": ref})
    full.backward()
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]  # uneven, one of them holds only the empty row
    scale = sum(grpo.loss_normaliser(mask[s], agg) for s in parts)
    split_logp = logp.clone().requires_grad_()
    total = 0.0
    for s in parts:
        part, _ = grpo.policy_loss(split_logp[s], old[s], adv[s], mask[s], loss_scale=scale,
                                   **{**kw, "ref_logp": ref[s]})
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(split_logp.grad, full_logp.grad)


def test_sft_loss_and_split():
    logp, _, _, mask, _ = ragged_batch()
    torch.testing.assert_close(grpo.sft_loss(logp, mask), -logp[mask].mean())
    scale = mask[:4].sum() + mask[4:].sum()
    total = grpo.sft_loss(logp[:4], mask[:4], loss_scale=scale) + grpo.sft_loss(logp[4:], mask[4:], loss_scale=scale)
    torch.testing.assert_close(total, -logp[mask].mean())
    assert grpo.sft_loss(logp, torch.zeros_like(mask)) == 0.0  # all padding: 0, not NaN


# ---------------------------------------------------------------- log-probs and exact diagnostics

def test_token_logprobs_chunked_and_differentiable():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 4, 11, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 11, (5, 4), generator=g)
    expect = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    for chunk in (1, 2, 3, 5, 8):  # 2 and 3 do not divide B = 5
        got = grpo.token_logprobs(logits, targets, chunk=chunk)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expect.float())
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    g1, = torch.autograd.grad((expect * w).sum(), logits)
    g2, = torch.autograd.grad((grpo.token_logprobs(logits, targets, chunk=2).double() * w).sum(), logits)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    # a non-contiguous bf16 slice, as a model's logits[:, :-1] would be
    half = torch.randn(3, 6, 11, generator=g).bfloat16()[:, :-1]
    tgt = torch.randint(0, 11, (3, 5), generator=g)
    torch.testing.assert_close(grpo.token_logprobs(half, tgt, chunk=2),
                               half.float().log_softmax(-1).gather(-1, tgt[..., None])[..., 0])


def test_entropy_and_exact_kl_against_naive():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, 13, generator=g) * 3
    ref = torch.randn(5, 3, 13, generator=g) * 3
    p = logits.double().softmax(-1)
    ent = grpo.token_entropy(logits, chunk=2).double()
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)
    q = ref.double().softmax(-1)
    kl = grpo.exact_kl(logits, ref, chunk=3)
    torch.testing.assert_close(kl.double(), (p * (p.log() - q.log())).sum(-1), rtol=1e-5, atol=1e-5)
    assert (kl >= 0).all() and kl.dtype == torch.float32
    assert torch.equal(grpo.exact_kl(logits, logits.clone()), torch.zeros(5, 3))
    with torch.no_grad():
        assert grpo.token_entropy(logits).shape == (5, 3)


def test_k3_is_an_unbiased_estimate_of_exact_kl():
    # tokens sampled from π_θ: the mean of k3 over many samples approaches the exact KL
    g = torch.Generator().manual_seed(4)
    logits, ref = torch.randn(1, 1, 6, generator=g), torch.randn(1, 1, 6, generator=g)
    samples = torch.multinomial(logits[0, 0].softmax(-1), 200_000, replacement=True, generator=g)
    lp = logits[0, 0].log_softmax(-1)[samples]
    d = ref[0, 0].log_softmax(-1)[samples] - lp
    k3 = (d.exp() - d - 1).mean()
    assert k3.item() == pytest.approx(grpo.exact_kl(logits, ref).item(), rel=0.03)


# ---------------------------------------------------------------- bad input

def test_bad_input_raises():
    logp, old, ref, mask, adv = ragged_batch()
    with pytest.raises(ValueError, match="seq_mean"):
        grpo.policy_loss(logp, old, adv, mask, agg="seq_mean")
    with pytest.raises(ValueError, match="'std'"):
        grpo.group_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="not divisible"):
        grpo.group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="rewards must be 1-d"):
        grpo.keep_groups(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="old_logp"):
        grpo.policy_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="mask"):
        grpo.policy_loss(logp, old, adv, mask[:3])
    with pytest.raises(ValueError, match="advantages"):
        grpo.policy_loss(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="logp must be 2-d"):
        grpo.policy_loss(logp[0], old[0], adv, mask[0])
    with pytest.raises(ValueError, match="ref_logp"):
        grpo.policy_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="unknown agg 'x'"):
        grpo.loss_normaliser(mask, "x")
    with pytest.raises(ValueError, match="targets"):
        grpo.token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="ref_logits"):
        grpo.exact_kl(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="cache_len"):
        grpo.overlong_penalty(torch.zeros(2), 10, 11)
    with pytest.raises(ValueError, match="group_size"):
        grpo.process_advantages(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long),
                                torch.ones(3, 2, dtype=torch.bool), 2, 5)

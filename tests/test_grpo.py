"""grpo.py against hand-computed numbers, naive loops and float64 references."""
import math

import pytest
import torch

import credit
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


def with_means(logp, old, adv, mask, **kw):
    """policy_loss, and its metrics as means over the loss tokens (grpo.loss_sums / their count), with
    "tokens" the count, as a trainer logs them."""
    loss, terms = grpo.policy_loss(logp, old, adv, mask, **kw)
    sums = grpo.loss_sums(loss, terms, mask, torch.zeros_like(logp), old)  # entropy 0, μ = π_old
    n, skip = sums.pop("tokens"), {"loss", "entropy", "mismatch_kl", "logprob_gap_max"}
    return loss, {**{k: v / n.clamp(min=1) for k, v in sums.items() if k not in skip}, "tokens": n}


# ---------------------------------------------------------------- process supervision

# ---------------------------------------------------------------- clipped surrogate

def test_equal_groups_zero_advantage_and_finite_loss():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0])
    for scale in ("group", "batch", "none"):
        assert torch.equal(credit.group_advantages(r, 3, scale=scale), torch.zeros(6))
        assert torch.equal(credit.group_advantages(r, 1, scale=scale), torch.zeros(6))  # G = 1
    assert torch.equal(credit.group_advantages(torch.tensor([2.0]), 1, scale="batch"), torch.zeros(1))
    logp, old, ref, mask, _ = ragged_batch()
    adv = credit.group_advantages(r, 3).double()
    for agg in AGGS:
        loss, m = with_means(logp, old, adv, mask, ref_logp=ref, beta=0.1, agg=agg)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())


def one_token(ratios, adv, **kw):
    # one valid token per row, logp chosen so that exp(logp - old) is the given ratio
    logp = torch.tensor(ratios, dtype=torch.float64).log()[:, None].requires_grad_()
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, m = with_means(logp, old, torch.tensor(adv, dtype=torch.float64), mask, agg="token_mean", **kw)
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
    loss, m = with_means(logp, logp.detach().clone(), adv, mask.float(), agg=agg, max_len=10)
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
    _, m = with_means(logp, old, zero_adv, mask, ref_logp=logp.clone(), beta=0.1)
    assert m["kl"] == 0.0
    loss, m = with_means(logp, old, zero_adv, mask, ref_logp=ref, beta=1.0, agg="token_mean")
    assert m["kl"] > 0 and loss > 0
    d = (ref - logp)[mask]
    torch.testing.assert_close(m["kl"], (d.exp() - d - 1).mean())


def test_metrics_are_detached_scalars_and_token_advantages():
    logp, old, ref, mask, adv = ragged_batch()
    logp.requires_grad_()
    loss, m = with_means(logp, old, adv, mask, ref_logp=ref, beta=0.1)
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


# ---------------------------------------------------------------- the k3 estimator

def test_k3_is_an_unbiased_estimate_of_exact_kl():
    # tokens sampled from π_θ: the mean of k3 over many samples approaches the exact KL
    g = torch.Generator().manual_seed(4)
    logits, ref = torch.randn(1, 1, 6, generator=g), torch.randn(1, 1, 6, generator=g)
    samples = torch.multinomial(logits[0, 0].softmax(-1), 200_000, replacement=True, generator=g)
    lp = logits[0, 0].log_softmax(-1)[samples]
    d = ref[0, 0].log_softmax(-1)[samples] - lp
    k3 = (d.exp() - d - 1).mean()
    p, q = logits[0, 0].double().softmax(-1), ref[0, 0].double().softmax(-1)
    assert k3.item() == pytest.approx((p * (p / q).log()).sum().item(), rel=0.03)  # the exact KL


# ---------------------------------------------------------------- bad input

def test_bad_input_raises():
    logp, old, ref, mask, adv = ragged_batch()
    with pytest.raises(ValueError, match="seq_mean"):
        grpo.check_settings(agg="seq_mean")
    with pytest.raises(ValueError, match="'std'"):
        credit.group_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="not divisible"):
        credit.group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="rewards must be 1-d"):
        credit.group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="old_logp"):
        grpo.check_shapes(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="mask"):
        grpo.check_shapes(logp, old, adv, mask[:3])
    with pytest.raises(ValueError, match="advantages"):
        grpo.check_shapes(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="logp must be 2-d"):
        grpo.check_shapes(logp[0], old[0], adv, mask[0])
    with pytest.raises(ValueError, match="ref_logp"):
        grpo.check_shapes(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="agg 'x'"):
        grpo.check_settings(agg="x")
    with pytest.raises(ValueError, match="cache_len"):
        credit.overlong_penalty(torch.zeros(2), 10, 11)
    with pytest.raises(ValueError, match="group_size"):
        credit.process_advantages(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long),
                                torch.ones(3, 2, dtype=torch.bool), 2, 5)


# ---------------------------------------------------------------- newer objectives: RLOO, REINFORCE++

# ---------------------------------------------------------------- GSPO, CISPO, dual-clip, k1/k2/k3, pg_weight

def loop_aggregate(rows: list, toks: list, agg: str, seq_sum_norm: float):
    """The reference loops' aggregation of per-token terms: over all tokens, per sequence, or by a constant."""
    if agg == "token_mean":
        return sum(toks) / len(toks)
    if agg == "seq_mean_token_mean":
        return sum(rows) / len(rows)
    return sum(toks) / seq_sum_norm


def loop_loss(logp, old, ref, mask, adv, eps_low=0.2, eps_high=0.2, beta=0.0, agg="seq_mean_token_mean",
              max_len=None, ratio_level="token", pg_loss="clip", dual_clip=0.0, kl="k3", weight=None):
    """Per-row, per-token loop on 0-d tensors, in the papers' own forms; returns (loss for the gradient, value).
    GSPO: s_i with its full gradient (eq. 5); CISPO: −sg(clip(ρ)) Â log π, whose value differs from grpo.py's
    (grpo.py reports sg(clip(ρ)) Â, the surrogate's value); the gradients are the same."""
    n, length = logp.shape
    rows, toks, rows_v, toks_v = [], [], [], []
    for i in range(n):
        ts = [t for t in range(length) if mask[i, t]]
        if ts:
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in ts) / len(ts))
        row, row_v = [], []
        for t in ts:
            a = adv[i]
            r = s if ratio_level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            c = torch.clamp(r, 1 - eps_low, 1 + eps_high)
            if pg_loss == "cispo":
                sur, sur_v = c.detach() * a * logp[i, t], (c * a).detach()
            else:
                sur = torch.minimum(r * a, c * a)
                if dual_clip and a < 0:
                    sur = torch.maximum(sur, dual_clip * a)
                sur_v = sur
            w = 1.0 if weight is None else float(weight[i, t])
            d = ref[i, t] - logp[i, t]
            k = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[kl]
            row.append(-w * sur + beta * k)
            row_v.append(-w * sur_v + beta * k)
        for out, lst in ((rows, row), (rows_v, row_v)):
            if lst:
                out.append(sum(lst) / len(lst))
        toks += row
        toks_v += row_v
    return tuple(loop_aggregate(r, t, agg, n * (max_len or length)) for r, t in ((rows, toks), (rows_v, toks_v)))


OPTIONS = [dict(ratio_level="sequence"), dict(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
           dict(pg_loss="cispo", eps_low=1.0, eps_high=0.28), dict(pg_loss="cispo", eps_low=0.1, eps_high=0.1),
           dict(dual_clip=1.5), dict(kl="k1", beta=0.1), dict(kl="k2", beta=0.1), dict(kl="k3", beta=0.1),
           dict(weight=True, eps_high=0.28),
           dict(pg_loss="cispo", ratio_level="sequence", beta=0.05, kl="k2", weight=True)]
OPTIONS_2026 = [dict(pg_loss="dppo_tv", eps_low=0.05, eps_high=0.05), dict(pg_loss="dppo_kl", eps_low=0.02,
                eps_high=0.02), dict(pg_loss="sapo"), dict(pg_loss="sapo", tau_pos=0.5, tau_neg=3.0),
                dict(pg_loss="gmpo", eps_low=0.4, eps_high=0.4), dict(pg_loss="gmpo", eps_low=0.1, eps_high=0.2),
                dict(kl_old=0.3, abs_kl=True),
                dict(pg_loss="dppo_tv", eps_low=0.1, eps_high=0.1, kl_old=0.1, weight=True)]


def weights_for(mask, seed=7):
    # a pg_weight like TIS × top-entropy: positive reals with some exact zeros
    g = torch.Generator().manual_seed(seed)
    return torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2 * (torch.rand(mask.shape, generator=g) > 0.3)


def grpo_kwargs(opts, mask):
    kw = {k: v for k, v in opts.items() if k not in ("kl", "weight")}
    kw["kl_estimator"] = opts.get("kl", "k3")
    kw["pg_weight"] = weights_for(mask) if opts.get("weight") else None
    kw["abs_kl"] = weights_for(mask, seed=11) * 0.5 if opts.get("abs_kl") else None  # KL-Cov's β on some tokens
    return kw


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_new_options_match_loop(agg, opts):
    logp, old, ref, mask, adv = ragged_batch()
    old = logp + 2 * (old - logp)  # ratios in [0.5, 6.6]: every clip and the dual clip bind somewhere
    logp.requires_grad_()
    kw = grpo_kwargs(opts, mask)
    loss, m = with_means(logp, old, adv, mask, ref_logp=ref, agg=agg, max_len=11, **kw)
    g_got, = torch.autograd.grad(loss, logp)
    loop_kw = {**opts, "weight": kw["pg_weight"]}
    for_grad, value = loop_loss(logp, old, ref, mask, adv, agg=agg, max_len=11, **loop_kw)
    g_ref, = torch.autograd.grad(for_grad, logp)
    assert loss.item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-10, atol=1e-14)
    assert torch.isfinite(g_got).all() and (g_got[~mask] == 0).all()
    # garbage (−inf) under the padding changes neither the loss nor the gradient
    bad = logp.detach().masked_fill(~mask, -math.inf).requires_grad_()
    loss_bad, _ = grpo.policy_loss(bad, old, adv, mask, ref_logp=ref, agg=agg, max_len=11, **kw)
    torch.testing.assert_close(loss_bad, loss.detach())
    torch.testing.assert_close(torch.autograd.grad(loss_bad, bad)[0], g_got)
    if opts.get("dual_clip"):
        assert m["dual_clip"] > 0
    if opts.get("eps_low") == 3e-4:
        assert m["clip_low"] + m["clip_high"] > 0


def test_gspo_cispo_dual_clip_by_hand():
    # GSPO: one row, log-ratios 0.1 and 0.3 -> s = e^0.2 = 1.2214, inside 1 + 0.3: loss −s·Â, d/dlogp_t = −s·Â/2
    logp = torch.tensor([[0.1, 0.3]], dtype=torch.float64).requires_grad_()
    zeros, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = with_means(logp, zeros, torch.tensor([2.0], dtype=torch.float64), mask, eps_high=0.3,
                               ratio_level="sequence")
    loss.backward()
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(-2 * s) and m["ratio"].item() == pytest.approx(s)
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -s, dtype=torch.float64))
    # ε_high = 0.2 clips the whole sequence: no gradient on either token, though token 0's own ratio is 1.105
    logp.grad = None
    grpo.policy_loss(logp, zeros, torch.tensor([2.0], dtype=torch.float64), mask, ratio_level="sequence")[0].backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    # CISPO: ratio 1.8 with Â = 1 is capped at 1.28 yet keeps a gradient; 0.4 with Â = −1 has no lower cap
    loss, m, grad = one_token([1.8, 0.4], [1.0, -1.0], pg_loss="cispo", eps_low=1.0, eps_high=0.28)
    torch.testing.assert_close(grad, torch.tensor([-1.28 / 2, 0.4 / 2], dtype=torch.float64))
    assert loss.item() == pytest.approx(-(1.28 - 0.4) / 2) and m["clip_high"] == 0.5 and m["clip_low"] == 0
    # dual-clip c = 3 for Â < 0: ratio 4 gives the constant −3·Â (no gradient), ratio 2 keeps ρ·Â
    loss, m, grad = one_token([4.0, 2.0], [-1.0, -1.0], dual_clip=3.0)
    assert loss.item() == pytest.approx((3 + 2) / 2) and m["dual_clip"] == 0.5
    torch.testing.assert_close(grad, torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_kl_estimators_by_hand_and_at_ref():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.5]])  # d = −1, 0.5
    d = torch.tensor([[-1.0, 0.5]])
    torch.testing.assert_close(grpo.kl_penalty(logp, ref, "k1"), -d)
    torch.testing.assert_close(grpo.kl_penalty(logp, ref, "k2"), d * d / 2)
    torch.testing.assert_close(grpo.kl_penalty(logp, ref, "k3"), d.exp() - d - 1)
    for est in grpo.KL_ESTIMATORS:
        assert torch.equal(grpo.kl_penalty(logp, logp.clone(), est), torch.zeros(1, 2))


# ---------------------------------------------------------------- truncated / masked importance sampling

@pytest.mark.parametrize("level", grpo.TIS_LEVELS)
@pytest.mark.parametrize("mode", grpo.TIS_MODES)
def test_tis_weights_loop(level, mode):
    logp, old, _, mask, _ = ragged_batch()  # row 2 is all padding
    sampler = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(8), dtype=old.dtype)
    cap = 1.2
    got, m = grpo.tis_weights(old, sampler, mask, level, mode, cap)
    expect, raw, cut = torch.zeros_like(got), [], 0
    for i in range(6):
        ts = [t for t in range(7) if mask[i, t]]
        seq = math.exp(sum(float(old[i, t] - sampler[i, t]) for t in ts))
        for t in ts:
            w = seq if level == "sequence" else math.exp(float(old[i, t] - sampler[i, t]))
            out = w < 1 / cap or w > cap if mode == "mask" else w > cap
            expect[i, t] = min(w, cap) if mode == "truncate" else 0.0 if out else w
            raw.append(w)
            cut += out
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, expect.float())
    assert m["tis_mean"].item() == pytest.approx(sum(raw) / len(raw), rel=1e-5)
    assert m["tis_max"].item() == pytest.approx(max(raw), rel=1e-5)
    assert m["tis_cut"].item() == pytest.approx(cut / len(raw)) and 0 < cut < len(raw)
    # a sequence's product overflowing float32: truncation gives C, the mask gives 0, never inf or NaN
    huge, _ = grpo.tis_weights(torch.full((1, 3), 50.0), torch.zeros(1, 3), torch.ones(1, 3), level, mode, cap)
    assert torch.equal(huge, torch.full((1, 3), cap if mode == "truncate" else 0.0))


# ---------------------------------------------------------------- top-entropy mask

def test_entropy_threshold_ties_and_loop():
    h = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    assert grpo.entropy_threshold(h, 0.2) == 3.0  # k = 1
    assert grpo.entropy_threshold(h, 0.4) == 2.0  # k = 2 lands in a tie: all three 2.0 tokens are kept
    mask = torch.ones(1, 5, dtype=torch.bool)
    assert grpo.top_entropy_mask(h[None], mask, grpo.entropy_threshold(h, 0.4)).sum() == 4
    assert grpo.top_entropy_mask(h[None], mask, grpo.entropy_threshold(h, 1.0)).all()
    # 0.07 · 100 = 7.000000000000001 in floating point: k must still be 7, τ the 7th largest
    assert grpo.entropy_threshold(torch.arange(100.0), 0.07) == 93.0
    g = torch.Generator().manual_seed(9)
    ent = torch.rand(6, 7, generator=g).round(decimals=1)  # many ties
    _, _, _, valid, _ = ragged_batch()
    for q in (0.05, 0.2, 0.5, 0.8, 1.0):
        vals = sorted((float(ent[i, t]) for i in range(6) for t in range(7) if valid[i, t]), reverse=True)
        tau = vals[math.ceil(round(q * len(vals), 9)) - 1]
        assert grpo.entropy_threshold(ent, q, valid).item() == tau
        # the threshold of the flat valid entropies (what an all-gather gives) is the same
        assert grpo.entropy_threshold(ent[valid], q).item() == tau
        keep = grpo.top_entropy_mask(ent, valid, torch.tensor(tau))
        assert keep.sum() == sum(v >= tau for v in vals) and not keep[~valid].any()
    with pytest.raises(ValueError, match="q must be in"):
        grpo.entropy_threshold(ent, 0.0)


# ---------------------------------------------------------------- partition invariance

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("opts", OPTIONS + OPTIONS_2026 + [dict(tis="sequence", entropy_q=0.5)], ids=lambda o: "-".join(
    f"{k}={v}" for k, v in o.items()))
def test_new_options_split_into_micro_batches_and_ranks(agg, opts):
    """Micro-batches [0:2] [2:3] [3:6], and 2 "ranks" (rows 0-2 and 3-5, each in 2 micro-batches): the summed
    losses and accumulated gradients equal the full batch's, with pg_weight built per micro-batch from
    tis_weights and a top-entropy τ computed once over every rank's valid tokens."""
    logp, old, ref, mask, adv = ragged_batch()
    old = logp + 2 * (old - logp)
    sampler = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(8), dtype=old.dtype)
    ent = torch.rand(6, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64).round(decimals=1)
    kw = grpo_kwargs({k: v for k, v in opts.items() if k not in ("tis", "entropy_q")}, mask)
    full_w = kw.pop("pg_weight")
    full_k = kw.pop("abs_kl")
    tau = grpo.entropy_threshold(torch.cat([ent[:3][mask[:3]], ent[3:][mask[3:]]]), opts.get("entropy_q", 1.0))

    def run(parts):
        leaf = logp.clone().requires_grad_()
        scale = sum(grpo.loss_normaliser(mask[s], agg, 11) for s in parts)
        total = 0.0
        for s in parts:
            w = None if full_w is None else full_w[s]
            if "tis" in opts:
                w = grpo.tis_weights(old[s], sampler[s], mask[s], opts["tis"], "truncate", 2.0)[0].double()
                w = w * grpo.top_entropy_mask(ent[s], mask[s], tau)
            part, _ = grpo.policy_loss(leaf[s], old[s], adv[s], mask[s], ref_logp=ref[s], agg=agg, max_len=11,
                                       loss_scale=scale if len(parts) > 1 else None, pg_weight=w,
                                       abs_kl=None if full_k is None else full_k[s], **kw)
            part.backward()
            total = total + part.detach()
        return total, leaf.grad

    full, g_full = run([slice(0, 6)])
    for parts in ([slice(0, 2), slice(2, 3), slice(3, 6)], [slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 6)]):
        total, grad = run(parts)
        torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad, g_full, rtol=1e-12, atol=1e-15)
    assert g_full.abs().sum() > 0


def test_new_options_bad_input_raises():
    logp, old, ref, mask, adv = ragged_batch()
    with pytest.raises(ValueError, match="ratio_level 'seq'"):
        grpo.check_settings(ratio_level="seq")
    with pytest.raises(ValueError, match="pg_loss 'ppo'"):
        grpo.check_settings(pg_loss="ppo")
    with pytest.raises(ValueError, match="dual_clip must be 0"):
        grpo.check_settings(dual_clip=0.5)
    with pytest.raises(ValueError, match="dual_clip must be 0"):
        grpo.check_settings(dual_clip=3.0, pg_loss="cispo")
    with pytest.raises(ValueError, match="kl_estimator 'k4'"):
        grpo.check_settings(kl_estimator="k4")
    with pytest.raises(ValueError, match="pg_weight"):
        grpo.check_shapes(logp, old, adv, mask, pg_weight=mask[:, :3])
    with pytest.raises(ValueError, match="'reinforce'"):
        credit.group_advantages(torch.zeros(4), 2, scale="reinforce")
    with pytest.raises(ValueError, match="cap 0.5"):
        grpo.tis_weights(old, old, mask, cap=0.5)
    with pytest.raises(ValueError, match="mode 'clip'"):
        grpo.tis_weights(old, old, mask, mode="clip")
    with pytest.raises(ValueError, match="sampler_logp"):
        grpo.tis_weights(old, old[:, :3], mask)


# ---------------------------------------------------------------- 2026 objectives: DPPO, SAPO, GMPO, kl_old, KL-Cov

def loop_2026(logp, old, mask, adv, pg_loss, eps_low=0.2, eps_high=0.2, tau_pos=1.0, tau_neg=1.05, kl_old=0.0,
              abs_kl=None, weight=None, agg="seq_mean_token_mean", max_len=None):
    """A per-token loop on 0-d float64 tensors, from the papers' forms; returns (loss for the gradient, value).
    DPPO: −M sg(min(ρ, 20)) Â log π (value −M sg(min(ρ, 20)) Â); SAPO: −4/τ σ(τ(ρ − 1)) Â;
    GMPO: −Â_i (Π_t ρ̃_t)^(1/|o_i|) with ρ̃_t the pessimistic of ρ_t and its e^[−ε_low, ε_high] clip, put on
    each of the row's tokens."""
    n, length = logp.shape
    rows, toks, rows_v, toks_v = [], [], [], []
    for i in range(n):
        ts = [t for t in range(length) if mask[i, t]]
        a = adv[i]
        if pg_loss == "gmpo":
            logs = []
            for t in ts:
                x = logp[i, t] - old[i, t]
                c = torch.clamp(x, -eps_low, eps_high)
                logs.append(torch.minimum(x, c) if a > 0 else torch.maximum(x, c) if a < 0 else 0 * x)
            geo = torch.exp(sum(logs) / len(ts)) if ts else None
        row, row_v = [], []
        for t in ts:
            r = torch.exp(logp[i, t] - old[i, t])
            if pg_loss in ("dppo_tv", "dppo_kl"):
                p, q = math.exp(logp[i, t].item()), math.exp(old[i, t].item())
                if pg_loss == "dppo_tv":
                    out = p - q > eps_high if a > 0 else p - q < -eps_low
                else:
                    bkl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
                    out = (p > q and bkl > eps_high) if a > 0 else (p < q and bkl > eps_low)
                w = 0.0 if out else min(float(r), 20.0)
                sur, sur_v = w * a * logp[i, t], (w * a).detach()
            elif pg_loss == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                sur = sur_v = 4 / tau * torch.sigmoid(tau * (r - 1)) * a
            elif pg_loss == "gmpo":
                sur = sur_v = a * geo
            else:
                sur = sur_v = torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            wt = 1.0 if weight is None else float(weight[i, t])
            extra = kl_old * (logp[i, t] - old[i, t]) ** 2 / 2
            if abs_kl is not None:
                extra = extra + float(abs_kl[i, t]) * torch.abs(logp[i, t] - old[i, t])
            row.append(-wt * sur + extra)
            row_v.append(-wt * sur_v + extra)
        for out_, lst in ((rows, row), (rows_v, row_v)):
            if lst:
                out_.append(sum(lst) / len(lst))
        toks += row
        toks_v += row_v
    return tuple(loop_aggregate(r, t, agg, n * (max_len or length)) for r, t in ((rows, toks), (rows_v, toks_v)))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("opts", OPTIONS_2026, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_2026_objectives_match_loop(agg, opts):
    logp, old, ref, mask, adv = ragged_batch()
    old = logp + 2 * (old - logp)  # ratios in [0.5, 6.6]: every trust region binds somewhere
    logp.requires_grad_()
    kw = grpo_kwargs(opts, mask)
    loss, m = with_means(logp, old, adv, mask, ref_logp=ref, agg=agg, max_len=11, **kw)
    g_got, = torch.autograd.grad(loss, logp)
    lkw = {k: v for k, v in opts.items() if k not in ("weight", "abs_kl", "pg_loss")}
    for_grad, value = loop_2026(logp, old, mask, adv, opts.get("pg_loss", "clip"), weight=kw["pg_weight"],
                                abs_kl=kw["abs_kl"], agg=agg, max_len=11, **lkw)
    g_ref, = torch.autograd.grad(for_grad, logp)
    assert loss.item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-10, atol=1e-14)
    assert torch.isfinite(g_got).all() and (g_got[~mask] == 0).all() and g_got.abs().sum() > 0
    bad = logp.detach().masked_fill(~mask, -math.inf).requires_grad_()  # garbage under the padding is inert
    loss_bad, _ = grpo.policy_loss(bad, old, adv, mask, ref_logp=ref, agg=agg, max_len=11, **kw)
    torch.testing.assert_close(loss_bad, loss.detach())
    torch.testing.assert_close(torch.autograd.grad(loss_bad, bad)[0], g_got)
    if opts.get("pg_loss", "").startswith(("dppo", "gmpo")):
        assert 0 < m["clip_low"] + m["clip_high"] < 1  # the trust region masks some tokens, not all


def test_2026_objectives_by_hand():
    f64 = dict(dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # DPPO-TV, δ = 0.1: π_old 0.5 → π_θ 0.7 (+0.2, out for Â > 0: no gradient) and 0.5 → 0.55 (+0.05, kept):
    # the kept token's gradient is −sg(ρ)·Â/2 = −1.1/2 with token_mean; value −(0 + 1.1)/2
    old = torch.tensor([[0.5, 0.5]], **f64).log()
    logp = torch.tensor([[0.7, 0.55]], **f64).log().requires_grad_()
    loss, m = with_means(logp, old, torch.tensor([1.0], **f64), mask, eps_low=0.1, eps_high=0.1, agg="token_mean",
                               pg_loss="dppo_tv")
    loss.backward()
    assert loss.item() == pytest.approx(-1.1 / 2) and m["clip_high"] == 0.5 and m["clip_low"] == 0
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1 / 2]], **f64))
    # the same move with Â < 0 is kept (it pushes π_θ back): both tokens have gradient ρ·|Â|/2
    logp.grad = None
    grpo.policy_loss(logp, old, torch.tensor([-1.0], **f64), mask, eps_low=0.1, eps_high=0.1, agg="token_mean",
                     pg_loss="dppo_tv")[0].backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.4 / 2, 1.1 / 2]], **f64))
    # DPPO-KL, δ = 0.05: binary KL of 0.5 → 0.7 is 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.0872 > δ (masked);
    # 0.5 → 0.55: 0.00501 < δ (kept)
    logp.grad = None
    loss, m = with_means(logp, old, torch.tensor([1.0], **f64), mask, eps_low=0.05, eps_high=0.05, agg="token_mean",
                               pg_loss="dppo_kl")
    assert m["clip_high"] == 0.5 and loss.item() == pytest.approx(-1.1 / 2)
    # SAPO at ρ = 1: value 4/τ · ½ · Â = 2Â/τ, gradient exactly Â (4σ(1 − σ) = 1); τ_pos for Â > 0, τ_neg else
    zeros = torch.zeros(1, 2, **f64)
    lp = zeros.clone().requires_grad_()
    loss, _ = grpo.policy_loss(lp, zeros, torch.tensor([[2.0, -1.0]], **f64), mask, agg="token_mean",
                               pg_loss="sapo", tau_pos=0.5, tau_neg=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(-(2 * 2 / 0.5 + 2 * -1 / 2.0) / 2)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.5]], **f64))
    # GMPO, ε = 0.4, Â = 1: log-ratios 0.1 and 0.6 (clipped to 0.4) → value e^((0.1 + 0.4)/2) = e^0.25; only the
    # unclipped token carries the gradient, −e^0.25/2
    lp = torch.tensor([[0.1, 0.6]], **f64).requires_grad_()
    loss, m = with_means(lp, zeros, torch.tensor([1.0], **f64), mask, eps_low=0.4, eps_high=0.4, pg_loss="gmpo")
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.25)) and m["clip_high"] == 0.5
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.exp(0.25) / 2, 0.0]], **f64))
    # kl_old = 1 and abs_kl = 2 at log-ratio 0.3 with Â = 0: value 0.3²/2 + 2·0.3, gradient 0.3 + 2
    lp = torch.tensor([[0.3]], **f64).requires_grad_()
    loss, _ = grpo.policy_loss(lp, zeros[:, :1], torch.zeros(1, **f64), mask[:, :1], kl_old=1.0,
                               abs_kl=torch.full((1, 1), 2.0, **f64))
    loss.backward()
    assert loss.item() == pytest.approx(0.045 + 0.6) and lp.grad.item() == pytest.approx(2.3)
    with pytest.raises(ValueError, match="gmpo takes token ratios"):
        grpo.check_settings(pg_loss="gmpo", ratio_level="sequence")


def test_cov_select_by_hand_and_loop():
    # 4 valid tokens (one row padded): Â = [1, 1, −1, −1] centred is itself, log π_old = [−1, −3, −1, −3] centred
    # [1, −1, 1, −1] → cov = [1, −1, −1, 1]; KL-Cov's top half is tokens 0 and 3 (ties: the earlier first)
    old = torch.tensor([[-1.0, -3.0, 9.0], [-1.0, -3.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    assert grpo.cov_select(old, adv, mask, "kl", 0.5).tolist() == [[True, False, False], [False, True, False]]
    assert grpo.cov_select(old, adv, mask, "kl", 0.25).tolist() == [[True, False, False], [False, False, False]]
    # Clip-Cov, band (0.5, 2): candidates 0 and 3; frac 0.25 draws one of them, never a token outside the band
    for seed in range(6):
        got = grpo.cov_select(old, adv, mask, "clip", 0.25, 0.5, 2.0, torch.Generator().manual_seed(seed))
        assert got.sum() == 1 and (got[0, 0] or got[1, 1]) and not got[~mask].any()
    assert grpo.cov_select(old, adv, mask, "clip", 1.0, 0.5, 2.0).sum() == 2  # k = 4 > 2 candidates: both
    assert not grpo.cov_select(old, adv, mask, "clip", 1.0, 5.0, 9.0).any()  # nobody in the band
    # against a loop on a random batch: the k largest covariances
    logp, _, _, valid, a = ragged_batch()
    toks = [(i, t) for i in range(6) for t in range(7) if valid[i, t]]
    ma = sum(float(a[i]) for i, _ in toks) / len(toks)
    ml = sum(float(logp[i, t]) for i, t in toks) / len(toks)
    cov = {(i, t): (float(a[i]) - ma) * (float(logp[i, t]) - ml) for i, t in toks}
    top = sorted(toks, key=lambda x: -cov[x])[:int(0.2 * len(toks))]
    got = grpo.cov_select(logp, a, valid, "kl", 0.2)
    assert sorted(map(tuple, got.nonzero().tolist())) == sorted(top)
    with pytest.raises(ValueError, match="cov mode"):
        grpo.cov_select(logp, a, valid, "top", 0.2)


def test_entropy_threshold_keeps_the_input_dtype():
    # float64 entropies tied at 0.1: a float32 τ (0.10000000149) would sit above them and drop the tie
    h = torch.tensor([0.3, 0.1, 0.1, 0.0], dtype=torch.float64)
    tau = grpo.entropy_threshold(h, 0.5)
    assert tau.dtype == torch.float64 and tau.item() == 0.1
    assert grpo.top_entropy_mask(h[None], torch.ones(1, 4), tau).sum() == 3

"""tools/oracle.py's exact identities, by enumeration (no Monte Carlo), to 1e-6; and its enumeration by hand."""
import pytest
import torch

import credit
import grpo
from tools import oracle


@pytest.fixture(scope="module")
def task():
    return oracle.make_task()


def exact_mean(spec, task, reg=oracle.ON, group=3):
    mean, _, se, true = oracle.measure(spec, task, reg, group)
    assert se is None  # enumerated, not sampled
    return mean, true


def test_enumeration_by_hand(task):
    names = ["".join("$ab"[v] for v in task.tok[y][task.mask[y]].tolist()) for y in range(task.Y)]
    assert len(set(names)) == 15 and {len(n) for n in names} == {1, 2, 3}
    assert {n for n in names if "$" not in n} == {a + b + c for a in "ab" for b in "ab" for c in "ab"}  # cut off
    correct = [{n for n, r in zip(names, task.reward[p].tolist()) if r == 1.0} for p in range(3)]
    assert correct == [{"$", "b$", "bb$"}, {"a$", "ab$", "ba$"}, {"aa$"}]
    probs = oracle.seq_logp(task.theta, task).exp()
    torch.testing.assert_close(probs.sum(1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-12)


def test_exact_gradient_matches_finite_differences(task):
    for which in (0, 1):  # J and KL
        _, grad = oracle.exact_grad(task.theta, task, which)
        fd, h = torch.zeros_like(grad), 1e-6
        for i in range(grad.numel()):
            e = torch.zeros(grad.numel(), dtype=torch.float64)
            e[i] = h
            up, down = (oracle.exact(task.theta + s * e.view_as(task.theta), task)[which] for s in (1, -1))
            fd[i] = (up - down) / (2 * h)
        torch.testing.assert_close(grad, fd, rtol=0, atol=1e-6)
        assert grad.abs().max() > 1e-2


@pytest.mark.parametrize("group", [2, 3, 4])
def test_rloo_is_unbiased_and_mean_baseline_is_scaled(task, group):
    mean, true = exact_mean(oracle.RLOO, task, group=group)
    torch.testing.assert_close(mean, true, rtol=0, atol=1e-6)
    mean, _ = exact_mean(dict(adv="none", **oracle.SUM), task, group=group)
    torch.testing.assert_close(mean, (group - 1) / group * true, rtol=0, atol=1e-6)
    # Dr. GRPO divides the same sum by L_max = H = 3
    mean, _ = exact_mean(dict(adv="none", agg="seq_mean_token_sum_norm", max_len=3), task, group=group)
    torch.testing.assert_close(mean, (group - 1) / (3 * group) * true, rtol=0, atol=1e-6)


def test_sequence_is_with_no_cap_is_unbiased_under_a_mismatched_sampler(task):
    mean, true = exact_mean(dict(tis="sequence", cap=float("inf"), **oracle.RLOO), task, oracle.MIS)
    torch.testing.assert_close(mean, true, rtol=0, atol=1e-6)
    biased, _ = exact_mean(oracle.RLOO, task, oracle.MIS)
    assert (biased - true).norm() > 1e-2 * true.norm()


@pytest.mark.parametrize("kw", [{}, dict(ratio_level="sequence"), dict(pg_loss="cispo"), dict(dual_clip=3.0),
                                dict(eps_low=3e-4, eps_high=4e-4), dict(pg_loss="dppo_tv", eps_low=0.01, eps_high=0.01),
                                dict(pg_loss="dppo_kl"), dict(pg_loss="sapo", tau_pos=0.3, tau_neg=3.0),
                                dict(pg_loss="gmpo", eps_low=0.4, eps_high=0.4), dict(kl_old=0.5)])
def test_surrogates_at_ratio_one_are_the_plain_policy_gradient(task, kw):
    """μ = 1: E[ĝ] of the clipped (or GSPO / CISPO / dual-clip) surrogate = the gradient of
    Σ_b P(b) · 1/G Σ_i Â_i · 1/|o_i| Σ_t log π_θ(o_i,t) / P with the same GRPO advantages, by plain autograd."""
    group = 3
    mean, _ = exact_mean(dict(adv="group", kw=kw, **oracle.SMTM), task, group=group)
    prompt, comp, weight, _, scale = oracle.exact_batches(task, task.theta, group)
    th = task.theta.clone().requires_grad_()
    logp = oracle.token_logp(th, task)[prompt, comp]  # [B, G, H]
    adv = credit.group_advantages(task.reward[prompt, comp].reshape(-1), group).view(-1, group).double()
    per_row = logp.sum(-1) / task.mask[comp].sum(-1)  # 1/|o_i| Σ_t log π
    surrogate = (scale * weight * (adv * per_row).mean(1)).sum()
    expect, = torch.autograd.grad(surrogate, th)
    torch.testing.assert_close(mean, expect.reshape(-1), rtol=0, atol=1e-9)


def test_per_batch_gradients_match_autograd(task):
    # the tabular map ∂L/∂log π · (e_v − π) behind tr Cov, against autograd of one batch's loss through θ
    group, spec = 2, dict(adv="rloo", tis="token", cap=2.0, kw=dict(ratio_level="sequence"), **oracle.TOK)
    batches = oracle.mc_batches(task, task.sampler, group, 5)
    g = oracle.batch_grads(spec, task, task.step, task.theta, task.sampler, batches, group)
    for b in range(5):
        prompt, comp = batches[0][b], batches[1][b]
        th = task.step.clone().requires_grad_()
        args = [oracle.token_logp(t, task)[prompt, comp] for t in (th, task.theta, task.sampler, task.ref)]
        loss = oracle.batch_loss(spec, group, *args, task.mask[comp], task.reward[prompt, comp], None)
        expect, = torch.autograd.grad(loss, th)
        torch.testing.assert_close(g[b], -expect.reshape(-1), rtol=0, atol=1e-12)
    assert g.abs().sum() > 0


def test_kl_estimator_identities(task):
    kl, rows = oracle.kl_rows(task)
    by = {r[0]: r for r in rows}
    assert kl > 0
    assert abs(by["k1"][1]) < 1e-12 and abs(by["k3"][1]) < 1e-12  # E[Σ_t k1] = E[Σ_t k3] = KL exactly
    assert by["k2"][1] > 1e-4  # k2 is biased
    assert by["k1"][4] < 1e-9  # k1 as a loss term: E[∇] = E[Σ_t ∇log π] = 0
    assert by["k1 in the reward"][3] == pytest.approx(1.0, abs=1e-9)  # REINFORCE on the KL: E[∇] = ∇KL
    assert by["k1 in the reward"][4] == pytest.approx(1.0, abs=1e-9)
    # OPD's Â_t = −k1_t at ratio 1 has k2's gradient, −k1_t ∇log π: the state-wise ∇KL, not the sequences' ∇KL
    opd = by["k1 per token (OPD's Â_t)"]
    assert opd[3:] == pytest.approx(by["k2"][3:], rel=1e-9) and opd[3] < 0.999


def test_opd_per_token_advantage_is_the_state_wise_kl_gradient(task):
    """E[∇] of distill.opd_advantage's loss (π_ref as the teacher, on-policy) = Σ_s d(s) ∇KL(π_θ(·|s)‖π_T(·|s)), the
    visit probabilities d held fixed: by enumeration, with autograd through the per-prefix KL."""
    batches = oracle.exact_batches(task, task.theta, 1)
    g = -oracle.batch_grads(dict(adv="opd", **oracle.SUM), task, task.theta, task.theta, task.theta, batches, 1)
    mean, _ = oracle.moments(g, *batches[2:])
    th = task.theta.clone().requires_grad_()
    lp, lq = th.log_softmax(-1), task.ref.log_softmax(-1)  # [P, R, V]
    kl_at = (lp.exp() * (lp - lq)).sum(-1)[:, task.pre]  # [P, Y, H]: the KL at each completion's t-th prefix
    visit = oracle.seq_logp(task.theta, task).exp()  # [P, Y], no gradient
    want, = torch.autograd.grad((visit * torch.where(task.mask, kl_at, 0.0).sum(-1)).sum(1).mean(), th)
    torch.testing.assert_close(mean, want.reshape(-1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("group", [2, 4])
def test_maxrl_prompt_weights_closed_form(task, group):
    """MaxRL's Â_i = G r_i / K − 1 (K ≥ 1 successes; 0 when K = 0) gives E[ĝ_p] = c_p ∇p with
    c_p = (1 − (1 − p)^G) / p − (1 − p)^(G − 1): the first term is E[1{K ≥ 1}] ∇p / p, the second the mean
    baseline's share of the K = 0 outcomes, which are zeroed. So the hardest prompt weighs most, bounded by G."""
    mean, true = exact_mean(dict(adv="maxrl", **oracle.SUM), task, group=group)
    p = (oracle.seq_logp(task.theta, task).exp() * task.reward).sum(1)
    c = (1 - (1 - p) ** group) / p - (1 - p) ** (group - 1)
    torch.testing.assert_close(mean.view(task.P, -1), c[:, None] * true.view(task.P, -1), rtol=1e-3, atol=1e-9)

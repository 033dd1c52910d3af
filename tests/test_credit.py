"""credit.py (rewards -> advantages) against hand-computed numbers and naive loops."""
import math

import pytest
import torch

import credit


def test_worked_example_advantages():
    for r in ([1.0, 0, 0, 1], [0.0, 0, 1, 1]):
        a = credit.group_advantages(torch.tensor(r), 4, eps=1e-8)
        expect = [0.8660254 if x == 1 else -0.8660254 for x in r]
        torch.testing.assert_close(a, torch.tensor(expect), rtol=0, atol=1e-6)
    # two prompts in one batch, prompt-major
    a = credit.group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1]), 4, eps=1e-8)
    torch.testing.assert_close(a.abs(), torch.full((8,), 0.8660254), rtol=0, atol=1e-6)


def test_default_eps_bounds_a_tiny_spread():
    # the default eps = 1e-4 added to the Bessel-corrected group std: [1, 0, 0, 1] has mean 1/2, deviations ±1/2,
    # std sqrt((4 · 1/4) / 3) = sqrt(1/3) (sqrt(0.5) is the std of a G = 2 group [1, 0])
    a = credit.group_advantages(torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0]), 4)
    hand = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # 0.865876, vs 0.866025 at eps = 0
    torch.testing.assert_close(a[:4], torch.tensor([hand, -hand, -hand, hand]), rtol=0, atol=1e-6)
    # [1, 0, 0, 0]: mean 1/4, std sqrt((9/16 + 3/16) / 3) = 1/2
    torch.testing.assert_close(a[4:], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4), rtol=0, atol=1e-6)
    two = credit.group_advantages(torch.tensor([1.0, 0]), 2)
    torch.testing.assert_close(two, torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-4), rtol=0, atol=1e-6)
    # a spread of 1e-6 (float noise in a shaped reward): eps dominates the std, so |Â| is small, not ±0.87
    tiny = credit.group_advantages(torch.tensor([1e-6, 0, 0, 1e-6]), 4)
    hand = 5e-7 / (5e-7 * math.sqrt(4 / 3) + 1e-4)  # 0.00497
    torch.testing.assert_close(tiny, torch.tensor([hand, -hand, -hand, hand]), rtol=1e-4, atol=0)
    assert tiny.abs().max() < 0.01


def test_scale_batch_and_none_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # groups [1, 0] and [0, 0], G = 2
    none = credit.group_advantages(r, 2, scale="none")
    assert none.tolist() == [0.5, -0.5, 0.0, 0.0]
    # batch std (Bessel) of [1, 0, 0, 0] = sqrt(0.75 / 3) = 0.5
    batch = credit.group_advantages(r, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(batch, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    # group std of [1, 0] = sqrt(0.5)
    group = credit.group_advantages(r, 2, eps=0.0)
    torch.testing.assert_close(group, torch.tensor([0.5, -0.5, 0, 0]) / math.sqrt(0.5))


def test_keep_groups():
    r = torch.tensor([0.0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0])  # none, some, all, some correct
    assert credit.keep_groups(r.view(-1, 3).tolist()) == [False, True, False, True]


def test_overlong_penalty_boundaries():
    lengths = torch.tensor([0, 12, 16, 17, 18, 20, 21, 100])  # max_len 20, cache 4: ramp over (16, 20]
    got = credit.overlong_penalty(lengths, max_len=20, cache_len=4)
    torch.testing.assert_close(got, torch.tensor([0, 0, 0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    # no cache: a hard cut at max_len
    assert credit.overlong_penalty(torch.tensor([20, 21]), 20, 0).tolist() == [0.0, -1.0]


def test_process_advantages_hand_example():
    # one prompt, G = 2, L = 5; row 0 has steps ending at tokens 1 and 3, row 1 one step ending at 2
    rewards = torch.tensor([[1.0, 0.0], [0.0, 9.0]])
    ends = torch.tensor([[1, 3], [2, 0]])
    smask = torch.tensor([[True, True], [True, False]])
    got = credit.process_advantages(rewards, ends, smask, group_size=2, length=5, eps=0.0)
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
    got = credit.process_advantages(rewards, ends, smask, group, length, eps=1e-4)
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


def test_rloo_advantages_loop_and_edges():
    g = torch.Generator().manual_seed(5)
    for group in (2, 3, 5):
        r = torch.randint(0, 3, (4 * group,), generator=g).float()
        r[:group] = 1.0  # one zero-spread group
        got = credit.group_advantages(r, group, scale="rloo")
        for i in range(len(r)):
            others = [float(r[j]) for j in range(len(r)) if j // group == i // group and j != i]
            assert got[i].item() == pytest.approx(float(r[i]) - sum(others) / len(others), abs=1e-6)
        assert torch.equal(got[:group], torch.zeros(group))  # exact zeros, not ulps
    assert credit.group_advantages(torch.tensor([1.0, 0.0]), 2, scale="rloo").tolist() == [1.0, -1.0]
    assert torch.equal(credit.group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1, scale="rloo"), torch.zeros(3))


def test_reinforce_pp_advantages_token_weighted_loop():
    g = torch.Generator().manual_seed(6)
    r = torch.randint(0, 2, (12,), generator=g).float()
    r[4:8] = 1.0  # a zero-spread group: 0 after the baseline, −mean/std after the batch whitening
    lengths = torch.randint(0, 9, (12,), generator=g)
    lengths[3] = 0  # an all-padding row carries no token, so it does not move the batch statistics
    got = credit.group_advantages(r, 4, scale="reinforce_pp", lengths=lengths, eps=0.0)
    centred = [float(r[i]) - sum(float(r[j]) for j in range(12) if j // 4 == i // 4) / 4 for i in range(12)]
    tokens = [centred[i] for i in range(12) for _ in range(int(lengths[i]))]  # one entry per token
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((a - mean) ** 2 for a in tokens) / len(tokens))
    torch.testing.assert_close(got, torch.tensor([(a - mean) / std for a in centred]))
    # every group zero-spread: exact zeros, not 0/0
    same = credit.group_advantages(torch.ones(8), 4, scale="reinforce_pp", lengths=torch.full((8,), 3))
    assert torch.equal(same, torch.zeros(8))
    with pytest.raises(ValueError, match="lengths"):
        credit.group_advantages(r, 4, scale="reinforce_pp")




# ---------------------------------------------------------------- MaxRL, KL in the reward

def test_maxrl_advantages_by_hand_and_loop():
    # group 1: 1 of 4 right (p̂ = 1/4) → (1 − 1/4)/(1/4) = 3 and −1; group 2: 3 of 4 (p̂ = 3/4) → 1/3 and −1;
    # group 3: none right → 0 (the estimator 1/K Σ_{r=1} ∇log π is 0 there); group 4: all right → 0
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    got = credit.group_advantages(r, 4, scale="maxrl", eps=0.0)
    expect = [3, -1, -1, -1, 1 / 3, 1 / 3, -1, 1 / 3] + [0] * 8
    torch.testing.assert_close(got, torch.tensor(expect, dtype=torch.float32))
    # the sum over a 0/1 group is G/K Σ_{right} − G = 0 and Σ_i Â_i ∇ equals G·(1/K Σ_right ∇ − 1/G Σ_all ∇)
    g = torch.Generator().manual_seed(3)
    r = (torch.rand(40, generator=g) < 0.3).float()
    got = credit.group_advantages(r, 8, scale="maxrl", eps=0.0).view(5, 8)
    for row, a in zip(r.view(5, 8), got):
        k = int(row.sum())
        want = [0.0] * 8 if k in (0, 8) else [8 / k * float(x) - 1 for x in row]
        torch.testing.assert_close(a, torch.tensor(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rewards >= 0"):  # an overlong penalty would flip the sign of Â
        credit.group_advantages(torch.tensor([1.0, -0.5]), 2, scale="maxrl")


def test_kl_reward_by_hand():
    # row 0: k1 = (−1 − (−2)) + (−0.5 − (−0.25)) = 0.75 → 1 − 0.1·0.75; row 1's padding token (garbage) is ignored
    old = torch.tensor([[-1.0, -0.5], [-0.3, 99.0]])
    ref = torch.tensor([[-2.0, -0.25], [-0.1, -5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    got = credit.kl_reward(torch.tensor([1.0, 0.0]), old.requires_grad_(), ref, mask, beta=0.1)
    torch.testing.assert_close(got, torch.tensor([1 - 0.075, -0.1 * -0.2]))
    assert not got.requires_grad
    with pytest.raises(ValueError, match="need rewards"):
        credit.kl_reward(torch.zeros(3), old, ref, mask, 0.1)

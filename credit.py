"""Credit assignment for GRPO-family trainers: rewards in, advantages out (shaping, baselines).
Imports only torch; grpo.py holds the policy losses that consume these advantages.

A prompt q gets a group of G sampled completions o_1..o_G; rows are prompt-major, N = P·G.
1. Reward shaping, DAPO §3.4 soft overlong punishment (eq. 13), Lmax = max_len, Lc = cache_len:
     R_len(y) = 0 if |y| ≤ Lmax − Lc; (Lmax − Lc − |y|) / Lc if Lmax − Lc < |y| ≤ Lmax;
                −1 otherwise.
   KL in the reward (kl_reward; Ziegler et al. 2019 eq. 2, Ouyang et al. 2022 eq. 2), before Â:
     r_i ← r_i − β Σ_t k1_i,t,   k1_t = log π_old(o_t) − log π_ref(o_t).
   Its expected score-function gradient is the exact ∇_θ [J − β KL(π_θ‖π_ref)]
   (tools/oracle.py's "k1 in the reward" row); k3 in the loss is not.
2. Dynamic sampling, DAPO §3.2: keep a group only if 0 < |{o_i correct}| < G (reward spread > 0),
   since a zero-spread group has Â = 0 and gives no gradient.
3. Group-relative advantage, DeepSeekMath §4.1.2, scale="group":
     Â_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + eps).
   "none" keeps only r_i − mean (Dr. GRPO §3); "batch" divides by the std of the whole batch.
   "rloo", leave-one-out (Ahmadian et al. 2024):
     Â_i = r_i − 1/(G−1) Σ_{j≠i} r_j = G/(G−1) (r_i − mean).
   "reinforce_pp", REINFORCE++-baseline (Hu 2025): A_i = r_i − mean(r_1..r_G), then whitened over
   every token of the global batch, a row weighted by its length |o_i|:
     Â_i = (A_i − mean_tok A) / (std_tok A + eps).
   "maxrl", MaxRL (Tajwar et al. 2026, arXiv 2602.02710, on-policy, mean control variate):
     Â_i = (r_i − mean r) / (mean r + eps).
   For 0/1 rewards its gradient 1/K Σ_{r_i=1} ∇log π(o_i) − 1/G Σ_i ∇log π(o_i) (K wins)
   estimates ∇ log p(q) = ∇p/p, so a prompt solved with probability p weighs ~1/p (0 when no
   sample succeeds, as there the estimator is 0).
   Process supervision, DeepSeekMath §4.1.3, over all steps R of the group:
     r̃_j = (r_j − mean(R)) / std(R),   Â_t = Σ_{j: index(j) ≥ t} r̃_j.

Test: python -m pytest -q tests/test_credit.py
"""
import math
from typing import Optional

import torch

SCALES = ("group", "batch", "none", "rloo", "reinforce_pp", "maxrl")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    # [N] -> [P, G]; rows are prompt-major so a plain view puts each group on one row
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-d [N] with N divisible by group_size={group_size} "
                         f"(got shape {tuple(rewards.shape)}: not 1-d or not divisible)")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-4, lengths: Optional[torch.Tensor] = None):
    """rewards [N] prompt-major -> advantages [N] (float32), the equation of `scale` in step 3 of
    the module docstring ("maxrl" expects rewards ≥ 0).

    lengths [N] (each row's loss tokens) only for scale="reinforce_pp": pass the whole global
    batch, as every rank holds it, so the result is exact. There a zero-spread group's 0 becomes
    −mean/std after the batch whitening, as in the paper."""
    r = _grouped(rewards, group_size)  # [P, G]
    adv = r - r.mean(1, keepdim=True)  # [P, G]
    if scale == "group":
        # Bessel-corrected std, as in DeepSeekMath's worked example; G = 1 has no spread (std 0)
        std = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(r)
        adv = adv / (std + eps)
    elif scale == "batch":
        adv = adv / ((r.std() if r.numel() > 1 else r.new_zeros(())) + eps)
    elif scale == "rloo":
        # r_i − mean_{j≠i} r_j = G/(G−1) (r_i − mean_G r); G = 1 has no other sample: 0
        adv = adv * (group_size / max(group_size - 1, 1))
    elif scale == "maxrl":
        # p̂ = mean r is a success rate: a negative reward would flip Â's sign
        if bool((r < 0).any()):
            raise ValueError("scale='maxrl' needs rewards >= 0 "
                             "(no negative shaping such as overlong_buffer)")
        # divide by the group's mean reward p̂ (not its std): hard prompts (small p̂) weigh ~1/p̂
        adv = adv / (r.mean(1, keepdim=True) + eps)
    elif scale not in ("none", "reinforce_pp"):
        raise ValueError(f"unknown advantage scale {scale!r}; use one of {SCALES}")
    # exact zeros for zero-spread groups ([P, 1]): the float mean of equal values can be off by
    # an ulp, and eps = 0 gives 0/0
    adv = torch.where((r.amax(1, keepdim=True) - r.amin(1, keepdim=True)) > 0, adv, 0.0)
    if scale == "reinforce_pp":
        if lengths is None or lengths.shape != rewards.shape:
            raise ValueError(f"scale='reinforce_pp' needs lengths [N] = {tuple(rewards.shape)}")
        # mean and (population) std over tokens: a row of |o_i| tokens counts |o_i| times,
        # as in OpenRLHF
        w = lengths.float().view_as(r)
        mean = (w * adv).sum() / w.sum().clamp(min=1)
        std = ((w * (adv - mean) ** 2).sum() / w.sum().clamp(min=1)).sqrt()
        adv = (adv - mean) / (std + eps)
    return adv.view(-1)


def keep_groups(rewards) -> list[bool]:
    """DAPO dynamic sampling (§3.2): each group's rewards -> True where they differ (a group whose
    rewards are all equal has Â = 0: it teaches nothing)."""
    return [max(r) > min(r) for r in rewards]


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO eq. 13 soft overlong punishment: lengths [N] -> penalty [N] in [-1, 0]."""
    if not 0 <= cache_len <= max_len:
        raise ValueError("need 0 <= cache_len <= max_len, "
                         f"got cache_len={cache_len}, max_len={max_len}")
    y = lengths.float()
    soft = max_len - cache_len
    # linear ramp from 0 at soft to -1 at max_len; cache_len = 0 leaves the ramp empty (hard cut)
    ramp = (soft - y) / max(cache_len, 1)
    return torch.where(y <= soft, 0.0, torch.where(y <= max_len, ramp, -1.0))


def process_advantages(step_rewards: torch.Tensor, step_ends: torch.Tensor,
                       step_mask: torch.Tensor, group_size: int, length: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """Process supervision (DeepSeekMath §4.1.3): per-step rewards -> per-token advantages [N, L].

    step_rewards [N, K] float, step_ends [N, K] long (index of the last completion token of each
    step), step_mask [N, K] bool (False for padding steps); K is the most steps of any row.
    """
    shapes = (step_ends.shape, step_mask.shape)
    if step_rewards.dim() != 2 or shapes != (step_rewards.shape,) * 2:
        raise ValueError("step_rewards, step_ends, step_mask must share a 2-d shape [N, K], got "
                         f"{tuple(step_rewards.shape)}, {tuple(step_ends.shape)}, "
                         f"{tuple(step_mask.shape)}")
    n, k = step_rewards.shape
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"N={n} is not divisible by group_size={group_size}")
    if k == 0:  # no steps anywhere: nothing to reward
        return step_rewards.new_zeros(n, length, dtype=torch.float32)
    # a step ending before token 0 rewards no token, so it is dropped like padding
    valid = step_mask.bool() & (step_ends >= 0)
    # [P, G·K]: all steps of all G outputs of a prompt
    r = step_rewards.float().reshape(-1, group_size * k)
    m = valid.reshape(-1, group_size * k).float()
    cnt = m.sum(1, keepdim=True)
    mean = (r * m).sum(1, keepdim=True) / cnt.clamp(min=1)
    # Bessel-corrected std over the group's steps, matching group_advantages
    var = (m * (r - mean) ** 2).sum(1, keepdim=True) / (cnt - 1).clamp(min=1)
    big = torch.where(m > 0, r, -math.inf).amax(1, True)
    small = torch.where(m > 0, r, math.inf).amin(1, True)
    norm = torch.where((m > 0) & (big > small), (r - mean) / (var.sqrt() + eps), 0.0).view(n, k)
    # put each step's reward at its end token, then a reverse cumsum sums the steps ending at or
    # after t
    ends = step_ends.clamp(0, length - 1)
    per_end = torch.zeros(n, length, dtype=norm.dtype, device=norm.device)
    per_end = per_end.scatter_add_(1, ends, norm)
    return per_end.flip(1).cumsum(1).flip(1)


def kl_reward(rewards: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
              mask: torch.Tensor, beta: float) -> torch.Tensor:
    """KL in the reward: r_i − β Σ_t (log π_old − log π_ref)(o_i,t) over valid tokens (k1
    summed over the sequence, detached). rewards [N]; old_logp, ref_logp, mask [N, L] -> [N]
    float32. Pass π_old (the sampling policy as the trainer scores it): the reward must not depend
    on θ."""
    same = old_logp.shape == ref_logp.shape == mask.shape
    if not same or rewards.shape != old_logp.shape[:1]:
        raise ValueError("need rewards [N] and old_logp, ref_logp, mask [N, L], got "
                         f"{tuple(rewards.shape)}, {tuple(old_logp.shape)}, "
                         f"{tuple(ref_logp.shape)}, {tuple(mask.shape)}")
    k1 = old_logp.detach().float() - ref_logp.detach().float()  # [N, L]
    k1 = torch.where(mask != 0, k1, 0.0)
    return rewards.float() - beta * k1.sum(1)

"""Pure GRPO / DAPO / Dr. GRPO loss functions: tensors in, (loss, metrics) out. Imports only torch.

A prompt q gets a group of G sampled completions o_1..o_G; rows are prompt-major, N = P·G.
1. Reward shaping, DAPO §3.4 soft overlong punishment (eq. 13), with Lmax = max_len, Lc = cache_len:
     R_len(y) = 0 if |y| ≤ Lmax − Lc;  ((Lmax − Lc) − |y|) / Lc if Lmax − Lc < |y| ≤ Lmax;  −1 otherwise.
2. Dynamic sampling, DAPO §3.2: keep a group only if 0 < |{o_i correct}| < G (its reward spread is > 0),
   since a zero-spread group has Â = 0 and gives no gradient.
3. Group-relative advantage, DeepSeekMath §4.1.2:  Â_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + eps).
   scale="none" keeps only r_i − mean (Dr. GRPO §3); scale="batch" divides by the std of the whole batch.
   Process supervision, DeepSeekMath §4.1.3: r̃_j = (r_j − mean(R)) / std(R) over all steps R of the group,
   and Â_t = Σ_{j: index(j) ≥ t} r̃_j.
4. Clipped surrogate per token, ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t):
     s_t = min(ρ_t Â_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â_t)     ε_high > ε_low: DAPO §3.1 clip-higher (eq. 8)
5. KL to π_ref with the k3 estimator (DeepSeekMath eq. 4), ≥ 0 and unbiased under o ~ π_θ:
     D_t = π_ref/π_θ − log(π_ref/π_θ) − 1,      per-token loss ℓ_t = −s_t + β D_t
6. Aggregation (agg), the loss is −J:
     "seq_mean_token_mean"      1/G Σ_i 1/|o_i| Σ_t ℓ_i,t        J_GRPO, DeepSeekMath eq. 3
     "token_mean"               1/Σ_i |o_i| Σ_i Σ_t ℓ_i,t        DAPO §3.3 token-level loss, eq. 8
     "seq_mean_token_sum_norm"  1/(G·Lmax) Σ_i Σ_t ℓ_i,t         Dr. GRPO §3, a constant normaliser
   Micro-batches / ranks: loss = Σ(local terms) / loss_scale, loss_scale = all-reduced Σ loss_normaliser(...),
   so the summed micro-batch losses equal the full-batch loss exactly.

Test: python -m pytest -q tests/test_grpo.py
"""
import math
from typing import Optional, Union

import torch

AGGS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
Scale = Optional[Union[float, torch.Tensor]]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    # [N] -> [P, G]; rows are prompt-major so a plain view puts each group on one row
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-d [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"N={rewards.numel()} is not divisible by group_size={group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4):
    """rewards [N] prompt-major -> advantages [N] (float32)."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown advantage scale {scale!r}; use 'group', 'batch' or 'none'")
    r = _grouped(rewards, group_size)  # [P, G]
    adv = r - r.mean(1, keepdim=True)  # [P, G]
    if scale == "group":
        # Bessel-corrected std, as in DeepSeekMath's worked example; G = 1 has no spread, so std is 0 there
        adv = adv / ((r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(r)) + eps)
    elif scale == "batch":
        adv = adv / ((r.std() if r.numel() > 1 else r.new_zeros(())) + eps)
    # exact zeros for zero-spread groups: the float mean of equal values can be off by an ulp, and eps=0 gives 0/0
    spread = (r.amax(1, keepdim=True) - r.amin(1, keepdim=True)) > 0  # [P, 1]
    return torch.where(spread, adv, 0.0).view(-1)


def keep_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: rewards [N] -> bool [N/G], True where the group's rewards are not all equal."""
    r = _grouped(rewards, group_size)
    return (r.amax(1) - r.amin(1)) > 0


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO eq. 13 soft overlong punishment: lengths [N] -> penalty [N] in [-1, 0]."""
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    y = lengths.float()
    soft = max_len - cache_len
    # linear ramp from 0 at soft to -1 at max_len; cache_len = 0 leaves the ramp empty (hard cut)
    ramp = (soft - y) / max(cache_len, 1)
    return torch.where(y <= soft, 0.0, torch.where(y <= max_len, ramp, -1.0))


def process_advantages(step_rewards: torch.Tensor, step_ends: torch.Tensor, step_mask: torch.Tensor,
                       group_size: int, length: int, eps: float = 1e-4) -> torch.Tensor:
    """Process supervision (DeepSeekMath §4.1.3): per-step rewards -> per-token advantages [N, L].

    step_rewards [N, K] float, step_ends [N, K] long (index of the last completion token of each step),
    step_mask [N, K] bool (False for padding steps); K is the most steps of any row.
    """
    if step_rewards.dim() != 2 or step_ends.shape != step_rewards.shape or step_mask.shape != step_rewards.shape:
        raise ValueError(f"step_rewards, step_ends, step_mask must share a 2-d shape [N, K], got "
                         f"{tuple(step_rewards.shape)}, {tuple(step_ends.shape)}, {tuple(step_mask.shape)}")
    n, k = step_rewards.shape
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"N={n} is not divisible by group_size={group_size}")
    if k == 0:  # no steps anywhere: nothing to reward
        return step_rewards.new_zeros(n, length, dtype=torch.float32)
    # a step ending before token 0 rewards no token, so it is dropped like padding
    valid = step_mask.bool() & (step_ends >= 0)
    r = step_rewards.float().reshape(-1, group_size * k)  # [P, G·K]: all steps of all G outputs of a prompt
    m = valid.reshape(-1, group_size * k).float()
    cnt = m.sum(1, keepdim=True)
    mean = (r * m).sum(1, keepdim=True) / cnt.clamp(min=1)
    # Bessel-corrected std over the group's steps, matching group_advantages
    var = (m * (r - mean) ** 2).sum(1, keepdim=True) / (cnt - 1).clamp(min=1)
    big, small = torch.where(m > 0, r, -math.inf).amax(1, True), torch.where(m > 0, r, math.inf).amin(1, True)
    norm = torch.where((m > 0) & (big > small), (r - mean) / (var.sqrt() + eps), 0.0).view(n, k)
    # put each step's reward at its end token, then a reverse cumsum sums the steps ending at or after t
    ends = step_ends.clamp(0, length - 1)
    per_end = torch.zeros(n, length, dtype=norm.dtype, device=norm.device).scatter_add_(1, ends, norm)
    return per_end.flip(1).cumsum(1).flip(1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """log π(target): logits [B, T, V], targets [B, T] -> float32 [B, T], differentiable.

    Works on `chunk` rows at a time as gathered logit − logsumexp, so only a [chunk, T, V] float32 copy
    exists at once, never a full [B, T, V] log-softmax.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"need logits [B, T, V] and targets [B, T], got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}")
    out = []
    for i in range(0, logits.shape[0], chunk):
        z = logits[i:i + chunk].float()  # [c, T, V]
        picked = z.gather(-1, targets[i:i + chunk].unsqueeze(-1)).squeeze(-1)  # [c, T]
        out.append(picked - z.logsumexp(-1))
    return torch.cat(out)


def token_entropy(logits: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Exact entropy of π per position: logits [B, T, V] -> float32 [B, T], H = −Σ_v π_v log π_v."""
    if logits.dim() != 3:
        raise ValueError(f"need logits [B, T, V], got {tuple(logits.shape)}")
    out = []
    for i in range(0, logits.shape[0], chunk):
        z = logits[i:i + chunk].float()
        # −Σ p log p on the normalised log-probs, not lse − Σ p z, which cancels badly for peaked π
        logp = z - z.logsumexp(-1, keepdim=True)  # [c, T, V]
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Exact KL(π_θ ‖ π_ref) over the full vocabulary: [B, T, V] twice -> float32 [B, T], ≥ 0."""
    if logits.dim() != 3 or ref_logits.shape != logits.shape:
        raise ValueError(f"need logits and ref_logits of one shape [B, T, V], got {tuple(logits.shape)}, "
                         f"{tuple(ref_logits.shape)}")
    out = []
    for i in range(0, logits.shape[0], chunk):
        lp = logits[i:i + chunk].float().log_softmax(-1)  # [c, T, V]
        lq = ref_logits[i:i + chunk].float().log_softmax(-1)
        # clamp away the ~1e-7 negative rounding so the diagnostic is a true divergence
        out.append((lp.exp() * (lp - lq)).sum(-1).clamp(min=0))
    return torch.cat(out)


def loss_normaliser(mask: torch.Tensor, agg: str, max_len: Optional[int] = None) -> torch.Tensor:
    """This micro-batch's share of the loss denominator (0-d float32): valid tokens for "token_mean",
    non-empty rows for "seq_mean_token_mean", N·max_len (max_len defaults to L) for "seq_mean_token_sum_norm".
    Sum it over micro-batches and ranks and pass the total as loss_scale."""
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; use one of {AGGS}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-d [N, L], got shape {tuple(mask.shape)}")
    valid = mask != 0
    if agg == "token_mean":
        return valid.sum().float()
    if agg == "seq_mean_token_mean":
        return valid.any(1).sum().float()
    n, length = mask.shape
    return torch.tensor(float(n * (length if max_len is None else max_len)), device=mask.device)


def _aggregate(per_tok: torch.Tensor, valid: torch.Tensor, agg: str, max_len: Optional[int],
               loss_scale: Scale) -> torch.Tensor:
    # numerator: the sum of per-sequence means or per-token losses; denominator: local or global normaliser
    norm = loss_normaliser(valid, agg, max_len) if loss_scale is None else None
    if agg == "seq_mean_token_mean":
        # a row with no valid tokens has no mean: it adds 0 here and is not counted by loss_normaliser
        total = (per_tok.sum(1) / valid.sum(1).clamp(min=1)).sum()
    else:
        total = per_tok.sum()
    # an all-padding batch gives 0 rather than 0/0
    return total / norm.clamp(min=1) if loss_scale is None else total / loss_scale


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.2, ref_logp: Optional[torch.Tensor] = None,
                beta: float = 0.0, agg: str = "seq_mean_token_mean", max_len: Optional[int] = None,
                loss_scale: Scale = None):
    """Clipped-surrogate GRPO/DAPO/Dr. GRPO loss. logp, old_logp, ref_logp, mask [N, L]; advantages [N] or
    [N, L]. Returns (loss, metrics) with metrics a dict of detached 0-d tensors (token means over valid tokens)."""
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; use one of {AGGS}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-d [N, L], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [N] or [N, L] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    valid = mask != 0  # [N, L]
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype).expand_as(logp)
    # zero the log-ratio on padding before exp, so garbage there cannot become inf and then NaN gradients
    ratio = torch.where(valid, logp - old_logp, 0.0).exp()  # [N, L]
    # pessimistic min: clipping removes the gain from moving ρ past the trust region, never a loss's penalty
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    per_tok = -surr
    if beta > 0:
        # k3 = e^d − d − 1 ≥ 0 with d = log(π_ref/π_θ): low variance and unbiased for tokens sampled from π_θ
        d = torch.where(valid, ref_logp - logp, 0.0)
        kl = d.exp() - d - 1
        per_tok = per_tok + beta * kl
    per_tok = torch.where(valid, per_tok, 0.0)
    loss = _aggregate(per_tok, valid, agg, max_len, loss_scale)

    # metrics: the clip is active (zero gradient) only where it binds against the advantage's sign
    with torch.no_grad():
        n_tok = valid.sum()
        denom = n_tok.clamp(min=1).float()
        metrics = {
            "clip_low": ((ratio < 1 - eps_low) & (adv < 0) & valid).sum() / denom,
            "clip_high": ((ratio > 1 + eps_high) & (adv > 0) & valid).sum() / denom,
            "ratio": torch.where(valid, ratio, 0.0).sum() / denom,
            "tokens": n_tok.float(),
        }
        if beta > 0:
            metrics["kl"] = torch.where(valid, kl, 0.0).sum() / denom
    return loss, metrics


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, loss_scale: Scale = None) -> torch.Tensor:
    """Token-mean negative log-likelihood over valid tokens (SFT cold start, STaR / rejection sampling).
    logp, mask [N, L]. With loss_scale (the global valid-token count) it is Σ NLL / loss_scale."""
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"need logp and mask of one shape [N, L], got {tuple(logp.shape)}, {tuple(mask.shape)}")
    valid = mask != 0
    return _aggregate(torch.where(valid, -logp, 0.0), valid, "token_mean", None, loss_scale)

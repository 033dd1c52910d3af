"""Pure GRPO / DAPO / Dr. GRPO (and GSPO, CISPO, RLOO, REINFORCE++) loss functions: tensors in, (loss, metrics)
out. Imports only torch.

A prompt q gets a group of G sampled completions o_1..o_G; rows are prompt-major, N = P·G.
1. Reward shaping, DAPO §3.4 soft overlong punishment (eq. 13), with Lmax = max_len, Lc = cache_len:
     R_len(y) = 0 if |y| ≤ Lmax − Lc;  ((Lmax − Lc) − |y|) / Lc if Lmax − Lc < |y| ≤ Lmax;  −1 otherwise.
2. Dynamic sampling, DAPO §3.2: keep a group only if 0 < |{o_i correct}| < G (its reward spread is > 0),
   since a zero-spread group has Â = 0 and gives no gradient.
3. Group-relative advantage, DeepSeekMath §4.1.2:  Â_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + eps).
   scale="none" keeps only r_i − mean (Dr. GRPO §3); scale="batch" divides by the std of the whole batch;
   "rloo", leave-one-out (Ahmadian et al. 2024, RLOO):  Â_i = r_i − 1/(G−1) Σ_{j≠i} r_j = G/(G−1) (r_i − mean);
   "reinforce_pp", REINFORCE++-baseline (Hu 2025):  A_i = r_i − mean(r_1..r_G), then whitened over every token
   of the global batch, Â_i = (A_i − mean_tok A) / (std_tok A + eps), a row weighted by its length |o_i|.
   Process supervision, DeepSeekMath §4.1.3: r̃_j = (r_j − mean(R)) / std(R) over all steps R of the group,
   and Â_t = Σ_{j: index(j) ≥ t} r̃_j.
4. Clipped surrogate per token, ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t):
     s_t = min(ρ_t Â_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â_t)     ε_high > ε_low: DAPO §3.1 clip-higher (eq. 8)
   ratio_level="sequence", GSPO (Zheng et al. 2025, eq. 5): ρ_t → s_i = exp(1/|o_i| Σ_t log ρ_i,t), one ratio and
     one clip per sequence, in the paper's GSPO-token form s_i,t = sg[s_i] · π_θ(o_i,t)/sg[π_θ(o_i,t)].
   pg_loss="cispo", MiniMax-M1 §3.1: s_t = sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) Â_t log π_θ(o_t): every token
     keeps its gradient, only its weight is capped.
   dual_clip=c > 1, Ye et al. 2020 (dual-clip PPO): s_t = max(s_t, c Â_t) where Â_t < 0, bounding ρ_t's effect.
   pg_weight w_t, detached, multiplies s_t: truncated importance sampling of the sampler/trainer mismatch
     (Yao et al. 2025), w_t = min(π_old/π_sampler, C) per token or per sequence, or masked outside [1/C, C];
     the top-entropy mask (Wang et al. 2025, "Beyond the 80/20 rule"): w_t = 1[H_t ≥ τ], τ the top-q entropy.
5. KL to π_ref (Schulman 2020, "Approximating KL divergence"), d_t = log π_ref(o_t) − log π_θ(o_t):
     k1 = −d_t,  k2 = d_t²/2,  k3 = e^d_t − d_t − 1 (DeepSeekMath eq. 4; default),  ℓ_t = −s_t + β D_t
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
SCALES = ("group", "batch", "none", "rloo", "reinforce_pp")
RATIO_LEVELS, PG_LOSSES, KL_ESTIMATORS = ("token", "sequence"), ("clip", "cispo"), ("k1", "k2", "k3")
TIS_LEVELS, TIS_MODES = ("token", "sequence"), ("truncate", "mask")
Scale = Optional[Union[float, torch.Tensor]]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    # [N] -> [P, G]; rows are prompt-major so a plain view puts each group on one row
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-d [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"N={rewards.numel()} is not divisible by group_size={group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     lengths: Optional[torch.Tensor] = None):
    """rewards [N] prompt-major -> advantages [N] (float32). lengths [N] (each row's loss tokens) only for
    scale="reinforce_pp"; pass the whole global batch, as every rank holds it, so the result is exact. There a
    zero-spread group's 0 becomes −mean/std after the batch whitening, as in the paper."""
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; use one of {SCALES}")
    r = _grouped(rewards, group_size)  # [P, G]
    adv = r - r.mean(1, keepdim=True)  # [P, G]
    if scale == "group":
        # Bessel-corrected std, as in DeepSeekMath's worked example; G = 1 has no spread, so std is 0 there
        adv = adv / ((r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(r)) + eps)
    elif scale == "batch":
        adv = adv / ((r.std() if r.numel() > 1 else r.new_zeros(())) + eps)
    elif scale == "rloo":
        # r_i − mean_{j≠i} r_j = G/(G−1) (r_i − mean_G r); with G = 1 there is no other sample and adv is 0
        adv = adv * (group_size / max(group_size - 1, 1))
    # exact zeros for zero-spread groups: the float mean of equal values can be off by an ulp, and eps=0 gives 0/0
    spread = (r.amax(1, keepdim=True) - r.amin(1, keepdim=True)) > 0  # [P, 1]
    adv = torch.where(spread, adv, 0.0)
    if scale == "reinforce_pp":
        if lengths is None or lengths.shape != rewards.shape:
            raise ValueError(f"scale='reinforce_pp' needs lengths [N] = {tuple(rewards.shape)}")
        # mean and (population) std over tokens: a row of |o_i| tokens counts |o_i| times, as in OpenRLHF
        w = lengths.float().view_as(r)
        mean = (w * adv).sum() / w.sum().clamp(min=1)
        std = ((w * (adv - mean) ** 2).sum() / w.sum().clamp(min=1)).sqrt()
        adv = (adv - mean) / (std + eps)
    return adv.view(-1)


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


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) at tokens sampled from π_θ: [N, L] twice -> [N, L].
    k1 = −d is unbiased but signed, k2 = d²/2 is ≥ 0 but biased, k3 = e^d − d − 1 is both (Schulman 2020)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; use one of {KL_ESTIMATORS}")
    d = ref_logp - logp
    return -d if estimator == "k1" else 0.5 * d * d if estimator == "k2" else d.exp() - d - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.2, ref_logp: Optional[torch.Tensor] = None,
                beta: float = 0.0, agg: str = "seq_mean_token_mean", max_len: Optional[int] = None,
                loss_scale: Scale = None, ratio_level: str = "token", pg_loss: str = "clip", dual_clip: float = 0.0,
                kl_estimator: str = "k3", pg_weight: Optional[torch.Tensor] = None):
    """Clipped-surrogate GRPO/DAPO/Dr. GRPO loss (GSPO, CISPO, dual-clip by flag). logp, old_logp, ref_logp,
    mask, pg_weight [N, L]; advantages [N] or [N, L]. Returns (loss, metrics) with metrics a dict of detached
    0-d tensors (token means over valid tokens)."""
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; use one of {AGGS}")
    if ratio_level not in RATIO_LEVELS or pg_loss not in PG_LOSSES:
        raise ValueError(f"ratio_level {ratio_level!r} / pg_loss {pg_loss!r}: use {RATIO_LEVELS} / {PG_LOSSES}")
    if dual_clip != 0 and (dual_clip <= 1 or pg_loss != "clip"):
        raise ValueError(f"dual_clip must be 0 (off) or > 1 with pg_loss='clip', got {dual_clip} with {pg_loss!r}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-d [N, L], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("pg_weight", pg_weight)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [N] or [N, L] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    valid = mask != 0  # [N, L]
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype).expand_as(logp)
    # zero the log-ratio on padding before exp, so garbage there cannot become inf and then NaN gradients
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [N, L]
    if ratio_level == "sequence":
        # GSPO-token: the value is s_i, the gradient s_i ∇log π_θ(o_i,t), so with one Â_i per row and
        # agg="seq_mean_token_mean" the loss and its gradient are GSPO's eq. 5 exactly
        seq = log_ratio.sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp(min=1)  # [N, 1]
        log_ratio = torch.where(valid, seq.detach() + logp - logp.detach(), 0.0)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if pg_loss == "cispo":
        # 1 + log π − sg(log π) has value 1 and gradient ∇log π_θ: the loss keeps the surrogate's value, the
        # gradient is CISPO's, and nothing overflows where ρ does
        lp = torch.where(valid, logp, 0.0)
        surr = clipped.detach() * adv * (1 + lp - lp.detach())
    else:
        # pessimistic min: clipping removes the gain from moving ρ past the trust region, never a loss's penalty
        surr = torch.minimum(ratio * adv, clipped * adv)
        if dual_clip > 0:
            dual = (adv < 0) & (surr < dual_clip * adv)  # ρ > c for Â < 0: the loss stops growing with ρ
            surr = torch.where(dual, dual_clip * adv, surr)
    per_tok = -surr if pg_weight is None else -surr * pg_weight.detach().to(surr.dtype)
    if beta > 0:
        # both zeroed on padding: d = 0 there for every estimator, and garbage cannot reach the gradient
        kl = kl_penalty(torch.where(valid, logp, 0.0), torch.where(valid, ref_logp, 0.0), kl_estimator)
        per_tok = per_tok + beta * kl
    per_tok = torch.where(valid, per_tok, 0.0)
    loss = _aggregate(per_tok, valid, agg, max_len, loss_scale)

    # metrics: the clip is active (zero gradient) only where it binds against the advantage's sign; for CISPO,
    # where the weight is capped (the token still has a gradient)
    with torch.no_grad():
        n_tok = valid.sum()
        denom = n_tok.clamp(min=1).float()
        low, high = ratio < 1 - eps_low, ratio > 1 + eps_high
        if pg_loss == "clip":
            low, high = low & (adv < 0), high & (adv > 0)
        metrics = {
            "clip_low": (low & valid).sum() / denom,
            "clip_high": (high & valid).sum() / denom,
            "ratio": torch.where(valid, ratio, 0.0).sum() / denom,
            "tokens": n_tok.float(),
        }
        if dual_clip > 0:
            metrics["dual_clip"] = (dual & valid).sum() / denom
        if beta > 0:
            metrics["kl"] = torch.where(valid, kl, 0.0).sum() / denom
    return loss, metrics


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, level: str = "token",
                mode: str = "truncate", cap: float = 2.0):
    """Truncated importance sampling of the sampler/trainer mismatch (Yao et al. 2025): detached weights
    w = π_old/π_sampler, the trainer's old log-probs over the sampler's recorded ones, per token or (level=
    "sequence") one product per row; mode "truncate": min(w, C); "mask": w if 1/C ≤ w ≤ C, else 0.
    [N, L] thrice -> (weights [N, L] float32, 0 on padding; metrics: raw w's token mean and max, fraction cut)."""
    if level not in TIS_LEVELS or mode not in TIS_MODES or not cap >= 1:
        raise ValueError(f"tis level {level!r} / mode {mode!r} / cap {cap}: use {TIS_LEVELS} / {TIS_MODES} / >= 1")
    if old_logp.shape != sampler_logp.shape or mask.shape != old_logp.shape or old_logp.dim() != 2:
        raise ValueError(f"need old_logp, sampler_logp, mask of one shape [N, L], got {tuple(old_logp.shape)}, "
                         f"{tuple(sampler_logp.shape)}, {tuple(mask.shape)}")
    valid = mask != 0
    log_w = torch.where(valid, old_logp.detach().float() - sampler_logp.float(), 0.0)  # [N, L]
    if level == "sequence":
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    w = log_w.exp()  # a long sequence's product can overflow to inf: truncate gives C, mask gives 0, as it should
    cut = (w > cap) | ((w < 1 / cap) & (mode == "mask"))
    out = torch.where(valid & ~cut, w, 0.0) if mode == "mask" else torch.where(valid, w.clamp(max=cap), 0.0)
    denom = valid.sum().clamp(min=1)
    metrics = {"tis_mean": torch.where(valid, w, 0.0).sum() / denom,
               "tis_max": torch.where(valid, w, 0.0).amax() if w.numel() else w.new_zeros(()),
               "tis_cut": (cut & valid).sum() / denom}
    return out, metrics


def entropy_threshold(entropy: torch.Tensor, q: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """τ for the top-entropy mask (Wang et al. 2025): the k-th largest entropy, k = ⌈q·n⌉ of the n valid ones
    (mask, any shape; all of them without one); 0-d. Pass every token of the global batch (all-gather across
    ranks). Ties: every token with H_t = τ is kept, so slightly more than q·n may pass. q = 1 keeps all."""
    if not 0 < q <= 1:
        raise ValueError(f"top-entropy q must be in (0, 1], got {q}")
    h = entropy.detach().float().reshape(-1)
    ok = torch.ones_like(h, dtype=torch.bool) if mask is None else (mask != 0).reshape(-1)
    top = torch.where(ok, h, -math.inf).sort(descending=True).values
    # k in float64 with a 1e-6 slack: 0.07 · 100 is 7.000000000000001, whose ceiling would be 8
    k = torch.ceil(q * ok.sum().double() - 1e-6).long().clamp(min=1)
    return top.gather(0, (k - 1).view(1)).squeeze(0)  # no valid token: −inf, and no token is valid anyway


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Valid tokens whose entropy is at least τ = entropy_threshold(...): [N, L] -> bool [N, L] (a pg_weight)."""
    return (mask != 0) & (entropy.detach() >= threshold)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, loss_scale: Scale = None) -> torch.Tensor:
    """Token-mean negative log-likelihood over valid tokens (SFT cold start, STaR / rejection sampling).
    logp, mask [N, L]. With loss_scale (the global valid-token count) it is Σ NLL / loss_scale."""
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"need logp and mask of one shape [N, L], got {tuple(logp.shape)}, {tuple(mask.shape)}")
    valid = mask != 0
    return _aggregate(torch.where(valid, -logp, 0.0), valid, "token_mean", None, loss_scale)

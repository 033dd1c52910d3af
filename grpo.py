"""Pure GRPO / DAPO / Dr. GRPO (and GSPO, CISPO, DPPO, SAPO, GMPO, Clip-/KL-Cov) policy losses: tensors in,
(loss, metrics) out. Imports only torch.

A prompt q gets a group of G sampled completions o_1..o_G; rows are prompt-major, N = P·G. The advantages Â come
from credit.py (rewards, shaping, group baselines).
1. Clipped surrogate per token, ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t):
     s_t = min(ρ_t Â_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â_t)     ε_high > ε_low: DAPO §3.1 clip-higher (eq. 8)
   ratio_level="sequence", GSPO (Zheng et al. 2025, eq. 5): ρ_t → s_i = exp(1/|o_i| Σ_t log ρ_i,t), one ratio and
     one clip per sequence, in the paper's GSPO-token form s_i,t = sg[s_i] · π_θ(o_i,t)/sg[π_θ(o_i,t)]; it is eq. 5
     only with agg="seq_mean_token_mean" (configs/gspo.toml).
   pg_loss="cispo", MiniMax-M1 §3.1: gradient of sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) Â_t log π_θ(o_t): every
     token keeps its gradient, only its weight is capped. Its loss VALUE is −sg(clip ρ)·Â (log π replaced by 1 + log π
     − sg(log π), value 1, same gradient), not −J_CISPO, whose log π term has no meaning as a number.
   pg_loss="dppo_tv" | "dppo_kl", DPPO (Qi et al. 2026, arXiv 2602.04879, Binary-TV / Binary-KL): gradient of
     M_t sg(min(ρ_t, C)) Â_t log π_θ(o_t), C = 20; M_t = 0 (no gradient) where the sampled token's divergence from
     π_old leaves the trust region in the direction Â pushes it: TV, Â > 0 and π_θ(o_t) − π_old(o_t) > δ_high, or
     Â ≤ 0 and π_θ − π_old < −δ_low; KL, the binary KL p_old log(p_old/p) + (1 − p_old) log((1 − p_old)/(1 − p))
     of the sampled token's probability above δ_high (p > p_old, Â > 0) or δ_low (p < p_old, Â ≤ 0); δ = ε here.
   pg_loss="sapo", SAPO (Gao et al. 2025, arXiv 2511.20347, the soft gate): s_t = f(ρ_t) Â_t, f(ρ) = 4/τ σ(τ(ρ − 1)),
     τ = τ_pos if Â_t > 0 else τ_neg; ∇s_t = 4σ(1 − σ) ρ_t Â_t ∇log π, weight 1 at ρ = 1, fading smoothly off-policy.
   pg_loss="gmpo", GMPO (Zhao et al. 2025, arXiv 2507.20673, its objective with the log-space clip): per sequence
     Â_i · exp(1/|o_i| Σ_t sgn(Â_i) min(sgn(Â_i) log ρ_t, sgn(Â_i) clip(log ρ_t, −ε_low, ε_high))), the geometric
     mean of the token ratios; its value sits on every token of row i, so agg="seq_mean_token_mean" is 1/G Σ_i.
   dual_clip=c > 1, Ye et al. 2020 (dual-clip PPO): s_t = max(s_t, c Â_t) where Â_t < 0, bounding ρ_t's effect.
   pg_weight w_t, detached, multiplies s_t: truncated importance sampling of the sampler/trainer mismatch
     (Yao et al. 2025), w_t = min(π_old/π_sampler, C) per token or per sequence, or masked outside [1/C, C]
     (IcePop's two-sided band) or above C (mode "mask_high": Seq-MIS's one-sided mask at level="sequence");
     the top-entropy mask (Wang et al. 2025, "Beyond the 80/20 rule"): w_t = 1[H_t ≥ τ], τ the top-q entropy;
     Clip-Cov (Cui et al. 2025, arXiv 2505.22617): w_t = 0 on the tokens cov_select picks, by the covariance of
     log π_old and Â over the global batch.
2. KL to π_ref (Schulman 2020, "Approximating KL divergence"), d_t = log π_ref(o_t) − log π_θ(o_t):
     k1 = −d_t,  k2 = d_t²/2,  k3 = e^d_t − d_t − 1 (DeepSeekMath eq. 4; default),  ℓ_t = −s_t + β D_t.
   k3's value estimates the reverse KL(π_θ‖π_ref), but per state E_{o~π_θ}[∇k3] = ∇KL(π_ref‖π_θ), the forward KL;
   E[∇k2] = ∇KL(π_θ‖π_ref) per state; k1 in the reward (credit.kl_reward) is the exact sequence-level gradient.
   kl_old β_old: + β_old (log π_θ − log π_old)²/2, a k2 KL to the behaviour policy (DPPO's companion term);
   abs_kl κ_t (KL-Cov, Cui et al. 2025): + κ_t |log ρ_t|, κ_t = β_cov on the top-covariance tokens, else 0.
3. Aggregation (agg), the loss is −J:
     "seq_mean_token_mean"      1/G Σ_i 1/|o_i| Σ_t ℓ_i,t        J_GRPO, DeepSeekMath eq. 3
     "token_mean"               1/Σ_i |o_i| Σ_i Σ_t ℓ_i,t        DAPO §3.3 token-level loss, eq. 8
     "seq_mean_token_sum_norm"  1/(G·Lmax) Σ_i Σ_t ℓ_i,t         Dr. GRPO §3, a constant normaliser
   Micro-batches / ranks: loss = Σ(local terms) / loss_scale, loss_scale = all-reduced Σ loss_normaliser(...),
   so the summed micro-batch losses equal the full-batch loss exactly (infra.micro_batches splits by a token budget).

Test: python -m pytest -q tests/test_grpo.py
"""
import math
from typing import Optional, Union

import torch

AGGS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS, KL_ESTIMATORS = ("token", "sequence"), ("k1", "k2", "k3")
PG_LOSSES = ("clip", "cispo", "dppo_tv", "dppo_kl", "sapo", "gmpo")
TIS_LEVELS, TIS_MODES = ("token", "sequence"), ("truncate", "mask", "mask_high")
Scale = Optional[Union[float, torch.Tensor]]


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
                kl_estimator: str = "k3", pg_weight: Optional[torch.Tensor] = None, tau_pos: float = 1.0,
                tau_neg: float = 1.05, kl_old: float = 0.0, abs_kl: Optional[torch.Tensor] = None):
    """The policy loss of step 1-3 of the module docstring, chosen by pg_loss (clip, cispo, dppo_tv, dppo_kl, sapo,
    gmpo) and ratio_level, plus dual-clip, pg_weight (TIS, top-entropy, Clip-Cov), β·KL to π_ref, kl_old·k2 to π_old
    and abs_kl·|log ρ| (KL-Cov). logp, old_logp, ref_logp, mask, pg_weight, abs_kl [N, L]; advantages [N] or
    [N, L]; ε_low / ε_high are the ratio clip (clip, cispo), the log-ratio clip (gmpo) or δ (dppo); τ_pos / τ_neg
    SAPO's temperatures. Returns (loss, metrics): metrics a dict of detached 0-d tensors (valid-token means)."""
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; use one of {AGGS}")
    if ratio_level not in RATIO_LEVELS or pg_loss not in PG_LOSSES:
        raise ValueError(f"ratio_level {ratio_level!r} / pg_loss {pg_loss!r}: use {RATIO_LEVELS} / {PG_LOSSES}")
    if dual_clip != 0 and (dual_clip <= 1 or pg_loss != "clip"):
        raise ValueError(f"dual_clip must be 0 (off) or > 1 with pg_loss='clip', got {dual_clip} with {pg_loss!r}")
    if pg_loss == "gmpo" and ratio_level != "token" or not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"gmpo takes token ratios (it forms its own geometric mean); SAPO's τ must be > 0, got "
                         f"ratio_level={ratio_level!r}, tau_pos={tau_pos}, tau_neg={tau_neg}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-d [N, L], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("pg_weight", pg_weight),
                    ("abs_kl", abs_kl)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [N] or [N, L] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    valid = mask != 0  # [N, L]
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype).expand_as(logp)
    # zero the log-ratio on padding before exp, so garbage there cannot become inf and then NaN gradients
    tok_log_ratio = log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [N, L]
    count = valid.sum(1, keepdim=True).clamp(min=1)  # [N, 1]
    if ratio_level == "sequence":
        # GSPO-token: the value is s_i, the gradient s_i ∇log π_θ(o_i,t), so with one Â_i per row and
        # agg="seq_mean_token_mean" the loss and its gradient are GSPO's eq. 5 exactly
        seq = log_ratio.sum(1, keepdim=True) / count  # [N, 1]
        log_ratio = torch.where(valid, seq.detach() + logp - logp.detach(), 0.0)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    # 1 + log π − sg(log π) has value 1 and gradient ∇log π_θ: for the sg-weighted losses (CISPO, DPPO) the loss
    # keeps the surrogate's value sg(w)·Â, the gradient is sg(w)·Â·∇log π_θ, and nothing overflows where ρ does
    lp = torch.where(valid, logp, 0.0)
    score = 1 + lp - lp.detach()
    low, high = ratio < 1 - eps_low, ratio > 1 + eps_high  # metrics: where the trust region binds (below)
    if pg_loss == "cispo":
        surr = clipped.detach() * adv * score
    elif pg_loss in ("dppo_tv", "dppo_kl"):
        p, p_old = lp.detach().exp(), torch.where(valid, old_logp, 0.0).exp()
        if pg_loss == "dppo_tv":  # Binary-TV: |π_θ − π_old| of the sampled token, the TV of the two-way split
            high, low = p - p_old > eps_high, p - p_old < -eps_low
        else:  # Binary-KL of (p_old, 1 − p_old) to (p, 1 − p); log1p keeps p → 1 finite (capped at 1 − 1e-6)
            top = 1 - 1e-6
            bkl = p_old * (old_logp.detach() - lp.detach()) * valid + (1 - p_old) * (
                torch.log1p(-p_old.clamp(max=top)) - torch.log1p(-p.clamp(max=top)))
            high, low = (bkl > eps_high) & (p > p_old), (bkl > eps_low) & (p < p_old)
        high, low = high & (adv > 0), low & (adv <= 0)  # masked only when Â pushes further out of the region
        surr = torch.where(high | low, 0.0, ratio.detach().clamp(max=20.0) * adv * score)
    elif pg_loss == "sapo":
        # soft gate 4/τ σ(τ(ρ − 1)); |log ρ| ≤ 20 keeps exp finite where σ' is already 0
        tau = torch.full_like(adv, tau_neg).masked_fill(adv > 0, tau_pos)  # in Â's dtype (float64 stays exact)
        surr = 4 / tau * torch.sigmoid(tau * (log_ratio.clamp(-20, 20).exp() - 1)) * adv
    elif pg_loss == "gmpo":
        sgn = adv.sign()
        # sgn·min(sgn·x, sgn·clip(x)): the pessimistic side of the log-space clip, as PPO's min for the sign of Â
        kept = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio.clamp(-eps_low, eps_high))
        low, high = (log_ratio < -eps_low) & (adv < 0), (log_ratio > eps_high) & (adv > 0)
        seq_adv = torch.where(valid, adv, 0.0).sum(1, keepdim=True) / count  # Â_i (a token-level Â: its mean)
        surr = (seq_adv * (torch.where(valid, kept, 0.0).sum(1, keepdim=True) / count).exp()).expand_as(logp)
    else:
        # pessimistic min: clipping removes the gain from moving ρ past the trust region, never a loss's penalty
        surr = torch.minimum(ratio * adv, clipped * adv)
        low, high = low & (adv < 0), high & (adv > 0)
        if dual_clip > 0:
            dual = (adv < 0) & (surr < dual_clip * adv)  # ρ > c for Â < 0: the loss stops growing with ρ
            surr = torch.where(dual, dual_clip * adv, surr)
    per_tok = -surr if pg_weight is None else -surr * pg_weight.detach().to(surr.dtype)
    if beta > 0:
        # both zeroed on padding: d = 0 there for every estimator, and garbage cannot reach the gradient
        kl = kl_penalty(torch.where(valid, logp, 0.0), torch.where(valid, ref_logp, 0.0), kl_estimator)
        per_tok = per_tok + beta * kl
    if kl_old > 0:
        per_tok = per_tok + kl_old * 0.5 * tok_log_ratio ** 2
    if abs_kl is not None:
        per_tok = per_tok + abs_kl.detach().to(per_tok.dtype) * tok_log_ratio.abs()
    per_tok = torch.where(valid, per_tok, 0.0)
    loss = _aggregate(per_tok, valid, agg, max_len, loss_scale)

    # metrics: clip_low / clip_high, where the trust region takes the token's gradient away (clip, gmpo, dppo);
    # for CISPO and SAPO, where ρ leaves [1 − ε_low, 1 + ε_high] (the token still has a gradient)
    with torch.no_grad():
        n_tok = valid.sum()
        denom = n_tok.clamp(min=1).float()
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


def cov_select(old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, mode: str, frac: float,
               low: float = 1.0, high: float = 5.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Clip-Cov / KL-Cov token selection (Cui et al. 2025, arXiv 2505.22617): cov_t = (Â_t − mean Â)(log π_old(o_t)
    − mean log π_old), means over the valid tokens. mode "kl": the k = max(1, ⌊frac·n⌋) largest cov_t (KL-Cov);
    "clip": k drawn uniformly (generator) from the tokens with low < cov_t < high (Clip-Cov). Pass the GLOBAL batch
    (all ranks' tokens, one canonical order): old_logp, mask [N, L]; advantages [N] or [N, L] -> bool [N, L]."""
    if mode not in ("clip", "kl") or not 0 < frac <= 1:
        raise ValueError(f"cov mode {mode!r} / frac {frac}: use 'clip' or 'kl' and 0 < frac <= 1")
    valid = mask != 0
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).double().expand_as(old_logp)
    a, lp = adv[valid], old_logp.detach().double()[valid]  # [n]: the valid tokens, row-major
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(frac * cov.numel() + 1e-9))
    if mode == "kl":
        pick = cov.argsort(descending=True, stable=True)[:k]  # ties: the earlier token first
    else:
        cand = ((cov > low) & (cov < high)).nonzero().squeeze(1)
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:k]]
    flat = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    out = torch.zeros_like(valid)
    out[valid] = flat.index_fill(0, pick, True)
    return out


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, level: str = "token",
                mode: str = "truncate", cap: float = 2.0):
    """Truncated importance sampling of the sampler/trainer mismatch (Yao et al. 2025): detached weights
    w = π_old/π_sampler, the trainer's old log-probs over the sampler's recorded ones, per token or (level=
    "sequence") one product per row; mode "truncate": min(w, C); "mask": w if 1/C ≤ w ≤ C, else 0 (IcePop's
    two-sided band, Ling Team 2025, "Every Step Evolves", for tokens); "mask_high": w if w ≤ C, else 0 (the one-sided
    masked IS, Seq-MIS with level="sequence", of Liu et al. 2025, "When Speed Kills Stability").
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
    out = torch.where(valid & ~cut, w, 0.0) if mode != "truncate" else torch.where(valid, w.clamp(max=cap), 0.0)
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
    # τ in the entropies' own dtype: a float32 τ of float64 entropies drops a tied block sitting exactly at τ
    h = entropy.detach().reshape(-1)
    h = h if h.is_floating_point() else h.float()
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

"""The policy losses of GRPO / DAPO / Dr. GRPO and their 2025-26 successors as pure functions:
tensors in, (loss, metrics) out. Imports only torch.

A prompt q gets a group of G sampled completions o_1..o_G; rows are prompt-major, N = P·G. The
advantages Â come from credit.py (rewards, shaping, group baselines). policy_loss forms, per token:
1. The ratio ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t); with ratio_level="sequence"
   (GSPO, Zheng et al. 2025, eq. 5) one ratio per row, s_i = exp(1/|o_i| Σ_t log ρ_i,t), in
   GSPO-token form s_i,t = sg[s_i] · π_θ(o_i,t) / sg[π_θ(o_i,t)] (eq. 5 exactly only with
   agg="seq_mean_token_mean").
2. The surrogate s_t, chosen by pg_loss from PG_LOSSES, the table below: each entry is one small
   function with its formula and paper (clip: PPO / GRPO / DAPO; cispo; dppo_tv, dppo_kl; sapo;
   gmpo). A new loss is one function registered there; the Config's choices, checks.py and
   objective.py's printed formula read the same table.
3. Weights and penalties: ℓ_t = −w_t s_t + β D_t + β_old (log ρ_t)²/2 + κ_t |log ρ_t|,
   where w_t (pg_weight, detached) is truncated importance sampling of the sampler/trainer
   mismatch (Yao et al. 2025), the top-entropy mask (Wang et al. 2025) or Clip-Cov's mask (Cui
   et al. 2025); D_t the KL to π_ref (Schulman 2020), d_t = log π_ref(o_t) − log π_θ(o_t):
   k1 = −d_t, k2 = d_t²/2, k3 = e^d_t − d_t − 1 (DeepSeekMath eq. 4; default). k3's value
   estimates the reverse KL(π_θ‖π_ref), but per state E_{π_θ}[∇k3] = ∇KL(π_ref‖π_θ),
   the forward KL; E[∇k2] = ∇KL(π_θ‖π_ref); k1 in the reward (credit.kl_reward) is the
   exact sequence-level gradient. β_old (kl_old): DPPO's k2 to π_old; κ_t (abs_kl): KL-Cov's.
4. Aggregation (agg); the loss is −J:
     "seq_mean_token_mean"      1/G Σ_i 1/|o_i| Σ_t ℓ_i,t    J_GRPO, DeepSeekMath eq. 3
     "token_mean"               1/Σ_i |o_i| Σ_i Σ_t ℓ_i,t    DAPO §3.3 token-level, eq. 8
     "seq_mean_token_sum_norm"  1/(G·Lmax) Σ_i Σ_t ℓ_i,t     Dr. GRPO §3, constant norm
   Micro-batches / ranks: loss = Σ(local terms) / loss_scale, loss_scale = all-reduced Σ
   loss_normaliser(...), so the summed micro-batch losses equal the full-batch loss exactly.

Test: python -m pytest -q tests/test_grpo.py
"""
import math
from typing import Callable, NamedTuple, Optional, Union

import torch

AGGS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS, KL_ESTIMATORS = ("token", "sequence"), ("k1", "k2", "k3")
TIS_LEVELS, TIS_MODES = ("token", "sequence"), ("truncate", "mask", "mask_high")
Scale = Optional[Union[float, torch.Tensor]]


class Ratios(NamedTuple):
    """What every surrogate reads: [N, L] tensors and the loss's hyper-parameters."""
    ratio: torch.Tensor      # ρ_t (GSPO: s_i on each token, with the token's gradient)
    log_ratio: torch.Tensor  # log ρ_t, 0 on padding
    adv: torch.Tensor        # Â_t [n, L], or Â_i [n, 1] broadcast over the row; logp's dtype
    valid: torch.Tensor      # bool: the loss tokens
    logp: torch.Tensor       # log π_θ(o_t), 0 on padding
    old_logp: torch.Tensor   # log π_old(o_t), as given
    count: torch.Tensor      # [N, 1] loss tokens of each row, at least 1
    eps_low: float           # ε_low / ε_high: the ratio clip (clip, cispo), the log-ratio clip
    eps_high: float          #   (gmpo) or the divergence δ (dppo)
    tau_pos: float           # SAPO's gate temperatures for Â > 0 and Â ≤ 0
    tau_neg: float
    dual_clip: float         # c > 1 bounds the loss of Â < 0 at c·Â (clip only); 0: off


class Surrogate(NamedTuple):
    """A surrogate's output: s_t, to be maximised, and where its trust region binds."""
    value: torch.Tensor      # s_t [N, L]
    clip_low: torch.Tensor   # bool [N, L]: the gradient is taken away below (or ρ left the range)
    clip_high: torch.Tensor  #   and above
    extra: dict              # more bool [N, L] masks, logged as their share of the valid tokens


# pg_loss -> its surrogate: the Config's choices, filled by @register below
PG_LOSSES: dict[str, Callable[[Ratios], Surrogate]] = {}


def register(name: str, formula: str, title: Optional[str] = None):
    """Add a surrogate to PG_LOSSES under `name`. formula: objective.py's printed term, with {rho}
    (ρ_t or s_i), {lo}, {hi} (ε_low, ε_high), {tau_pos}, {tau_neg} filled from the config; title:
    the method's name in the printed objective (default `name`; "" lets objective.py name the clip
    family by the other choices: GRPO, DAPO, GSPO, ...)."""
    def add(fn: Callable[[Ratios], Surrogate]) -> Callable[[Ratios], Surrogate]:
        fn.formula, fn.title = formula, name if title is None else title
        PG_LOSSES[name] = fn
        return fn
    return add


@register("clip", "min({rho} Â, clip({rho}, 1−{lo}, 1+{hi}) Â)", title="")
def clip(r: Ratios) -> Surrogate:
    """PPO's clipped surrogate (DeepSeekMath eq. 3; DAPO §3.1 clip-higher ε_high > ε_low, eq. 8):
    s_t = min(ρ_t Â_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â_t), the pessimistic side: clipping
    removes the gain from moving ρ past the trust region, never a penalty. dual_clip c > 1 (Ye et
    al. 2020): s_t = max(s_t, c Â_t) where Â_t < 0, so the loss stops growing with ρ."""
    clipped = r.ratio.clamp(1 - r.eps_low, 1 + r.eps_high)
    surr = torch.minimum(r.ratio * r.adv, clipped * r.adv)
    # the gradient is taken away where ρ left the range in the direction Â pushes it
    low, high = (r.ratio < 1 - r.eps_low) & (r.adv < 0), (r.ratio > 1 + r.eps_high) & (r.adv > 0)
    if r.dual_clip == 0:
        return Surrogate(surr, low, high, {})
    dual = (r.adv < 0) & (surr < r.dual_clip * r.adv)  # ρ > c for Â < 0
    return Surrogate(torch.where(dual, r.dual_clip * r.adv, surr), low, high, {"dual_clip": dual})


class LossTerms(NamedTuple):
    """What policy_loss formed, for the step's metrics (loss_sums)."""
    surrogate: Surrogate               # s_t and where its trust region binds
    ratio: torch.Tensor                # ρ_t [n, L] (GSPO: s_i)
    kl: Optional[torch.Tensor]         # D_t [n, L], the KL to π_ref (β > 0)
    old_logp: torch.Tensor             # log π_old [n, L], as given


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, loss_scale: Scale = None, eps_low: float = 0.2,
                eps_high: float = 0.2, agg: str = "seq_mean_token_mean",
                max_len: Optional[int] = None, ratio_level: str = "token", pg_loss: str = "clip",
                dual_clip: float = 0.0, tau_pos: float = 1.0, tau_neg: float = 1.05,
                pg_weight: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
                beta: float = 0.0, kl_estimator: str = "k3", kl_old: float = 0.0,
                abs_kl: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, LossTerms]:
    """−J of a micro-batch, steps 1-4 of the module docstring: Σ of its per-token terms over
    loss_scale, the normaliser of the WHOLE batch (Σ of loss_normaliser over every micro-batch and
    rank; None: this batch's own), so the micro-batch losses sum to the batch's loss.
    logp, old_logp, mask [n, L]; advantages [n] or [n, L]; pg_weight, ref_logp, abs_kl [n, L] or
    None. Checked once, not per call: the settings by check_settings (a trainer's Config check),
    the shapes by check_shapes (a trainer's tensors have them by construction) -> (loss,
    LossTerms). The defaults are GRPO's (DeepSeekMath); train.py passes its Config's settings
    (DAPO's by default: eps_high 0.28, token_mean) through Run.loss_kw."""
    valid = mask != 0                                                                    # [n, L]
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype)  # [n, 1|L]
    # the log-ratio is 0 on padding before exp: garbage there cannot become inf, then NaN ∇
    tok_log_ratio = torch.where(valid, logp - old_logp, 0.0)                              # [n, L]
    count = valid.sum(1, keepdim=True).clamp(min=1)                                       # [n, 1]
    log_ratio = tok_log_ratio if ratio_level == "token" else gspo_log_ratio(
        tok_log_ratio, logp, valid, count)                                               # [n, L]
    ratios = Ratios(log_ratio.exp(), log_ratio, adv, valid, torch.where(valid, logp, 0.0), old_logp,
                    count, eps_low, eps_high, tau_pos, tau_neg, dual_clip)
    surr = PG_LOSSES[pg_loss](ratios)  # s_t: clip (PPO, GRPO, DAPO), below, by default
    per_tok = -surr.value
    if pg_weight is not None:  # w_t: TIS, the top-entropy mask, Clip-Cov's mask
        per_tok = per_tok * pg_weight.detach().to(per_tok.dtype)
    kl = kl_penalty(logp, ref_logp, kl_estimator, valid) if beta > 0 else None  # D_t, 0 on padding
    per_tok = per_tok + beta * kl if beta > 0 else per_tok
    if kl_old > 0:
        per_tok = per_tok + kl_old * 0.5 * tok_log_ratio ** 2
    if abs_kl is not None:
        per_tok = per_tok + abs_kl.detach().to(per_tok.dtype) * tok_log_ratio.abs()
    per_tok = torch.where(valid, per_tok, 0.0)
    # step 4, aggregation: per-sequence means (GRPO) or a plain sum (DAPO, Dr. GRPO), then / the
    # normaliser (an empty row adds 0 and is not counted; with loss_scale None, an all-padding
    # batch gives 0, not 0/0)
    total = (per_tok.sum(1) / count[:, 0]).sum() if agg == "seq_mean_token_mean" else per_tok.sum()
    if loss_scale is None:
        loss_scale = loss_normaliser(valid, agg, max_len).clamp(min=1)
    return total / loss_scale, LossTerms(surr, ratios.ratio, kl, old_logp)


def gspo_log_ratio(log_ratio: torch.Tensor, logp: torch.Tensor, valid: torch.Tensor,
                   count: torch.Tensor) -> torch.Tensor:
    """ratio_level = "sequence" (GSPO-token): value log s_i = 1/|o_i| Σ_t log ρ_i,t on each token,
    gradient ∇log π_θ(o_i,t); with one Â_i per row and agg="seq_mean_token_mean" the loss and
    its gradient are GSPO's eq. 5 exactly."""
    seq_log_ratio = log_ratio.sum(1, keepdim=True) / count                                # [n, 1]
    return torch.where(valid, seq_log_ratio.detach() + logp - logp.detach(), 0.0)


def loss_sums(loss: torch.Tensor, terms: LossTerms, mask: torch.Tensor, entropy: torch.Tensor,
              sampler_logp: torch.Tensor) -> dict:
    """A micro-batch's metrics (detached), sums over its loss tokens that a trainer divides by
    their count ("tokens"), but "loss" (policy_loss's, normalised already) and maxima (*_max):
    clip_low / clip_high, where the trust region takes the gradient away (clip, gmpo, dppo; for
    CISPO and SAPO, where ρ leaves [1 − ε_low, 1 + ε_high]), ρ_t, the surrogate's extra masks
    (dual_clip), the KL to π_ref (β > 0), the entropy of π_θ (entropy [n, L]), and against the
    sampler's log-probs μ of these tokens (sampler_logp [n, ≥ L]) mismatch_kl, k3 of
    KL(μ‖π_old), and logprob_gap_max, the largest |log π_old − log μ|."""
    valid, surr = mask != 0, terms.surrogate
    gap = (terms.old_logp - sampler_logp[:, :mask.shape[1]]) * mask  # log π_old − log μ
    sums = {"loss": loss, "tokens": valid.sum(), "entropy": (entropy * mask).sum(),
            "clip_low": (surr.clip_low & valid).sum(), "clip_high": (surr.clip_high & valid).sum(),
            "ratio": torch.where(valid, terms.ratio, 0.0).sum(),
            "mismatch_kl": (torch.expm1(gap) - gap).sum(), "logprob_gap_max": gap.abs().amax(),
            **{k: (m & valid).sum() for k, m in surr.extra.items()},
            **({"kl": torch.where(valid, terms.kl, 0.0).sum()} if terms.kl is not None else {})}
    return {k: v.detach() for k, v in sums.items()}


def loss_normaliser(mask: torch.Tensor, agg: str, max_len: Optional[int] = None) -> torch.Tensor:
    """This micro-batch's share of the loss's denominator (0-d float32), step 4: its loss tokens
    (token_mean), its non-empty rows (seq_mean_token_mean) or rows · max_len (default L; Dr. GRPO).
    Summed over every micro-batch and rank, it is policy_loss's loss_scale."""
    valid, (n, length) = mask != 0, mask.shape
    count = {"token_mean": valid.sum(), "seq_mean_token_mean": valid.any(1).sum(),
             "seq_mean_token_sum_norm": n * (length if max_len is None else max_len)}[agg]
    return torch.as_tensor(count, dtype=torch.float32, device=mask.device)


# ============================================== the other surrogates, then the options' terms
def outside(r: Ratios) -> tuple[torch.Tensor, torch.Tensor]:
    """ρ_t below 1 − ε_low and above 1 + ε_high: where the trust region would bind."""
    return r.ratio < 1 - r.eps_low, r.ratio > 1 + r.eps_high


def sg_weighted(weight: torch.Tensor, r: Ratios) -> torch.Tensor:
    """sg(w) Â (1 + log π − sg(log π)): value sg(w) Â, gradient sg(w) Â ∇log π_θ, of the
    sg-weighted losses (CISPO, DPPO); nothing overflows where ρ does."""
    grad_carrier = 1 + r.logp - r.logp.detach()  # value 1, gradient ∇log π_θ
    return weight.detach() * r.adv * grad_carrier


@register("cispo", "sg(clip({rho}, 1−{lo}, 1+{hi})) Â log π_θ "
          "[train/loss logs −sg(clip)·Â, not −J_CISPO]", "CISPO")
def cispo(r: Ratios) -> Surrogate:
    """CISPO (MiniMax-M1 2025, §3.1): the gradient of sg(clip(ρ_t, 1 − ε_low, 1 + ε_high))
    Â_t log π_θ(o_t): every token keeps its gradient, only its weight is capped. The loss VALUE
    is −sg(clip ρ)·Â, not −J_CISPO, whose log π term means nothing as a number.
    clip_low/high: where ρ leaves the range."""
    clipped = r.ratio.clamp(1 - r.eps_low, 1 + r.eps_high)
    low, high = outside(r)
    return Surrogate(sg_weighted(clipped, r), low, high, {})


def dppo(r: Ratios, high: torch.Tensor, low: torch.Tensor) -> Surrogate:
    """DPPO's shared form: M_t sg(min(ρ_t, C)) Â_t log π_θ(o_t), C = 20, where M_t = 0 (no
    gradient) once the sampled token's divergence leaves the trust region the way Â pushes it."""
    high, low = high & (r.adv > 0), low & (r.adv <= 0)
    surr = torch.where(high | low, 0.0, sg_weighted(r.ratio.detach().clamp(max=20.0), r))
    return Surrogate(surr, low, high, {})


@register("dppo_tv", "1[π_θ − π_old ≤ {hi} if Â > 0, ≥ −{lo} else] "
          "sg(min({rho}, 20)) Â log π_θ", "DPPO-TV")
def dppo_tv(r: Ratios) -> Surrogate:
    """DPPO Binary-TV (Qi et al. 2026, arXiv 2602.04879; δ = ε): masked where Â > 0 and
    π_θ(o_t) − π_old(o_t) > δ_high, or Â ≤ 0 and π_θ − π_old < −δ_low (the TV of
    the two-way split)."""
    p, p_old = r.logp.detach().exp(), torch.where(r.valid, r.old_logp, 0.0).exp()
    return dppo(r, p - p_old > r.eps_high, p - p_old < -r.eps_low)


@register("dppo_kl", "1[D_bin(π_old‖π_θ) ≤ {hi} (Â > 0, π_θ > π_old), "
          "≤ {lo} (Â ≤ 0, π_θ < π_old)] sg(min({rho}, 20)) Â log π_θ", "DPPO-KL")
def dppo_kl(r: Ratios) -> Surrogate:
    """DPPO Binary-KL (Qi et al. 2026): the KL p_old log(p_old/p) + (1 − p_old)
    log((1 − p_old)/(1 − p)) of the sampled token's probability, masked above δ_high
    (p > p_old, Â > 0) or δ_low (p < p_old, Â ≤ 0). log1p keeps p → 1 finite (capped at
    1 − 1e-6)."""
    p, p_old = r.logp.detach().exp(), torch.where(r.valid, r.old_logp, 0.0).exp()
    top = 1 - 1e-6
    stay = p_old * (r.old_logp.detach() - r.logp.detach()) * r.valid
    switch = (1 - p_old) * (torch.log1p(-p_old.clamp(max=top)) - torch.log1p(-p.clamp(max=top)))
    binary_kl = stay + switch
    return dppo(r, (binary_kl > r.eps_high) & (p > p_old), (binary_kl > r.eps_low) & (p < p_old))


@register("sapo", "4/τ σ(τ({rho} − 1)) Â, τ = {tau_pos} (Â > 0) | {tau_neg}", "SAPO")
def sapo(r: Ratios) -> Surrogate:
    """SAPO's soft gate (Gao et al. 2025, arXiv 2511.20347): s_t = 4/τ σ(τ(ρ_t − 1)) Â_t,
    τ = τ_pos if Â_t > 0 else τ_neg; ∇s_t = 4σ(1 − σ) ρ_t Â_t ∇log π: weight 1 at
    ρ = 1, fading smoothly off-policy. |log ρ| ≤ 20 keeps exp finite where σ' is already 0."""
    # τ in Â's dtype, so float64 stays exact
    tau = torch.full_like(r.adv, r.tau_neg).masked_fill(r.adv > 0, r.tau_pos)
    gate = 4 / tau * torch.sigmoid(tau * (r.log_ratio.clamp(-20, 20).exp() - 1))
    low, high = outside(r)
    return Surrogate(gate * r.adv, low, high, {})


@register("gmpo", "Â_i Π_t clip_[e^−{lo}, e^{hi}](ρ_t)^(1/|o_i|) (sign-pessimistic)", "GMPO")
def gmpo(r: Ratios) -> Surrogate:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673), its log-space clip: per row, s_i = sgn(Â_i),
    Â_i · exp(1/|o_i| Σ_t s_i min(s_i log ρ_t, s_i clip(log ρ_t, −ε_low, ε_high))):
    the geometric mean of the token ratios; its value sits on every token of row i, so
    agg="seq_mean_token_mean" is 1/G Σ_i. Takes token ratios (it forms its own mean)."""
    sgn = r.adv.sign()
    # the pessimistic side of the log-space clip, as PPO's min is for the sign of Â
    kept = sgn * torch.minimum(sgn * r.log_ratio, sgn * r.log_ratio.clamp(-r.eps_low, r.eps_high))
    low = (r.log_ratio < -r.eps_low) & (r.adv < 0)
    high = (r.log_ratio > r.eps_high) & (r.adv > 0)
    # Â_i; a token-level Â gives its row mean
    seq_adv = torch.where(r.valid, r.adv, 0.0).sum(1, keepdim=True) / r.count
    mean_log_ratio = torch.where(r.valid, kept, 0.0).sum(1, keepdim=True) / r.count
    return Surrogate((seq_adv * mean_log_ratio.exp()).expand_as(r.logp), low, high, {})


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3",
               valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) at tokens sampled from π_θ: [N, L] × 2 -> [N, L],
    0 where valid (bool [N, L]) is False: garbage there cannot reach the gradient. k1 = −d is
    unbiased but signed, k2 = d²/2 is ≥ 0 but biased, k3 = e^d − d − 1 is both (Schulman
    2020)."""
    d = ref_logp - logp if valid is None else torch.where(valid, ref_logp - logp, 0.0)
    return -d if estimator == "k1" else 0.5 * d * d if estimator == "k2" else d.exp() - d - 1


def check_shapes(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, ref_logp: Optional[torch.Tensor] = None, beta: float = 0.0,
                 pg_weight: Optional[torch.Tensor] = None, abs_kl: Optional[torch.Tensor] = None):
    """policy_loss's tensors: a ValueError naming the first that does not fit."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-d [N, L], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp),
                    ("pg_weight", pg_weight), ("abs_kl", abs_kl)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [N] or [N, L] = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")


def check_settings(pg_loss: str = "clip", ratio_level: str = "token", agg: str = AGGS[0],
                   dual_clip: float = 0.0, tau_pos: float = 1.0, tau_neg: float = 1.05,
                   kl_estimator: str = "k3"):
    """policy_loss's settings, checked once (a run's Config: checks.py), not per call."""
    if agg not in AGGS or kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"agg {agg!r} / kl_estimator {kl_estimator!r}: "
                         f"use {AGGS} / {KL_ESTIMATORS}")
    if ratio_level not in RATIO_LEVELS or pg_loss not in PG_LOSSES:
        raise ValueError(f"ratio_level {ratio_level!r} / pg_loss {pg_loss!r}: "
                         f"use {RATIO_LEVELS} / {tuple(PG_LOSSES)}")
    if dual_clip != 0 and (dual_clip <= 1 or pg_loss != "clip"):
        raise ValueError(f"dual_clip must be 0 (off) or > 1 with pg_loss='clip', "
                         f"got {dual_clip} with {pg_loss!r}")
    if pg_loss == "gmpo" and ratio_level != "token" or pg_loss == "sapo" and not (
            tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"gmpo takes token ratios (it forms its own geometric mean); SAPO's τ "
                         f"must be > 0, got ratio_level={ratio_level!r}, tau_pos={tau_pos}, "
                         f"tau_neg={tau_neg}")


def cov_select(old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, mode: str,
               frac: float, low: float = 1.0, high: float = 5.0,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Clip-Cov / KL-Cov token selection (Cui et al. 2025, arXiv 2505.22617): cov_t = (Â_t −
    mean Â)(log π_old(o_t) − mean log π_old), means over the valid tokens. mode "kl": the
    k = max(1, ⌊frac·n⌋) largest cov_t (KL-Cov); "clip": k drawn uniformly (generator) from the
    tokens with low < cov_t < high (Clip-Cov). Pass the GLOBAL batch (all ranks' tokens, one
    canonical order): old_logp, mask [N, L]; advantages [N] or [N, L] -> bool [N, L]."""
    if mode not in ("clip", "kl") or not 0 < frac <= 1:
        raise ValueError(f"cov mode {mode!r} / frac {frac}: use 'clip' or 'kl' and 0 < frac <= 1")
    valid = mask != 0
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = adv.double().expand_as(old_logp)
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


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                level: str = "token", mode: str = "truncate", cap: float = 2.0):
    """Truncated importance sampling of the sampler/trainer mismatch (Yao et al. 2025): detached
    weights w = π_old/π_sampler, the trainer's old log-probs over the sampler's recorded ones, per
    token or (level="sequence") one product per row; mode "truncate": min(w, C); "mask": w if
    1/C ≤ w ≤ C, else 0 (IcePop's two-sided band, Ling Team 2025, "Every Step Evolves", for
    tokens); "mask_high": w if w ≤ C, else 0 (the one-sided masked IS, Seq-MIS with
    level="sequence", of Liu et al. 2025, "When Speed Kills Stability"). [N, L] thrice ->
    (weights [N, L] float32, 0 on padding; metrics: raw w's token mean and max, fraction cut)."""
    if level not in TIS_LEVELS or mode not in TIS_MODES or not cap >= 1:
        raise ValueError(f"tis level {level!r} / mode {mode!r} / cap {cap}: "
                         f"use {TIS_LEVELS} / {TIS_MODES} / >= 1")
    if old_logp.shape != sampler_logp.shape or mask.shape != old_logp.shape or old_logp.dim() != 2:
        shapes = (tuple(old_logp.shape), tuple(sampler_logp.shape), tuple(mask.shape))
        raise ValueError(f"need old_logp, sampler_logp, mask of one shape [N, L], got {shapes}")
    valid = mask != 0
    log_w = torch.where(valid, old_logp.detach().float() - sampler_logp.float(), 0.0)  # [N, L]
    if level == "sequence":
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    # a long sequence's product can overflow to inf: truncate gives C, mask gives 0, as it should
    w = log_w.exp()
    cut = (w > cap) | ((w < 1 / cap) & (mode == "mask"))
    if mode == "truncate":
        out = torch.where(valid, w.clamp(max=cap), 0.0)
    else:
        out = torch.where(valid & ~cut, w, 0.0)
    denom = valid.sum().clamp(min=1)
    metrics = {"tis_mean": torch.where(valid, w, 0.0).sum() / denom,
               "tis_max": torch.where(valid, w, 0.0).amax() if w.numel() else w.new_zeros(()),
               "tis_cut": (cut & valid).sum() / denom}
    return out, metrics


def entropy_threshold(entropy: torch.Tensor, q: float,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """τ for the top-entropy mask (Wang et al. 2025): the k-th largest entropy, k = ⌈q·n⌉ of
    the n valid ones (mask, any shape; all of them without one); 0-d. Pass every token of the
    global batch (all-gather across ranks). Ties: every token with H_t = τ is kept, so slightly
    more than q·n may pass. q = 1 keeps all."""
    if not 0 < q <= 1:
        raise ValueError(f"top-entropy q must be in (0, 1], got {q}")
    # τ in the entropies' own dtype: a float32 τ of float64 entropies drops a tied block at τ
    h = entropy.detach().reshape(-1)
    h = h if h.is_floating_point() else h.float()
    ok = torch.ones_like(h, dtype=torch.bool) if mask is None else (mask != 0).reshape(-1)
    top = torch.where(ok, h, -math.inf).sort(descending=True).values
    # k in float64 with a 1e-6 slack: 0.07 · 100 is 7.000000000000001, whose ceiling would be 8
    k = torch.ceil(q * ok.sum().double() - 1e-6).long().clamp(min=1)
    # no valid token: −inf, and no token is valid anyway
    return top.gather(0, (k - 1).view(1)).squeeze(0)


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor,
                     threshold: torch.Tensor) -> torch.Tensor:
    """Valid tokens whose entropy is at least τ = entropy_threshold(...): [N, L] -> bool [N, L] (a
    pg_weight)."""
    return (mask != 0) & (entropy.detach() >= threshold)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, loss_scale: Scale = None) -> torch.Tensor:
    """Token-mean negative log-likelihood over valid tokens (SFT cold start, STaR / rejection
    sampling). logp, mask [N, L]. With loss_scale (the global valid-token count) it is Σ NLL /
    loss_scale."""
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"need logp and mask of one shape [N, L], "
                         f"got {tuple(logp.shape)}, {tuple(mask.shape)}")
    valid = mask != 0
    total = torch.where(valid, -logp, 0.0).sum()
    return total / (valid.sum().float().clamp(min=1) if loss_scale is None else loss_scale)

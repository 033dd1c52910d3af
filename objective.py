"""The RL objective a train.Config composes, printed as one formula so a log says exactly which paper it is, and the
two passes over the whole batch that some objectives need before the first update (whole_batch_pass, cov_picks).

objective(cfg) reads only the config's objective fields (adv_scale, agg, ratio_level, pg_loss, ε, dual_clip, tis,
top_entropy_q, cov, β, kl_in, kl_estimator, kl_old, reward, teacher, opd_weight, dynamic_sampling, max_staleness)
and names what the combination is:
  1. the advantage Â_i (credit.py), with KL in the reward (kl_in = "reward") shown as r_i ← r_i − β Σ_t k1, and
     on-policy distillation's per-token term (distill.py; reward = "none": the verifier's Â is 0);
  2. the per-token term (grpo.policy_loss) and its weights (TIS, top-entropy, Clip-Cov) and penalties
     (β·k to π_ref with the gradient it actually has, k2 to π_old, KL-Cov's |log ρ|);
  3. the aggregation; the name is a paper's only where the combination is that paper's (a sequence ratio without
     seq-mean-token-mean is not GSPO's eq. 5, and says so).

whole_batch_pass computes the log-probs of every micro-batch under π_old (and π_ref for KL in the reward) without gradients; cov_picks gathers
every rank's (log π_old, Â) of valid tokens, puts them in (global row, position) order and picks Clip-Cov's /
KL-Cov's tokens (grpo.cov_select), so neither the micro-batch split nor the rank count changes the selection.

  python -c "import train, objective; print(objective.objective(train.Config(pg_loss='sapo')))"
"""

import torch

import grpo
import infra
from tasks import seed_of

# what E[∇] of each estimator of the KL term is per sampled state (tools/oracle.py measures it): k3's value estimates
# KL(π_θ‖π_ref), but its gradient is the reverse KL's; k1's gradient is 0 in expectation
KL_GRAD = {"k1": "E[∇] = 0", "k2": "∇ → ∇KL(π_θ‖π_ref)", "k3": "∇ → ∇KL(π_ref‖π_θ)"}


def objective(cfg) -> str:
    """cfg: a train.Config (any object with its objective fields) -> "NAME: J = E[...], Â_i = ..."."""
    adv = {"group": "(r_i − mean_G r) / (std_G r + ε)", "batch": "(r_i − mean_G r) / std_batch r",
           "none": "r_i − mean_G r", "rloo": "r_i − mean_{j≠i} r_j", "maxrl": "(r_i − mean_G r) / mean_G r",
           "reinforce_pp": "whiten_tokens(r_i − mean_G r)"}[cfg.adv_scale]
    agg = {"seq_mean_token_mean": "1/G Σ_i 1/|o_i| Σ_t", "token_mean": "1/Σ|o_i| Σ_i Σ_t",
           "seq_mean_token_sum_norm": f"1/(G·{cfg.max_new_tokens}) Σ_i Σ_t"}[cfg.agg]
    rho, lo, hi = "s_i" if cfg.ratio_level == "sequence" else "ρ_t", cfg.eps_low, cfg.eps_high
    surrogate = grpo.PG_LOSSES[cfg.pg_loss]  # its formula and paper, where it is defined (grpo.py)
    term = surrogate.formula.format(rho=rho, lo=lo, hi=hi, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)
    term = f"max({term}, {cfg.dual_clip}·Â)_(Â<0)" if cfg.dual_clip else term
    term = f"w^TIS_{cfg.tis} ({cfg.tis_mode}, C = {cfg.tis_cap:g}) · {term}" if cfg.tis != "none" else term
    term = f"1[H_t ≥ top {cfg.top_entropy_q:g}] · {term}" if cfg.top_entropy_q < 1 else term
    term = f"1[t ∉ Clip-Cov {cfg.cov_frac:g} of cov ∈ ({cfg.cov_low:g}, {cfg.cov_high:g})] · {term}" \
        if cfg.cov == "clip" else term
    pen = f" − {cfg.beta}·{cfg.kl_estimator} [{KL_GRAD[cfg.kl_estimator]}]" if cfg.beta > 0 and cfg.kl_in == "loss" \
        else ""
    pen += f" − {cfg.kl_old}·(log ρ_t)²/2" if cfg.kl_old > 0 else ""
    pen += f" − {cfg.cov_kl_coef}·1[t ∈ top {cfg.cov_frac:g} cov]·|log ρ_t|" if cfg.cov == "kl" else ""
    adv += f",  r_i ← r_i − {cfg.beta}·Σ_t k1 (KL in the reward)" if cfg.kl_in_reward else ""
    adv = "0 (reward off)" if cfg.reward == "none" else adv
    opd = getattr(cfg, "teacher", "") and cfg.opd_weight > 0  # distill.py: the sampled-token reverse KL, discount 0
    adv += f",  Â_t += {cfg.opd_weight:g}·(log π_T(o_t) − log π_old(o_t)) per token [sampled-token reverse " \
        "KL(π_θ‖π_T), discount 0]" if opd else ""
    gspo = cfg.ratio_level == "sequence" and cfg.agg == "seq_mean_token_mean"
    name = surrogate.title or (  # the clip family is named by its other choices
        "GSPO" if gspo else "sequence-ratio clip, not GSPO (eq. 5 needs seq_mean_token_mean)"
        if cfg.ratio_level == "sequence" else
        "MaxRL" if cfg.adv_scale == "maxrl" else
        "RLOO" if cfg.adv_scale == "rloo" else "REINFORCE++" if cfg.adv_scale == "reinforce_pp" else
        "Dr. GRPO" if cfg.adv_scale == "none" and cfg.agg == "seq_mean_token_sum_norm" else
        "DAPO" if cfg.agg == "token_mean" and cfg.eps_high > cfg.eps_low else
        "GRPO (DeepSeekMath)" if cfg.agg == "seq_mean_token_mean" else "custom")
    name += {"clip": " + Clip-Cov", "kl": " + KL-Cov"}.get(cfg.cov, "")
    name = ("on-policy distillation" if cfg.reward == "none" else name + " + on-policy distillation") if opd else name
    k = getattr(cfg, "max_staleness", 0)  # async_rl.py: the behaviour policy μ is the sampler's, K versions old
    src = f";  o ~ μ = π_(s−1−{k}) at step s (ρ_t = π_θ/π_old, π_old the trainer's; w = π_old/μ: decoupled PPO)" \
        if k else ""
    return (f"{name}: J = E[{agg} {term}{pen}],  Â_i = {adv}" + (" per step (process)" if cfg.reward == "process"
            else "") + (", zero-spread groups resampled (DAPO §3.2)" if cfg.dynamic_sampling else "") + src)


def whole_batch_pass(run, logprobs, prompts: list, comps: list, plan: list[list[int]]) -> list[tuple]:
    """(log π_old, entropy, log π_ref or None) [n, L] of every micro-batch of a train.Run, without gradients
    (logprobs: train.policy_logprobs): what the top-entropy τ, KL in the reward and Clip-/KL-Cov need before the
    first update."""
    cfg = run.cfg
    with_ref = cfg.kl_in_reward
    out = []
    with torch.no_grad():
        for rows in plan:
            old_logp, entropy = logprobs(run, run.model, prompts, comps, rows, cfg.temperature)
            ref_logp = logprobs(run, run.ref, prompts, comps, rows, cfg.temperature)[0] if with_ref else None
            out.append((old_logp, entropy, ref_logp))
    return out


def cov_picks(cfg, rank: int, pre: list[tuple], plan: list[list[int]], mask: torch.Tensor, adv: torch.Tensor,
              step: int, ids: list[int]) -> list[torch.Tensor]:
    """Clip-Cov / KL-Cov's tokens (grpo.cov_select) over every rank's valid tokens, ordered by (global row, position)
    so that no rank count or micro-batch split changes the pick: bool [n, L] per micro-batch of this rank (mask
    [n + 1, L], adv [n + 1] or [n + 1, L] of this rank's rows, ids [n] their global row indices). Clip-Cov's draw is
    seeded by (seed, step)."""
    masks = [mask[rows, :lp.shape[1]] for (lp, _, _), rows in zip(pre, plan)]
    advs = [(adv[rows, :m.shape[1]] if adv.dim() == 2 else adv[rows, None]).expand_as(m)
            for m, rows in zip(masks, plan)]
    keys = [(torch.tensor(ids + [-1])[rows, None] * mask.shape[1] + torch.arange(m.shape[1])).expand_as(m)
            for m, rows in zip(masks, plan)]
    parts = infra.all_gather_list([(rank, lp[m].cpu(), a[m].cpu(), k[m.cpu()])
                                   for (lp, _, _), m, a, k in zip(pre, masks, advs, keys)])
    order = torch.cat([p[3] for p in parts]).argsort()  # the canonical token order
    lp, a = (torch.cat([p[j] for p in parts])[order][None] for j in (1, 2))
    picked = grpo.cov_select(lp, a, torch.ones_like(lp), cfg.cov, cfg.cov_frac, cfg.cov_low, cfg.cov_high,
                             torch.Generator().manual_seed(seed_of(cfg.seed, step)))[0]
    sel = torch.empty_like(picked).index_put_((order,), picked)  # back in gather order
    sel = [x for p, x in zip(parts, sel.split([p[1].numel() for p in parts])) if p[0] == rank]
    return [torch.zeros_like(m).masked_scatter(m, x.to(m.device)) for m, x in zip(masks, sel)]

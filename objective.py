"""The RL objective a train.Config composes, printed as one formula so a log says exactly which
paper it is, and the two passes over the whole batch that some objectives need before the first
update (whole_batch_pass, cov_picks).

objective(cfg) reads only the config's objective fields (adv_scale, agg, ratio_level, pg_loss, ε,
dual_clip, tis, top_entropy_q, cov, β, kl_in, kl_estimator, kl_old, reward, teacher, opd_weight,
dynamic_sampling, max_staleness) and names what the combination is:
  1. the advantage Â_i (credit.py), with KL in the reward (kl_in = "reward") shown as r_i ← r_i
     − β Σ_t k1, and on-policy distillation's per-token term (distill.py; reward = "none": the
     verifier's Â is 0);
  2. the per-token term (grpo.policy_loss) and its weights (TIS, top-entropy, Clip-Cov) and
     penalties (β·k to π_ref with the gradient it actually has, k2 to π_old, KL-Cov's |log ρ|);
  3. the aggregation; the name is a paper's only where the combination is that paper's (a sequence
     ratio without seq-mean-token-mean is not GSPO's eq. 5, and says so).

whole_batch_pass computes the log-probs of every micro-batch under π_old (and π_ref for KL in the
reward) without gradients; cov_picks gathers every rank's (log π_old, Â) of valid tokens, puts
them in (global row, position) order and picks Clip-Cov's / KL-Cov's tokens (grpo.cov_select), so
neither the micro-batch split nor the rank count changes the selection.

  python -c "import train, objective; print(objective.objective(train.Config(pg_loss='sapo')))"
"""

import bisect
import itertools

import torch

import credit
import distill
import grpo
import infra
import verify
from rollout import completion_logprobs, pad_batch
from tasks import seed_of

# what E[∇] of each estimator of the KL term is per sampled state (tools/oracle.py measures it):
# k3's value estimates KL(π_θ‖π_ref), but its gradient is the reverse KL's; k1's gradient is 0
# in expectation
KL_GRAD = {"k1": "E[∇] = 0",
           "k2": "∇ → ∇KL(π_θ‖π_ref)",
           "k3": "∇ → ∇KL(π_ref‖π_θ)"}


def objective(cfg) -> str:
    """cfg: a train.Config (any object with its objective fields) ->
    "NAME: J = E[...], Â_i = ..."."""
    adv = {"group": "(r_i − mean_G r) / (std_G r + ε)",
           "batch": "(r_i − mean_G r) / std_batch r",
           "none": "r_i − mean_G r",
           "rloo": "r_i − mean_{j≠i} r_j",
           "maxrl": "(r_i − mean_G r) / mean_G r",
           "reinforce_pp": "whiten_tokens(r_i − mean_G r)"}[cfg.adv_scale]
    agg = {"seq_mean_token_mean": "1/G Σ_i 1/|o_i| Σ_t",
           "token_mean": "1/Σ|o_i| Σ_i Σ_t",
           "seq_mean_token_sum_norm": f"1/(G·{cfg.max_new_tokens}) Σ_i Σ_t"}[cfg.agg]
    rho, lo, hi = "s_i" if cfg.ratio_level == "sequence" else "ρ_t", cfg.eps_low, cfg.eps_high
    surrogate = grpo.PG_LOSSES[cfg.pg_loss]  # its formula and paper, where it is defined (grpo.py)
    term = surrogate.formula.format(rho=rho, lo=lo, hi=hi, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)
    if cfg.dual_clip:
        term = f"max({term}, {cfg.dual_clip}·Â)_(Â<0)"
    if cfg.tis != "none":
        term = f"w^TIS_{cfg.tis} ({cfg.tis_mode}, C = {cfg.tis_cap:g}) · {term}"
    if cfg.top_entropy_q < 1:
        term = f"1[H_t ≥ top {cfg.top_entropy_q:g}] · {term}"
    if cfg.cov == "clip":
        band = f"({cfg.cov_low:g}, {cfg.cov_high:g})"
        term = f"1[t ∉ Clip-Cov {cfg.cov_frac:g} of cov ∈ {band}] · {term}"
    pen = ""
    if cfg.beta > 0 and cfg.kl_in == "loss":
        pen += f" − {cfg.beta}·{cfg.kl_estimator} [{KL_GRAD[cfg.kl_estimator]}]"
    if cfg.kl_old > 0:
        pen += f" − {cfg.kl_old}·(log ρ_t)²/2"
    if cfg.cov == "kl":
        pen += f" − {cfg.cov_kl_coef}·1[t ∈ top {cfg.cov_frac:g} cov]·|log ρ_t|"
    if cfg.kl_in_reward:
        adv += f",  r_i ← r_i − {cfg.beta}·Σ_t k1 (KL in the reward)"
    if cfg.reward == "none":
        adv = "0 (reward off)"
    # distill.py: the sampled-token reverse KL, discount 0
    opd = getattr(cfg, "teacher", "") and cfg.opd_weight > 0
    if opd:
        adv += (f",  Â_t += {cfg.opd_weight:g}·(log π_T(o_t) − log π_old(o_t)) per token "
                "[sampled-token reverse KL(π_θ‖π_T), discount 0]")
    gspo = cfg.ratio_level == "sequence" and cfg.agg == "seq_mean_token_mean"
    name = surrogate.title or (  # the clip family is named by its other choices
        "GSPO" if gspo else "sequence-ratio clip, not GSPO (eq. 5 needs seq_mean_token_mean)"
        if cfg.ratio_level == "sequence" else
        "MaxRL" if cfg.adv_scale == "maxrl" else
        "RLOO" if cfg.adv_scale == "rloo" else
        "REINFORCE++" if cfg.adv_scale == "reinforce_pp" else
        "Dr. GRPO" if cfg.adv_scale == "none" and cfg.agg == "seq_mean_token_sum_norm" else
        "DAPO" if cfg.agg == "token_mean" and cfg.eps_high > cfg.eps_low else
        "GRPO (DeepSeekMath)" if cfg.agg == "seq_mean_token_mean" else "custom")
    name += {"clip": " + Clip-Cov", "kl": " + KL-Cov"}.get(cfg.cov, "")
    if opd:
        opd_name = "on-policy distillation"
        name = opd_name if cfg.reward == "none" else f"{name} + {opd_name}"
    text = f"{name}: J = E[{agg} {term}{pen}],  Â_i = {adv}"
    if cfg.reward == "process":
        text += " per step (process)"
    if cfg.dynamic_sampling:
        text += ", zero-spread groups resampled (DAPO §3.2)"
    k = getattr(cfg, "max_staleness", 0)  # async_rl.py: the behaviour policy μ is K versions old
    if k:
        text += (f";  o ~ μ = π_(s−1−{k}) at step s (ρ_t = π_θ/π_old, π_old the "
                 "trainer's; w = π_old/μ: decoupled PPO)")
    return text


class Options:
    """The step's options beyond the default path, for train.rl_step: each one's work, done where it
    is needed. Before the first update: a no-grad pass over the whole batch (top-entropy's τ, KL in
    the reward, Clip-/KL-Cov read π_old of every token); the advantages (KL in the reward, process
    rewards, reward = "none", REINFORCE++'s token counts); per micro-batch at epoch 0, the terms
    grpo.policy_loss takes (TIS, top-entropy and Clip-Cov weights, KL-Cov's |log ρ|, OPD's Â_t)
    and their metrics."""

    def __init__(self, run, batch, step: int):
        cfg = run.cfg
        self.run, self.cfg, self.batch, self.step = run, cfg, batch, step
        self.pre, self.tau, self.cov, self.metrics = [], None, [], []
        if cfg.top_entropy_q < 1 or cfg.cov != "none" or cfg.kl_in == "reward":
            self.pre = whole_batch_pass(run, batch)
        if cfg.top_entropy_q < 1:  # τ over the global batch's tokens (Wang et al. 2025)
            entropies = [entropy[batch.mask[rows, :entropy.shape[1]]].cpu()
                         for (_, entropy, _), rows in zip(self.pre, batch.plan)]
            every = torch.cat(infra.all_gather_list(entropies) or [torch.zeros(0)])
            self.tau = grpo.entropy_threshold(every, cfg.top_entropy_q).to(infra.DEVICE)
        if run.teacher is not None:  # every rank gathers the student's copy now, if stale
            infra.sampling(run.sampler, run.model)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Â [N] or [N, L] of the global batch from its rewards [N] (train.rl_step's default:
        credit.group_advantages of the rewards)."""
        cfg, batch = self.cfg, self.batch
        if cfg.kl_in == "reward":  # r_i − β Σ_t k1 (credit.kl_reward), before Â
            rewards = rewards + kl_shift(cfg, self.pre, batch)
        if cfg.reward == "process":
            adv = process_advantages(cfg, batch.groups, rewards, self.run.task)
        else:  # reward = "none": zero rewards, so Â = 0 (pure distillation)
            lengths = torch.tensor([0 if cfg.mask_truncated and cut else len(c)
                                    for g in batch.groups for c, cut in zip(g.comps, g.truncated)])
            adv = credit.group_advantages(rewards * (cfg.reward != "none"), cfg.group_size,
                                          scale=cfg.adv_scale, lengths=lengths)
        if cfg.cov != "none":  # Clip-/KL-Cov's tokens by cov(log π_old, Â) over the global batch
            self.cov = cov_picks(cfg, self.run.proc.rank, self.pre, batch.plan, batch.mask,
                                 adv[batch.rows].to(infra.DEVICE), self.step, batch.rows)
        return adv

    def terms(self, b: int, fixed: dict, entropy, mask, sampler_logp):
        """Micro-batch b's option terms for grpo.policy_loss, into `fixed` (its π_old and Â, fixed
        at epoch 0), and their metrics (token sums; maxima: *_max) into self.metrics."""
        cfg, run, old = self.cfg, self.run, fixed["old_logp"]
        weight = None
        if cfg.tis != "none":  # the sampler drew from its own log-probs: reweight to π_old
            weight, tis = grpo.tis_weights(old, sampler_logp, mask, cfg.tis, cfg.tis_mode,
                                           cfg.tis_cap)
            n_tokens = mask.sum()
            self.metrics.append({"tis_mean": tis["tis_mean"] * n_tokens,
                                 "tis_cut": tis["tis_cut"] * n_tokens, "tis_max": tis["tis_max"]})
        if self.tau is not None:  # gradient only on the top-q entropy tokens
            high = grpo.top_entropy_mask(entropy, mask, self.tau)
            weight = high.float() if weight is None else weight * high
        if cfg.cov == "clip":  # the picked tokens leave the loss
            weight = (~self.cov[b]).float() * (1 if weight is None else weight)
        if cfg.cov == "kl":  # KL-Cov: κ|log ρ| on the picked tokens
            fixed["abs_kl"] = cfg.cov_kl_coef * self.cov[b].float()
        if weight is not None:
            fixed["pg_weight"] = weight
        # on-policy distillation: Â_t += w (log π_T − log π_old)(o_t)
        if run.teacher is not None:
            rows = self.batch.plan[b]
            teacher = distill.teacher_logprobs(run, [self.batch.prompts[i] for i in rows],
                                               [self.batch.completions[i] for i in rows])
            fixed["advantages"] = distill.opd_advantage(fixed["advantages"], teacher.logp, old,
                                                        mask, cfg.opd_weight)
            self.metrics.append(distill.metrics(teacher, old, mask))


def whole_batch_pass(run, batch) -> list[tuple]:
    """(log π_old, entropy, log π_ref or None) [n, L] of every micro-batch of a train.Batch, no
    gradients: what the top-entropy τ, KL in the reward and Clip-/KL-Cov need before the first
    update; padding passes as the training loop has, so FSDP's collectives line up."""
    cfg, out = run.cfg, []
    with torch.no_grad():
        for rows in batch.plan:
            ps, cs = [batch.prompts[i] for i in rows], [batch.completions[i] for i in rows]
            old, entropy = completion_logprobs(run.model, ps, cs, cfg.temperature, cfg.top_k,
                                               cfg.top_p)
            ref = None
            if cfg.kl_in == "reward":
                ref = completion_logprobs(run.ref, ps, cs, cfg.temperature, cfg.top_k, cfg.top_p)[0]
            out.append((old, entropy, ref))
        infra.padding_passes(run.model, batch.pad_passes, backward=False)
    return out


def kl_shift(cfg, pre: list[tuple], batch) -> torch.Tensor:
    """KL in the reward: −β Σ_t k1 [N] of every row of the global batch (credit.kl_reward on
    this rank's rows, gathered by row)."""
    mine = torch.zeros(len(batch.rows), device=infra.DEVICE)
    for (old_logp, _, ref_logp), rows in zip(pre, batch.plan):
        mask = batch.mask[rows, :old_logp.shape[1]]
        mine[rows] = credit.kl_reward(mine[rows], old_logp, ref_logp, mask, cfg.beta)
    gathered = infra.all_gather_list(list(zip(batch.rows, mine.tolist())))
    return torch.tensor([v for _, v in sorted(gathered)])


def process_advantages(cfg, groups: list, rewards: torch.Tensor, task) -> torch.Tensor:
    """reward = "process" (DeepSeekMath §4.1.3): Â [N, L] (credit.process_advantages) from each
    step's 0/1 reward (verify.step_rewards) at its last token and the shaped outcome reward at
    the end."""
    steps, shaped = [], iter(rewards.tolist())  # steps: per row, [(reward, end token)]
    for g in groups:
        for comp, text, r in zip(g.comps, g.texts, shaped):
            # each token's end character, to find the token a step's text ends in
            ends = list(itertools.accumulate(len(task.text([t])) for t in comp))
            row = [(float(ok), bisect.bisect_right(ends, e - 1))
                   for e, ok in verify.step_rewards(text)]
            steps.append(row + [(r, len(comp) - 1)])
    step_rewards = pad_batch([[s[0] for s in row] for row in steps], 0, torch.float32)
    step_ends = pad_batch([[s[1] for s in row] for row in steps], 0, torch.long)
    valid = pad_batch([[True] * len(row) for row in steps], False, torch.bool)
    length = max(len(c) for g in groups for c in g.comps)
    return credit.process_advantages(step_rewards, step_ends, valid, cfg.group_size, length)


def cov_picks(cfg, rank: int, pre: list[tuple], plan: list[list[int]], mask: torch.Tensor,
              adv: torch.Tensor, step: int, rows: list[int]) -> list[torch.Tensor]:
    """Clip-Cov / KL-Cov's tokens (grpo.cov_select) over every rank's valid tokens, ordered by
    (global row, position) so that no rank count or micro-batch split changes the pick: bool [n, L]
    per micro-batch of this rank (mask [n, L], adv [n] or [n, L] of this rank's rows, rows [n]
    their global row indices). Clip-Cov's draw is seeded by (seed, step)."""
    masks = [mask[mb, :lp.shape[1]] for (lp, _, _), mb in zip(pre, plan)]
    advs = [(adv[mb, :m.shape[1]] if adv.dim() == 2 else adv[mb, None]).expand_as(m)
            for m, mb in zip(masks, plan)]
    keys = [(torch.tensor(rows)[mb, None] * mask.shape[1] + torch.arange(m.shape[1])).expand_as(m)
            for m, mb in zip(masks, plan)]
    parts = infra.all_gather_list([(rank, lp[m].cpu(), a[m].cpu(), k[m.cpu()])
                                   for (lp, _, _), m, a, k in zip(pre, masks, advs, keys)])
    order = torch.cat([p[3] for p in parts]).argsort()  # the canonical token order
    lp, a = (torch.cat([p[j] for p in parts])[order][None] for j in (1, 2))
    gen = torch.Generator().manual_seed(seed_of(cfg.seed, step))
    picked = grpo.cov_select(lp, a, torch.ones_like(lp), cfg.cov, cfg.cov_frac, cfg.cov_low,
                             cfg.cov_high, gen)[0]
    sel = torch.empty_like(picked).index_put_((order,), picked)  # back in gather order
    sel = [x for p, x in zip(parts, sel.split([p[1].numel() for p in parts])) if p[0] == rank]
    return [torch.zeros_like(m).masked_scatter(m, x.to(m.device)) for m, x in zip(masks, sel)]

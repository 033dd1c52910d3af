"""What each policy-gradient estimator in grpo.py optimises, measured exactly on a task small enough
to enumerate.

1. Task: P = 3 prompts, vocabulary {EOS, a, b}, horizon H = 3: each prompt has Y = 15 completions of
   1-3 tokens (three tokens without EOS are cut off, unanswered). Verifiable 0/1 reward of prompt p:
   the completion ends with EOS and holds exactly p a's.
2. Policy: a tabular softmax θ[p, prefix, v] over the 7 unfinished prefixes; π_ref, π_old and the
   sampler are tables too. Three regimes: on-policy (sampler = π_old = π_θ); off-policy (samples
   from π_old, θ one step away, so ratios ≠ 1); mismatch (sampler ≠ π_old = π_θ, what
   truncated importance sampling corrects).
3. Exact by enumeration: J(θ) = 1/P Σ_p Σ_y π_θ(y|p) r(p, y) and ∇J (autograd through the
   sum), KL(π_θ‖π_ref), the entropy of π_θ(y|p).
4. An estimator is a batch loss L(b; θ) built only from grpo.py's and credit.py's functions,
   ĝ(b) = −∇_θ L(b; θ). Exact moments where L is a mean of per-group terms
   (a constant normaliser): all Y^G G-tuples of each prompt, P(tuple) = Π_i π_sampler(y_i|p),
   E[ĝ] = 1/P Σ_p E_p[ĝ_p], tr Cov = 1/P² Σ_p tr Cov_p. Monte Carlo over B batches of P groups
   where the batch couples prompts (token-mean, batch std, REINFORCE++, top-entropy, Clip-Cov /
   KL-Cov: their tokens are picked over the batch), with the standard error of 8 chunks.
   Per-batch gradients: ∂L/∂log π(o_t) of every token from one backward (batches share no
   tokens), times the tabular ∇_θ log π(v | prefix) = e_v − π(· | prefix).
5. KL estimators k1/k2/k3 (grpo.kl_penalty) of one completion: bias and variance of Σ_t k_t against
   the exact KL, and of its gradient as a loss term against ∇KL; and k1 in the reward instead
   (Â_t = −Σ_{t'≥t} k1_t'); and on-policy distillation's per-token advantage
   (distill.opd_advantage, π_ref as the teacher): Â_t = −k1_t, the sampled-token estimate of
   −∇KL(π_θ‖π_T) with discount 0 (no sum over later tokens).

Run: python -m tools.oracle          Test: python -m pytest -q tests/test_oracle.py
"""
import argparse
import itertools
import math
import time
from types import SimpleNamespace

import torch
from torch.func import vmap

import credit
import distill
import grpo

EOS, V = 0, 3  # tokens: 0 = EOS, 1 = a, 2 = b
# 1/N Σ_i Σ_t: REINFORCE's sequence-sum aggregation
SUM = dict(agg="seq_mean_token_sum_norm", max_len=1)
SMTM, TOK = dict(agg="seq_mean_token_mean"), dict(agg="token_mean")


def make_task(prompts: int = 3, horizon: int = 3, seed: int = 0) -> SimpleNamespace:
    """The enumerated output space ([Y, H] tokens, prefix ids, mask), rewards [P, Y] and the policy
    tables."""
    seqs = [s for n in range(1, horizon + 1) for s in itertools.product(range(V), repeat=n)
            if EOS not in s[:-1] and (s[-1] == EOS or n == horizon)]
    prefix = {s: i for i, s in enumerate(s for n in range(horizon)
                                         for s in itertools.product(range(1, V), repeat=n))}
    tok = torch.zeros(len(seqs), horizon, dtype=torch.long)
    pre, mask = torch.zeros_like(tok), torch.zeros(len(seqs), horizon, dtype=torch.bool)
    for y, s in enumerate(seqs):
        for t, v in enumerate(s):
            tok[y, t], pre[y, t], mask[y, t] = v, prefix[s[:t]], True
    reward = torch.tensor([[float(s[-1] == EOS and s.count(1) == p) for s in seqs]
                           for p in range(prompts)], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(prompts, len(prefix), V, generator=g, dtype=torch.float64)  # [P, R, V]

    def near(scale):
        return theta + scale * torch.randn(theta.shape, generator=g, dtype=torch.float64)
    return SimpleNamespace(tok=tok, pre=pre, mask=mask, reward=reward, P=prompts, R=len(prefix),
                           Y=len(seqs), H=horizon, theta=theta, ref=near(0.5), step=near(0.5),
                           sampler=near(0.5))


def token_logp(theta: torch.Tensor, task) -> torch.Tensor:
    """log π(o_t | p, o_<t) of every token of every completion: θ [P, R, V] -> [P, Y, H], 0 on
    padding."""
    return torch.where(task.mask, theta.log_softmax(-1)[:, task.pre, task.tok], 0.0)


def seq_logp(theta, task):
    return token_logp(theta, task).sum(-1)  # [P, Y]


def exact(theta, task):
    """J(θ), KL(π_θ‖π_ref) and the entropy of π_θ(y|p), averaged over prompts;
    differentiable in θ."""
    lp, lq = seq_logp(theta, task), seq_logp(task.ref, task)
    return ((lp.exp() * task.reward).sum(1).mean(), (lp.exp() * (lp - lq)).sum(1).mean(),
            -(lp.exp() * lp).sum(1).mean())


def exact_grad(theta, task, which=0):
    """(value, gradient [P·R·V]) of J (which=0) or KL (which=1) at θ."""
    th = theta.clone().requires_grad_()
    value = exact(th, task)[which]
    return value.detach(), torch.autograd.grad(value, th)[0].reshape(-1)


def exact_batches(task, sampler, group):
    """Every G-tuple of every prompt: prompt, comp [B, G] (B = P·Y^G), P(tuple | p) [B],
    stratum = prompt."""
    tuples = torch.cartesian_prod(*[torch.arange(task.Y)] * group).view(-1, group)  # [Y^G, G]
    comp = tuples.repeat(task.P, 1)
    prompt = torch.arange(task.P).repeat_interleave(len(tuples))[:, None].expand(-1, group)
    probs = seq_logp(sampler, task).exp()
    return prompt, comp, probs[prompt, comp].prod(1), prompt[:, 0], 1 / task.P


def mc_batches(task, sampler, group, n_batches, seed=1):
    """n_batches batches of P groups (prompt-major rows, [B, P·G]) drawn from the sampler, weight
    1/B each."""
    probs = seq_logp(sampler, task).exp()
    comp = torch.multinomial(probs, n_batches * group, replacement=True,
                             generator=torch.Generator().manual_seed(seed))  # [P, B·G]
    comp = comp.view(task.P, n_batches, group).transpose(0, 1).reshape(n_batches, -1)
    prompt = torch.arange(task.P).repeat_interleave(group).expand(n_batches, -1)
    one = torch.zeros(n_batches, dtype=torch.long)  # a single stratum: the batch is one draw
    return prompt, comp, torch.full((n_batches,), 1 / n_batches, dtype=torch.float64), one, 1.0


def batch_loss(spec, group, lp, old, samp, ref, mask, r, ent, sel=None):
    """One batch's loss from grpo.py and credit.py: lp, old, samp, ref, ent, mask, sel [n, H];
    r [n]. sel: the tokens grpo.cov_select picked (Clip-Cov, KL-Cov), chosen outside vmap over the
    whole batch."""
    # KL in the reward: Â_t = −Σ_{t' ≥ t} k1_t', REINFORCE on the sequence's KL
    if spec["adv"] == "kl_to_go":
        adv = -torch.where(mask, old - ref, 0.0).flip(-1).cumsum(-1).flip(-1)
    elif spec["adv"] == "opd":
        # on-policy distillation (distill.py), π_ref as the teacher: Â_t = log π_T − log π_old
        adv = distill.opd_advantage(0 * r, ref, old, mask, 1.0)
    else:
        adv = r if spec["adv"] == "raw" else 0 * r if spec["adv"] == "zero" else \
            credit.group_advantages(r, group, spec["adv"], lengths=mask.sum(1)).to(lp.dtype)
    w = None
    if "tis" in spec:
        w = grpo.tis_weights(old, samp, mask, spec["tis"], spec.get("mode", "truncate"),
                             spec["cap"])[0].to(lp.dtype)
    if "q" in spec:
        keep = grpo.top_entropy_mask(ent, mask,
                                     grpo.entropy_threshold(ent, spec["q"], mask)).to(lp.dtype)
        w = keep if w is None else w * keep
    cov = {}
    if spec.get("cov") == "clip":  # Clip-Cov: the picked tokens leave the loss
        w = (1 - sel.to(lp.dtype)) * (1 if w is None else w)
    elif spec.get("cov") == "kl":  # KL-Cov: β_cov |log ρ| on them
        cov = dict(abs_kl=spec["beta_cov"] * sel.to(lp.dtype))
    return grpo.policy_loss(lp, old, adv, mask, agg=spec["agg"], max_len=spec.get("max_len"),
                            ref_logp=ref, pg_weight=w, **spec.get("kw", {}), **cov)[0]


def batch_grads(spec, task, theta, old, sampler, batches, group):
    """ĝ(b) = −∇_θ L(b; θ) of every batch: [B, P·R·V]."""
    prompt, comp = batches[:2]
    b = len(comp)
    # [P, R]: π_old's entropy at each prefix
    ent_pr = -(old.softmax(-1) * old.log_softmax(-1)).sum(-1)
    lp = token_logp(theta, task)[prompt, comp].detach().requires_grad_()  # [B, n, H]
    args = [token_logp(t, task)[prompt, comp] for t in (old, sampler, task.ref)]
    mask, r, ent = (task.mask[comp], task.reward[prompt, comp],
                    ent_pr[prompt[..., None], task.pre[comp]])
    sel = torch.zeros_like(mask)
    # per group, so one call over all batches; its reward check cannot run under vmap
    if spec["adv"] == "maxrl":
        r, spec = (credit.group_advantages(r.reshape(-1), group, "maxrl").view_as(r).double(),
                   {**spec, "adv": "raw"})
    # cov_select is data-dependent (not vmappable): one call per batch, with Â of the batch
    if "cov" in spec:
        adv, gen = (credit.group_advantages(r.reshape(-1), group, spec["adv"]).view_as(r),
                    torch.Generator())
        sel = torch.stack([grpo.cov_select(o, a, m, spec["cov"], spec["frac"], 1.0, 5.0,
                                           gen.manual_seed(i))
                           for i, (o, a, m) in enumerate(zip(args[0], adv, mask))])
    losses = vmap(lambda *a: batch_loss(spec, group, *a))(lp, *args, mask, r, ent, sel)  # [B]
    coef, = torch.autograd.grad(losses.sum(), lp)  # [B, n, H]: ∂L_b/∂log π(o_t), 0 on padding
    # scatter into θ's shape: Σ_t coef_t (e_{o_t} − π(· | prefix_t)) at row (p, prefix_t)
    row = (prompt[..., None] * task.R + task.pre[comp]).reshape(b, -1)  # [B, n·H]
    g = torch.zeros(b, task.P * task.R * V, dtype=torch.float64)
    g.scatter_add_(1, row * V + task.tok[comp].reshape(b, -1), coef.reshape(b, -1))
    s = torch.zeros(b, task.P * task.R, dtype=torch.float64).scatter_add_(1, row,
                                                                         coef.reshape(b, -1))
    g = g.view(b, -1, V) - s[..., None] * theta.softmax(-1).view(-1, V)
    return -g.reshape(b, -1)


def moments(g, weight, stratum, scale):
    """E[ĝ] [D] and tr Cov[ĝ] of a batch that averages independent strata (prompts) with the given
    scale."""
    mean, tr = torch.zeros(g.shape[1], dtype=torch.float64), 0.0
    for s in stratum.unique():
        w, gs = weight[stratum == s], g[stratum == s]
        w = w / w.sum()  # exact tuples of one prompt: their probabilities sum to 1 up to rounding
        m = w @ gs
        mean, tr = mean + scale * m, tr + scale ** 2 * float(w @ (gs * gs).sum(1) - m @ m)
    return mean, tr


def cos(a, b):
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


ON, OFF, MIS = "on-policy", "off-policy", "mismatch"
RLOO = dict(adv="rloo", **SUM)
ESTIMATORS = [  # (name, regime, spec); names say adv scale · aggregation · loss options
    ("REINFORCE, no baseline · seq-sum", ON, dict(adv="raw", **SUM)),
    ("RLOO · seq-sum", ON, RLOO),
    ("mean baseline (Dr. GRPO w/o const) · seq-sum", ON, dict(adv="none", **SUM)),
    ("Dr. GRPO: none · sum/(G·L_max)", ON,
     dict(adv="none", agg="seq_mean_token_sum_norm", max_len=3)),
    ("group std · seq-sum", ON, dict(adv="group", **SUM)),
    ("none · seq-mean token-mean", ON, dict(adv="none", **SMTM)),
    ("GRPO: group std · seq-mean token-mean", ON, dict(adv="group", **SMTM)),
    ("batch std · seq-sum", ON, dict(adv="batch", **SUM)),
    ("none · token-mean", ON, dict(adv="none", **TOK)),
    ("DAPO: group std · token-mean", ON, dict(adv="group", **TOK)),
    ("REINFORCE++: reinforce_pp · token-mean", ON, dict(adv="reinforce_pp", **TOK)),
    ("DAPO + top-entropy q = 0.5", ON, dict(adv="group", q=0.5, **TOK)),
    ("DAPO + top-entropy q = 0.2", ON, dict(adv="group", q=0.2, **TOK)),
    ("MaxRL: maxrl · seq-sum", ON, dict(adv="maxrl", **SUM)),
    ("RLOO · seq-sum, token ratio, no clip", OFF,
     dict(kw=dict(eps_low=1.0, eps_high=1e9), **RLOO)),
    ("  + PPO clip ε 0.2", OFF, RLOO),
    ("  + clip-higher ε 0.2/0.28", OFF, dict(kw=dict(eps_high=0.28), **RLOO)),
    ("  + dual-clip c = 3", OFF, dict(kw=dict(dual_clip=3.0), **RLOO)),
    ("  GSPO, ε 3e-4/4e-4", OFF,
     dict(kw=dict(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4), **RLOO)),
    ("  GSPO, ε 0.2", OFF, dict(kw=dict(ratio_level="sequence"), **RLOO)),
    ("  CISPO ε_low 1, ε_high 0.28", OFF,
     dict(kw=dict(pg_loss="cispo", eps_low=1.0, eps_high=0.28), **RLOO)),
    ("  DPPO-TV δ 0.15", OFF,
     dict(kw=dict(pg_loss="dppo_tv", eps_low=0.15, eps_high=0.15), **RLOO)),
    ("  DPPO-KL δ 0.05", OFF,
     dict(kw=dict(pg_loss="dppo_kl", eps_low=0.05, eps_high=0.05), **RLOO)),
    ("  SAPO τ 1 / 1.05", OFF, dict(kw=dict(pg_loss="sapo"), **RLOO)),
    ("  GMPO ε 0.4 · seq-mean token-mean", OFF,
     dict(adv="rloo", kw=dict(pg_loss="gmpo", eps_low=0.4, eps_high=0.4), **SMTM)),
    ("  + PPO clip, Clip-Cov r 0.2 in (1, 5)", OFF,
     dict(cov="clip", frac=0.2, batches=1 << 14, **RLOO)),
    ("  KL-Cov r 0.2, β 1, no clip", OFF, dict(cov="kl", frac=0.2, beta_cov=1.0, batches=1 << 14,
                                               kw=dict(eps_low=1.0, eps_high=1e9), **RLOO)),
    ("RLOO · seq-sum, no correction", MIS, RLOO),
    ("  + TIS token, C = 2", MIS, dict(tis="token", cap=2.0, **RLOO)),
    ("  + TIS sequence, C = 2", MIS, dict(tis="sequence", cap=2.0, **RLOO)),
    ("  + IS sequence, C = ∞", MIS, dict(tis="sequence", cap=math.inf, **RLOO)),
    ("  + masked IS token, [1/2, 2]", MIS, dict(tis="token", mode="mask", cap=2.0, **RLOO)),
    ("  + masked IS sequence, [1/2, 2]", MIS, dict(tis="sequence", mode="mask", cap=2.0, **RLOO)),
]


def measure(spec, task, reg, group=4, n_batches=1 << 17):
    """(E[ĝ], tr Cov, standard errors of cos and norm ratio or None, true gradient) of one
    estimator."""
    t = task.theta
    theta, old, sampler = {ON: (t, t, t), OFF: (task.step, t, t), MIS: (t, t, task.sampler)}[reg]
    true = exact_grad(theta, task)[1]
    # a normaliser or statistic over the whole batch ties the prompts' groups together: no
    # per-prompt enumeration
    mc = (spec["agg"] == "token_mean" or spec["adv"] in ("batch", "reinforce_pp") or "q" in spec
          or "cov" in spec)
    n_batches = spec.get("batches", n_batches)
    batches = (mc_batches(task, sampler, group, n_batches) if mc
               else exact_batches(task, sampler, group))
    g = batch_grads(spec, task, theta, old, sampler, batches, group)
    mean, tr = moments(g, *batches[2:])
    se = None
    if mc:  # 8 chunks of B/8 batches: the spread of their cos and norm ratio
        parts = [(cos(c.mean(0), true), float(c.mean(0).norm() / true.norm())) for c in g.chunk(8)]
        se = [torch.tensor(x, dtype=torch.float64).std().item() / math.sqrt(8) for x in zip(*parts)]
    return mean, tr, se, true


def prompt_scales(mean, true, task):
    # the weight each prompt's exact gradient gets: ⟨E[ĝ]_p, ∇J_p⟩ / ‖∇J_p‖² on prompt
    # p's block of θ
    m, t = mean.view(task.P, -1), true.view(task.P, -1)
    return " ".join(f"{float(a @ b / (b @ b)):.2f}" for a, b in zip(m, t))


def kl_rows(task, group=1):
    """k1/k2/k3 on-policy: (name, bias of E[Σ_t k_t], its variance, cos and norm ratio of E[∇],
    tr Cov)."""
    # probs [P, Y]
    (kl, true), probs, rows = exact_grad(task.theta, task, 1), seq_logp(task.theta, task).exp(), []
    batches = exact_batches(task, task.theta, group)
    for k in grpo.KL_ESTIMATORS + ("k1 in the reward", "k1 per token (OPD's Â_t)"):
        value = torch.where(task.mask, grpo.kl_penalty(token_logp(task.theta, task),
                                                       token_logp(task.ref, task), k[:2]),
                            0.0).sum(-1)  # [P, Y]: Σ_t k_t of each completion
        e = (probs * value).sum(1)
        spec = dict(adv={"k1 i": "kl_to_go", "k1 p": "opd"}[k[:4]], **SUM) if len(k) > 2 else \
            dict(adv="zero", kw=dict(beta=1.0, kl_estimator=k), **SUM)
        mean, tr = moments(-batch_grads(spec, task, task.theta, task.theta, task.theta, batches,
                                        group), *batches[2:])
        rows.append((k, float(e.mean() - kl), float(((probs * value ** 2).sum(1) - e ** 2).mean()),
                     cos(mean, true), float(mean.norm() / true.norm()), tr))
    return float(kl), rows


def main():
    # --help; no options
    argparse.ArgumentParser(prog="python -m tools.oracle", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    task = make_task()
    j, _, ent = exact(task.theta, task)
    print(f"task: P={task.P} prompts, V={V} (EOS, a, b), H={task.H}, "
          f"Y={task.Y} completions per prompt, G=4; "
          f"J(θ)={float(j):.4f}, per-prompt success " + " ".join(
              f"{float(x):.3f}" for x in (seq_logp(task.theta, task).exp() * task.reward).sum(1))
          + f"; H(π_θ)={float(ent):.4f} nats")
    print("\n| estimator | regime | E[ĝ] by | cos(E[ĝ], ∇J) | ‖E[ĝ]‖/‖∇J‖ "
          "| tr Cov[ĝ] | tr Cov/‖E[ĝ]‖² | prompt weights |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, reg, spec in ESTIMATORS:
        mean, tr, se, true = measure(spec, task, reg)
        how = ("exact" if se is None
               else f"MC, 2^{spec.get('batches', 1 << 17).bit_length() - 1} batches")
        pm = ("", "") if se is None else (f" ± {se[0]:.1g}", f" ± {se[1]:.1g}")
        print(f"| {name} | {reg} | {how} | {cos(mean, true):.4f}{pm[0]} "
              f"| {float(mean.norm() / true.norm()):.4f}{pm[1]} | {tr:.3g} "
              f"| {tr / float(mean @ mean):.3g} | {prompt_scales(mean, true, task)} |")
    kl, rows = kl_rows(task)
    print(f"\nexact KL(π_θ‖π_ref) = {kl:.4f} per completion; "
          "one completion per estimate (exact)\n\n"
          "| estimator | E[Σ_t k_t] − KL | Var[Σ_t k_t] | cos(E[∇], ∇KL) "
          "| ‖E[∇]‖/‖∇KL‖ | tr Cov[∇] |\n"
          "|---|---|---|---|---|---|")
    for k, bias, var, c, ratio, tr in rows:
        c = f"{c:.4f}" if ratio > 1e-9 else "— (E[∇] = 0)"
        print(f"| {k} | {bias:+.4f} | {var:.4f} | {c} | {ratio:.4f} | {tr:.3g} |")
    print(f"\n{time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

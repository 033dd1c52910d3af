"""On-policy distillation (OPD): a frozen teacher gives its log-prob of every token the student
sampled, and the student moves toward it on its own trajectories, beside (or instead of) the
verifier's reward.

The student π_θ samples o ~ π_θ(·|q) as in every RL step; the teacher π_T (its own
Hugging Face folder, any size, the same vocabulary) gives its log-probs of the sampled tokens. The
objective is the reverse KL to the teacher on the student's own states,
KL(π_θ‖π_T) = E_{o~π_θ} Σ_t log π_θ(o_t|q, o_<t) − log π_T(o_t|q, o_<t) (GKD, Agarwal
et al. 2024, its on-policy reverse-KL case; Thinking Machines, "On-Policy Distillation", 2025).
Implemented as they do, a per-token advantage with discount 0 (each token's own log-ratio, no sum
over later tokens):
  1. log π_T of the completions (no gradient, at the sampling temperature, no top-k/top-p filter: a
     token the student's filter kept must have a finite teacher log-prob) once per batch,
     micro-batch by micro-batch;
  2. Â_t ← Â_t + w · (log π_T(o_t) − log π_old(o_t)), Â_t the verifier's advantage (0 with
     reward = "none": pure distillation), then the usual grpo.policy_loss. At ratio 1 its gradient
     is w Σ_t (log π_T − log π_θ)(o_t) ∇log π_θ(o_t): the sampled-token estimate of
     −Σ_s d(s) ∇KL(π_θ(·|s)‖π_T(·|s)), the visit probabilities d held fixed, k2's
     gradient as a loss term. tools/oracle.py's "k1 per token" row: cos 0.985 and norm ratio 1.009
     to the sequences' exact ∇KL, tr Cov 0.033, where the unbiased sum over later tokens
     ("k1 in the reward") has 0.065. The summed Â_t goes through the policy loss's clip;
     Clip-/KL-Cov and top-entropy selections see the verifier's Â;
  3. metrics: train/opd_kl, the sampled-token estimate of the reverse KL per token (mean over tokens
     of log π_old − log π_T); train/opd_kl_exact, the full-vocabulary
     Σ_v π_old(v) log(π_old(v)/π_T(v)) per token, when V ≤ EXACT_KL_MAX_V ([tokens × V]
     log-probs are cheap only there): the teacher's one forward of step 1 then keeps its full log
     softmax, beside one more no-grad forward of π_old.
The teacher is a plain frozen copy on every rank, like π_ref (bf16 on CUDA, float32 on CPU); the
tokenizers must be equal (checked at start; the models' vocab_size may differ, as Qwen2.5's padded
heads do, but then no exact KL). A teacher with opd_weight = 0 only measures the KL. Every
teacher_pass_every steps, train/teacher_pass: the teacher's own greedy pass@1 on the step's prompts
(teacher_pass; one greedy generate of P rows, its seconds in time/teacher_pass_s, outside
time/train_s), the ceiling a pupil is distilled toward.

  python train.py --config configs/smoke.toml --config configs/opd.toml
  Test: python -m pytest -q tests/test_distill.py
"""
import time
from typing import NamedTuple

import torch

import infra
from cli import UserError
from model import Transformer, load_tokenizer
from rollout import completion_log_softmax, completion_logprobs, generate, pad_batch

# exact full-vocabulary KL per micro-batch only up to this vocabulary (memory ~ tokens × V)
EXACT_KL_MAX_V = 2048


def load_teacher(cfg, student_tok, device) -> Transformer | None:
    """The frozen teacher of a train.Config (None without one; checks.py has checked its folder and
    the OPD settings), after checking its tokenizer is the student's (the same token -> id map,
    special tokens included): the per-token log-ratio compares the two models' probabilities of the
    same ids. bf16 on CUDA (the compute dtype, as π_ref), float32 on CPU."""
    if not cfg.teacher:
        return None
    student = cfg.init_from or "the fresh model's character tokenizer"
    if (load_tokenizer(cfg.teacher).get_vocab(with_added_tokens=True)
            != student_tok.get_vocab(with_added_tokens=True)):
        raise UserError(f"teacher {cfg.teacher!r} and student ({student}) have different "
                        "tokenizers: on-policy distillation compares their log-probs of the same "
                        "token ids, so the vocabularies must match")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Transformer.from_pretrained(cfg.teacher, device=device,
                                       dtype=dtype).requires_grad_(False).eval()


class TeacherLogProbs(NamedTuple):
    """What one teacher forward gives a micro-batch of epoch 0 (later epochs reuse it)."""
    logp: torch.Tensor                  # log π_T(o_t | q, o_<t) [n, L] float32,
                                        #   0 past a row's length
    kl_exact: torch.Tensor | None       # Σ_v π_old(v) log(π_old(v)/π_T(v)) [n, L]
                                        #   (V ≤ EXACT_KL_MAX_V), else None


def exact_ok(run) -> bool:
    """The exact KL is cheap (V ≤ EXACT_KL_MAX_V) and defined (teacher and student heads of one
    vocabulary size)."""
    V = run.teacher.config.vocab_size
    return V <= EXACT_KL_MAX_V and V == run.model.config.vocab_size


def teacher_logprobs(run, prompts: list, completions: list) -> TeacherLogProbs:
    """Steps 1 and 3 for a micro-batch's rows, no gradient: log π_T at the sampling temperature
    without top-k/top-p, and, when exact_ok, the exact KL from the same teacher forward's full log
    softmax beside π_old's (the student's at the sampling settings)."""
    cfg = run.cfg
    with torch.no_grad():
        if not exact_ok(run):
            return TeacherLogProbs(completion_logprobs(run.teacher, prompts, completions,
                                                       cfg.temperature)[0], None)       # [n, L]
        lt, valid = completion_log_softmax(run.teacher, prompts, completions,
                                           cfg.temperature)                            # [M, V]
        # π_old from the plain sampling copy where FSDP shards the policy (in epoch 0 the copy is
        # π_old): a no-grad forward of the sharded model between micro-batches changed the 2-rank
        # gradient (tests/test_distill.py)
        student = infra.sampling(run.sampler, run.model)
        ls = completion_log_softmax(student, prompts, completions, cfg.temperature, cfg.top_k,
                                    cfg.top_p)[0]
    # a filtered token: 0 · (−inf) adds 0
    kl = (ls.exp() * (ls - lt)).nan_to_num(0.0, posinf=0.0, neginf=0.0).sum(-1)
    zeros = lt.new_zeros(valid.shape)
    targets = pad_batch(completions).to(valid.device)[valid]                     # [M] o_t
    logp = lt.gather(-1, targets[:, None])[:, 0]                                 # [M] log π_T(o_t)
    return TeacherLogProbs(zeros.masked_scatter(valid, logp),
                           zeros.masked_scatter(valid, kl.clamp(min=0)))


def opd_advantage(adv: torch.Tensor, teacher_logp: torch.Tensor, old_logp: torch.Tensor,
                  mask: torch.Tensor, weight: float) -> torch.Tensor:
    """Â_t + w (log π_T(o_t) − log π_old(o_t)) (step 2): adv [n] or [n, L]; teacher_logp,
    old_logp, mask [n, L] -> [n, L] float32 (float64 inputs: float64), detached; padding keeps the
    verifier's Â (the loss masks it anyway)."""
    if teacher_logp.shape != old_logp.shape or mask.shape != old_logp.shape or adv.shape not in (
            old_logp.shape[:1], old_logp.shape):
        raise ValueError("need adv [n] or [n, L] and teacher_logp, old_logp, mask [n, L], "
                         f"got {tuple(adv.shape)}, {tuple(teacher_logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    # float32, or float64 for float64 inputs (tools/oracle.py)
    dt = torch.promote_types(old_logp.dtype, torch.float32)
    base = (adv[:, None] if adv.dim() == 1 else adv).detach().to(dt).expand_as(old_logp)
    gap = torch.where(mask != 0, teacher_logp.detach().to(dt) - old_logp.detach().to(dt), 0.0)
    return base + weight * gap


def metrics(teacher: TeacherLogProbs, old_logp, mask) -> dict:
    """Token sums for train.rl_step's log (it divides by the token count): the sampled-token
    reverse-KL estimate and, for small vocabularies, the exact one (step 3)."""
    out = {"opd_kl": torch.where(mask, old_logp - teacher.logp, 0.0).sum()}
    if teacher.kl_exact is not None:
        out["opd_kl_exact"] = teacher.kl_exact[:, :mask.shape[1]][mask].sum()
    return out


def teacher_pass(run, groups: list, step: int) -> dict:
    """The teacher's own greedy pass rate on the step's P prompts (train.Group list, every rank the
    same), every teacher_pass_every steps (the step count, as eval_every), else {}: one greedy
    teacher completion per prompt, scored by the task's verifier, beside train/accuracy (the
    student's, sampled). Rank r decodes prompts r, r + world, ...; eagerly (static=False): the
    compiled step's frame budget and static buffers stay the policy's alone."""
    cfg, proc = run.cfg, run.proc
    if run.teacher is None or not cfg.teacher_pass_every or step % cfg.teacher_pass_every:
        return {}
    t0, mine = time.time(), groups[proc.rank::proc.world]
    ro = mine and generate(run.teacher, [g.prompt for g in mine], 1, cfg.max_new_tokens,
                           temperature=0.0, stop_ids=run.task.stop_ids, static=False)
    ids, mask = (ro.completion_ids.cpu(), ro.completion_mask.cpu()) if mine else (None, None)
    solved = sum(run.task.score(run.task.text(ids[i][mask[i]].tolist()), g.problem)
                 for i, g in enumerate(mine))
    # [solved, prompts] over ranks
    n = infra.all_sum(torch.tensor([float(solved), float(len(mine))]))
    return {"train/teacher_pass": n[0] / n[1].clamp(min=1), "time/teacher_pass_s": time.time() - t0}

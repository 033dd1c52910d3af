"""Sampling throughput (generated tokens/s) of rollout.generate, side by side on the same \
weights with
  1. a naive loop that recomputes the whole sequence every step (no KV cache),
  2. Hugging Face transformers' generate (only if transformers is importable; the project does not
     need it),
  3. the matmul-only bound of a decode step: N rows times every weight matrix of every layer plus
     the LM head, as plain F.linear calls on preallocated inputs, in a loop. ours / bound is the
     fraction of it we reach.
Every row runs all new tokens (no stop ids; transformers with eos off), greedy (T = 0) and T = 1
(no top-k / top-p). Each number is the best of --repeats runs, the methods taking turns every round
(speed drifts up to 2x over minutes). Settings are P×G×new-tokens: the first times all three, the
others ours alone (a prompt is prefilled once per group).

Presets, Qwen2-like (q/k/v bias, GQA, SwiGLU, tied embeddings), vocab 4096 so the LM head weighs
like a real one:
  2m:  hidden 128, 6 layers, 4 heads / 2 KV heads of 32, FFN 512     2.00M parameters
  20m: hidden 384, 12 layers, 6 heads / 2 KV heads of 64, FFN 1024  20.4M parameters
  python -m tools.bench --size 2m
  python -m tools.bench --size 20m --repeats 2 --static   (+ the compiled step)
  python -m tools.bench --ckpt DIR --device cuda --dtype bfloat16 --settings 8x8x128,2x32x128
--device cuda without --ckpt runs the GPU check (bench_gpu, a few minutes): a random
Qwen2.5-0.5B-shaped bf16 model, eager against captured (CUDA graph) decoding at 64 and 512 rows,
their fraction of max(HBM, FLOP) floors (the sampler's logits counted), RL steps of
configs/qwen2.5-0.5b-gsm8k.toml on one GPU, the sampling copy's refresh, sampling and training
timed apart:  python -m tools.bench --device cuda    (--gpu_new 128 --gpu_rl_steps 1: shorter)
--rl instead splits one RL step of a preset (4 x 8 x 64 tokens) by torch.profiler into sampling,
scoring, loss, backward and AdamW, each with its time outside aten ops:
  python -m tools.bench --rl --size 20m --threads 1
--logprobs instead times the trainer's log-probs at a real vocabulary (default 151,936, Qwen's),
forward + backward of one micro-batch, each method in a fresh process for its own peak RSS: `full`
(logits at every position, a float32 copy, an [n, L, V] gather, an entropy pass apart) against
`chunked`, rollout.completion_logprobs (the LM head at completion tokens only, chunks recomputed in
backward):
  python -m tools.bench --logprobs --threads 1
      (a 10M-parameter Qwen2-shaped model, 32 rows of 136 + 64 tokens)
--compact instead times the eager sampler at several rollout.COMPACT_AT values (rows stopping at
random lengths): python -m tools.bench --compact --size 20m --threads 1. --logprobs --chunks
21,23,25 times completion_logprobs at 2^k logits per LM-head block (rollout.LOGITS_PER_CHUNK).
--shared instead times the trainer's log-prob forward + backward of one micro-batch, 4 groups of 8
rows (prompts of 30-40 tokens, completions of 15-40), each group's prompt run once against once per
row, at SmolLM2-135M's shape (random weights) or --ckpt's config:
  python -m tools.bench --shared --threads 2
--profile instead splits one eager decode call (the first --settings, greedy and T = 1) by
torch.profiler into its ops' self CPU time, the largest first, with the share that is matrix
products (the LM head and the projections: aten::mm / addmm, or oneDNN's packed GEMM):
  python -m tools.bench --profile --ckpt checkpoints/SmolLM2-135M-Instruct --settings 64x1x128
--fused instead times a decode step's projections through every layer (random inputs, the model's
weights), the seven products as the model runs them (q, k, v, o; gate, up, down) against q/k/v and
gate/up each fused into one wider product (the weights concatenated once), at 8, 64 and 512 rows:
  python -m tools.bench --fused --ckpt checkpoints/SmolLM2-135M-Instruct --threads 2
--gemm instead times plain F.linear against oneDNN's packed GEMM (model.Transformer.packed) per
weight shape and row count, the ratios that set model.PACK_FROM:
  python -m tools.bench --gemm --threads 1; python -m tools.bench --gemm --threads 2
--step_packed instead times train.rl_step of --config on --ckpt at compare_trl's bench shape (4 x 8
x 64 tokens), --repeats steps each with the packed GEMM off and on, alternating after a warm-up:
  python -m tools.bench --step_packed --ckpt checkpoints/SmolLM2-135M-Instruct --threads 2
--step_bf16 likewise with train.py's cpu_bf16 off and on (the decode from a bf16 copy of the
weights; training's layers in bf16 autocast, its LM head's forward in float32 and backward in bf16),
and the mismatch KL between the sampler's and the trainer's log-probs:
  python -m tools.bench --step_bf16 --ckpt checkpoints/SmolLM2-135M-Instruct --threads 2
--verify instead times verify.reward on a fixed mix of completions (numbers, fractions, LaTeX,
symbolic answers, long and adversarial texts), one thread, its slowest call on hostile runs
(HOSTILE) of 10k, 100k and 1M characters (linear time: ~10x per size), and math-verify's calls/s
and agreement if importable:  python -m tools.bench --verify
"""
import argparse
import dataclasses
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import timeit
from functools import partial

import torch
import torch.nn.functional as F

import grpo
import infra
import model as model_py
import rollout
import train
import verify
from model import ModelConfig, Transformer, read_config
from rollout import completion_logprobs, filter_logits, generate, pad_batch

# --logprobs' children run from it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


VERIFY_FAMILIES = [  # gold, a right answer, a wrong one
    ("72", "72", "73"), ("1000", "1,000", "100"), ("0.5", r"\frac{1}{2}", r"\frac{1}{3}"),
    (r"\frac{3}{4}", "0.75", r"\frac{4}{3}"), ("(1,2)", "(1, 2)", "(2,1)"),
    ("[2,5)", "[2, 5)", "[2,5]"),
    (r"\{1,2\}", r"\{2, 1\}", r"\{1, 3\}"), ("18.90", r"\$18.9", "18.09"),
    (r"\text{(C)}", "C", "D"),
    (r"2\sqrt{2}", r"\sqrt{8}", r"\sqrt{4}"), ("x^2+2x+1", "(x+1)^2", "x^2+1"),
    ("3+4i", "4i+3", "3-4i"),
    (r"\frac{\pi}{2}", r"\frac{1}{2}\pi", r"2\pi"),
    (r"\frac{\sqrt2}{2}", r"\frac{1}{\sqrt{2}}", r"\sqrt2"),
    ("3", r"\log_2 8", r"\log_2 4"), ("120", "5!", "100"), (r"\frac13", r"0.\overline{3}", "0.33"),
    (r"\frac{x+2}{7}", r"\frac{x}{7}+\frac{2}{7}", r"\frac{x}{7}+2"),
    ("10", r"\binom{5}{2}", r"\binom{5}{1}")]


def verify_mix() -> list[tuple[str, str]]:
    """(completion, gold) pairs: each family right and wrong, in three answer formats; GSM8K lines;
    long texts (10 KB of reasoning with and without a final answer); adversarial boxes (unclosed,
    power towers, nesting)."""
    pairs = [(t.format(pred), gold) for gold, *preds in VERIFY_FAMILIES for pred in preds for t in (
        "<think>so on</think><answer>{}</answer>", "Thus $\\boxed{{{}}}$.", "The answer is ${}$.")]
    pairs += [(f"Natalia sold {i} clips.\n#### {i * 2}", str(i * 2 + i % 2)) for i in range(10)]
    filler = "We add 12 and 30 to get 42, then check 7 * 6 = 42. " * 200
    pairs += [(filler + r"\boxed{42}", "42"), (filler + "so it is 42", "42"), (filler, "42")]
    return pairs + [("\\boxed{" + "{" * 20000, "1"), ("\\boxed{" + "10^" * 160 + "10}", "1"),
                    (r"\boxed{1000!}", "1"), ("\\boxed{" + "(" * 240 + "x" + ")" * 240 + "}", "x"),
                    (r"\boxed{(a+b+c+d)^{30}}", "1")]


HOSTILE = [" ", "\n", "{", "}", "\\", "#### ", "1", "0", "the answer is ", "\\boxed{", "wait, ",
           "$", "\\frac{", "\\mathbf{", "1, ", "(", " \\,", "a", "<answer>",
           "if I'm wrong "]  # runs the parser scans for: blanks, cues
PLACES = [("", "{r}", "5"), ("#### 5 +", "#### 5{r}", "5"),  # run r, digits d
          ("\\boxed{5} +", "\\boxed{{5}}{r}", "5"),
          ("withdrawn +", "\\boxed{{4}} is wrong.{r}\\boxed{{5}}", "5"),
          ("in a box:", "\\boxed{{1.{d}}}", "1.{d}0")]


def bench_verify(rounds: int = 20):
    pairs, t0 = verify_mix(), time.perf_counter()
    ours = [[verify.reward(c, g) for c, g in pairs] for _ in range(rounds)][0]
    rate = rounds * len(pairs) / (time.perf_counter() - t0)
    slowest = {n: max((timeit.timeit(partial(verify.reward,
                                             t.format(r=u * (n // len(u)), d=(u * 3900)[:3900]),
                                             g.format(d=(u * 3900)[:3900])), number=1) * 1e3,
                       f"{k} {u!r}".strip())
                      for u in HOSTILE for k, t, g in PLACES)
               for n in (10_000, 100_000, 1_000_000)}  # linear: ~10x
    res = {"verify_calls_s": rate, "n": len(pairs), "slowest_ms": slowest}
    print(f"verify.reward: {rate:,.0f} calls/s on {len(pairs)} completions x {rounds} rounds, "
          f"{sum(ours):.0f} rewarded;"
          f" the slowest of {len(HOSTILE) * len(PLACES)} hostile shapes: " + ", ".join(
              f"{n:,} chars {t:.1f} ms ({k})" for n, (t, k) in slowest.items()))
    try:
        from math_verify import parse, verify as mv_verify
    except ImportError:
        return print("math-verify is not installed: no comparison\n" + json.dumps(res))
    # the call TRL's and verl's reward functions make, its own timeouts on; a bare gold needs $...$
    # to parse as LaTeX
    t0 = time.perf_counter()
    theirs = [float(mv_verify(parse(f"${g}$"), parse(c))) for c, g in pairs]
    mv_rate, agree = (len(pairs) / (time.perf_counter() - t0),
                      sum(a == b for a, b in zip(ours, theirs)) / len(pairs))
    # equivalence alone, without extraction
    answers = [(p, g) for g, *preds in VERIFY_FAMILIES for p in preds]
    same = sum(verify.is_equiv(p, g) == mv_verify(parse(f"${g}$"), parse(f"${p}$"))
               for p, g in answers) / len(answers)
    print(f"math-verify:   {mv_rate:,.0f} calls/s, {sum(theirs):.0f} rewarded; "
          f"agreement with ours {agree:.1%} on completions, "
          f"{same:.1%} on the {len(answers)} bare answers; "
          f"ours / math-verify {rate / mv_rate:,.0f}x")
    print(json.dumps(res | {"math_verify_calls_s": mv_rate, "agreement": agree,
                            "answer_agreement": same}))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """log π(target): logits [B, T, V], targets [B, T] -> float32 [B, T], differentiable. `chunk`
    rows at a time as gathered logit − logsumexp: a [chunk, T, V] float32 copy at once, never a
    full [B, T, V] log-softmax."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError("need logits [B, T, V] and targets [B, T], "
                         f"got {tuple(logits.shape)}, {tuple(targets.shape)}")
    return torch.cat([(z := logits[i:i + chunk].float())
                      .gather(-1, targets[i:i + chunk].unsqueeze(-1)).squeeze(-1)
                      - z.logsumexp(-1)
                      for i in range(0, logits.shape[0], chunk)])  # z [c, T, V], each term [c, T]


def token_entropy(logits: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Exact entropy of π per position: logits [B, T, V] -> float32 [B, T],
    H = −Σ_v π_v log π_v."""
    if logits.dim() != 3:
        raise ValueError(f"need logits [B, T, V], got {tuple(logits.shape)}")
    out = []
    for i in range(0, logits.shape[0], chunk):
        # −Σ p log p on the normalised log-probs, not lse − Σ p z, which cancels badly
        # for peaked π
        logp = (z := logits[i:i + chunk].float()) - z.logsumexp(-1, keepdim=True)  # [c, T, V]
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def full_logits_logprobs(model, prompts, comps, T):
    """The trainer's log-probs before rollout.completion_logprobs: all logits, gathered to
    [n, L, V], entropy apart."""
    # [n, T-1, V]
    logits = model(pad_batch([p + c for p, c in zip(prompts, comps.tolist())])[:, :-1]).float()
    # [n, L]
    pos = torch.tensor([len(p) for p in prompts])[:, None] - 1 + torch.arange(comps.shape[1])
    logits = filter_logits(logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])), T)
    ent = token_entropy(logits.detach())
    return token_logprobs(logits, comps), ent


def bench_logprobs(method: str, vocab: int, rows=32, prompt_len=136, new=64, repeats=2):
    """One method in this process: seconds per forward + backward (best of repeats) and this
    process's peak RSS."""
    if method.startswith("chunk_"):  # the chunked path at 2^k logits per block of the LM head
        rollout.LOGITS_PER_CHUNK["cpu"] = 2 ** int(method.split("_")[1])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=vocab,
                                    hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                    intermediate_size=256, max_seq_len=512))
    prompts, comps = (torch.randint(3, vocab, (rows, prompt_len)).tolist(),
                      torch.randint(3, vocab, (rows, new)))
    fn = partial(full_logits_logprobs if method == "full" else completion_logprobs, model, prompts,
                 comps, 1.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        logp, ent = fn()
        (-logp.mean()).backward()
        best = min(best, time.perf_counter() - t0)
    grad = sum(p.grad.double().square().sum() for p in model.parameters()) ** 0.5
    print(json.dumps({"method": method, "s": best,
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
                      "logp_sum": logp.sum().item(), "entropy_mean": ent.mean().item(),
                      "grad_norm": grad.item(),
                      "params": sum(p.numel() for p in model.parameters())}))


def rows_apart_logprobs(model, prompts, comps, T: float):
    """The trainer's log-prob forward before model.Prefix: every row runs its own prompt (prompt +
    completion right-padded to the longest row, one causal forward), the same chunked head."""
    n, ids = len(comps), rollout.pad_batch(comps)                                      # [n, L]
    valid = rollout.pad_batch([[True] * len(c) for c in comps], False, torch.bool)    # [n, L]
    seqs = rollout.pad_batch([p + c for p, c in zip(prompts, ids.tolist())])          # [n, S+L]
    first = torch.tensor([[len(p) - 1] for p in prompts])                            # o_0's input
    at = (torch.arange(n)[:, None], first + torch.arange(ids.shape[1]))
    chunk = max(1, rollout.LOGITS_PER_CHUNK.get("cpu", 2 ** 23) // model.config.vocab_size)
    return model(seqs[:, :-1], head=lambda h, w: rollout.HeadLogProbs.apply(
        h[at][valid], w, ids[valid], T, 0, 1.0, chunk))


def bench_shared(ckpt: str, repeats: int, P=4, G=8, S=(30, 40), L=(15, 40)):
    """--shared (see the top): one micro-batch of P groups of G rows, forward + backward, each
    group's prompt run once (rollout.completion_logprobs) against once per row (rows_apart), taking
    turns; the median of repeats, and the tokens each runs through the model."""
    cfg = read_config(ckpt) if ckpt else ModelConfig(  # SmolLM2-135M's shape, random weights
        vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
        intermediate_size=1536, max_seq_len=2048, tie_embeddings=True)
    torch.manual_seed(0)
    model, rng = Transformer(cfg), torch.Generator().manual_seed(0)

    def draw(lo: int, hi: int) -> list[int]:  # lo..hi random token ids
        n = int(torch.randint(lo, hi + 1, (), generator=rng))
        return torch.randint(3, cfg.vocab_size, (n,), generator=rng).tolist()
    prompts = [p for p in (draw(*S) for _ in range(P)) for _ in range(G)]
    comps = [draw(*L) for _ in range(P * G)]
    times, sums = {"shared": [], "rows_apart": []}, {}
    for _ in range(repeats):
        for name, fn in (("rows_apart", rows_apart_logprobs), ("shared", completion_logprobs)):
            t0 = time.perf_counter()
            logp = fn(model, prompts, comps, 1.0)[0]
            logp.sum().backward()
            times[name].append(time.perf_counter() - t0)
            sums[name] = logp.sum().item()
            model.zero_grad(set_to_none=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    n_s, n_l = max(map(len, prompts)), max(map(len, comps))
    tokens = {"rows_apart": P * G * (max(len(p) + len(c) for p, c in zip(prompts, comps)) - 1),
              "shared": P * n_s + P * G * (n_l - 1)}
    for k in ("rows_apart", "shared"):
        print(f"{k:>10}: {med[k]:6.2f} s forward + backward (median of {repeats}), "
              f"{tokens[k]:,} tokens through the model")
    print(f"shared / rows_apart: time {med['shared'] / med['rows_apart']:.2f}, tokens "
          f"{tokens['shared'] / tokens['rows_apart']:.2f}; |d sum log-prob| "
          f"{abs(sums['shared'] - sums['rows_apart']):.1e}")


def logprobs_side_by_side(vocab: int, threads: int, chunks: str = ""):
    """Each method in fresh processes (alternating, best of two each), so that each peak RSS is the
    method's own; with chunks ("21,23,25"), the chunked path at 2^k logits a block instead."""
    if chunks:
        return chunks_side_by_side(vocab, threads, [int(k) for k in chunks.split(",")])
    res = {}
    for method in ("full", "chunked", "full", "chunked"):
        r = json.loads(subprocess.run([sys.executable, "-m", "tools.bench", "--logprobs",
                                       f"--method={method}", f"--vocab={vocab}",
                                       f"--threads={threads}"], capture_output=True, text=True,
                                      check=True, cwd=ROOT).stdout.strip().splitlines()[-1])
        res[method] = min(res.get(method, r), r, key=lambda x: x["s"])
    f, c = res["full"], res["chunked"]
    print(f"{f['params'] / 1e6:.1f}M params, V = {vocab:,}, 32 rows x (136 + 64) tokens, "
          f"{threads} threads\n"
          + "\n".join(f"{r['method']:>8}: {r['s']:6.2f} s forward + backward, "
                      f"peak RSS {r['peak_rss_gb']:5.2f} GB"
                      for r in (f, c)))
    print(f"chunked / full: time {c['s'] / f['s']:.2f}, "
          f"peak RSS {c['peak_rss_gb'] / f['peak_rss_gb']:.2f}; "
          f"|Δ sum log-prob| {abs(c['logp_sum'] - f['logp_sum']):.1e}, "
          f"|Δ grad| {abs(c['grad_norm'] - f['grad_norm']):.1e}")
    print(json.dumps(res))


def chunks_side_by_side(vocab: int, threads: int, ks: list[int]):
    """rollout.completion_logprobs at 2^k logits per LM-head block (LOGITS_PER_CHUNK), each k in
    fresh processes (taking turns, best of two each): time, peak RSS, the same sums."""
    res = {}
    for k in ks * 2:
        r = json.loads(subprocess.run([sys.executable, "-m", "tools.bench", "--logprobs",
                                       f"--method=chunk_{k}", f"--vocab={vocab}",
                                       f"--threads={threads}"], capture_output=True, text=True,
                                      check=True, cwd=ROOT).stdout.strip().splitlines()[-1])
        res[k] = min(res.get(k, r), r, key=lambda x: x["s"])
    print(f"V = {vocab:,}, 32 rows x (136 + 64) tokens, {threads} threads, best of 2")
    for k, r in res.items():
        print(f"2^{k} logits ({2 ** k * 4 / 2 ** 20:,.0f} MB float32) a block: {r['s']:6.2f} s "
              f"forward + backward, peak RSS {r['peak_rss_gb']:5.2f} GB, "
              f"sum log-prob {r['logp_sum']:.6e}, grad norm {r['grad_norm']:.6e}")
    print(json.dumps(res))


def bench_compact(model, repeats: int, values=(0.0, 0.5, 0.75, 0.9, 1.0), P=8, G=8, new=128):
    """Eager generate's tokens/s at several rollout.COMPACT_AT (0: never compact; 1: at every
    finished row), taking turns on one model; rows end at random lengths: 64 of the vocabulary's
    tokens stop a row (about 1 in 64 a step at random weights). Every value samples the same
    tokens (checked)."""
    torch.set_grad_enabled(False)
    default, gen = rollout.COMPACT_AT, torch.Generator().manual_seed(0)
    prompts = torch.randint(100, model.config.vocab_size, (P, 32), generator=gen).tolist()
    outs = {}

    def run(v):
        rollout.COMPACT_AT = v
        outs[v] = generate(model, prompts, G, new, 1.0, stop_ids=list(range(64)), seed=0)
    best = best_times({v: partial(run, v) for v in values}, repeats)
    rollout.COMPACT_AT = default
    assert all(torch.equal(o.completion_ids, outs[default].completion_ids) for o in outs.values())
    tokens, lengths = int(outs[default].lengths.sum()), outs[default].lengths.float()
    print(f"{P}x{G}x{new}, T = 1, mean length {lengths.mean():.1f} (max {int(lengths.max())}), "
          f"{torch.get_num_threads()} threads, best of {repeats}")
    for v, t in best.items():
        print(f"COMPACT_AT = {v:<4}: {tokens / t:8,.0f} tok/s, {best[default] / t:.2f}x the "
              f"default's ({default})")


def best_times(jobs: dict, repeats: int, first: dict | None = None) -> dict:
    """{name: fn} -> {name: fastest of `repeats`} (noise only adds time), one warm-up each, the jobs
    taking turns; `first` gets each warm-up's time (a compiled job's: its compile)."""
    # CUDA work timed once it is done
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None
    first = {} if first is None else first
    for k, fn in jobs.items():
        t0 = sync() or time.perf_counter()
        fn()
        first[k] = sync() or time.perf_counter() - t0
    best = {k: float("inf") for k in jobs}
    for _ in range(repeats):
        for k, fn in jobs.items():
            t0 = sync() or time.perf_counter()  # sync() returns None
            fn()
            best[k] = min(best[k], sync() or time.perf_counter() - t0)
    return best


# Qwen2.5-0.5B's shapes, tied embeddings
QWEN05 = dict(model_type="qwen2", attention_bias=True, vocab_size=151936, hidden_size=896,
              n_layers=24, n_heads=14, n_kv_heads=2, intermediate_size=4864, max_seq_len=32768)


def bench_gpu(S=256, L=512, G=8, rows_list=(64, 512), rl_steps=2):
    """The GPU check (see the top): roofline fraction = max(HBM floor, FLOP floor) / time;
    HBM floor = bytes a decode step moves (every weight, each row's filled KV slots, the sampler's
    logits written and read once) / copy bandwidth; FLOP floor = 2 per weight and row + attention's
    4 per KV slot, head dim and query head / a bf16 matmul's rate."""
    dev = torch.device("cuda")
    t_start, gen, x = (time.time(), torch.Generator().manual_seed(0),
                       torch.empty(2 ** 30, dtype=torch.uint8, device=dev))
    bw = 2 * x.numel() / best_times({0: x.clone}, 5)[0]  # bytes read + written per second
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    flops = 2 * 8192 ** 3 / best_times({0: partial(torch.mm, a, a)}, 5)[0]
    del x, a
    # random weights: no stop token is ever likely, every row decodes all L tokens
    with torch.device(dev):
        model = Transformer(ModelConfig(**QWEN05)).to(torch.bfloat16).eval()
    V, n_w = QWEN05["vocab_size"], sum(p.numel() for p in model.parameters())
    # K and V bytes per token
    kv_slot = 4 * QWEN05["n_layers"] * QWEN05["n_kv_heads"] * model.config.head_dim
    # FLOPs per row and KV slot
    att = 4 * QWEN05["n_layers"] * QWEN05["n_heads"] * model.config.head_dim
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s; "
          f"{2 * n_w / 2 ** 30:.2f} GiB of bf16 weights, {kv_slot // 1024} KiB of KV per token; "
          f"{S}-token prompts, "
          f"{L} new tokens, T = 1, no stop token")
    for rows in rows_list:
        prompts = torch.randint(3, V, (rows // G, S), generator=gen).tolist()
        run = {m: partial(generate, model, prompts, G, L, seed=0, static=m == "captured")
               for m in ("eager", "captured")}
        t0 = time.time()
        # torch.compile once (dynamic shapes), then a CUDA graph per (batch, width)
        run["captured"]()
        t1, best = time.time(), best_times(run, 2)
        slots = rows * (S * L + L * (L - 1) // 2)  # KV slots read over the L steps
        hbm, sampler = (L * 2 * n_w + kv_slot * slots + L * rows * V * 4) / bw, L * rows * V * 4
        floor = max(hbm, flop := (2 * n_w * rows * L + att * slots) / flops)
        print(f"{rows} rows (first captured call {t1 - t0:.0f} s; floors: HBM {hbm:.2f} s, "
              f"of it the sampler's logits {sampler / 2 ** 30:.1f} GiB, FLOP {flop:.2f} s): "
              + ", ".join(f"{m} {rows * L / sec:,.0f} tok/s = {floor / sec:.2f} of max(HBM, FLOP)"
                          for m, sec in best.items())
              + f"; captured / eager {best['eager'] / best['captured']:.1f}x")
    counters = torch._dynamo.utils.counters  # a skipped CUDA graph or a graph break would show here
    print(f"graph breaks: {dict(counters['graph_break'])}, "
          f"CUDA graph skips: {counters['inductor']['cudagraph_skips']}")
    # the preset's RL step on one GPU of 8 with train.py's pieces (FSDP2 on a 1-rank group, AdamW,
    # the copy refreshed)
    rl, proc = (train.parse_args(["--config", "configs/qwen2.5-0.5b-gsm8k.toml"]),
                infra.setup("cuda"))
    with torch.device(dev):
        run = train.Run(rl, proc, infra.shard(Transformer(ModelConfig(**QWEN05)), proc), None)
    run.sampler, opt = infra.frozen_copy(run.model, dev), train.make_optimizer(run, rl.lr, 10)[0]
    prompts = torch.randint(3, V, (rl.prompts_per_step // 8, S), generator=gen).tolist()
    rows_p = [p for p in prompts for _ in range(rl.group_size)]
    for step in range(rl_steps):
        t0 = time.time()
        # the copy re-gathered after the last step (stale)
        sampler = infra.sampling(run.sampler, run.model)
        t1 = torch.cuda.synchronize() or time.time()
        comps = generate(sampler, prompts, rl.group_size, rl.max_new_tokens,
                         seed=step).completion_ids.tolist()
        t2, n_tok = time.time(), len(comps) * (S + rl.max_new_tokens)
        for rows in infra.micro_batches(rows_p, comps, run.cfg.micro_batch_tokens)[0]:
            logp, _ = completion_logprobs(run.model, [rows_p[i] for i in rows],
                                          [comps[i] for i in rows], rl.temperature)
            grpo.policy_loss(logp, logp.detach(), torch.randn(len(rows), device=dev),
                             torch.ones_like(logp).bool(),
                             agg="token_mean", loss_scale=logp.numel())[0].backward()
        train.optimizer_step(run, opt), torch.cuda.synchronize()
        print(f"RL step {step}: refresh {t1 - t0:.2f} s, sampling {t2 - t1:.1f} s "
              f"({len(comps)} rows x {rl.max_new_tokens} tokens), "
              f"training {time.time() - t2:.1f} s ({n_tok:,} tokens fwd + bwd, AdamW); "
              f"peak memory {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    print(f"total {time.time() - t_start:.0f} s")


def bench_rl(model, threads: int, static: bool, P=4, G=8, L=64, S=32, steps=2):
    """--rl (see the top): one RL step as train.rl_step composes it, one process; the split of the
    faster of `steps`."""
    # split[name] += [wall time, of it outside aten ops]
    def section(split: dict, name: str, fn, *args, **kw):
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn(*args, **kw)
        wall, ops = (time.perf_counter() - t0,
                     sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6)
        split[name] = [a + b for a, b in zip(split.get(name, (0.0, 0.0)),
                                             (wall, max(0.0, wall - ops)))]
        return out
    run = train.Run(rl := train.parse_args([f"--threads={threads}"]), infra.setup("cpu", threads),
                    model.train(), None)
    opt, best, n_params = (train.make_optimizer(run, rl.lr, 10)[0], {},
                           sum(t.numel() for t in model.parameters()))
    prompts = torch.randint(3, model.config.vocab_size, (P, S)).tolist()
    rows_p = [p for p in prompts for _ in range(G)]
    for step in range(steps):
        comps = section(split := {}, "sampling",
                        lambda: generate(model, prompts, G, L, seed=step,
                                         static=static).completion_ids.tolist())
        for rows in infra.micro_batches(rows_p, comps, run.cfg.micro_batch_tokens)[0]:
            logp = section(split, "scoring", completion_logprobs, model, [rows_p[i] for i in rows],
                           [comps[i] for i in rows], rl.temperature)[0]
            loss = section(split, "loss", grpo.policy_loss, logp, logp.detach(),
                           torch.randn(len(rows)),  # advantages
                           torch.ones_like(logp).bool(), agg="token_mean",
                           loss_scale=logp.numel())[0]
            section(split, "backward", loss.backward)
        section(split, "optimizer", train.optimizer_step, run, opt)
        split["total"] = [sum(v[i] for v in split.values()) for i in (0, 1)]
        best = min(best, split, key=lambda x: x.get("total", [float("inf")])[0])
    print(f"RL step, {P}x{G}x{L} tokens, {n_params / 1e6:.1f}M params, {threads} threads, "
          f"best of {steps} "
          f"(seconds, share of the step, of it outside aten ops): " + ", ".join(
              f"{k} {t:.2f} ({t / best['total'][0]:.0%}, {o:.2f})" for k, (t, o) in best.items()))
    print(json.dumps({"rl_step": best}))


def bench_step_ab(config: str, ckpt: str, steps: int, modes: dict) -> dict:
    """--step_packed / --step_bf16 (see the top): train.rl_step of `config` on the folder at
    compare_trl's bench shape (4 prompts x 8, 64 new tokens, no stop ids or refill), each of
    `modes` ({name: wrap(run, fn) -> fn()}) in turn, a warm-up step each first -> per mode the
    medians of the step's, the rollout's and the training's seconds and the sampler-trainer
    mismatch KL."""
    import statistics
    cfg = train.parse_args(["--config", config, f"--threads={torch.get_num_threads()}",
                            f"--out_dir={tempfile.mkdtemp()}", "--wandb_mode=disabled"])
    cfg = dataclasses.replace(cfg, init_from=ckpt, prompts_per_step=4, group_size=8,
                              max_new_tokens=64, beta=0.0, ppo_epochs=1, dynamic_sampling=False)
    run = train.build_run(cfg)
    run.task.stop_ids = []  # every row decodes all 64 tokens
    opt, sched = train.make_optimizer(run, cfg.lr, 1000)
    state, names, rows = train.TrainState(), list(modes), {name: [] for name in modes}
    for step in range(len(names) * (1 + steps)):
        name, t0 = names[step % len(names)], time.perf_counter()
        rec = modes[name](run, partial(train.rl_step, run, opt, sched, state, step))
        if step >= len(names):  # past the warm-up round
            rows[name].append((time.perf_counter() - t0, rec["time/rollout_s"],
                               rec["time/train_s"], rec.get("train/mismatch_kl", math.nan)))
    med = {k: [statistics.median(x) for x in zip(*v)] for k, v in rows.items()}
    for k, (step_s, roll, tr, kl) in med.items():
        print(f"{k}: step {step_s:.2f} s, rollout {roll:.2f} s, training {tr:.2f} s, "
              f"sampler-trainer KL {kl:.1e} (median of {len(rows[k])})")
    a, b = names[0], names[-1]
    print(f"{a} / {b}: step {med[a][0] / med[b][0]:.2f}x, rollout {med[a][1] / med[b][1]:.2f}x, "
          f"training {med[a][2] / med[b][2]:.2f}x")
    return med


def cpu_bf16(on: bool):
    """A bench_step_ab mode: fn() with train.py's cpu_bf16 `on` ("cpu" in rollout.BF16 and a bf16
    sampling copy of the weights, infra.sampling_copy's, made once: later steps refresh it, as a
    run's do) or off (neither)."""
    copies = {}

    def wrap(run, fn):
        before, sampler = set(rollout.BF16), run.sampler
        (rollout.BF16.add if on else rollout.BF16.discard)("cpu")
        if id(run) not in copies:
            copies[id(run)] = infra.sampling_copy(run.model, run.proc, on)
        run.sampler = copies[id(run)]
        try:
            return fn()
        finally:
            rollout.BF16.clear(), rollout.BF16.update(before)
            run.sampler = sampler
    return wrap


@torch.no_grad()
def naive(model, prompt_ids, G: int, steps: int, T: float):
    """The no-cache loop: the whole sequence through the model at every step."""
    seq = prompt_ids.repeat_interleave(G, 0)                                   # [N, S]
    for _ in range(steps):
        logits = model(seq)[:, -1].float()                          # the whole sequence, every step
        tok = logits.argmax(-1) if T == 0 else torch.multinomial(logits.softmax(-1), 1)[:, 0]
        seq = torch.cat((seq, tok[:, None]), 1)


def hf_jobs(model, prompt_ids, G: int, new: int, dtype) -> dict:
    """{(label, T): (fn, tokens)}: transformers' generate on the same weights, greedy and T = 1; {}
    without it."""
    try:
        import transformers
    except ImportError:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(
            prompt_ids.device).eval()
    hf.generation_config.eos_token_id = None  # every row generates all `new` tokens
    def hf_run(sample):
        kw = (dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) if sample
              else dict(do_sample=False))
        # greedy refuses num_return_sequences; it would repeat too
        ids = prompt_ids.repeat_interleave(G, 0)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0, **kw)
        assert out.shape == (len(ids), prompt_ids.shape[1] + new), out.shape
    label = f"transformers {transformers.__version__}"
    return {(label, T): (partial(hf_run, T > 0), len(prompt_ids) * G * new) for T in (0.0, 1.0)}


def unpacked(fn):
    """fn() with model.PACKED_GEMM off: generate's products by plain F.linear."""
    before, model_py.PACKED_GEMM = model_py.PACKED_GEMM, False
    try:
        return fn()
    finally:
        model_py.PACKED_GEMM = before


def bench_sampling(model, args):
    """Ours at every setting; transformers, the naive loop and the matmul-only bound at the first
    (see the top)."""
    torch.set_grad_enabled(False)
    dtype, dev, S = getattr(torch, args.dtype), torch.device(args.device), args.prompt_len
    cfg, n_params, gen = (model.config, sum(t.numel() for t in model.parameters()),
                          torch.Generator().manual_seed(0))
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",")]
    results, jobs = {"model": args.ckpt or args.size, "params": n_params, "dtype": args.dtype,
                     "device": args.device,
                     "threads": args.threads, "prompt_len": S}, {}  # jobs: name -> (fn, tokens)
    for P, G, new in settings:
        prompts = torch.randint(3, cfg.vocab_size, (P, S), generator=gen).tolist()
        for T, static in itertools.product((0.0, 1.0), (False, True) if args.static else (False,)):
            run = partial(generate, model, prompts, G, new, temperature=T, seed=0, static=static)
            jobs[f"ours{' static' * static} {P}x{G}x{new}", T] = (run, P * G * new)
            if args.unpacked and not static:  # the products by plain F.linear, as before packing
                jobs[f"ours unpacked {P}x{G}x{new}", T] = (partial(unpacked, run), P * G * new)
    (P, G, new), N = settings[0], math.prod(settings[0][:2])
    prompt_ids = torch.randint(3, cfg.vocab_size, (P, S), generator=gen).to(dev)
    jobs |= (hf := {} if args.no_hf else hf_jobs(model, prompt_ids, G, new, dtype))
    # matmul-only bound: every weight matrix (and the LM head) times the rows of each setting, 20
    # decode steps' worth
    mats = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)] + \
        ([(model.model.embed_tokens.weight, None)] if cfg.tie_embeddings else [])
    for n_rows in sorted({P_ * G_ for P_, G_, _ in settings}):
        xs = [torch.randn(n_rows, w.shape[1], device=dev, dtype=dtype) for w, _ in mats]
        jobs[f"matmul-only bound {n_rows} rows", 0.0] = (
            lambda xs=xs: [F.linear(x, w, b) for _ in range(20) for x, (w, b) in zip(xs, mats)],
            n_rows * 20)
    first = {}  # each job's first call: a static (compiled) one's compile is in it
    tps = {k: jobs[k][1] / t for k, t in best_times({k: fn for k, (fn, _) in jobs.items()},
                                                    args.repeats, first).items()}
    pair = {label: {"greedy": tps[label, 0.0], "sampling": tps[label, 1.0]}
            for label, T in jobs if T == 1.0}
    results |= {f"ours_{P_}x{G_}x{new_}": pair[f"ours {P_}x{G_}x{new_}"]
                for P_, G_, new_ in settings}
    results |= {"transformers": pair[next(iter(hf))[0]]} if hf else {}
    # rows -> tokens/s
    bounds = {int(k.split()[-2]): v for (k, _), v in tps.items() if k.startswith("matmul")}
    results["matmul_bound"] = bounds[N]
    rows = [(lb, *pair[lb].values()) for lb in pair]
    rows += [(f"matmul-only bound, {n} rows", b, b) for n, b in bounds.items()]
    times = best_times({T: partial(naive, model, prompt_ids, G, args.naive_tokens, T)
                        for T in (0.0, 1.0)}, 1)
    nv = [N * args.naive_tokens / t for t in times.values()]
    rows.insert(len(pair), (f"naive, {args.naive_tokens} tokens (faster than at {new})", *nv))
    results["naive"] = {"greedy": nv[0], "sampling": nv[1], "tokens": args.naive_tokens}
    print(f"{results['model']}: {n_params / 1e6:.2f}M params, {args.dtype}, {args.device}, "
          f"{args.threads} threads, "
          f"{S}-token prompts, best of {args.repeats}")
    print(f"{'method':<44}{'greedy tok/s':>14}{'sampling tok/s':>16}"
          f"{'of the matmul-only bound':>28}")
    # a row's fraction: of the bound at its own rows (the naive loop: at the first setting's)
    for label, a, b in rows:
        n = math.prod(map(int, label.split()[-1].split("x")[:2])) if label.startswith("ours") else N
        frac = "" if "bound" in label else f"{a / bounds[n]:>18.2f} / {b / bounds[n]:.2f}"
        print(f"{label:<44}{a:>14,.0f}{b:>16,.0f}{frac}")
    for (label, T), t in first.items():  # the compile a static setting pays once, then its gain
        if "static" in label:
            eager = label.replace(" static", ""), T  # the same setting's eager job
            print(f"{label}, T = {T}: first call {t:.1f} s (eager {jobs[eager][1] / tps[eager]:.1f}"
                  f" s), then {tps[label, T] / tps[eager]:.2f}x eager's tok/s")
    for label in (lb for lb in pair if lb.startswith("ours unpacked")):  # packed / plain GEMM
        a, b = (pair[label.replace(" unpacked", "")][k] / pair[label][k] for k in pair[label])
        print(f"{'packed / unpacked ' + label.split()[-1]:<44}{a:>13.2f}x{b:>15.2f}x")
    if hf := results.get("transformers"):
        a, b = (results[f"ours_{P}x{G}x{new}"][k] / hf[k] for k in ("greedy", "sampling"))
        print(f"{'ours / transformers':<44}{a:>13.2f}x{b:>15.2f}x")
    print(json.dumps(results))


PRESETS = {"2m": dict(hidden_size=128, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=512),
           "20m": dict(hidden_size=384, n_layers=12, n_heads=6, n_kv_heads=2,
                       intermediate_size=1024)}


@torch.no_grad()
def bench_profile(model, setting: str, prompt_len: int, top: int = 12):
    """--profile (see the top): each op's share of one eager decode call's CPU time."""
    P, G, new = (int(x) for x in setting.split("x"))
    prompts = torch.randint(3, model.config.vocab_size, (P, prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    for T in (0.0, 1.0):
        generate(model, prompts[:2], G, 4, temperature=T, seed=0)  # warm-up
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(model, prompts, G, new, temperature=T, seed=0)
        wall, ops = time.perf_counter() - t0, prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ops)
        share = {e.key: e.self_cpu_time_total / total for e in ops}
        mm = sum(share.get(k, 0) for k in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"))
        print(f"T = {T}, {P}x{G}x{new}: {P * G * new / wall:.0f} tok/s (profiled), matrix "
              f"products {mm:.1%}; by op: " + ", ".join(
                  f"{k} {v:.1%}" for k, v in sorted(share.items(), key=lambda x: -x[1])[:top]))


@torch.no_grad()
def bench_fused(model, repeats: int, rows_list=(8, 64, 512)):
    """--fused (see the top): the projections of a decode step, apart against fused."""
    blocks = [(b.self_attn, b.mlp) for b in model.model.layers]
    parts = [(a.q_proj, a.k_proj, a.v_proj) for a, _ in blocks]
    qkv = [(torch.cat([p.weight for p in ps]), torch.cat([p.bias for p in ps])
            if ps[0].bias is not None else None) for ps in parts]
    gate_up = [torch.cat([m.gate_proj.weight, m.up_proj.weight]) for _, m in blocks]
    sizes = [p.out_features for p in parts[0]]

    def layer_apart(x, i):  # -> (q, k, v, the MLP's output)
        a, mlp = blocks[i]
        return a.q_proj(x), a.k_proj(x), a.v_proj(x), mlp.down_proj(
            F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    def layer_fused(x, i):
        (w, bias), mlp = qkv[i], blocks[i][1]
        gate, up = F.linear(x, gate_up[i]).chunk(2, -1)
        return *F.linear(x, w, bias).split(sizes, -1), mlp.down_proj(F.silu(gate) * up)

    def run(layer, x):  # every layer; the residual scaled so that 30 of them stay finite
        for i, (a, _) in enumerate(blocks):
            q, _, _, mlp_out = layer(x, i)
            x = x + (a.o_proj(q) + mlp_out) * 0.01
        return x
    for rows in rows_list:
        x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        for i in range(len(blocks)):  # the fused products are the seven's, layer by layer
            if not all(map(torch.allclose, layer_apart(x, i), layer_fused(x, i))):
                raise AssertionError(f"layer {i}: the fused projections differ from the seven")
        apart, fused = (lambda: run(layer_apart, x)), (lambda: run(layer_fused, x))
        best = best_times({"apart": apart, "fused": fused}, repeats)
        print(f"{rows} rows x {len(blocks)} layers, {torch.get_num_threads()} threads: "
              f"seven products {best['apart'] * 1e3:.1f} ms, fused {best['fused'] * 1e3:.1f} ms, "
              f"fused / apart {best['fused'] / best['apart']:.3f}")


@torch.no_grad()
def bench_gemm(repeats: int, widths=(128, 256, 384, 576, 896), rows_list=(16, 128), calls=20):
    """--gemm (see the top): a product's time by plain F.linear over its time by the packed GEMM
    (model.linear with a weight as Transformer.packed reorders it), per weight (out x in: in x in,
    4·in x in, 50,000 x in) and rows; the two products checked equal first."""
    gen = torch.Generator().manual_seed(0)
    for k in widths:
        cells = []
        for n in (k, 4 * k, 50_000):
            w = torch.randn(n, k, generator=gen) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            for rows in rows_list:
                x = torch.randn(rows, 1, k, generator=gen)
                if not torch.allclose(model_py.linear(x, w, packed=packed), F.linear(x, w),
                                      atol=1e-5):
                    raise AssertionError(f"{n} x {k}: the packed product differs from F.linear")
                t = best_times({"plain": lambda: [F.linear(x, w) for _ in range(calls)],
                                "packed": lambda: [model_py.linear(x, w, packed=packed)
                                                   for _ in range(calls)]}, repeats)
                cells.append(f"{n} x {k} ({n * k / 2 ** 17:.2g} x 2^17), {rows} rows "
                             f"{t['plain'] / t['packed']:.2f}")
        print(f"in {k}, {torch.get_num_threads()} threads, plain / packed: " + "; ".join(cells))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="2m", choices=sorted(PRESETS))
    p.add_argument("--ckpt", default="", help="a Hugging Face folder to load instead of a preset")
    p.add_argument("--settings", default="8x8x128,4x16x128,64x1x128",
                   help="comma-separated P x G x new tokens")
    for name, default in (("--prompt_len", 32), ("--repeats", 3), ("--threads", 2),
                          ("--vocab", 151936)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--naive_tokens", type=int, default=16,
                   help="the naive loop runs only this many steps")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no_hf", action="store_true", help="skip transformers even if installed")
    p.add_argument("--static", action="store_true",
                   help="also the compiled static step (rollout.generate(static=True))")
    p.add_argument("--unpacked", action="store_true",
                   help="also ours by plain F.linear (model.PACKED_GEMM off), side by side")
    for mode, text in (("--rl", "the time split of one RL step (4 x 8 x 64 tokens) instead"),
                       ("--verify", "time verify.reward (and math-verify) instead of sampling"),
                       ("--logprobs", "log-prob memory and time at a real vocabulary"),
                       ("--shared", "the log-prob forward with each group's prompt run once"),
                       ("--profile", "the eager decode's CPU time by op (torch.profiler)"),
                       ("--fused", "decode projections apart against q/k/v and gate/up fused"),
                       ("--gemm", "plain F.linear against the packed GEMM, per weight shape"),
                       ("--step_packed", "--config's RL step on --ckpt, unpacked and packed"),
                       ("--step_bf16", "--config's RL step on --ckpt, float32 and cpu_bf16"),
                       ("--compact", "eager tokens/s at several rollout.COMPACT_AT values")):
        p.add_argument(mode, action="store_true", help=text)
    p.add_argument("--config", default="configs/smollm2-135m-rg.toml",
                   help="--step_packed, --step_bf16: the train.py config whose RL step is timed")
    p.add_argument("--chunks", default="",
                   help="--logprobs: the chunked path at 2^k logits a block, e.g. 21,23,25")
    # --logprobs runs each method in a child process
    p.add_argument("--method", default="", help=argparse.SUPPRESS)
    p.add_argument("--gpu_new", type=int, default=512,
                   help="--device cuda: new tokens per row of the decode check")
    p.add_argument("--gpu_rl_steps", type=int, default=2, help="--device cuda: RL steps timed")
    return p


def main():
    args = parser().parse_args()
    torch.set_num_threads(1 if args.verify and not args.logprobs else args.threads)
    infra.keep_freed_memory()  # as train.py's CPU runs: freed large blocks reused (every side here)
    if args.logprobs and args.method:  # one method, in a child process of logprobs_side_by_side
        return bench_logprobs(args.method, args.vocab)
    if args.logprobs or args.verify:
        return (logprobs_side_by_side(args.vocab, args.threads, args.chunks) if args.logprobs
                else bench_verify())
    if args.shared:
        return bench_shared(args.ckpt, args.repeats)
    if args.gemm:
        return bench_gemm(args.repeats)
    if args.step_packed:
        return bench_step_ab(args.config, args.ckpt, args.repeats,
                             {"unpacked": lambda run, fn: unpacked(fn),
                              "packed": lambda run, fn: fn()})
    if args.step_bf16:
        return bench_step_ab(args.config, args.ckpt, args.repeats,
                             {"float32": cpu_bf16(False), "cpu_bf16": cpu_bf16(True)})
    if args.device == "cuda" and not args.ckpt:
        return bench_gpu(L=args.gpu_new, rl_steps=args.gpu_rl_steps)
    torch.manual_seed(0)
    model = Transformer.from_pretrained(args.ckpt) if args.ckpt else Transformer(ModelConfig(
        model_type="qwen2", attention_bias=True, vocab_size=4096, max_seq_len=1024,
        **PRESETS[args.size]))
    model = model.to(torch.device(args.device), getattr(torch, args.dtype)).eval()
    if args.compact:
        return bench_compact(model, args.repeats)
    if args.fused:
        return bench_fused(model, args.repeats)
    if args.profile:
        return bench_profile(model, args.settings.split(",")[0], args.prompt_len)
    return bench_rl(model, args.threads, args.static) if args.rl else bench_sampling(model, args)


if __name__ == "__main__":
    main()

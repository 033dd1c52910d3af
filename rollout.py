"""Batched, KV-cached sampling of G completions for each of P prompts: the rollout half of GRPO.

N = P·G rows, prompt-major (the G samples of prompt 0 first). The algorithm:
  1. Left-pad the P distinct prompts to S tokens and prefill them once into a KVCache (start = pad counts),
     keeping the last position's logits [P, V].
  2. Repeat each prompt's cache rows and logits G times (decode.batch with rows arange(P).repeat_interleave(G)):
     a prompt is prefilled once per group, never once per sample.
  3. Each step, turn logits into the sampling distribution z = filter(logits / T): top-k, then top-p (nucleus),
     everything else −inf, the most likely token always kept. Sample x by inverting the CDF: with p ∝ exp z,
     x = the first token whose cumulative mass exceeds u · Σp, where u = splitmix64(row seed, position) is
     counter-based noise: one uniform per row and step, so a row's draws depend only on its seed and position,
     never on its batch-mates or on when finished rows are dropped. (The CDF is summed in float64. Gumbel-max
     would need a hash per token of the vocabulary, V times the noise: 15% of a step at V = 4096.)
  4. Record x and log softmax(z)[x]. Feed x back through the cache; a row that emits a stop id is done.
     Steps 3-4 are decode.step, one function for both loops below.
  5. Eager (the CPU default): when the live rows have fallen to 3/4 of the batch since the last compaction, drop
     the done rows from the batch and the cache (a copy, so not every step); a host check every step. Static (the
     CUDA default, torch.compile + CUDA graphs): N rows start in a power-of-two batch (padding rows not live), at
     most MAX_ROWS a call (whole prompts); done rows stay in the captured batch, masked; every CHECK_EVERY steps the
     host looks, and once the live rows fit in half the batch, they move to a half-size (or smaller) batch. Both
     stop when no row is live or after max_new_tokens, with the same tokens and log-probs. A row whose logits are
     not finite ends there (Rollout.nonfinite).

Log-probs are those of the distribution actually sampled from: tempered, filtered and renormalised. completion_logprobs() is
generate's twin on the trainer side: one causal forward over prompt + completion, the same filter_logits, so the
trainer's π (and π_old) of a token is the sampler's, and the importance ratio π/π_old starts at 1 (sampling at
T = 0.7 and training on the raw softmax is a known bug). Greedy (T = 0) takes the argmax of the raw logits and
records log_softmax(raw logits) at it; top_k/top_p do not apply.

  python rollout.py --ckpt DIR --prompt "12+7=" --n 4 --max_new_tokens 64 --temperature 0.7 --top_p 0.95 --seed 0
"""
import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import decode
from decode import Decoder, batch, compiled_step, filter_logits, record, step

# splitmix64 (Steele et al. 2014) constants as signed int64: torch's int64 arithmetic wraps like uint64 does
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MIX1, MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)
COMPACT_AT = 0.75  # compact when live rows <= 3/4 of the batch: measured (2m, 20m models, 64 rows, mean length ~55)
                   # 0.75-0.9 fastest, 1.1-1.3x faster than every time a row stops, 1.6-1.9x than never
CHECK_EVERY = 8    # static decoding: the host reads live.any() every 8 steps (a finished batch runs < 8 steps more)
MIN_BUCKET = 8     # static decoding: batches halve while the live rows fit, down to 8 rows
MAX_ROWS = 512     # static decoding: a larger call runs in chunks of whole prompts (static buffers < 2 x 512 rows)
WIDTH_STEP = {"cuda": 128}  # static decoding: attention reads the filled slots rounded up to 128 on CUDA (a CUDA
                            # graph per width), exactly the filled slots elsewhere (no graphs to record)
LOGITS_PER_CHUNK = {"cuda": 2 ** 26}  # completion_logprobs()'s LM-head blocks: 32 MB elsewhere (measured faster than 8 or 128 on
                                     # CPU), 256 MB on CUDA (441 rows at V = 151,936: GEMMs large enough for the GPU)
STOP_NAMES = ("<eos>", "<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>")


@dataclass
class Rollout:
    completion_ids: torch.Tensor   # [N, L] long, pad_id after the stop token
    completion_mask: torch.Tensor  # [N, L] bool, True on generated tokens up to and including the stop token
    logprobs: torch.Tensor         # [N, L] float32, log-prob under the sampling distribution; 0 on padding
    truncated: torch.Tensor        # [N] bool, no stop token within max_new_tokens (or a non-finite row: no stop)
    lengths: torch.Tensor          # [N] long, generated tokens per row (completion_mask.sum(1))
    seeds: torch.Tensor            # [N] long, per-row seeds: generate(model, [prompt], 1, ..., seed=seeds[r:r+1])
                                   # regenerates row r alone
    nonfinite: torch.Tensor        # [N] bool, the row ended at logits that were not finite (NaN, inf; also truncated)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on an int64 tensor. >> is arithmetic on int64, so mask after shifting."""
    for shift, mult in ((30, MIX1), (27, MIX2), (31, 0)):
        x ^= (x >> shift).bitwise_and_((1 << (64 - shift)) - 1)
        if mult:
            x *= mult
    return x


def row_seeds(seed, n: int, device) -> torch.Tensor:
    """[n] int64 per-row seeds: a tensor is taken as is; an int is hashed with each row index (splitmix64 stream);
    None draws them from torch's default generator."""
    if isinstance(seed, torch.Tensor):
        if seed.shape != (n,):
            raise ValueError(f"seed tensor has shape {tuple(seed.shape)}, expected ({n},): one seed per row")
        return seed.to(device=device, dtype=torch.long)
    if seed is None:
        return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), dtype=torch.long).to(device)
    if not -(1 << 63) <= int(seed) < (1 << 63):
        raise ValueError(f"seed {seed} does not fit in int64")
    base = mix64(torch.tensor([int(seed)], dtype=torch.long, device=device))
    return mix64(base + torch.arange(1, n + 1, device=device) * GOLDEN)


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """keys [B] random int64 (one per row and position) -> u [B] float64, uniform in (0, 1) from their top 52 bits
    (k + 1/2) / 2^52: never exactly 0 or 1 (with 53 bits, k + 1/2 would round up to 2^53)."""
    return (keys >> 12).bitwise_and_((1 << 52) - 1).double().add_(0.5).mul_(2.0 ** -52)


def pad_batch(seqs: list[list], pad=0, dtype=torch.long) -> torch.Tensor:
    """Right-pad lists to the longest -> [n, T] (T = 1 for an empty batch of empty lists)."""
    T = max(map(len, seqs), default=1)
    return torch.tensor([list(s) + [pad] * (T - len(s)) for s in seqs], dtype=dtype).view(len(seqs), T)


def _chunk_log_softmax(h, w, temperature, top_k, top_p):
    """h [c, C] hidden states, w [V, C] the LM head -> log softmax of the sampling distribution [c, V] float32."""
    return filter_logits(F.linear(h, w), temperature, top_k, top_p).log_softmax(-1)  # the kept set: a constant


class HeadLogProbs(torch.autograd.Function):
    """log π(target) [M] and entropy [M] of π = filter(h Wᵀ / T) for M hidden states h [M, C], `chunk` rows at a
    time. Backward recomputes each chunk's logits, so one [chunk, V] block is alive at a time, never [M, V]: with
    z = logits / T, ∂ log π(t) / ∂z = onehot(t) − π on the kept set, and ∂z / ∂logits = 1/T (1 at T = 0)."""

    @staticmethod
    def forward(ctx, h, w, targets, temperature, top_k, top_p, chunk):
        logp, ent = (h.new_empty(len(h), dtype=torch.promote_types(h.dtype, torch.float32)) for _ in range(2))
        for i in range(0, len(h), chunk):
            lz = _chunk_log_softmax(h[i:i + chunk], w, temperature, top_k, top_p)                # [c, V]
            logp[i:i + chunk] = lz.gather(-1, targets[i:i + chunk, None])[:, 0]
            ent[i:i + chunk] = -(lz.exp() * lz).nansum(-1)  # a filtered token's 0 · −inf adds nothing
        ctx.save_for_backward(h, w, targets)
        ctx.settings = temperature, top_k, top_p, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _):
        h, w, targets = ctx.saved_tensors
        temperature, top_k, top_p, chunk = ctx.settings
        gh, gw = torch.zeros_like(h), torch.zeros_like(w, dtype=g.dtype)                   # gw summed in float32+
        for i in range(0, len(h), chunk):
            gi = g[i:i + chunk, None]                                                           # [c, 1]
            gz = -_chunk_log_softmax(h[i:i + chunk], w, temperature, top_k, top_p).exp() * gi  # [c, V]
            gz.scatter_add_(-1, targets[i:i + chunk, None], gi)
            gz = (gz / temperature if temperature > 0 else gz).to(w.dtype)  # both GEMMs in w's dtype (bf16 on GPU,
            gh[i:i + chunk] = gz @ w                                         # fp32 accumulation inside), as a
            gw += gz.T @ h[i:i + chunk].to(w.dtype)                          # Linear's backward; gw summed in fp32
        return gh, gw.to(w.dtype), None, None, None, None, None


def completion_logprobs(model, prompts: list[list[int]], comps: torch.Tensor, temperature: float, top_k: int = 0,
          top_p: float = 1.0, lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """generate's twin for the trainer: comps [n, L] (right-padded; `lengths` real tokens per row, default all L)
    after their prompts -> (log π(o_t | q, o_<t) [n, L] float32, differentiable, 0 past a row's length; the entropy
    of π there [n, L], no grad, for logging), with π the distribution generate samples from at the same settings.
    One causal forward over prompt + completion (right-padded rows need no mask); the LM head runs only at the
    completion tokens, in chunks of ~2^23 logits (HeadLogProbs), so memory never holds [n, L, V] logits."""
    dev = model.model.embed_tokens.weight.device
    n, L = comps.shape
    lens = torch.tensor(lengths if lengths is not None else [L] * n, device=dev)
    valid = torch.arange(L, device=dev) < lens[:, None]                                  # [n, L]
    pos = torch.tensor([len(p) for p in prompts], device=dev)[:, None] - 1 + torch.arange(L, device=dev)
    seqs, targets = pad_batch([p + c for p, c in zip(prompts, comps.tolist())]).to(dev), comps.to(dev)[valid]

    def head(h, w):  # h [n, T-1, C]: keep the M completion positions, then the LM head chunk by chunk
        chunk = max(1, LOGITS_PER_CHUNK.get(dev.type, 2 ** 23) // w.shape[0])  # float32 [chunk, V] blocks
        return HeadLogProbs.apply(h[torch.arange(n, device=dev)[:, None], pos][valid], w, targets, temperature,
                                  top_k, top_p, chunk)
    logp, ent = model(seqs[:, :-1], head=head)                                               # [M], [M]
    zeros = logp.new_zeros(n, L)
    return zeros.masked_scatter(valid, logp), zeros.masked_scatter(valid, ent)


def _check(model, prompts, num_samples, max_new_tokens, temperature, top_k, top_p):
    if not prompts:
        raise ValueError("prompts is empty: pass a list of token-id lists")
    V, max_len = model.config.vocab_size, model.config.max_seq_len
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens: + max_new_tokens={max_new_tokens} exceeds "
                             f"max_seq_len={max_len}")
        if min(p) < 0 or max(p) >= V:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={V})")
    checks = [(num_samples >= 1, f"num_samples={num_samples} must be >= 1"),
              (max_new_tokens >= 1, f"max_new_tokens={max_new_tokens} must be >= 1"),
              (temperature >= 0, f"temperature={temperature} must be >= 0 (0 means greedy)"),
              (top_k >= 0, f"top_k={top_k} must be >= 0 (0 means off)"),
              (0 < top_p <= 1, f"top_p={top_p} must be in (0, 1] (1 means off)")]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def _cat(parts: list, pad_id: int) -> Rollout:
    """Rollouts of consecutive prompt chunks -> one, right-padded to the longest."""
    n = max(r.completion_ids.shape[1] for r in parts)
    return Rollout(*(torch.cat([F.pad(getattr(r, k), (0, n - getattr(r, k).shape[1]), value=v) for r in parts])
                     for k, v in (("completion_ids", pad_id), ("completion_mask", False), ("logprobs", 0.0))),
                   *(torch.cat([getattr(r, k) for r in parts]) for k in ("truncated", "lengths", "seeds", "nonfinite")))


@torch.no_grad()
def generate(model, prompts, num_samples, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
             seed=None, pad_id=0, static=None) -> Rollout:
    """Sample num_samples completions of each prompt (lists of token ids) -> Rollout with N = P·G rows. static
    (default: on CUDA) runs the compiled static step, else the same step eagerly; both sample the same tokens."""
    _check(model, prompts, num_samples, max_new_tokens, temperature, top_k, top_p)
    dev = model.model.embed_tokens.weight.device
    static = decode.STATIC_BY_DEFAULT.get(dev.type, False) if static is None else static  # the rule: decode.py
    P, G, L = len(prompts), num_samples, max_new_tokens
    N, S = P * G, max(map(len, prompts))
    seeds = row_seeds(seed, N, dev)
    if static and N > MAX_ROWS and P > 1:  # whole prompts, at most MAX_ROWS rows a call: bounded static buffers
        k = max(1, MAX_ROWS // G)
        return _cat([generate(model, prompts[i:i + k], G, L, temperature, top_k, top_p, stop_ids,
                              seeds[i * G:(i + k) * G], pad_id, static) for i in range(0, P, k)], pad_id)
    chunk = WIDTH_STEP.get(dev.type, 1) if static else 1
    W = -(-(S + L) // chunk) * chunk  # cache slots (static: in whole chunks)
    # a static call runs in power-of-two batches B <= B0 (its padding rows: not live, writing output row N), in
    # buffers of one capacity (slots, L, rows) per model: at least this call's, the largest call's so far
    B = max(MIN_BUCKET, 1 << (N - 1).bit_length()) if static else N
    # (a slot more than any width: a width equal to the whole cache is another graph, its K/V slices contiguous)
    W, Lc, R = decode.reserve(model, W + 1, L, B) if static else (W, L, N)
    # 1. one prefill of the P distinct prompts, left-padded to S
    idx = torch.tensor([[pad_id] * (S - len(p)) + list(p) for p in prompts], device=dev)      # [P, S]
    cache = model.new_cache(P, W, start=torch.tensor([S - len(p) for p in prompts], device=dev))
    logits = model(idx, cache, last_only=True)[:, -1]                                         # [P, V]
    cache.width = W if static else None
    # 2. G rows share each prompt's prefill; one uniform per (row, position), drawn up front: noise never depends
    # on the batch a row is in. The outputs have rows past N, where a static batch's padding rows write.
    rows = torch.arange(B, device=dev).clamp(max=N)                                           # [B] (N: padding)
    group = (rows.clamp(max=N - 1) // G)                                                      # [B] prompt of a row
    noise = uniform(mix64(seeds[rows.clamp(max=N - 1), None] + torch.arange(1, L + 1, device=dev) * MIX1))  # [B, L]

    def outputs():  # [R + 1, ...]: row N takes the writes of a static batch's padding rows
        return decode.Outputs.empty(R + 1, Lc, dev)
    out = decode.persistent(model, "out", outputs) if static else outputs()
    out.clear(pad_id)
    ids = sorted(set(stop_ids))
    stop = torch.tensor(ids + [-1] * (2 - len(ids)), dtype=torch.long, device=dev)  # >= 2 ids: no branch, no 0/1
    d = Decoder(cache, *[None] * 4, rows.new_zeros(()), out, stop, (temperature, top_k, top_p, pad_id))  # t=0 and co.
    d = batch(model, d, cache, group, (rows.new_zeros(B), rows < N, rows, noise), static)    # the B-row batch
    record(d, logits[group])                                                                 # 3-4. token 0
    del cache, logits  # the prefill's cache: copied into the batch, not kept through decoding
    run, batch_at_compaction = compiled_step(dev.type) if static else step, N
    for t in range(1, L):
        if stop_ids and (not static or t % CHECK_EVERY == 0):  # the host sync: every step eagerly, every
            n_live, B = int(d.live.sum()), len(d.tok)                           # CHECK_EVERY steps statically
            if n_live == 0:
                break
            if static and n_live <= B // 2 and B > MIN_BUCKET:  # a half-size (or smaller) captured batch
                while B // 2 >= max(n_live, MIN_BUCKET):
                    B //= 2
            elif not static and n_live <= COMPACT_AT * batch_at_compaction:  # the live rows, exactly
                B = batch_at_compaction = n_live
            if B < len(d.tok):  # 5. drop finished rows; a static batch pads with not-live copies of a kept row
                keep = d.live.nonzero()[:, 0]
                sel, pad = torch.cat((keep, keep[:1].expand(B - n_live))), torch.arange(B, device=dev) >= n_live
                d = batch(model, d, d.cache, sel, (d.tok[sel], d.live[sel] & ~pad, d.rows[sel].masked_fill(pad, N),
                                                   d.noise[sel, :L]), static)
        if static:  # attend over the filled slots rounded up to a chunk: a CUDA graph per (batch, width)
            d.cache.width = min(W, -(-(S + t) // chunk) * chunk)
        run(model, d)                                                                        # 3-4. token t
    ids, lp, mask = (x[:N, :L] for x in (out.ids, out.logprobs, out.mask))
    lengths = mask.sum(1)
    n = int(lengths.max())  # the longest row: the steps that produced a token
    nonfinite = out.nonfinite[:N] > 0
    live = torch.zeros(N + 1, dtype=torch.bool, device=dev).index_put_((d.rows,), d.live)[:N]
    return Rollout(ids[:, :n].clone(), mask[:, :n].clone(), lp[:, :n].clone(), live | nonfinite, lengths, seeds,
                   nonfinite)


def main():
    p = argparse.ArgumentParser(description="Sample completions of one prompt from a checkpoint folder.")
    p.add_argument("--ckpt", required=True, help="a Hugging Face folder: config.json, model.safetensors, tokenizer")
    p.add_argument("--prompt", required=True)
    p.add_argument("--n", type=int, default=4, help="completions to sample")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads; oversubscribing shared cores is very slow")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from model import Transformer, load_tokenizer
    from templates import read_tokenizer_config, stop_ids
    model, tok = Transformer.from_pretrained(args.ckpt).eval(), load_tokenizer(args.ckpt)
    stop = stop_ids(tok, read_tokenizer_config(args.ckpt), STOP_NAMES)  # the checkpoint's own, else by name
    t0 = time.perf_counter()
    r = generate(model, [tok.encode(args.prompt).ids], args.n, args.max_new_tokens, args.temperature, args.top_k,
                 args.top_p, stop_ids=stop, seed=args.seed)
    dt = time.perf_counter() - t0
    for i in range(args.n):
        ids = r.completion_ids[i, :r.lengths[i]].tolist()
        end = "stop" if not r.truncated[i] else "max_new_tokens"
        print(f"--- {i} ({len(ids)} tokens, {end}, log-prob {r.logprobs[i].sum():.2f})\n{args.prompt}{tok.decode(ids)}")
    print(f"--- {int(r.lengths.sum())} tokens in {dt:.2f} s: {r.lengths.sum() / dt:.0f} tokens/s")


if __name__ == "__main__":
    main()

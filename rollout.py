"""Batched, KV-cached sampling of G completions for each of P prompts: the rollout half of GRPO.

N = P·G rows, prompt-major (the G samples of prompt 0 first). The algorithm:
  1. Left-pad the P distinct prompts to S tokens and prefill them once into a KVCache (start = pad
     counts), keeping the last position's logits [P, V].
  2. Repeat each prompt's cache rows and logits G times (decode.batch, rows
     arange(P).repeat_interleave(G)): a prompt is prefilled once per group, never once per sample.
  3. Each step, turn logits into the sampling distribution z = filter(logits / T): top-k, then top-p
     (nucleus), everything else −inf, the most likely token always kept. Sample x by inverting the
     CDF: with p ∝ exp z, x = the first token whose cumulative mass exceeds u · Σp, where
     u = splitmix64(row seed, position) is counter-based noise: one uniform per row and step, so a
     row's draws depend only on its seed and position, never on its batch-mates or on when finished
     rows are dropped (the CDF summed in float64; Gumbel-max: V times the noise, 15% of a step).
  4. Record x and log softmax(z)[x]. Feed x back through the cache; a row that emits a stop id is
     done. generate's eager loop below is steps 1-5 in one body; the static loop and tools
     (tooluse.py: a row that closes a call takes the result as forced tokens, no log-prob) run
     decode.py's step in generate_decoder, with the same tokens.
  5. Eager (the CPU default): when the live rows have fallen to 3/4 of the batch since the last
     compaction, drop the done rows from the batch and the cache (a copy, so not every step); a host
     check every step. Static (the CUDA default, torch.compile + CUDA graphs): N rows start in a
     power-of-two batch (padding rows not live), at most MAX_ROWS a call (whole prompts); done rows
     stay in the captured batch, masked; every CHECK_EVERY steps the host looks, and once the live
     rows fit in half the batch, they move to a half-size (or smaller) batch. Both stop when no row
     is live or after max_new_tokens, with the same tokens and log-probs. A row whose logits are not
     finite ends there (Rollout.nonfinite).

Log-probs are those of the distribution actually sampled from: tempered, filtered and renormalised.
completion_logprobs() is generate's twin on the trainer side: one causal forward over prompt +
completion, each distinct prompt computed once for the rows that continue it (model.Prefix, as
the sampler prefills once per group), the same filter_logits, so the trainer's π (and π_old) of a
token is the sampler's and the importance ratio π/π_old starts at 1 (sampling at T = 0.7 and
training on the raw softmax is a known bug). Greedy (T = 0) takes the argmax of the raw logits and
records log_softmax(raw logits) at it; top_k/top_p do not apply.

  python rollout.py --ckpt DIR --prompt "12+7=" --n 4 --max_new_tokens 64 --temperature 0.7 --seed 0
"""
import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import decode
from decode import Outputs, batch, compiled_step, filter_logits, record
from model import Prefix

# splitmix64 (Steele et al. 2014) constants as signed int64: torch's int64 wraps as uint64 does
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MIX1, MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)
COMPACT_AT = 0.75  # eager: compact at 3/4 of the batch's live rows (RESULTS.md §4, constants)
CHECK_EVERY = 8    # static decoding: the host reads live.any() every 8 steps (< 8 steps wasted)
MIN_BUCKET = 8     # static decoding: batches halve while the live rows fit, down to 8 rows
MAX_ROWS = 512     # static: a larger call runs in chunks of whole prompts (buffers < 2 x 512 rows)
# static: attention reads the filled slots rounded up to these many (CUDA: a graph a width; CPU:
# the K/V re-laid as views of that width, decode.set_width)
WIDTH_STEP = {"cuda": 128, "cpu": 32}
# completion_forward's LM-head blocks, in logits: 2^23 (32 MB) on CPU (RESULTS.md §4, constants)
LOGITS_PER_CHUNK = {"cuda": 2 ** 26}
# completion_forward in bf16 autocast (fp32 weights and gradients): CUDA; CPU with cpu_bf16 (whose
# sampler is then a bf16 copy, as CUDA's: train.build_run)
BF16 = {"cuda"}
STOP_NAMES = ("<eos>", "<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>")
# how a row ended (Rollout.finish): a stop token; max_new_tokens; a tool call past max_tool_calls
# (tooluse.py); logits that were not finite
FINISH = ("stop", "length", "tool_limit", "nonfinite")


@dataclass
class Rollout:
    completion_ids: torch.Tensor   # [N, L] long, pad_id after the stop token
    completion_mask: torch.Tensor  # [N, L] bool, True on generated tokens, the stop token included
    logprobs: torch.Tensor         # [N, L] float32, log-prob under the sampled π; 0 on padding
    truncated: torch.Tensor        # [N] bool, no stop token within max_new_tokens (or not finite)
    lengths: torch.Tensor          # [N] long, generated tokens per row (completion_mask.sum(1))
    seeds: torch.Tensor            # [N] long; seed=seeds[r:r+1] regenerates row r alone
    nonfinite: torch.Tensor        # [N] bool, the row ended at NaN or inf logits (truncated)
    policy_mask: torch.Tensor      # [N, L] bool, sampled tokens (False on a tool's forced tokens)
    tool_calls: torch.Tensor       # [N] long, tool calls answered (tooluse.py); 0 without tools
    tool_errors: torch.Tensor      # [N] long, of which answered with an error
    finish: torch.Tensor           # [N] long, how the row ended: FINISH[finish]


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 (>> is arithmetic there: mask after shifting)."""
    for shift, mult in ((30, MIX1), (27, MIX2)):
        x ^= (x >> shift).bitwise_and_((1 << (64 - shift)) - 1)
        x *= mult
    return x.bitwise_xor_((x >> 31).bitwise_and_((1 << 33) - 1))


def row_seeds(seed, n: int, device) -> torch.Tensor:
    """[n] int64 per-row seeds: a tensor is taken as is; an int is hashed with each row index
    (a splitmix64 stream); None draws them from torch's default generator."""
    if isinstance(seed, torch.Tensor):
        if seed.shape != (n,):
            raise ValueError(f"seed tensor has shape {tuple(seed.shape)}, expected ({n},): "
                             "one seed per row")
        return seed.to(device=device, dtype=torch.long)
    if seed is None:
        return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), dtype=torch.long).to(device)
    if not -(1 << 63) <= int(seed) < (1 << 63):
        raise ValueError(f"seed {seed} does not fit in int64")
    base = mix64(torch.tensor([int(seed)], dtype=torch.long, device=device))
    return mix64(base + torch.arange(1, n + 1, device=device) * GOLDEN)


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """keys [B] random int64 (one per row and position) -> u [B] float64 in (0, 1) from their top
    52 bits k: (k + 1/2) / 2^52, never exactly 0 or 1 (with 53 bits, k + 1/2 could round to 1)."""
    return (keys >> 12).bitwise_and_((1 << 52) - 1).double().add_(0.5).mul_(2.0 ** -52)


def pad_batch(seqs: list[list], pad=0, dtype=torch.long) -> torch.Tensor:
    """Right-pad lists to the longest -> [n, T] (T = 1 for an empty batch of empty lists)."""
    T = max(map(len, seqs), default=1)
    rows = [list(s) + [pad] * (T - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=dtype).view(len(seqs), T)


class HeadLogProbs(torch.autograd.Function):
    """log π(target) [M] and entropy [M] of π = filter(h Wᵀ / T) for M hidden states h [M, C],
    `chunk` rows at a time. Backward recomputes each chunk's logits, so one [chunk, V] block is
    alive at once, never [M, V]: with z = logits/T, ∂log π(t)/∂z = onehot(t) − π on the kept
    set, and ∂z / ∂logits = 1/T (1 at T = 0)."""

    @staticmethod
    def forward(ctx, h, w, targets, temperature, top_k, top_p, chunk):
        logp, ent = h.new_empty(2, len(h), dtype=torch.promote_types(h.dtype, torch.float32))
        with torch.autocast(h.device.type, enabled=False):  # in w's dtype: float32 on CPU
            for i in range(0, len(h), chunk):
                z = filter_logits(F.linear(h[i:i + chunk], w), temperature, top_k, top_p)  # [c,V]
                lz = z.log_softmax(-1)
                logp[i:i + chunk] = lz.gather(-1, targets[i:i + chunk, None])[:, 0]
                ent[i:i + chunk] = -(lz.exp() * lz).nansum(-1)  # filtered: 0·−inf, skipped
        ctx.save_for_backward(h, w, targets)
        ctx.settings = temperature, top_k, top_p, chunk, torch.is_autocast_enabled(h.device.type)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _):
        (h, w, targets), (temperature, top_k, top_p, chunk, bf16) = ctx.saved_tensors, ctx.settings
        # the products in w's dtype (bf16 on GPU), or bf16 if forward ran under bf16 autocast (the
        # layers' backward's precision; forward's log π stays float32: the ratio, the sampler gap)
        wc = w.to(torch.bfloat16) if bf16 else w
        gh, gw = torch.empty_like(h), torch.zeros_like(w, dtype=g.dtype)    # gw summed in float32+
        for i in range(0, len(h), chunk):
            z = filter_logits(F.linear(hi := h[i:i + chunk].to(wc), wc), temperature, top_k, top_p)
            gi = g[i:i + chunk, None] / (temperature if temperature > 0 else 1)  # dz/dlogits: 1/T
            gz = z.softmax(-1).mul_(-gi).scatter_add_(  # (onehot - pi) g/T, then in wc's dtype
                -1, targets[i:i + chunk, None], gi).to(wc.dtype)  # (gw sums in float32)
            gh[i:i + chunk] = gz @ wc  # and gw in place where it can (no [V, C] product: 1.8x)
            gw.addmm_(gz.T, hi) if gw.dtype == gz.dtype else gw.add_(gz.T @ hi)
        return gh, gw.to(w.dtype), None, None, None, None, None


def completion_forward(model, prompts: list[list[int]], completions: list[list[int]], head):
    """One causal forward over prompt + completion (bf16 autocast on BF16's devices), its LM head
    replaced by head(h [M, C], w [V, C], targets [M], chunk) at the M completion tokens only
    (chunk: the rows of a [chunk, V] block of ~2^23 logits) -> (head's result, valid [n, L]: a
    completion's tokens). Rows with one prompt (a group's G samples) share its forward:
    model.Prefix."""
    dev = model.model.embed_tokens.weight.device
    prefix = Prefix(prompts, completions, dev)  # ids, valid [n, L]; at [n, L]: o_t's input
    with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type in BF16):  # the head: w's dtype
        return model(prefix.idx, prefix=prefix, head=lambda h, w: head(
            h[0, prefix.at][prefix.valid].to(w.dtype), w, prefix.ids[prefix.valid],
            max(1, LOGITS_PER_CHUNK.get(dev.type, 2 ** 23) // w.shape[0]))), prefix.valid


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]],
                        temperature: float, top_k: int = 0,
                        top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """generate's twin for the trainer: each completion (token ids) after its prompt ->
    (log π(o_t | q, o_<t) [n, L] float32, differentiable, 0 past a row's end; the entropy of π
    there [n, L], no grad), π the distribution generate samples from at the same settings. The LM
    head runs only at completion tokens, in chunks (HeadLogProbs): never [n, L, V] logits."""
    (logp, ent), valid = completion_forward(model, prompts, completions, lambda h, w, t, c: (
        HeadLogProbs.apply(h, w, t, temperature, top_k, top_p, c)))                  # [M], [M]
    return tuple(logp.new_zeros(valid.shape).masked_scatter(valid, x) for x in (logp, ent))


def completion_log_softmax(model, prompts: list[list[int]], completions: list[list[int]],
                           temperature: float, top_k: int = 0, top_p: float = 1.0):
    """completion_logprobs' forward keeping the whole log softmax of π at each of the M completion
    tokens -> (log π [M, V] float32, valid [n, L]). The same chunks of the same hidden states, so
    log π[target] is bitwise completion_logprobs'; memory M·V: small V only."""
    def head(h, w, targets, chunk):                                                     # [M, V]
        return torch.cat([filter_logits(F.linear(h[i:i + chunk], w), temperature, top_k,
                                        top_p).log_softmax(-1) for i in range(0, len(h), chunk)])
    return completion_forward(model, prompts, completions, head)


def _check(model, prompts, G: int, L: int, temperature: float, top_k: int, top_p: float, seed):
    """generate's arguments: a ValueError naming the first that is wrong."""
    V, max_len, N = model.config.vocab_size, model.config.max_seq_len, len(prompts) * G
    fits = [bool(p) and len(p) + L <= max_len and min(p) >= 0 and max(p) < V for p in prompts]
    ok = dict(prompts=bool(prompts), prompt=all(fits), num_samples=G >= 1, max_new_tokens=L >= 1,
              temperature=temperature >= 0, top_k=top_k >= 0, top_p=0 < top_p <= 1,
              seed=getattr(seed, "shape", (N,)) == (N,))
    if not all(ok.values()):
        i = fits.index(False) if False in fits else None
        i, p = (i, prompts[i]) if i is not None else (0, [0])
        raise ValueError({
            "prompts": "prompts is empty: pass a list of token-id lists",
            "prompt": f"prompt {i} is empty" if not p else f"prompt {i} has {len(p)} tokens, ids "
                      f"in [{min(p)}, {max(p)}]: ids must be in [0, vocab_size={V}), and "
                      f"+ max_new_tokens={L} <= max_seq_len={max_len}",
            "num_samples": f"num_samples={G} must be >= 1",
            "max_new_tokens": f"max_new_tokens={L} must be >= 1",
            "temperature": f"temperature={temperature} must be >= 0 (0 means greedy)",
            "top_k": f"top_k={top_k} must be >= 0 (0 means off)",
            "top_p": f"top_p={top_p} must be in (0, 1] (1 means off)",
            "seed": f"seed: an int, or one seed per row ({N},)"}[min(ok, key=ok.get)])


def prefill(model, prompts: list[list[int]], slots: int, pad_id: int):
    """Step 1: one forward of the P distinct prompts, left-padded to S, into a cache of `slots`
    -> (the cache, whose start is each row's pad count; the last position's logits [P, V])."""
    dev, S = model.model.embed_tokens.weight.device, max(map(len, prompts))
    idx = torch.tensor([[pad_id] * (S - len(p)) + list(p) for p in prompts], device=dev)  # [P, S]
    start = torch.tensor([S - len(p) for p in prompts], device=dev)                       # [P]
    cache = model.new_cache(len(prompts), slots, start=start)
    return cache, model(idx, cache, last_only=True)[:, -1]


def _cat(parts: list, pad_id: int) -> Rollout:
    """Rollouts of consecutive prompt chunks -> one, right-padded to the longest."""
    n = max(r.completion_ids.shape[1] for r in parts)

    def cat(k, value=None):  # field k of every part; a per-token one right-padded to n with value
        xs = [getattr(r, k) for r in parts]
        if value is not None:
            xs = [F.pad(x, (0, n - x.shape[1]), value=value) for x in xs]
        return torch.cat(xs)
    pads = dict(completion_ids=pad_id, completion_mask=False, logprobs=0.0, policy_mask=False)
    return Rollout(**{k: cat(k, pads.get(k)) for k in Rollout.__dataclass_fields__})


@torch.no_grad()
def generate(model, prompts, num_samples, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
             stop_ids=(), seed=None, pad_id=0, static=None, tools=None) -> Rollout:
    """Sample num_samples completions of each prompt (lists of token ids) -> Rollout, N = P·G rows.
    The eager loop below, by default on CPU; with static (default on CUDA:
    decode.STATIC_BY_DEFAULT) or tools, decode.py's step in generate_decoder. seed: an int, [N] row
    seeds or None. tools (a tooluse.Toolbox): a row that closes a call gets the tool's result as
    forced tokens; max_new_tokens counts them too. The same tokens every way."""
    _check(model, prompts, num_samples, max_new_tokens, temperature, top_k, top_p, seed)
    dev, P, G, L = model.model.embed_tokens.weight.device, len(prompts), num_samples, max_new_tokens
    seeds = seed.to(dev) if isinstance(seed, torch.Tensor) else row_seeds(seed, P * G, dev)  # [N]
    # step 3's uniforms up front, one per (row, position), whatever batch a row is in
    noise = uniform(mix64(seeds[:, None] + torch.arange(1, L + 1, device=dev) * MIX1))   # [N, L]
    static = decode.STATIC_BY_DEFAULT.get(dev.type, False) if static is None else static
    with model.packed():  # CPU: the weights packed for oneDNN (CUDA: as they are)
        if static or tools is not None:
            return generate_decoder(model, prompts, G, L, (temperature, top_k, top_p, pad_id),
                                    stop_ids, seeds, noise, tools, static)
        cache, logits = prefill(model, prompts, max(map(len, prompts)) + L, pad_id)  # 1. [P, V]
        rows = torch.arange(P * G, device=dev)  # 2. the output row of each batch row: G per prompt
        cache, logits = cache.index_rows(rows // G), logits[rows // G]                      # [N, V]
        ids, logps = torch.full((P * G, L), pad_id, device=dev), torch.zeros(P * G, L, device=dev)
        mask, live, nonfinite = torch.zeros_like(logps, dtype=torch.bool), rows >= 0, rows < 0
        stop, compacted_at = rows.new_tensor(sorted(set(stop_ids))), P * G
        for t in range(L):
            u = noise[rows, t] if temperature > 0 else None                        # [B] or greedy
            tok, logp = decode.sample(filter_logits(logits, temperature, top_k, top_p), u)  # 3. [B]
            ok = live & ~logp.isnan()  # logits not finite: the row ends here, without a token
            ids[rows, t], logps[rows, t] = tok.masked_fill(~ok, pad_id), logp.masked_fill(~ok, 0.0)
            mask[rows, t], nonfinite[rows] = ok, nonfinite[rows] | live & ~ok                 # 4.
            live = ok & ~torch.isin(tok, stop)
            n_live = int(live.sum()) if stop_ids else len(live)  # the host looks: every row done?
            if n_live == 0 or t == L - 1:
                break
            if n_live <= COMPACT_AT * compacted_at:  # 5. drop the done rows (a copy: not each step)
                keep, compacted_at = live.nonzero()[:, 0], n_live                         # [n_live]
                rows, live, tok, cache = rows[keep], live[keep], tok[keep], cache.index_rows(keep)
            logits = model(tok[:, None], cache)[:, -1]  # feed each row's token: [B, V]
        truncated = torch.zeros_like(nonfinite).index_put_((rows,), live) | nonfinite  # no stop id
        n = int(mask.sum(1).max())  # the longest completion
        return Rollout(ids[:, :n], mask[:, :n], logps[:, :n], truncated, mask.sum(1), seeds,
                       nonfinite, mask[:, :n], *rows.new_zeros(2, P * G), truncated + 2 * nonfinite)


def finish(ids, mask, logprobs, truncated, seeds, nonfinite, policy, calls=None,
           errors=None, limited=None) -> Rollout:
    """A call's [N, ...] outputs as a Rollout, cut to the longest completion; limited [N] bool:
    rows ended at a tool call past the limit."""
    lengths = mask.sum(1)
    n = int(lengths.max())  # the longest row: the steps that produced a token
    calls, errors = (torch.zeros_like(lengths), ) * 2 if calls is None else (calls, errors)
    ended = truncated + 2 * nonfinite  # FINISH's codes
    ended = ended if limited is None else ended.masked_fill(limited & ~truncated, 2)
    return Rollout(ids[:, :n].clone(), mask[:, :n].clone(), logprobs[:, :n].clone(), truncated,
                   lengths, seeds, nonfinite, policy[:, :n].clone(), calls, errors, ended)


def generate_decoder(model, prompts, G: int, L: int, settings: tuple, stop_ids, seeds, noise,
                     tools, static: bool) -> Rollout:
    """generate with tools or static: decode.py's step over a Decoder (the row state a compiled step
    reads), one loop for both. Eager (tools on CPU): finished rows dropped as in generate. Static
    (the CUDA default, torch.compile + CUDA graphs): N rows start in a power-of-two batch (padding
    rows not live, writing output row N), at most MAX_ROWS a call (whole prompts), in buffers made
    once per model at one capacity (decode.reserve); done rows stay in the captured batch, masked;
    every CHECK_EVERY steps the host looks, and once the live rows fit in half the batch they move
    to a half-size (or smaller) batch. With tools the host answers calls after every token."""
    dev, P, pad_id = seeds.device, len(prompts), settings[3]
    N, S = P * G, max(map(len, prompts))
    if static and N > MAX_ROWS and P > 1:  # whole prompts, <= MAX_ROWS rows a call: bounded buffers
        k = max(1, MAX_ROWS // G)
        parts = [generate_decoder(model, prompts[i:i + k], G, L, settings, stop_ids,
                                  seeds[i * G:(i + k) * G], noise[i * G:(i + k) * G], tools, static)
                 for i in range(0, P, k)]
        return _cat(parts, pad_id)
    chunk = WIDTH_STEP.get(dev.type, 128) if static else 1
    W = -(-(S + L) // chunk) * chunk  # cache slots (static: in whole chunks)
    # a static call runs in power-of-two batches B <= B0, in buffers of one capacity (slots, L,
    # rows) per model, the largest call's so far; a slot more than any width (a width of the whole
    # cache: another graph, its K/V slices contiguous)
    B = max(MIN_BUCKET, 1 << (N - 1).bit_length()) if static else N
    W, Lc, R = decode.reserve(model, W + 1, L, B) if static else (W, L, N)
    cache, logits = prefill(model, prompts, W, pad_id)                                  # [P, V]
    cache.width = min(W, -(-(S + 1) // chunk) * chunk) if static else None
    rows = torch.arange(B, device=dev).clamp(max=N)                # [B] output row (N: padding)
    group = rows.clamp(max=N - 1) // G                              # [B] prompt of a row
    out = decode.persistent(model, "out", lambda: Outputs.new(R + 1, Lc, pad_id, dev)) if static \
        else Outputs.new(R + 1, Lc, pad_id, dev)
    out.clear(pad_id)
    stop, close = (torch.tensor(sorted(set(x)) + [-1] * (2 - len(set(x))), dtype=torch.long,
                                device=dev) for x in (stop_ids, tools.marks if tools else ()))
    fixed = dict(out=out, stop=stop, close=close, settings=settings)  # >= 2 ids each, -1-padded
    tok, qpos, qlen = (rows.new_zeros(B) for _ in range(3))  # three tensors, each written in place
    state = (tok, rows < N, rows, noise[rows.clamp(max=N - 1)], rows.new_zeros(B, L), qpos, qlen)
    d = batch(model, cache, group, state, rows.new_zeros(()), fixed, static)  # the B-row batch
    session = tools.session(N) if tools is not None else None
    record(d, logits[group])                                          # 3-4. token 0
    del cache, logits  # the prefill's cache: copied into the batch, not kept through decoding
    step_fn = compiled_step(dev.type) if static else decode.step
    batch_at_compaction = N
    for t in range(1, L):
        if session is not None:  # a row that has just closed a call: its result queued (tooluse)
            session.answer(d)
        # the host sync: every step eagerly, every CHECK_EVERY steps statically
        if stop_ids and (not static or t % CHECK_EVERY == 0):
            n_live, B = int(d.live.sum()), len(d.tok)
            if n_live == 0:
                break
            if static and n_live <= B // 2 and B > MIN_BUCKET:  # a half-size (or smaller) batch
                while B // 2 >= max(n_live, MIN_BUCKET):
                    B //= 2
            elif not static and n_live <= COMPACT_AT * batch_at_compaction:  # the live rows
                B = batch_at_compaction = n_live
            if B < len(d.tok):  # 5. drop finished rows; a static batch pads with not-live copies
                keep = d.live.nonzero()[:, 0]                                          # [n_live]
                sel = torch.cat((keep, keep[:1].expand(B - n_live)))                   # [B]
                pad = torch.arange(B, device=dev) >= n_live                            # [B]
                state = (d.tok[sel], d.live[sel] & ~pad, d.rows[sel].masked_fill(pad, N),
                         d.noise[sel, :L], d.queue[sel, :L], d.qpos[sel], d.qlen[sel])
                d = batch(model, d.cache, sel, state, d.t, fixed, static)
        if static:  # the filled slots rounded up to a chunk
            decode.set_width(d.cache, min(W, -(-(S + t) // chunk) * chunk))
        step_fn(model, d)                                                             # 3-4. token t
    live = torch.zeros(N + 1, dtype=torch.bool, device=dev)  # row N: the padding rows', dropped
    live = live.index_put_((d.rows,), d.live)[:N]             # [N] still live: no stop token
    nonfinite = out.nonfinite[:N] > 0
    calls, errors, limited = session.counts(dev) if session else (None, None, None)
    return finish(out.ids[:N], out.mask[:N], out.logprobs[:N], live | nonfinite, seeds, nonfinite,
                  out.policy[:N], calls, errors, limited)


def main():
    p = argparse.ArgumentParser(description="Sample completions of one prompt from a checkpoint.")
    p.add_argument("--ckpt", required=True, help="a Hugging Face model folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--n", type=int, default=4, help="completions to sample")
    p.add_argument("--threads", type=int, default=2, help="CPU threads; oversubscribing is slow")
    for k, v in dict(max_new_tokens=128, temperature=0.7, top_k=0, top_p=0.95, seed=0).items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from model import Transformer, load_tokenizer
    from templates import read_tokenizer_config, stop_ids
    model, tok = Transformer.from_pretrained(args.ckpt).eval(), load_tokenizer(args.ckpt)
    stop = stop_ids(tok, read_tokenizer_config(args.ckpt), STOP_NAMES)  # its own, else by name
    t0 = time.perf_counter()
    r = generate(model, [tok.encode(args.prompt).ids], args.n, args.max_new_tokens,
                 args.temperature, args.top_k, args.top_p, stop_ids=stop, seed=args.seed)
    dt = time.perf_counter() - t0
    for i in range(args.n):
        ids = r.completion_ids[i, :r.lengths[i]].tolist()
        end = "stop" if not r.truncated[i] else "max_new_tokens"
        print(f"--- {i} ({len(ids)} tokens, {end}, log-prob {r.logprobs[i].sum():.2f})")
        print(f"{args.prompt}{tok.decode(ids)}")
    print(f"--- {int(r.lengths.sum())} tokens in {dt:.2f} s: {r.lengths.sum() / dt:.0f} tokens/s")


if __name__ == "__main__":
    main()

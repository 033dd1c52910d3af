"""One decode step of rollout.generate, written once for both of its loops: eager (CPU: compaction, a host check
per token) and static (CUDA: torch.compile captures the whole step in CUDA graphs, replayed every token).

A step of a batch of B rows (Decoder: every tensor it reads or writes lives in the Decoder and is updated in place):
  1. logits = model(tok, cache): the cache write position is a device tensor (cache.slot), the mask is built on
     the device from (start, slot) over `cache.width` slots, RoPE rows are gathered by position: no Python int that
     changes per token, so the step has static shapes (model.Attention.decode);
  2. z = filter(logits / T) (top-k, top-p), token t ~ z by inverting the CDF at the row's uniform noise[t];
  3. write the token, its log-prob and the live flag at (row, t) of the outputs (pad and 0 once a row stopped);
  4. live &= token not a stop id; t += 1. A finished row stays in the batch, masked: only the host, every few
     steps, decides to move the live rows into a smaller batch (batch()).
A captured graph reads fixed addresses: a static batch's tensors (cache, state, outputs) are made once per shape
and model, kept in _BUFFERS and marked as static addresses; a new call copies its rows into them.

  python -m pytest -q tests/test_rollout.py -k "static or two_level"     python bench.py --device cuda
"""
import weakref
from dataclasses import dataclass

import torch

CDF_BLOCK = 1024                  # the two-level inverse CDF's block: 148 blocks and a tail of a 151,936 vocabulary
TWO_LEVEL_ABOVE = {"cuda": 8192}  # device -> vocabularies above this search the CDF in two levels (never on CPU:
                                  # one float64 cumsum measured faster there, at 4,096 and at 151,936 tokens)


def sample(z: torch.Tensor, u: torch.Tensor | None):
    """z [B, V] filtered logits -> (token [B], its log-prob [B]). With u [B], inverse-CDF sampling: the first token
    whose cumulative probability c exceeds u · c_V (a token of probability 0 is never first: its c equals its
    predecessor's), c summed in float64; without (greedy), argmax z. For a large vocabulary on CUDA the search
    runs in two levels, block sums then the chosen block (no serial walk over V), on probabilities rounded down to
    multiples of 2^-52 (integers q): every partial sum is exact in any order, so it picks exactly the token of a
    one-level search over the same q."""
    if u is None:
        tok = z.argmax(-1)
        return tok, z.log_softmax(-1).gather(-1, tok[:, None])[:, 0].float()
    p = z.softmax(-1)                                                                   # [B, V], 0 where z = −inf
    (B, V), K = p.shape, CDF_BLOCK
    if V <= TWO_LEVEL_ABOVE.get(z.device.type, V):
        c = p.double().cumsum_(-1)                                                      # [B, V] float64
        tok = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)[:, 0]  # u < 1, so c_V > u · c_V: in range
        return tok, (p.gather(-1, tok[:, None])[:, 0] / c[:, -1]).log().float()
    q = p.double().mul_(2.0 ** 52).floor_()                                             # [B, V], sums < 2^53
    n = V // K * K  # full blocks, then the tail (maybe empty)
    sums = torch.cat((q[:, :n].view(B, -1, K).sum(-1), q[:, n:].sum(-1, keepdim=True)), 1)   # [B, V/K + 1]
    ends = sums.cumsum(-1)                                                              # c at each block's end
    x = (u * ends[:, -1])[:, None]                                                      # [B, 1]
    j = torch.searchsorted(ends, x, right=True)                                         # [B, 1] the block
    idx = j * K + torch.arange(K, device=q.device)                                      # [B, K] its tokens
    c = q.gather(1, idx.clamp(max=V - 1)).masked_fill_(idx >= V, 0).cumsum_(-1) + (ends - sums).gather(1, j)
    tok = j[:, 0] * K + torch.searchsorted(c, x, right=True)[:, 0]
    return tok, (p.gather(-1, tok[:, None])[:, 0] * 2.0 ** 52 / ends[:, -1]).log().float()


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> float32 logits of the sampling distribution: logits / T, then −inf outside the top-k
    (ties with the k-th value are kept) and outside the smallest set of most likely tokens with mass >= top_p."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits are scored in float32
    if temperature == 0:  # greedy: the raw distribution
        return z
    if temperature != 1:
        z = z / temperature
    if 0 < top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1:  # drop a token when the more likely tokens before it already reach top_p (the first never is)
        zs, order = z.sort(dim=-1, descending=True)
        p = zs.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z


@dataclass
class Decoder:
    """A batch's decode state; the sampling settings are Python constants the compiled step is specialised on."""
    cache: "model.KVCache"         # noqa: F821
    tok: torch.Tensor              # [B] the last sampled token
    live: torch.Tensor             # [B] bool, no stop token yet
    rows: torch.Tensor             # [B] output row of each batch row (N: a padding row of a static batch)
    noise: torch.Tensor            # [B, L] float64, each row's uniform per position
    t: torch.Tensor                # 0-d long: the position sampled next
    out: list                      # (ids, log-probs, mask), each [N + 1, L]: shared by every batch of one call
    stop: torch.Tensor             # [k] stop ids
    settings: tuple                # (temperature, top_k, top_p, pad_id)


def record(d: Decoder, logits: torch.Tensor):
    """Steps 2-4 from logits [B, V] (token 0 comes from the prefill's logits)."""
    temperature, top_k, top_p, pad_id = d.settings
    u = d.noise.index_select(1, d.t.view(1))[:, 0] if temperature > 0 else None
    tok, logp = sample(filter_logits(logits, temperature, top_k, top_p), u)                 # [B], [B]
    at = (d.rows, d.t.expand(len(d.rows)))
    for buf, x in zip(d.out, (tok.masked_fill(~d.live, pad_id), logp.masked_fill(~d.live, 0.0), d.live)):
        buf.index_put_(at, x)
    if len(d.stop):
        d.live.logical_and_(~torch.isin(tok, d.stop))
    d.tok.copy_(tok)
    d.t.add_(1)


def step(model, d: Decoder):
    """Steps 1-4: feed each row's last token, sample the next."""
    record(d, model(d.tok[:, None], d.cache)[:, -1])


_BUFFERS = weakref.WeakKeyDictionary()  # model -> {(B, L) or ("out", N, L): (KVCache or None, tensors)}
_COMPILED = {}                          # device type -> the compiled step


def compiled_step(device_type: str):
    """torch.compile of step, made once: one graph (fullgraph) over symbolic batch and width (dynamic), so a new
    batch size or width needs no recompile; on CUDA replayed as CUDA graphs ("reduce-overhead"), one per shape."""
    if device_type not in _COMPILED:
        _COMPILED[device_type] = torch.compile(step, fullgraph=True, dynamic=True,
                                               mode="reduce-overhead" if device_type == "cuda" else None)
    return _COMPILED[device_type]


def cache_slots(model, L: int, W: int) -> int:
    """W, or the slot count of a static batch this model already holds for L new tokens if that is larger."""
    return max([W] + [len(c.cos) for key, (c, _) in _BUFFERS.get(model, {}).items() if key[-1] == L and c])


def persistent(model, key, make, slots=None):
    """make() -> (cache or None, tensors), once per (model, key) and cache slot count; the tensors marked as static
    addresses. A batch size keeps one set: made again only when a longer prompt needs more slots."""
    bufs = _BUFFERS.setdefault(model, {})
    if key not in bufs or slots and len(bufs[key][0].cos) != slots:
        bufs[key] = make()
        for x in bufs[key][1]:
            torch._dynamo.mark_static_address(x)
    return bufs[key]


def batch(model, d: Decoder, cache, sel: torch.Tensor, state: tuple, static: bool) -> Decoder:
    """A batch of B = len(sel) rows: the cache rows `sel`, the per-row state (tok, live, rows, noise), d's t, outputs
    and settings. Eager: new tensors (a copy of the kept cache rows); static: copied into the persistent tensors of
    a B-row batch (per B and number of new tokens)."""
    if not static:
        return Decoder(cache.index_rows(sel), *state, d.t, d.out, d.stop, d.settings)

    def make():
        c = model.new_cache(len(sel), len(cache.cos))
        return c, c.k + c.v + [c.start, c.slot, c.cos, c.sin] + [torch.zeros_like(x) for x in (*state, d.t)]
    c, bufs = persistent(model, (len(sel), state[3].shape[1]), make, len(cache.cos))
    for dst, src in zip(bufs, cache.k + cache.v):  # the kept rows' keys and values, layer by layer
        torch.index_select(src, 0, sel, out=dst)
    rest = bufs[2 * len(cache.k):]  # start, slot, cos, sin, then tok, live, rows, noise, t
    for dst, src in zip(rest[:2] + rest[4:], (cache.start[sel], cache.slot, *state, d.t)):
        dst.copy_(src)
    c.width = cache.width
    return Decoder(c, *rest[4:], d.out, d.stop, d.settings)

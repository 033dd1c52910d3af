"""One decode step of rollout.generate_decoder, written once for both of its loops: eager (tools on
CPU: compaction, a host check per token) and static (CUDA: torch.compile captures the step in CUDA
graphs). The default CPU loop (rollout.generate) samples with this file's sample and filter_logits.

A step of a batch of B rows (Decoder: every tensor it reads or writes, updated in place):
  1. logits = model(tok, cache): the write position is a device tensor (cache.slot), the mask is
     built on the device from (start, slot) over `cache.width` slots, RoPE rows are gathered by
     position: no Python int changes per token, so shapes are static (model.Attention.decode);
  2. z = filter(logits / T) (top-k, top-p), token t ~ z by inverting the CDF at the row's noise[t];
  3. a row with a tool result queued (tooluse.py) takes its next token instead: forced, no log-prob;
  4. write the token, its log-prob, the live and policy flags at (row, t) of the Outputs (pad and 0
     once a row stopped; a row at logits that are not finite ends there, in Outputs.nonfinite);
  5. live &= sampled token not a stop id; t += 1. A finished row stays in the batch, masked: only
     the host, every few steps, moves the live rows into a smaller batch (batch()).
A captured graph reads fixed addresses: a static batch's Decoder and the Outputs are made once per
model (and power-of-two batch size) at one capacity (reserve), kept in _BUFFERS, marked static
without a guard; a call copies its rows in. Bounds: < 2 x the largest first batch rows held; a
frame per sampling setting, whatever the sizes, tools or not.

  python -m pytest -q tests/test_decode.py tests/test_rollout.py tests/test_tooluse.py
"""
import dataclasses
import weakref
from contextlib import nullcontext
from typing import NamedTuple

import torch

from model import define_packed_linear

CDF_BLOCK = 1024  # the two-level inverse CDF's block: 148 blocks and a tail of a 151,936 vocabulary
# device -> larger vocabularies search the CDF in two levels (CPU: never; one cumsum was faster)
TWO_LEVEL_ABOVE = {"cuda": 8192}


def sample(z: torch.Tensor, u: torch.Tensor | None):
    """z [B, V] filtered logits -> (token [B], its log-prob [B]). With u [B], inverse-CDF sampling:
    the first token whose cumulative probability c (float64) exceeds u·c_V (a token of probability
    0 is never first: its c is its predecessor's); without (greedy), argmax z."""
    if u is None:  # greedy: the first maximum, NaN counting as one
        if torch.compiler.is_compiling():  # the least index at a max: vectorised, ~2x max's index
            hit = (z == z.amax(-1, keepdim=True)) | (z != z)  # [B, V]; z != z: NaN (isnan: 2x)
            tok = torch.where(hit, torch.arange(z.shape[1], device=z.device), z.shape[1]).amin(-1)
        else:  # eagerly max's index (argmax's), 3-4x faster than argmax
            tok = z.max(-1).indices
        return tok, z.log_softmax(-1).gather(-1, tok[:, None])[:, 0].float()
    p = z.softmax(-1)                                               # [B, V], 0 where z = −inf
    if p.shape[1] > TWO_LEVEL_ABOVE.get(z.device.type, p.shape[1]):
        return sample_two_level(p, u)
    c = p.double().cumsum_(-1)                                      # [B, V] float64
    x = (u * c[:, -1])[:, None]                                     # [B, 1], u < 1: x < c_V
    tok = torch.searchsorted(c, x, right=True)[:, 0].clamp_(max=p.shape[1] - 1)  # NaN row: V
    return tok, (p.gather(-1, tok[:, None])[:, 0] / c[:, -1]).log().float()  # p(tok) / c_V


def sample_two_level(p: torch.Tensor, u: torch.Tensor):
    """sample's search for a large vocabulary on CUDA, in two levels: block sums, then the chosen
    block (no serial walk over V), on probabilities rounded down to multiples of 2^-52 (integers
    q): every partial sum is exact in any order, so it picks exactly the token of a one-level
    search over the same q."""
    (B, V), K = p.shape, CDF_BLOCK
    q = p.double().mul_(2.0 ** 52).floor_()                         # [B, V], sums < 2^53
    n = V // K * K  # full blocks, then the tail (maybe empty)
    full = q[:, :n].view(B, -1, K).sum(-1)                          # [B, V/K]
    sums = torch.cat((full, q[:, n:].sum(-1, keepdim=True)), 1)     # [B, V/K + 1]
    ends = sums.cumsum(-1)                                          # c at each block's end
    x = (u * ends[:, -1])[:, None]                                  # [B, 1]
    j = torch.searchsorted(ends, x, right=True).clamp_(max=sums.shape[1] - 1)  # [B, 1] (NaN: last)
    idx = j * K + torch.arange(K, device=q.device)                  # [B, K] its tokens
    in_block = q.gather(1, idx.clamp(max=V - 1)).masked_fill_(idx >= V, 0)
    c = in_block.cumsum_(-1) + (ends - sums).gather(1, j)           # [B, K] c within the block
    first = j[:, 0] * K                                             # [B] the block's first token
    tok = (first + torch.searchsorted(c, x, right=True)[:, 0]).clamp_(max=V - 1)
    p_tok = p.gather(-1, tok[:, None])[:, 0]                        # [B]
    return tok, (p_tok * 2.0 ** 52 / ends[:, -1]).log().float()


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> float32 logits of the sampling distribution: logits / T, −inf outside
    the top-k (ties with the k-th value are kept) and outside the smallest set of most likely tokens
    with mass >= top_p."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: in float32
    if temperature == 0:  # greedy: the raw distribution
        return z
    if temperature != 1:
        z = z / temperature
    if 0 < top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1:  # drop a token once the more likely tokens before it reach top_p (not the first)
        zs, order = z.sort(dim=-1, descending=True)
        p = zs.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p                          # [..., V] in sorted order
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z


class Outputs(NamedTuple):
    """A call's results, written at (row, t) by each of its batches. R + 1 rows, R >= N: row N takes
    the writes of a static batch's padding rows; L >= the call's max_new_tokens (the capacity)."""
    ids: torch.Tensor        # [R + 1, L] long, pad_id where no token was generated
    logprobs: torch.Tensor   # [R + 1, L] float32, log-prob under the sampling distribution, else 0
    mask: torch.Tensor       # [R + 1, L] bool, a token is in the row (sampled or forced)
    policy: torch.Tensor     # [R + 1, L] bool, the token was sampled (a forced one is context)
    nonfinite: torch.Tensor  # [R + 1] long, > 0: the row ended at logits that were not finite

    @classmethod
    def new(cls, rows: int, L: int, pad_id: int, device) -> "Outputs":  # every row empty
        per_token = (torch.full((rows, L), v, dtype=t, device=device)
                     for v, t in ((pad_id, torch.long), (0.0, torch.float), (False, torch.bool),
                                  (False, torch.bool)))
        return cls(*per_token, torch.zeros(rows, dtype=torch.long, device=device))

    def clear(self, pad_id: int):  # every row empty, for a new call (static: the same tensors)
        for buf, value in zip(self, (pad_id, 0.0, False, False, 0)):
            buf.fill_(value)


@dataclasses.dataclass
class Decoder:
    """A batch's decode state; settings are Python constants the compiled step specialises on."""
    cache: "model.KVCache"  # noqa: F821
    tok: torch.Tensor       # [B] the last sampled token
    live: torch.Tensor      # [B] bool, no stop token yet
    rows: torch.Tensor      # [B] output row of each batch row (N: a padding row of a static batch)
    noise: torch.Tensor     # [B, L] float64, each row's uniform per position
    t: torch.Tensor         # 0-d long: the position sampled next
    queue: torch.Tensor     # [B, L] long, a row's forced tokens (a tool's result) from 0
    qpos: torch.Tensor      # [B] long, the next forced token; forced while qpos < qlen
    qlen: torch.Tensor      # [B] long, forced tokens queued
    called: torch.Tensor    # [B] bool, this step sampled a token in `close`
    out: Outputs            # shared by every batch of one call
    stop: torch.Tensor      # [k] stop ids, k >= 2
    close: torch.Tensor     # [k] the tools' closing-marker ends, k >= 2 (-1: padding)
    settings: tuple         # (temperature, top_k, top_p, pad_id)


def record(d: Decoder, logits: torch.Tensor):
    """Steps 2-5 from logits [B, V] (token 0: the prefill's). A row at logits not finite (NaN or
    inf: log-prob NaN) ends there, without a token, counted in out.nonfinite: no index error."""
    temperature, top_k, top_p, pad_id = d.settings
    u = d.noise.index_select(1, d.t.view(1))[:, 0] if temperature > 0 else None    # [B] or greedy
    tok, logp = sample(filter_logits(logits, temperature, top_k, top_p), u)        # [B], [B]
    forced, at_q = d.qpos < d.qlen, d.qpos.clamp(max=d.queue.shape[1] - 1)[:, None]   # [B], [B, 1]
    tok = torch.where(forced, d.queue.gather(1, at_q)[:, 0], tok)                  # [B]
    bad = logp.isnan() & ~forced                                                   # [B]
    live, policy = d.live & ~bad, d.live & ~bad & ~forced                          # [B], [B]
    at = (d.rows, d.t.expand(len(d.rows)))                                         # (row, t)
    written = (tok.masked_fill(~live, pad_id), logp.masked_fill(~policy, 0.0), live, policy)
    for buf, x in zip((d.out.ids, d.out.logprobs, d.out.mask, d.out.policy), written):
        buf.index_put_(at, x)
    d.out.nonfinite.index_put_((d.rows,), (bad & d.live).long(), accumulate=True)
    d.live.logical_and_(~bad).logical_and_(forced | ~torch.isin(tok, d.stop))  # stop: -1-padded
    d.called.copy_(policy & torch.isin(tok, d.close))
    d.qpos.add_(forced.long())
    d.tok.copy_(tok)
    d.t.add_(1)


def step(model, d: Decoder):
    """Steps 1-5: feed each row's last token, sample (or force) the next."""
    record(d, model(d.tok[:, None], d.cache)[:, -1])


# model -> {B: (a B-row Decoder, its tensors), "out": (Outputs, their tensors)}
_BUFFERS = weakref.WeakKeyDictionary()
_CAP = weakref.WeakKeyDictionary()  # model -> their capacity (cache slots, new tokens, output rows)
_COMPILED = {}                      # device type -> the compiled step
# device type -> generate(static=None) runs the compiled step: on CUDA always; on CPU only once
# train.py plans CPU_COMPILE_RL_STEPS untimed RL steps (infra.compiled_sampling): a compile pays
# after ~450-1,000 calls of one setting there (the demo, 20M; RESULTS.md §8).
STATIC_BY_DEFAULT = {"cuda": True}
# device types whose static K/V are views at the step's width (set_width): the batched products read
# a whole tensor in place, where a slice of a wider buffer they copy first (~1.5x the attention's
# time on CPU, RESULTS.md §15); CUDA graphs read the whole buffers at fixed addresses
VIEWS = {"cpu"}
CPU_COMPILE_RL_STEPS = 1000
_FX = torch.fx.experimental._config  # without duck sizing, 64 rows = head_dim is no special case
NO_DUCK = _FX.patch(use_duck_shape=False) if hasattr(_FX, "use_duck_shape") else nullcontext()


def compiled_step(device_type: str):
    """torch.compile of step, made once: one graph (fullgraph) over symbolic batch and width
    (dynamic), so a new batch size or width needs no recompile; on CUDA replayed as CUDA graphs
    ("reduce-overhead"), one per shape. Without duck sizing: a frame per sampling setting."""
    if device_type not in _COMPILED:
        define_packed_linear()  # the packed products' op in the trace (model.linear)
        mode = "reduce-overhead" if device_type == "cuda" else None
        fn = torch.compile(step, fullgraph=True, dynamic=True, mode=mode)

        def run(model, d):  # constant floats: a SymFloat restarts each frame's analysis (~4 s)
            dyn, before = torch._dynamo.config, torch._dynamo.config.specialize_float
            dyn.specialize_float = True  # set, not config.patch(): that costs ~60 us a step
            try:
                with NO_DUCK:
                    return fn(model, d)
            finally:
                dyn.specialize_float = before
        _COMPILED[device_type] = run
    return _COMPILED[device_type]


def reserve(model, slots: int, L: int, rows: int) -> tuple[int, int, int]:
    """The capacity (cache slots, new tokens, output rows) of the model's static buffers for a call
    that needs (slots, L, rows): at least what they hold; a call that needs more drops every set.
    The bound: power-of-two batches B <= a call's largest first batch, so < 2 x that many rows."""
    cap = _CAP.get(model, (0, 0, 0))
    need = _CAP[model] = tuple(max(a, b) for a, b in zip(cap, (slots, L, rows)))
    if need != cap:
        _BUFFERS[model] = {}
    return need


def held_rows(model) -> int:
    """Rows of KV cache the model's static batches hold (the bound above)."""
    return sum(key for key in _BUFFERS.get(model, {}) if isinstance(key, int))


def _tensors(named) -> list:
    """A buffer set's tensors in order, a cache's (k, v per layer; start, slot, cos, sin) inline."""
    out = []
    for x in named if isinstance(named, tuple) else vars(named).values():
        is_cache, is_tensor = hasattr(x, "k"), isinstance(x, torch.Tensor)
        out += [*x.k, *x.v, x.start, x.slot, x.cos, x.sin] if is_cache else [x] * is_tensor
    return out


def persistent(model, key, make):
    """make() -> a buffer set (a Decoder or Outputs), once per (model, key) at the capacity
    reserve() set; its tensors marked as static addresses without a guard (torch < 2.10's default
    guard=True made each new set a recompile)."""
    bufs = _BUFFERS.setdefault(model, {})
    if key not in bufs:
        named = make()
        bufs[key] = (named, _tensors(named))
        for x in bufs[key][1]:
            torch._dynamo.mark_static_address(x, guard=False)
    return bufs[key][0]


def batch(model, cache, sel: torch.Tensor, state: tuple, t: torch.Tensor, fixed: dict,
          static: bool) -> Decoder:
    """A batch of B = len(sel) rows: the cache rows `sel`, the row state (tok, live, rows, noise,
    queue, qpos, qlen), the position t and the call's fixed parts (outputs, stop and close ids,
    settings). Eager: new tensors (a copy of the kept cache rows); static: copied into the model's
    persistent B-row Decoder (B a power of two), whose tensors a captured graph finds at fixed
    addresses (columns past a call's L stay stale)."""
    tok, live, rows, noise, queue, qpos, qlen = state
    if not static:
        return Decoder(cache.index_rows(sel), tok, live, rows, noise, t, queue, qpos, qlen,
                       torch.zeros_like(live), **fixed)
    slots, L, _ = _CAP[model]

    def make():  # at the capacity: [B, L] noise and queue, a cache of `slots`
        z, B, kv = torch.zeros_like, len(sel), model.new_cache(len(sel), slots)
        kv.buffers = kv.k, kv.v  # set_width's
        return Decoder(kv, z(tok), z(live), z(rows), noise.new_zeros(B, L), z(t),
                       queue.new_zeros(B, L), z(qpos), z(qlen), z(live), **dict.fromkeys(fixed))
    b = persistent(model, len(sel), make)
    set_width(b.cache, cache.width, move=False)
    for dst, src in zip(b.cache.k + b.cache.v, cache.k + cache.v):  # the kept rows' K/V, per layer
        torch.index_select(src[:, :, :dst.shape[2]], 0, sel, out=dst)
    copies = ((b.cache.start, cache.start[sel]), (b.cache.slot, cache.slot), (b.tok, tok),
              (b.live, live), (b.rows, rows), (b.t, t), (b.qpos, qpos), (b.qlen, qlen))
    for dst, src in copies:
        dst.copy_(src)
    b.noise[:, :noise.shape[1]], b.queue[:, :queue.shape[1]] = noise, queue
    return dataclasses.replace(b, **fixed)


def set_width(cache, width: int, move=True):
    """A static cache's step reads `width` slots. On a device type in VIEWS its K/V become
    contiguous [B, H_kv, width, D] views of the first elements of its buffers (the filled slots
    moved there if `move`); elsewhere they stay the whole buffers, of which a step reads a slice."""
    old, cache.width = cache.k[0].shape[2], width
    if cache.k[0].device.type not in VIEWS or width == old:
        return
    n, (B, H, _, D) = min(old, width), cache.buffers[0][0].shape

    def view(c, buf):  # c's first n slots, cloned first: the two views share their memory
        new = buf.view(-1)[:B * H * width * D].view(B, H, width, D)
        if move:
            new[:, :, :n] = c[:, :, :n].clone()
        return new
    cache.k, cache.v = ([view(c, buf) for c, buf in zip(cs, bufs)]
                        for cs, bufs in zip((cache.k, cache.v), cache.buffers))

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
A captured graph reads fixed addresses: a static batch's tensors (cache, state, outputs) are made once per model
and power-of-two batch size at one capacity (reserve), kept in _BUFFERS, marked as static addresses without a guard;
a new call copies its rows into them. Bounds: fewer than 2 x the largest first batch rows held; a frame per
sampling setting (no duck sizing, no branch on the stop ids), whatever the batch sizes, widths or lengths.

  python -m pytest -q tests/test_decode.py tests/test_rollout.py       python -m tools.bench --device cuda
"""
import contextlib
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
    if u is None:  # max's index: argmax's (the first maximum; NaN counts as one), 3-4x faster on CPU
        tok = z.max(-1).indices
        return tok, z.log_softmax(-1).gather(-1, tok[:, None])[:, 0].float()
    p = z.softmax(-1)                                                                   # [B, V], 0 where z = −inf
    (B, V), K = p.shape, CDF_BLOCK
    if V <= TWO_LEVEL_ABOVE.get(z.device.type, V):
        c = p.double().cumsum_(-1)                                                      # [B, V] float64
        tok = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)[:, 0]  # u < 1, so c_V > u · c_V: in range,
        tok = tok.clamp_(max=V - 1)                                                 # and a NaN row's V clamped
        return tok, (p.gather(-1, tok[:, None])[:, 0] / c[:, -1]).log().float()
    q = p.double().mul_(2.0 ** 52).floor_()                                             # [B, V], sums < 2^53
    n = V // K * K  # full blocks, then the tail (maybe empty)
    sums = torch.cat((q[:, :n].view(B, -1, K).sum(-1), q[:, n:].sum(-1, keepdim=True)), 1)   # [B, V/K + 1]
    ends = sums.cumsum(-1)                                                              # c at each block's end
    x = (u * ends[:, -1])[:, None]                                                      # [B, 1]
    j = torch.searchsorted(ends, x, right=True).clamp_(max=sums.shape[1] - 1)           # [B, 1] the block (NaN: last)
    idx = j * K + torch.arange(K, device=q.device)                                      # [B, K] its tokens
    c = q.gather(1, idx.clamp(max=V - 1)).masked_fill_(idx >= V, 0).cumsum_(-1) + (ends - sums).gather(1, j)
    tok = (j[:, 0] * K + torch.searchsorted(c, x, right=True)[:, 0]).clamp_(max=V - 1)
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
    """Steps 2-4 from logits [B, V] (token 0 comes from the prefill's logits). A row whose logits are not finite
    (NaN or inf: its log-prob is NaN) ends there, without a token, counted in out[3]: no index error, no assert."""
    temperature, top_k, top_p, pad_id = d.settings
    u = d.noise.index_select(1, d.t.view(1))[:, 0] if temperature > 0 else None
    tok, logp = sample(filter_logits(logits, temperature, top_k, top_p), u)                 # [B], [B]
    bad = logp.isnan()                                                                      # [B]
    live = d.live & ~bad
    at = (d.rows, d.t.expand(len(d.rows)))
    for buf, x in zip(d.out, (tok.masked_fill(~live, pad_id), logp.masked_fill(~live, 0.0), live)):
        buf.index_put_(at, x)
    d.out[3].index_put_((d.rows,), (bad & d.live).long(), accumulate=True)
    d.live.logical_and_(~bad).logical_and_(~torch.isin(tok, d.stop))  # stop: padded with -1, never empty
    d.tok.copy_(tok)
    d.t.add_(1)


def step(model, d: Decoder):
    """Steps 1-4: feed each row's last token, sample the next."""
    record(d, model(d.tok[:, None], d.cache)[:, -1])


_BUFFERS = weakref.WeakKeyDictionary()  # model -> {B: (KVCache, tensors), "out": (None, tensors)}
_CAP = weakref.WeakKeyDictionary()      # model -> their capacity (cache slots, new tokens, output rows)
_COMPILED = {}                          # device type -> the compiled step
# device type -> generate(static=None) runs the compiled step. The rule: compiling pays after (compile seconds) /
# (seconds saved per call) calls of one sampling setting (a frame, compiled once per process). CUDA: always (the
# graphs save far more than they cost). CPU (inductor, 2 threads, quiet; RESULTS.md §8): the demo (0.8M, 517 RL calls
# of <= 128 rows x 56 tokens) saves 23 s of sampling after a 45 s cold compile of its two frames (~10 s warm): ~1,000
# calls to pay; 20M at the RL bench's 32 x 64 saves 0.2 s a call (1.27 -> 1.07 s) after 90 s: ~450. A one-off: never.
# So eager, unless train.py plans CPU_COMPILE_RL_STEPS untimed RL steps (~2.5 calls each: infra.compiled_sampling).
STATIC_BY_DEFAULT = {"cuda": True}
CPU_COMPILE_RL_STEPS = 1000
_FX = torch.fx.experimental._config  # without duck sizing, a batch of 64 rows = head_dim is no special case
NO_DUCK = _FX.patch(use_duck_shape=False) if hasattr(_FX, "use_duck_shape") else contextlib.nullcontext()


def compiled_step(device_type: str):
    """torch.compile of step, made once: one graph (fullgraph) over symbolic batch and width (dynamic), so a new
    batch size or width needs no recompile; on CUDA replayed as CUDA graphs ("reduce-overhead"), one per shape.
    Without duck sizing (a size equal to another is not specialised on): a frame per sampling setting."""
    if device_type not in _COMPILED:
        mode = "reduce-overhead" if device_type == "cuda" else None
        fn = torch.compile(step, fullgraph=True, dynamic=True, mode=mode)

        def run(model, d):  # float settings as constants: a SymFloat restarts each frame's analysis (~4 s a frame)
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
    """The capacity (cache slots, new tokens, output rows) of the model's static buffers for a call that needs
    (slots, L, rows): at least what they hold. A call that needs more drops every set, made again at the new
    capacity. The bound: the sets are power-of-two batches B of one capacity, B <= the largest first batch of a
    call, so they hold fewer than 2 x that many rows."""
    cap = _CAP.get(model, (0, 0, 0))
    need = _CAP[model] = tuple(max(a, b) for a, b in zip(cap, (slots, L, rows)))
    if need != cap:
        _BUFFERS[model] = {}
    return need


def held_rows(model) -> int:
    """Rows of KV cache the model's static batches hold (the bound above)."""
    return sum(key for key in _BUFFERS.get(model, {}) if isinstance(key, int))


def persistent(model, key, make):
    """make() -> (cache or None, tensors), once per (model, key) at the capacity reserve() set; the tensors marked
    as static addresses without a guard (torch < 2.10's default guard=True made each new set a recompile)."""
    bufs = _BUFFERS.setdefault(model, {})
    if key not in bufs:
        bufs[key] = make()
        for x in bufs[key][1]:
            torch._dynamo.mark_static_address(x, guard=False)
    return bufs[key]


def batch(model, d: Decoder, cache, sel: torch.Tensor, state: tuple, static: bool) -> Decoder:
    """A batch of B = len(sel) rows: the cache rows `sel`, the per-row state (tok, live, rows, noise), d's t, outputs
    and settings. Eager: new tensors (a copy of the kept cache rows); static: copied into the persistent tensors of
    a B-row batch (B a power of two; noise columns past this call's L stay stale, never read)."""
    if not static:
        return Decoder(cache.index_rows(sel), *state, d.t, d.out, d.stop, d.settings)
    slots, L, _ = _CAP[model]

    def make():
        c = model.new_cache(len(sel), slots)
        return c, c.k + c.v + [c.start, c.slot, c.cos, c.sin] + [torch.zeros_like(x) for x in (*state[:3], d.t)] + \
            [state[3].new_zeros(len(sel), L)]
    c, bufs = persistent(model, len(sel), make)
    for dst, src in zip(bufs, cache.k + cache.v):  # the kept rows' keys and values, layer by layer
        torch.index_select(src, 0, sel, out=dst)
    rest = bufs[2 * len(cache.k):]  # start, slot, cos, sin, then tok, live, rows, t, noise
    for dst, src in zip(rest[:2] + rest[4:], (cache.start[sel], cache.slot, *state[:3], d.t)):
        dst.copy_(src)
    rest[-1][:, :state[3].shape[1]] = state[3]
    c.width = cache.width
    return Decoder(c, *rest[4:7], rest[-1], rest[7], d.out, d.stop, d.settings)

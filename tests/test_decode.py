"""decode.py's static step under torch.compile on CPU (inductor, as on CUDA without the CUDA graphs): a frame budget
and a bound on the static buffers over a sequence of calls, with torch < 2.10's mark_static_address default
(guard=True) patched back in; a row of NaN logits ends its row with an in-range token instead of an index error."""
import pytest
import torch

import decode
import model
import rollout
from decode import sample
from model import ModelConfig, Transformer
from rollout import generate

STOP = (2, 7, 13)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(layers=2, tie=True):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2, intermediate_size=48,
                      max_seq_len=96, tie_embeddings=tie)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # peaked, prompt-dependent distributions: rows stop at different steps
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.3)
    return m


def chain(b: int) -> int:
    """Rows of one bucket chain: b, b/2, ..., MIN_BUCKET."""
    return b + chain(b // 2) if b >= rollout.MIN_BUCKET else 0


@pytest.mark.slow
def test_static_calls_of_varying_batch_sizes_keep_frames_and_buffers_bounded(monkeypatch):
    """An eval of 8 then 32 rows, RL batches of 64, DAPO refills of 40, 7, 28, a call over the row cap, greedy and
    sampled, stop ids or none, prompts growing, widths up to the whole cache: through inductor with guard=True as on
    torch 2.6-2.9 (before: the 9th frame raised FailOnRecompileLimitHit, and every batch size kept its own buffers).
    Now a frame per sampling setting, held KV rows within one bucket chain of the largest first batch, and the
    eager path's tokens."""
    static_address = torch._dynamo.mark_static_address
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: static_address(t, guard=guard))
    monkeypatch.setattr(rollout, "MAX_ROWS", 64)
    monkeypatch.setattr(rollout, "CHECK_EVERY", 2)
    monkeypatch.setattr(rollout, "WIDTH_STEP", {"cpu": 8})  # K/V re-laid every 8 slots (decode.set_width)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.compilation_time_metrics.clear()
    m, largest = tiny(layers=1), 0
    calls = [(8, 0.0, STOP), (32, 1.0, STOP), (64, 1.0, STOP), (40, 1.0, STOP), (7, 1.0, ()), (28, 0.0, STOP),
             (100, 1.0, STOP), (16, 1.0, (5,)), (64, 0.0, STOP), (24, 1.0, STOP)]
    for i, (N, T, stop) in enumerate(calls):
        G = 4 if N % 4 == 0 else 1
        prompts = [[1, 3 + j % 5, 4 + j % 7] * (1 + (i + j) % 3) for j in range(N // G)]
        kw = dict(temperature=T, stop_ids=stop, seed=i)
        got = generate(m, prompts, G, 10 + i % 3, static=True, **kw)
        largest = max(largest, max(rollout.MIN_BUCKET, 1 << (min(N, rollout.MAX_ROWS) - 1).bit_length()))
        assert decode.held_rows(m) <= chain(largest), (i, N, decode.held_rows(m))
        if i in (1, 6):  # the compiled step samples what the eager one does (a chunked call included)
            want = generate(m, prompts, G, 10 + i % 3, static=False, **kw)
            assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.lengths, want.lengths)
            assert (got.logprobs - want.logprobs).abs().max() < 2e-5
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    attempts = [k for k in torch._dynamo.utils.compilation_time_metrics if k.startswith("compile_attempt_")]
    torch._dynamo.reset()
    assert attempts == ["compile_attempt_0"], attempts  # each frame traced once: no restart over a float scalar
    assert frames <= 2, frames  # greedy and sampled: one frame each, whatever the batch, width, stop ids or length
    assert largest == 64 and decode.held_rows(m) <= chain(64) == 120


def test_a_wider_static_cpu_cache_keeps_its_filled_slots_in_contiguous_views_of_its_buffers():
    """decode.set_width on CPU: the K/V become [B, H_kv, width, D] views of the first elements of the buffers (read
    in place by the batched products), the filled slots moved when it grows; move=False (a batch about to be copied
    in) keeps the views' shape only."""
    m = tiny()
    cache = m.new_cache(3, 40)
    cache.buffers = cache.k, cache.v
    decode.set_width(cache, 8, move=False)
    filled = [torch.randn(3, 2, 5, 8) for _ in cache.k + cache.v]
    for c, x in zip(cache.k + cache.v, filled):
        c[:, :, :5] = x
    for width in (16, 40):
        decode.set_width(cache, width)
        assert cache.width == width
        for c, buf, x in zip(cache.k + cache.v, cache.buffers[0] + cache.buffers[1], filled):
            assert c.shape == (3, 2, width, 8) and c.is_contiguous() and c.data_ptr() == buf.data_ptr()
            assert torch.equal(c[:, :, :5], x)


@pytest.mark.skipif(not model.PACKED_GEMM, reason="oneDNN's packed GEMM: x86 CPUs")
def test_the_compiled_cpu_step_multiplies_by_the_packed_weights(monkeypatch):
    """generate(static=True) on CPU: the compiled step runs every product on oneDNN's packed weights (the custom op
    grpo::packed_linear, model.define_packed_linear: inductor lowers oneDNN's own op only for weights frozen into
    the graph); the same tokens as the eager loop, log-probs within float32 fusion rounding,
    and again after the weights change (one graph: a call's new packed copies recompile nothing). Before: static
    calls ran unpacked (plain F.linear), 1.3-1.4x slower at SmolLM2's shape."""
    monkeypatch.setattr(model, "PACK_FROM", 1)  # the tiny model's weights pack as a real model's do
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    m = tiny()
    prompts, kw = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 3, 8]], dict(stop_ids=STOP, seed=3, temperature=1.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = generate(m, prompts, 4, 9, static=True, **kw)
    calls = {e.key: e.count for e in prof.key_averages()}
    n_products = 4 * len(m.model.layers) + 1  # q/k/v, o, gate/up, down; the head
    assert calls.get("grpo::packed_linear", 0) >= 8 * n_products, calls.get("grpo::packed_linear")  # 8 steps
    assert "aten::linear" not in calls and "aten::mm" not in calls
    want = generate(m, prompts, 4, 9, static=False, **kw)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.lengths, want.lengths)
    assert (got.logprobs - want.logprobs).abs().max() < 2e-5
    with torch.no_grad():  # an optimizer step: the next call packs the new weights, in the same graph
        for p in m.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    got, want = (generate(m, prompts, 4, 9, static=static, **kw) for static in (True, False))
    assert torch.equal(got.completion_ids, want.completion_ids) and (got.logprobs - want.logprobs).abs().max() < 2e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_a_nan_row_of_logits_samples_an_in_range_token(monkeypatch):
    """sample() on a row of NaN logits (one-level and two-level search, greedy): an index in [0, V), log-prob NaN,
    the other rows untouched (before: searchsorted's V, then an index error in the gather)."""
    torch.manual_seed(0)
    for V, two_level in ((50, False), (5000, True)):
        monkeypatch.setattr(decode, "TWO_LEVEL_ABOVE", {"cpu": 1024 if two_level else V})
        z = torch.randn(3, V)
        z[1] = float("nan")
        for u in (torch.tensor([0.3, 0.5, 0.9], dtype=torch.float64), None):
            tok, lp = sample(z, u)
            assert ((0 <= tok) & (tok < V)).all() and lp[1].isnan() and lp[[0, 2]].isfinite().all()
            ok, _ = sample(z[[0, 2]], u[[0, 2]] if u is not None else None)
            assert torch.equal(tok[[0, 2]], ok)


def test_greedy_takes_the_first_of_tied_maxima():
    """Greedy sample() on rows with tied maxima (integer logits) picks the first maximum, as a Python scan does,
    at a small vocabulary and at one where the CPU reduction runs vectorized; its log-prob is log_softmax's."""
    torch.manual_seed(0)
    for V in (7, 4099):
        z = torch.randint(-4, 2, (16, V)).float()
        z[3, -1] = 9.0  # the maximum last
        tok, lp = sample(z, None)
        want = [max(range(V), key=lambda j, row=row: (row[j], -j)) for row in z.tolist()]
        assert tok.tolist() == want
        assert torch.equal(lp, z.log_softmax(-1)[torch.arange(16), tok])


def test_compiled_greedy_takes_eager_greedys_token_and_log_prob():
    """Compiled, greedy sample() takes the least index at the row's maximum (vectorised), not max's index: the same
    token and log-prob as eagerly on ties, a NaN amid finite logits, a row of NaN, +inf, a row of -inf."""
    torch.manual_seed(0)
    z = torch.randint(-4, 2, (8, 4099)).float()
    z[1, 7], z[1, 3000] = float("nan"), float("nan")
    z[2] = float("nan")
    z[3, 11], z[3, 2000] = float("inf"), float("inf")
    z[4] = float("-inf")
    z[5, -1] = 9.0
    compiled = torch.compile(sample, fullgraph=True, dynamic=True)
    for rows in (z, z[[0, 5, 6]]):
        (tok, lp), (want, want_lp) = compiled(rows, None), sample(rows, None)
        assert torch.equal(tok, want) and torch.equal(lp.isnan(), want_lp.isnan())
        assert torch.equal(lp.nan_to_num(), want_lp.nan_to_num())
    assert tok.tolist() == [max(range(4099), key=lambda j, r=r: (r[j], -j)) for r in z[[0, 5, 6]].tolist()]
    torch._dynamo.reset()


class NaNAfterPrefill(Transformer):
    """Decode steps of rows whose prompt had 2 pad slots (cache.start == 2) return NaN logits."""

    def forward(self, idx, cache=None, **kw):
        out = super().forward(idx, cache, **kw)
        return out.masked_fill((cache.start == 2)[:, None, None], float("nan")) if idx.shape[1] == 1 else out


@pytest.mark.parametrize("static", [False, True])
def test_a_row_whose_logits_turn_nan_ends_there_and_is_counted(static, monkeypatch):
    """The rows of one prompt get NaN logits from the first decode step on: they end there (one token, from the
    prefill; marked nonfinite and truncated), in range, and every row samples what it samples without the NaN."""
    monkeypatch.setattr(rollout, "compiled_step", lambda device_type: decode.step)  # the static step, uncompiled
    monkeypatch.setattr(rollout, "MIN_BUCKET", 2)
    m = tiny()
    prompts, kw = [[1, 5, 6, 7], [1, 9], [1, 4, 4]], dict(stop_ids=STOP, seed=torch.arange(9), static=static)
    clean = generate(m, prompts, 3, 12, 1.0, **kw)
    m.__class__ = NaNAfterPrefill
    r = generate(m, prompts, 3, 12, 1.0, **kw)
    bad, keep = [3, 4, 5], [0, 1, 2, 6, 7, 8]
    assert r.nonfinite.tolist() == [i in bad for i in range(9)] and r.truncated[bad].all()
    assert (r.lengths[bad] == 1).all() and torch.equal(r.completion_ids[bad, 0], clean.completion_ids[bad, 0])
    assert torch.equal(r.completion_ids[keep], clean.completion_ids[keep]) and r.logprobs.isfinite().all()
    assert torch.equal(r.lengths[keep], clean.lengths[keep]) and not clean.nonfinite.any()

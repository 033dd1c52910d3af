"""rollout.py against a naive uncached argmax loop, against itself alone, a full forward's log-probs, counted
frequencies of sampled tokens, and a pure-Python splitmix64."""
import os

import pytest
import torch
import torch.nn.functional as F

import decode
import model
import rollout
from decode import filter_logits, sample
from model import KVCache, ModelConfig, Transformer
from rollout import HeadLogProbs, completion_logprobs, generate, mix64, uniform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 23
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8], [1, 10, 11]]  # different lengths: left padding
STOP = (2, 7, 13)  # several stop ids, so rows stop at different steps and finished rows get dropped


@pytest.fixture(autouse=True)
def one_thread():  # tiny tensors: a second thread only adds synchronisation, and stalls when a core is busy
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48,
                      max_seq_len=64)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # bigger weights than the 0.02 init: peaked, prompt-dependent distributions
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.3)
    return m.to(dtype)


def full_logits(m, prompt, completion):
    """Uncached forward of prompt + completion -> the logits that predicted each completion token [len, V]."""
    with torch.no_grad():
        out = m(torch.tensor([list(prompt) + list(completion)]))[0]
    return out[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def naive_greedy(m, prompt, n, stop):
    seq, out = list(prompt), []
    for _ in range(n):  # recompute the whole sequence every step: no cache, no padding, no batch
        with torch.no_grad():
            tok = int(m(torch.tensor([seq]))[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


def rows_of(r):
    return [r.completion_ids[i, :r.lengths[i]].tolist() for i in range(len(r.lengths))]


@pytest.fixture
def index_rows_sizes(monkeypatch):
    sizes, orig = [], KVCache.index_rows
    monkeypatch.setattr(KVCache, "index_rows", lambda self, rows: sizes.append(len(rows)) or orig(self, rows))
    return sizes


def test_greedy_matches_naive_uncached_loop(index_rows_sizes):
    m = tiny()
    r = generate(m, PROMPTS, 2, 20, temperature=0, stop_ids=STOP)
    want = [naive_greedy(m, p, 20, STOP) for p in PROMPTS for _ in range(2)]
    assert rows_of(r) == want
    assert len(set(map(len, want))) >= 3  # rows stopped at different steps ...
    assert index_rows_sizes[0] == 8 and min(index_rows_sizes) < 8  # ... and finished rows were dropped
    assert torch.equal(r.lengths, torch.tensor([len(w) for w in want]))


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_row_in_batch_equals_row_alone(T, k, p, index_rows_sizes):
    m = tiny()
    r = generate(m, PROMPTS, 4, 16, T, k, p, stop_ids=STOP, seed=123)  # N = 16 rows
    assert min(index_rows_sizes) < 16  # compaction happened in the batched run
    for i in range(16):
        alone = generate(m, [PROMPTS[i // 4]], 1, 16, T, k, p, stop_ids=STOP, seed=r.seeds[i:i + 1])
        assert rows_of(alone) == rows_of(r)[i:i + 1]
        L = alone.completion_ids.shape[1]
        assert (alone.logprobs[0] - r.logprobs[i, :L]).abs().max() < 1e-5
    assert len({tuple(x) for x in rows_of(r)}) > len(PROMPTS)  # samples of one prompt differ
    again = generate(m, PROMPTS, 4, 16, T, k, p, stop_ids=STOP, seed=123)
    assert torch.equal(again.completion_ids, r.completion_ids)  # an int seed fixes the run


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7), (0, 0, 1.0)])
def test_recorded_logprobs_match_full_forward(T, k, p):
    m = tiny()
    r = generate(m, PROMPTS, 3, 12, T, k, p, stop_ids=STOP, seed=7)
    prompts = [PROMPTS[i // 3] for i in range(len(r.completion_ids))]
    trainer, ent = completion_logprobs(m, prompts, rows_of(r), T, k, p)  # the trainer's twin
    for i, comp in enumerate(rows_of(r)):
        logits = full_logits(m, PROMPTS[i // 3], comp)
        logp = filter_logits(logits, T, k, p).log_softmax(-1)  # [len, V]
        ref = logp.gather(-1, torch.tensor(comp)[:, None])[:, 0]
        assert (r.logprobs[i, :len(comp)] - ref).abs().max() < 1e-5
        assert (trainer[i, :len(comp)] - ref).abs().max() < 1e-5
        h = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)  # entropy of the sampled distribution, by hand
        assert (ent[i, :len(comp)] - h).abs().max() < 1e-4
        if (k, p) == (0, 1.0) and T in (0, 1):  # unfiltered T = 1, and greedy: the plain softmax
            plain = logits.log_softmax(-1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
            assert (r.logprobs[i, :len(comp)] - plain).abs().max() < 1e-5


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.9)])
def test_first_token_frequencies_match_filtered_softmax(T, k, p):
    m = tiny()
    prompt, n = [1, 4, 9], 4000
    with torch.no_grad():
        z = m(torch.tensor([prompt]))[0, -1] / T  # the distribution, computed here by hand
    keep = torch.ones(V, dtype=torch.bool)
    if k:
        keep &= z >= z.sort(descending=True).values[k - 1]
    if p < 1:
        order = z.masked_fill(~keep, float("-inf")).argsort(descending=True)
        probs = z.masked_fill(~keep, float("-inf")).softmax(-1)[order]
        before = torch.cat((torch.zeros(1), probs.cumsum(0)[:-1]))
        keep[order[before >= p]] = False
    want = z.masked_fill(~keep, float("-inf")).softmax(-1)
    r = generate(m, [prompt], n, 1, T, k, p, seed=0)
    counts = torch.bincount(r.completion_ids[:, 0], minlength=V).float()
    assert counts[~keep].sum() == 0  # never outside the top-k / nucleus
    e = n * want[keep]
    chi2 = ((counts[keep] - e) ** 2 / e).sum().item()
    assert chi2 < 3 * int(keep.sum()) + 10, chi2  # mean is #kept − 1; this bound is far in the tail
    assert (r.logprobs[:, 0] - want.log()[r.completion_ids[:, 0]]).abs().max() < 1e-5


def test_inverse_cdf_edges_never_pick_a_filtered_token():
    z = torch.tensor([0.0, 1, 0, 2, 3, 0]).log().repeat(5, 1)  # probabilities 0, 1/6, 0, 2/6, 3/6, 0
    u = torch.tensor([2.0 ** -53, 0.16, 0.17, 0.5 + 1e-9, 1 - 2.0 ** -53], dtype=torch.float64)
    tok, lp = sample(z, u)
    assert tok.tolist() == [1, 1, 3, 4, 4]  # the extremes of u land on the first and last kept tokens
    assert torch.allclose(lp, torch.tensor([1 / 6, 1 / 6, 2 / 6, 3 / 6, 3 / 6]).log(), atol=1e-6)
    keys = torch.tensor([0, -1, 1 << 62, -(1 << 63)])  # extreme bit patterns stay strictly inside (0, 1)
    assert ((uniform(keys) > 0) & (uniform(keys) < 1)).all()


def test_mask_lengths_truncated_are_consistent():
    m = tiny()
    r = generate(m, PROMPTS, 4, 10, 1.0, stop_ids=STOP, seed=3, pad_id=0)
    N, L = r.completion_ids.shape
    assert N == 16 and L == r.lengths.max() <= 10
    assert r.truncated.any() and not r.truncated.all()  # the test sees both kinds of rows
    for i in range(N):
        n = int(r.lengths[i])
        assert torch.equal(r.completion_mask[i], torch.arange(L) < n)
        ids = r.completion_ids[i, :n].tolist()
        assert not any(t in STOP for t in ids[:-1])  # no stop id before the last token
        assert r.truncated[i] == (ids[-1] not in STOP) and (n == 10 or not r.truncated[i])
        assert (r.completion_ids[i, n:] == 0).all() and (r.logprobs[i, n:] == 0).all()
        assert (r.logprobs[i, :n] < 0).all()
    assert r.completion_mask.dtype == torch.bool and r.logprobs.dtype == torch.float32


@pytest.mark.parametrize("G", [2, 8])
def test_each_prompt_is_prefilled_once(G, monkeypatch):
    m = tiny()
    shapes, forward = [], m.forward
    monkeypatch.setattr(m, "forward", lambda idx, *a, **kw: shapes.append(tuple(idx.shape)) or forward(idx, *a, **kw))
    r = generate(m, PROMPTS, G, 6, 1.0, seed=1)
    assert shapes[0] == (4, 7)  # P prompts, S = longest prompt: not N = P·G rows
    assert all(s[1] == 1 for s in shapes[1:]) and len(shapes) == 6  # then one token per row per step
    assert r.completion_ids.shape == (4 * G, 6) and r.truncated.all()  # no stop ids: every row runs to the end


def test_seed_none_draws_from_torch_generator():
    m = tiny()
    torch.manual_seed(5)
    a = generate(m, PROMPTS, 2, 8, seed=None)
    torch.manual_seed(5)
    b = generate(m, PROMPTS, 2, 8, seed=None)
    assert torch.equal(a.seeds, b.seeds) and torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(generate(m, PROMPTS, 2, 8, seed=1).seeds, generate(m, PROMPTS, 2, 8, seed=2).seeds)


def test_mix64_is_splitmix64():
    def ref(x):  # the published finaliser on Python ints mod 2^64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2 ** 64
        return x ^ (x >> 31)
    xs = [0, 1, 12345, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 0x9E3779B97F4A7C15]
    got = mix64(torch.tensor([x - 2 ** 64 if x >= 2 ** 63 else x for x in xs]))
    assert [g % 2 ** 64 for g in got.tolist()] == [ref(x) for x in xs]


@pytest.mark.parametrize("kw,match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1] * 60]), "max_seq_len"),
    (dict(prompts=[[1, 99]]), "vocab_size"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(num_samples=0), "num_samples"),
    (dict(seed=torch.zeros(3, dtype=torch.long)), "seed"),
])
def test_bad_inputs_raise(kw, match):
    args = dict(prompts=[[1, 2]], num_samples=2, max_new_tokens=8) | kw
    with pytest.raises(ValueError, match=match):
        generate(tiny(), **args)


def test_bfloat16_model_runs():
    m = tiny(torch.bfloat16)
    r = generate(m, PROMPTS, 3, 8, 1.0, top_p=0.95, stop_ids=STOP, seed=0)
    assert r.completion_ids.shape[0] == 12 and r.logprobs.dtype == torch.float32
    assert torch.isfinite(r.logprobs).all() and (r.logprobs[r.completion_mask] < 0).all()
    g = generate(m, PROMPTS, 1, 8, 0.0, stop_ids=STOP)
    assert torch.isfinite(g.logprobs).all()


@pytest.mark.skipif(not model.PACKED_GEMM, reason="oneDNN's packed GEMM: x86 CPUs")
def test_the_eager_loop_multiplies_by_packed_weights_and_leaves_none(linear_calls):
    """On this CPU every product of generate's eager loop (prefill, decode, the head) runs on the weights
    packed for oneDNN (model.Transformer.packed), so the checks above against plain forwards test that
    path (test_tooluse: the loop with tools); afterwards nothing stays packed."""
    m = tiny()  # every weight packable here (linear_calls); by default >= 2^17 elements
    r = generate(m, PROMPTS, 2, 8, 1.0, stop_ids=STOP, seed=0)
    # a forward a token: 2 layers x 4 (q, k, v in one product, o, gate and up in one, down) + the head
    assert all(linear_calls) and len(linear_calls) == 9 * int(r.lengths.max())
    assert all("packed" not in vars(x) for x in m.modules())


def test_inference_mode_samples_what_no_grad_samples():
    m = tiny()
    with torch.inference_mode():
        a = generate(m, PROMPTS, 3, 8, 0.8, 5, 0.9, stop_ids=STOP, seed=3)
    b = generate(m, PROMPTS, 3, 8, 0.8, 5, 0.9, stop_ids=STOP, seed=3)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.lengths.min() < 8  # some rows stopped, so compaction ran under inference mode too


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7), (0, 0, 1.0)])
def test_completion_logprobs_equal_the_full_logits_path_in_values_and_gradients(T, k, p):
    """completion_logprobs() (LM head at completion tokens only, chunked, recomputed in backward) against the
    plain path: every position's full-vocabulary logits, filtered, log-softmaxed; float64, so tolerances are tight."""
    m = tiny().double()
    r = generate(m, PROMPTS, 2, 10, T, k, p, stop_ids=STOP, seed=3)
    comps, prompts = rows_of(r), [PROMPTS[i // 2] for i in range(len(r.completion_ids))]
    w = torch.randn(len(comps), max(map(len, comps)), dtype=torch.float64)  # a random upstream gradient
    lp, _ = completion_logprobs(m, prompts, comps, T, k, p)
    (lp * w).sum().backward()
    agrees_with_one_forward_per_row(m, prompts, comps, lp, w, T, k, p)


def agrees_with_one_forward_per_row(m, prompts, comps, lp, w, T=1.0, k=0, p=1.0):
    """lp (completion_logprobs, after the backward of (lp * w).sum()) against the plain path, one full forward per row
    (float64): every log-prob, and every parameter's gradient, within 1e-10."""
    ours = [q.grad.clone() for q in m.parameters()]
    m.zero_grad()
    total = 0
    for i, (q, c) in enumerate(zip(prompts, comps)):
        logits = m(torch.tensor([q + c]))[0, len(q) - 1:len(q) - 1 + len(c)]        # [len, V]
        ref = filter_logits(logits, T, k, p).log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        assert (lp[i, :len(c)] - ref).abs().max() < 1e-10 and (lp[i, len(c):] == 0).all()
        total = total + (ref * w[i, :len(c)]).sum()
    total.backward()
    for a, q in zip(ours, m.parameters()):
        assert (a - q.grad).abs().max() < 1e-10


@pytest.mark.parametrize("order", ["groups", "interleaved", "split", "one_token"])
def test_a_shared_prompt_runs_once_and_changes_no_log_prob_or_gradient(order):
    """model.Prefix: rows that continue one prompt share its forward. Against a naive loop of one full forward per
    row (float64, tight): every log-prob and every parameter's gradient, with a group's rows together, interleaved
    with other groups', a group split (a micro-batch that holds part of it), and one-token completions (T = 0);
    and the prompt's tokens go through the model once, not once per row."""
    m = tiny().double()
    r = generate(m, PROMPTS, 3, 10, 1.0, stop_ids=STOP, seed=5)
    comps, prompts = rows_of(r), [PROMPTS[i // 3] for i in range(len(r.lengths))]
    pick = {"groups": range(12), "interleaved": [0, 3, 6, 1, 9, 4, 2, 10, 7], "split": [1, 2, 3, 4, 5, 11],
            "one_token": range(12)}[order]
    prompts, comps = [prompts[i] for i in pick], [comps[i] for i in pick]
    if order == "one_token":
        comps = [c[:1] for c in comps]
    seen = []
    hook = m.model.embed_tokens.register_forward_hook(lambda mod, i, out: seen.append(i[0].numel()))
    w = torch.randn(len(comps), max(map(len, comps)), dtype=torch.float64)  # a random upstream gradient
    lp, _ = completion_logprobs(m, prompts, comps, 1.0)
    hook.remove()
    (lp * w).sum().backward()
    agrees_with_one_forward_per_row(m, prompts, comps, lp, w)
    distinct = {tuple(p) for p in prompts}
    S, T = max(map(len, distinct)), max(map(len, comps)) - 1
    assert seen == [len(distinct) * S + len(comps) * T]  # each distinct prompt once (left-padded to S)
    assert len(distinct) < len(prompts)


def test_head_log_probs_do_not_depend_on_the_chunk():
    torch.manual_seed(0)
    h, w = torch.randn(7, 8, dtype=torch.float64, requires_grad=True), torch.randn(11, 8, dtype=torch.float64)
    w.requires_grad_(True)
    t = torch.randint(0, 11, (7,))
    outs = []
    for chunk in (1, 3, 100):
        lp, ent = HeadLogProbs.apply(h, w, t, 0.8, 0, 1.0, chunk)
        gh, gw = torch.autograd.grad((lp * torch.arange(7.0, dtype=torch.float64)).sum(), (h, w))
        outs.append((lp, ent, gh, gw))
    z = (h @ w.T / 0.8).log_softmax(-1)  # the dense reference
    assert torch.allclose(outs[0][0], z.gather(-1, t[:, None])[:, 0], atol=1e-12)
    assert torch.allclose(outs[0][1], -(z.exp() * z).sum(-1), atol=1e-12)
    for o in outs[1:]:
        assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(o, outs[0]))


def test_head_log_probs_backward_runs_its_gemms_in_the_weights_bf16():
    """bf16 h and W (FSDP's compute dtype on GPU): backward's two GEMMs per chunk run in bf16 (before: the weight
    gradient as a float32 GEMM, slow on a GPU at V = 151,936), and log-probs and both gradients stay within bf16
    rounding of a float64 reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                seen.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))
    torch.manual_seed(0)
    h64, w64, t = torch.randn(40, 32, dtype=torch.float64), torch.randn(3000, 32, dtype=torch.float64) / 8, \
        torch.randint(0, 3000, (40,))
    g = torch.randn(40, dtype=torch.float64)
    grads = []
    for x, wt in ((h64, w64), (h64.bfloat16(), w64.bfloat16())):
        x, wt, seen = x.clone().requires_grad_(), wt.clone().requires_grad_(), set()
        lp, _ = HeadLogProbs.apply(x, wt, t, 1.0, 0, 1.0, 16)
        with MatmulDtypes():
            (lp * g.to(lp.dtype)).sum().backward()
        grads.append((lp.double(), x.grad.double(), wt.grad.double(), seen))
    (lp, gh, gw, _), (lp16, gh16, gw16, seen16) = grads
    assert seen16 == {torch.bfloat16}, seen16
    assert (lp16 - lp).abs().max() < 0.05
    for a, b in ((gh16, gh), (gw16, gw)):
        assert (a - b).norm() / b.norm() < 2e-2


def test_cpu_bf16_runs_the_layers_products_in_bf16_and_the_lm_head_forward_in_float32(monkeypatch):
    """rollout.BF16 with "cpu" (train.py's cpu_bf16): completion_logprobs' forward and backward run the layers'
    matrix products in bf16, attention's scores in float32 and its product with v in bf16 (model.attention), the
    chunked LM head's forward in float32 (MiniMax-M1 §3.2's fp32 head: the log-probs of the ratio and of the sampler
    gap) and its backward in bf16 (as the layers' backward), while the weights and their gradients stay float32. Against the standard path (autocast over the body, then the head's
    logits in float32, attention written plainly, one full forward per row, autograd's backward): log-probs and
    gradients far nearer it than the float32 path is. Without it: float32 throughout."""
    from torch.utils._python_dispatch import TorchDispatchMode
    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    class ProductDtypes(TorchDispatchMode):  # (the head's (an operand with a vocabulary-sized dimension), attention's
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # (batched) or a layer's, dtype)
            if func in PRODUCTS:
                head = any(V in a.shape for a in args if isinstance(a, torch.Tensor))
                batched = func not in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                seen.add(("head" if head else "attention" if batched else "layer", args[0].dtype))
            return func(*args, **(kwargs or {}))
    m = tiny()
    r = generate(m, PROMPTS, 3, 10, 0.8, stop_ids=STOP, seed=3)
    comps, prompts = rows_of(r), [PROMPTS[i // 3] for i in range(len(r.lengths))]
    w = torch.randn(len(comps), max(map(len, comps)))  # a random upstream gradient
    out = []
    for devices in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(rollout, "BF16", devices)
        m.zero_grad()
        seen = fwd = set()
        with ProductDtypes():
            lp, ent = completion_logprobs(m, prompts, comps, 0.8)
            seen = set()
            (lp * w).sum().backward()
        seen = fwd, seen
        assert lp.dtype == ent.dtype == torch.float32
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in m.parameters())
        out.append((seen, lp.detach(), ent, [p.grad.clone() for p in m.parameters()]))
    (seen32, lp32, ent32, g32), (seen16, lp16, ent16, g16) = out
    f32, b16 = torch.float32, torch.bfloat16
    # (forward's, backward's) products: (whose, dtype)
    assert seen32 == ({("head", f32), ("attention", f32), ("layer", f32)},) * 2, seen32
    assert seen16 == ({("head", f32), ("attention", f32), ("attention", b16), ("layer", b16)},
                      {("head", b16), ("attention", f32), ("attention", b16), ("layer", b16)}), seen16
    m.zero_grad()

    def sdpa(q, k, v, mask=None, is_causal=False, enable_gqa=False):  # the arithmetic model.attention should do
        assert mask is None and is_causal
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
        with torch.autocast("cpu", enabled=False):  # float32 scores and softmax, then v's dtype
            s = q.float() @ k.float().transpose(-1, -2) / q.shape[-1] ** 0.5
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            return s.softmax(-1).to(v.dtype) @ v
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)  # the reference's attention
    total, ref = 0, torch.zeros_like(lp16)
    for i, (q, c) in enumerate(zip(prompts, comps)):
        with torch.autocast("cpu", torch.bfloat16):
            h, head = m(torch.tensor([q + c]), head=lambda h, w: (h, w))
        logits = F.linear(h[0, len(q) - 1:len(q) - 1 + len(c)].float(), head)                      # [len, V] fp32
        ref[i, :len(c)] = filter_logits(logits, 0.8).log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        total = total + (ref[i, :len(c)] * w[i, :len(c)]).sum()
    total.backward()
    gref = [p.grad for p in m.parameters()]
    # bf16 moves the tiny model's large logits (up to ~20) by up to ~0.1; the two bf16 paths are nearer each other
    # than either is to float32 (their shapes differ: rounding may differ, not the arithmetic). Measured: log-probs
    # 1e-8 against 0.011 mean; gradients 0.5-1.5% against 1.9-6.2%
    assert (lp16 - ref).abs().mean() < (lp16 - lp32).abs().mean() / 4 and (lp16 - lp32).abs().max() < 0.3
    assert (ent16 - ent32).abs().max() < 0.3
    for a, b, c in zip(g16, gref, g32):
        assert (a - b).norm() / b.norm() < min(0.02, (a - c).norm() / c.norm() / 1.4) and (a - c).norm() / c.norm() < 0.1


@pytest.mark.parametrize("native", [True, False])
def test_cpu_bf16_is_a_setting_of_the_run(monkeypatch, capsys, native):
    """train.build_run puts "cpu" in rollout.BF16 for cpu_bf16 = true, and for auto where the CPU has bf16
    instructions (oneDNN's check), and takes it out for false (the default) and auto on other CPUs; true on those
    says it will be slower. With it on, the run samples from a bf16 copy of the float32 policy (CUDA's way), which
    an RL step refreshes; off, from the policy itself."""
    import train
    monkeypatch.setattr(rollout, "BF16", {"cuda"})
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    args = ["--config", os.path.join(ROOT, "configs", "smoke.toml"), "--device=cpu", "--wandb_mode=disabled"]
    for setting, on in (("true", True), ("false", False), ("auto", native), ("true", True), ("", False)):
        run = train.build_run(train.parse_args(args + ([f"--cpu_bf16={setting}"] if setting else [])))
        assert rollout.BF16 == ({"cuda", "cpu"} if on else {"cuda"}), setting
        assert next(run.model.parameters()).dtype == torch.float32
        assert (run.sampler is not None and next(run.sampler.parameters()).dtype) == (on and torch.bfloat16)
    run = train.build_run(train.parse_args(args + ["--cpu_bf16=true", "--dynamic_sampling=false",
                                                    "--weight_decay=0.5"]))  # decay moves it, any reward
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    opt, sched = train.make_optimizer(run, 1e-2, 10)
    train.rl_step(run, opt, sched, train.TrainState(), 5)  # samples from the copy, then updates the policy
    assert train.infra.sampling(run.sampler, run.model) is run.sampler  # refreshed before it samples again
    moved = [k for k, v in run.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) > 5
    for (name, p), q in zip(run.model.named_parameters(), run.sampler.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.detach().bfloat16()), name
    assert ("runs slower than float32" in capsys.readouterr().out) == (not native)


def one_level(z, u):
    """The reference search: the same probabilities on the 2^-52 grid, one cumsum over the whole vocabulary."""
    c = (z.softmax(-1).double() * 2.0 ** 52).floor().cumsum(-1)
    return torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)[:, 0]


@pytest.mark.parametrize("V", [5, 1024, 3000, 4096])
def test_two_level_cdf_picks_the_one_level_token(V, monkeypatch):
    """The two-level search against one cumsum over the same rounded probabilities, for u on, just below and just
    above every tested cumulative value: adversarial rows (all mass on one token, ties, a kept set of one, zero
    blocks and zeros on both sides of every block edge, a tail block)."""
    monkeypatch.setattr(decode, "CDF_BLOCK", 16 if V == 5 else 256)  # V = 5: the tail block only
    monkeypatch.setattr(decode, "TWO_LEVEL_ABOVE", {"cpu": 0})  # two levels on CPU too
    torch.manual_seed(V)
    K, inf = decode.CDF_BLOCK, float("-inf")
    rows = [torch.randn(V), torch.full((V,), inf).index_fill(0, torch.tensor([V - 1]), 0.0),  # mass in one token
            torch.zeros(V), torch.randn(V).round(),                                          # ties everywhere
            torch.full((V,), inf).index_fill(0, torch.tensor([0]), 3.0),                     # a kept set of one
            torch.randn(V) * 30]                                                             # nearly one-hot
    edges = torch.randn(V)  # whole blocks of zeros, and zeros on each side of every block edge
    edges[(torch.arange(V) % K == 0) | (torch.arange(V) % K == K - 1) | (torch.arange(V) // K % 2 == 1)] = inf
    z = torch.stack(rows + [edges, torch.where(torch.arange(V) % 2 == 0, 0.0, inf)])          # [R, V]
    R = len(z)
    c = (z.softmax(-1).double() * 2.0 ** 52).floor().cumsum(-1)
    # u on every cumulative value, just below and above it, and at the extremes of the uniforms
    at = (c[:, torch.linspace(0, V - 1, min(V, 40)).long()] / c[:, -1:]).T                   # [40, R]
    us = torch.cat([at, at.nextafter(torch.zeros(())), at.nextafter(torch.ones(())),
                    torch.rand(200, R, dtype=torch.float64), torch.full((1, R), 2.0 ** -53),
                    torch.full((1, R), 1 - 2.0 ** -53)]).clamp(2.0 ** -53, 1 - 2.0 ** -53)
    for u in us:
        tok, lp = sample(z, u)
        assert torch.equal(tok, one_level(z, u))
        assert torch.isfinite(z.gather(1, tok[:, None])).all()  # never a filtered token
        assert torch.allclose(lp, z.log_softmax(-1).gather(1, tok[:, None])[:, 0], atol=1e-5)


@pytest.fixture
def static_sizes(monkeypatch):
    """The static step run as plain PyTorch (its shapes and arithmetic, no compiler): the batch size of each call;
    buckets halve down to 2 rows, the host looks every 3 steps, attention reads slots in chunks of 8 as on CUDA
    (the slots past the filled ones: masked, and stale after a first call)."""
    sizes = []
    monkeypatch.setattr(rollout, "compiled_step", lambda device_type: lambda m, d: sizes.append(len(d.tok)) or
                        decode.step(m, d))
    monkeypatch.setattr(rollout, "MIN_BUCKET", 2)
    monkeypatch.setattr(rollout, "CHECK_EVERY", 3)
    monkeypatch.setattr(rollout, "WIDTH_STEP", {"cpu": 8})
    return sizes


@pytest.mark.parametrize("T,k,p", [(0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_static_step_samples_what_the_eager_path_samples(T, k, p, static_sizes):
    """Same tokens, mask, truncation and log-probs (float32), left-padded prompts of 2-7 tokens, GQA, rows stopping
    at different steps; finished rows stay in the captured batch, which halves only at host checks."""
    m = tiny()
    for G in (1, 4):
        static_sizes.clear()
        eager = generate(m, PROMPTS, G, 24, T, k, p, stop_ids=STOP, seed=11)
        static = generate(m, PROMPTS, G, 24, T, k, p, stop_ids=STOP, seed=11, static=True)
        assert rows_of(static) == rows_of(eager) and static.completion_ids.shape == eager.completion_ids.shape
        assert torch.equal(static.completion_mask, eager.completion_mask)
        assert torch.equal(static.truncated, eager.truncated) and torch.equal(static.lengths, eager.lengths)
        assert (static.logprobs - eager.logprobs).abs().max() < 2e-5
        assert static_sizes[0] == 4 * G and set(static_sizes) <= {16, 8, 4, 2}
        changes = [i for i in range(1, len(static_sizes)) if static_sizes[i] != static_sizes[i - 1]]
        assert all(static_sizes[i] < static_sizes[i - 1] and (i + 1) % 3 == 0 for i in changes)  # call i: step i + 1
    assert len(set(eager.lengths.tolist())) >= 3 and min(static_sizes) < 16  # rows stopped apart; batches halved
    ptrs = {key: [x.data_ptr() for x in v[1]] for key, v in decode._BUFFERS[m].items()}
    again = generate(m, PROMPTS, 4, 24, T, k, p, stop_ids=STOP, seed=11, static=True)
    assert rows_of(again) == rows_of(eager)  # a second call runs in the same buffers: a captured graph's addresses
    assert ptrs == {key: [x.data_ptr() for x in v[1]] for key, v in decode._BUFFERS[m].items()}


def test_the_default_loop_is_the_device_s_entry_in_static_by_default(static_sizes, monkeypatch):
    """generate(static=None) runs the static step where decode.STATIC_BY_DEFAULT says so (CUDA), else eagerly (CPU:
    compiling does not pay for the demo), the same tokens either way."""
    m = tiny()
    eager = generate(m, PROMPTS, 2, 12, 1.0, stop_ids=STOP, seed=3)
    assert static_sizes == [] and not decode.STATIC_BY_DEFAULT.get("cpu", False)
    monkeypatch.setitem(decode.STATIC_BY_DEFAULT, "cpu", True)
    static = generate(m, PROMPTS, 2, 12, 1.0, stop_ids=STOP, seed=3)
    assert static_sizes and rows_of(static) == rows_of(eager)


def test_static_step_compiles_to_one_graph(monkeypatch):
    """torch._dynamo.explain of the decode step: one graph, no graph break; then the step traced by dynamo
    (backend "eager": dynamo's graph without inductor, seconds on CPU) samples what the eager path samples."""
    m, seen = tiny(), []
    torch._dynamo.reset()
    compiled = torch.compile(decode.step, fullgraph=True, dynamic=True, backend="eager")

    def run(model, d):  # explain runs the step it traces: the first step is explain's
        if seen:
            return compiled(model, d)
        seen.append(torch._dynamo.explain(decode.step)(model, d))
        torch._dynamo.reset()  # else the compiled step would reuse explain's cached code, unchecked for breaks
    monkeypatch.setattr(rollout, "compiled_step", lambda device_type: run)
    monkeypatch.setattr(rollout, "MIN_BUCKET", 2)
    eager = generate(m, PROMPTS, 4, 20, 0.9, 6, 1.0, stop_ids=STOP, seed=2)
    static = generate(m, PROMPTS, 4, 20, 0.9, 6, 1.0, stop_ids=STOP, seed=2, static=True)
    torch._dynamo.reset()
    assert seen[0].graph_count == 1 and seen[0].graph_break_count == 0, seen[0].break_reasons
    assert rows_of(static) == rows_of(eager) and (static.logprobs - eager.logprobs).abs().max() < 2e-5


@pytest.mark.parametrize("family,base,ends", [("llama", False, ("<|end_of_text|>", "<|eot_id|>")),
                                              ("qwen", True, ("<|endoftext|>",))])
def test_command_line_stops_at_the_checkpoints_own_end_tokens(hf_folder, monkeypatch, capsys, family, base, ends):
    """python rollout.py --ckpt DIR: the stop ids are the folder's (generation_config.json's eos_token_id), not
    the tokens of rollout.STOP_NAMES it holds: a base Qwen2.5 has <|im_end|> but does not stop at it; Llama 3's
    <|end_of_text|> is no stop name."""
    import json
    import os
    import sys

    import rollout
    from tokenizers import Tokenizer
    folder, seen = hf_folder(family, base=base), {}
    expected = json.load(open(os.path.join(folder, "generation_config.json")))["eos_token_id"]
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert sorted(expected if isinstance(expected, list) else [expected]) == sorted(map(tok.token_to_id, ends))
    monkeypatch.setattr(rollout, "generate", lambda *a, **kw: seen.update(kw) or generate(*a, **kw))
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--ckpt", folder, "--prompt", "Natalia sold", "--n", "2",
                                      "--max_new_tokens", "3", "--threads", "1"])
    rollout.main()
    assert sorted(seen["stop_ids"]) == sorted(map(tok.token_to_id, ends)) and "tokens/s" in capsys.readouterr().out

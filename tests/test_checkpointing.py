"""Activation checkpointing (Transformer.checkpointing, set by train.build_run from
memory.resolve): each decoder block rerun in backward, not its activations kept; the same loss and
gradients, bit for bit, on one process and under 2-rank FSDP2; the saved activations shrink;
sampling never recomputes."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import records

import infra
import model
import train
from model import ModelConfig, Transformer
from rollout import completion_logprobs, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
CFG = ModelConfig(vocab_size=40, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)
# prompts and completions of different lengths: completion_forward's padded batch
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 8, 12, 3, 2], [1, 20, 21]]
COMPLETIONS = [[10, 11, 12, 2], [13, 2], [14, 15, 16, 17, 18, 2], [19]]


@pytest.fixture
def calls(monkeypatch):
    """How many times a decoder block ran (forward, or its recompute in backward)."""
    n = [0]

    def counted(*args, **kwargs):
        n[0] += 1
        return forward(*args, **kwargs)
    forward = model.Block.forward
    monkeypatch.setattr(model.Block, "forward", counted)
    return n


def small_model(seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CFG)


def loss_of(m: Transformer, path: str) -> torch.Tensor:
    """A loss over the batch: the trainer's completion_logprobs (right-padded rows, plain causal
    mask), or a left-padded batch through forward(start=...) (the padding mask)."""
    if path == "completion_logprobs":
        logp, _ = completion_logprobs(m, PROMPTS, COMPLETIONS, 1.0)                   # [n, L]
        return -(logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum()
    rows = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    T = max(map(len, rows))
    start = torch.tensor([T - len(r) for r in rows])
    idx = torch.tensor([[0] * (T - len(r)) + r for r in rows])                        # [n, T]
    logits = m(idx, start=start)                                                      # [n, T, V]
    return logits.log_softmax(-1)[:, :-1].gather(-1, idx[:, 1:, None]).sum().neg()


@pytest.mark.parametrize("path", ["completion_logprobs", "left_padded"])
def test_checkpointing_gives_the_same_loss_and_gradients(calls, path):
    """float32 on CPU: the recompute runs the same kernels on the same inputs, so the loss and every
    parameter's gradient are bitwise those without checkpointing; on, backward reruns each block."""
    m = small_model()
    results = {}
    for on in (False, True):
        m.checkpointing, calls[0] = on, 0
        m.zero_grad(set_to_none=True)
        loss = loss_of(m, path)
        assert calls[0] == CFG.n_layers
        loss.backward()
        assert calls[0] == CFG.n_layers * (2 if on else 1), (on, calls[0])
        results[on] = loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}
    (loss_off, grads_off), (loss_on, grads_on) = results[False], results[True]
    assert torch.equal(loss_on, loss_off), (loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) == len(list(m.parameters()))
    for k in grads_off:
        assert torch.equal(grads_on[k], grads_off[k]), (k, (grads_on[k] - grads_off[k]).abs().max())


def test_no_recompute_without_a_backward(calls):
    """Copies and loaded models default to off; with it on, no_grad forwards, KV-cached sampling and
    a cached prefill run the blocks as before (no checkpoint, the same logits and tokens)."""
    m = small_model()
    assert Transformer.checkpointing is False and m.checkpointing is False
    assert infra.frozen_copy(m, torch.device("cpu")).checkpointing is False
    idx = torch.tensor([p + c for p, c in zip(PROMPTS[:1], COMPLETIONS[:1])])
    seeds = torch.arange(8)
    with torch.no_grad():
        want_logits = m(idx)
    want = generate(m, PROMPTS, 2, 6, 1.0, seed=seeds)
    m.checkpointing = True
    with torch.no_grad():
        got_logits = m(idx)
    got = generate(m, PROMPTS, 2, 6, 1.0, seed=seeds)
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    # a cached prefill with autograd on: the cache's path, no block rerun in backward
    calls[0] = 0
    prefill = m(idx, cache=m.new_cache(1, CFG.max_seq_len))
    prefill.sum().backward()
    assert calls[0] == CFG.n_layers and torch.equal(prefill.detach(), want_logits)


def saved_bytes(m: Transformer) -> int:
    """Bytes of the tensors autograd saves for backward during one completion_logprobs forward:
    each storage once, parameters not counted (they are kept either way)."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(m, "completion_logprobs")
    return sum(seen.values())


def test_checkpointing_shrinks_the_saved_activations():
    """4 blocks: off, every block's intermediates (norms, q/k/v, attention, the SwiGLU's hidden
    states) are saved; on, each block's input, the shared RoPE tables, the final norm and head."""
    m = small_model()
    m.checkpointing = False
    off = saved_bytes(m)
    m.checkpointing = True
    on = saved_bytes(m)
    print(f"saved activations, 4 blocks: off {off} B, on {on} B ({on / off:.3f})")
    assert on < off / 3, (on, off)


def deterministic(recs):  # timings differ from run to run; everything else must not
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in recs]


def test_training_with_activation_checkpointing_logs_the_same_metrics(tmp_path, calls):
    """train.main's own path (build_run, memory.resolve, model.checkpointing): one SFT step and
    one RL step log the same metrics with --activation_checkpointing=true as with false; the true
    run reruns blocks in its backwards (the same samples: sampling never recomputes)."""
    recs, counts = {}, {}
    for on in ("false", "true"):
        calls[0] = 0
        out = tmp_path / on
        train.main(train.parse_args(["--config", SMOKE, f"--out_dir={out}", "--threads=1",
                                     f"--activation_checkpointing={on}", "--n_layers=2",
                                     "--sft_steps=1", "--rl_steps=1", "--eval_n=4",
                                     "--ckpt_every=0", "--overlong_buffer=24"]))
        recs[on], counts[on] = deterministic(records(out)), calls[0]
    assert counts["true"] > counts["false"], counts
    assert any(r["stage"] == "rl" and "train/grad_norm" in r for r in recs["true"]), recs["true"]
    assert recs["true"] == recs["false"]


WORKER = r"""
import sys
import torch
import infra
import model
from model import ModelConfig, Transformer
from rollout import completion_logprobs

proc = infra.setup("cpu")
calls = [0]  # a decoder block's forwards, recomputes in backward included
forward = model.Block.forward


def counted(*args, **kwargs):
    calls[0] += 1
    return forward(*args, **kwargs)


model.Block.forward = counted
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=40, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)
policy = infra.shard(Transformer(cfg), proc)  # FSDP2: each block, then the root (train.build_run)
g = torch.Generator().manual_seed(proc.rank)  # each rank its own rows
prompts = [[1] + torch.randint(3, 40, (n,), generator=g).tolist() for n in (3, 6, 1)]
comps = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (5, 2, 7)]
grads = {}
for on in (False, True):
    policy.checkpointing, calls[0] = on, 0
    policy.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(policy, prompts, comps, 1.0)
    (-logp.sum() * proc.world).backward()  # FSDP2 reduce-scatters the mean: train.py's scaling
    assert calls[0] == cfg.n_layers * (2 if on else 1), (on, calls[0])
    grads[on] = {k: p.grad.to_local().clone() for k, p in policy.named_parameters()}
bad = [k for k in grads[False] if not torch.equal(grads[True][k], grads[False][k])]
assert not bad and len(grads[True]) == len(list(policy.parameters())), bad
print(f"rank {proc.rank}: {len(grads[True])} gradient shards equal", flush=True)
infra.teardown()
"""


@pytest.mark.slow
def test_fsdp2_gradients_with_checkpointing_equal_those_without(tmp_path):
    """Two gloo ranks, FSDP2 as infra.shard applies it: each checkpointed block is rerun in
    backward after FSDP2's pre-backward all-gather of its weights, and every rank's gradient shards
    equal those without checkpointing, bit for bit."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", str(tmp_path / "worker.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("gradient shards equal") == 2, p.stdout

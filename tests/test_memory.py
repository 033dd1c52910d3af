"""memory.py's formulas against what the code allocates, on CPU at a small shape (hidden 64, 3 layers,
GQA 4/2 heads, q/k/v bias, an odd untied vocabulary): (a) the sharded fp32 state after an AdamW step and (b) the
whole gradients FSDP2 holds while gradient sync is off, on 2 gloo ranks (full and LoRA); (c) the tensors autograd
saves through rollout.completion_logprobs, checkpointing off and on, and what a checkpointed block's recompute
holds; (d) the static decode buffers of generate calls (decode._BUFFERS); (e) the LM head's chunked working
memory; then resolve's rules, the known shapes' parameter counts and the shipped presets' margins. float32 and
bfloat16 on CPU: the formulas take the dtype's size (memory.plan, CUDA's bf16). Each check prints both numbers."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from live_bytes import LiveBytes

import decode
import infra
import memory
import model
import rollout
import train
from model import ModelConfig, Transformer
from rollout import completion_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MC = ModelConfig(model_type="qwen2", vocab_size=51, hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2,
                 intermediate_size=176, max_seq_len=256, attention_bias=True, tie_embeddings=False)
PROMPTS = [[1] * 10, [1, 5, 6, 7, 8, 9, 10], [1] + list(range(3, 14))]
COMPLETIONS = [list(range(3, 33)), list(range(20, 40)), list(range(10, 35))]


@pytest.fixture(autouse=True)
def cuda_attention(monkeypatch):
    """The formulas are CUDA's, whose attention is SDPA's (model.attention on CPU multiplies instead, saving the
    scores): the tests run SDPA here too."""
    monkeypatch.setattr(model, "PRODUCTS_UPTO", 0)


def close(measured: int, formula: int, rel: float, what: str, unit: str = "B"):
    """measured within rel of formula (rel = 0: exactly), both printed."""
    print(f"{what}: measured {measured:,} {unit}, formula {formula:,} {unit} (tolerance {rel:.1%})")
    assert abs(measured - formula) <= rel * formula, (what, measured, formula)


# ------------------------------------------------------------------ (a), (b): FSDP2's state on 2 gloo ranks
WORKER = r"""
import json, sys
import torch
from torch.distributed.fsdp import FSDPModule
import infra, lora
from model import ModelConfig, Transformer
from rollout import completion_logprobs

proc = infra.setup("cpu", 1, 120)
MC = ModelConfig(**json.loads(sys.argv[1]))
g = torch.Generator().manual_seed(proc.rank)  # each rank its own rows
prompts = [[1] + torch.randint(3, MC.vocab_size, (n,), generator=g).tolist() for n in (4, 7, 2)]
comps = [torch.randint(3, MC.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 6)]


def local(x):  # this rank's shard of a DTensor
    return x.to_local() if hasattr(x, "to_local") else x


def nbytes(xs, storage=False):  # logical bytes (numel), or the storages' (padding included), each once
    if not storage:
        return sum(x.numel() * x.element_size() for x in xs)
    return sum({x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in xs}.values())


def held(model):  # the whole (unsharded) gradients FSDP2 keeps: accumulated in the reduce dtype, else .grad
    out = []
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group else []:
            unsharded = getattr(fp, "_unsharded_param", None)
            out += [x for x in (fp.unsharded_accumulated_grad, unsharded is not None and unsharded.grad)
                    if isinstance(x, torch.Tensor)]
    return nbytes(out, storage=True)


def run(lora_rank, every):
    torch.manual_seed(0)
    policy = Transformer(MC)
    if lora_rank:
        lora.wrap(policy, lora_rank, 32.0)
    policy = infra.shard(policy, proc)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    out = {"rank": proc.rank, "lora_rank": lora_rank, "every": every, "held": []}
    for b in range(3):  # train.rl_step's micro-batch loop: sync in the last backward (every: in each)
        policy.set_requires_gradient_sync(every or b == 2)
        logp, _ = completion_logprobs(policy, prompts, comps, 1.0)
        (-logp.sum() * proc.world).backward()
        out["held"].append(held(policy))
    opt.step()
    params = [local(p) for p in policy.parameters()]
    grads = [local(p.grad) for p in policy.parameters() if p.grad is not None]
    adam = [local(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    out.update({k: nbytes(v) for k, v in (("params", params), ("grads", grads), ("adam", adam))})
    out["storage"] = nbytes(params + grads + adam, storage=True)
    out["steps"] = nbytes([s["step"] for s in opt.state.values()])  # AdamW's step counts: 4 B a tensor
    with open(f"{sys.argv[2]}/rank{proc.rank}.jsonl", "a") as f:  # a file a rank: no interleaved lines
        f.write(json.dumps(out) + "\n")


for lora_rank, every in ((0, False), (4, False), (0, True)):
    run(lora_rank, every)
infra.teardown()
"""


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    """The worker's numbers: per rank, per (LoRA rank, grad_sync every)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    (tmp / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    shape = {f.name: getattr(MC, f.name) for f in dataclasses.fields(MC) if f.name != "extra"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp / "worker.py"), json.dumps(shape), str(tmp)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(ln) for rank in (0, 1) for ln in (tmp / f"rank{rank}.jsonl").read_text().splitlines()]
    assert len(rows) == 6, rows
    return {(r["rank"], r["lora_rank"], r["every"]): r for r in rows}


def two_gpu_plan(lora_rank=0, sync_every=False) -> dict:
    return memory.plan(MC, train.Config(lora_rank=lora_rank), 2, False, sync_every)


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_sharded_state_after_a_step_is_the_formula(fsdp_results, lora_rank):
    """(a) Rank 0's shards of the fp32 parameters, gradients and AdamW's m and v after a step are the plan's
    sharded_state exactly (rank 0 holds dim 0's first, largest chunk: ceil(d0 / 2) rows, FSDP2's padded size);
    the other rank's storages are no larger, and the two ranks' shards add up to each tensor once."""
    formula = two_gpu_plan(lora_rank)["sharded_state"]
    r0, r1 = (fsdp_results[rank, lora_rank, False] for rank in (0, 1))
    close(r0["params"] + r0["grads"] + r0["adam"], formula, 0.0, f"sharded state, rank 0, LoRA rank {lora_rank}")
    print(f"  AdamW's step counts, not in the formula: {r0['steps']} B; rank 1's storages: {r1['storage']:,} B")
    assert r1["storage"] <= r0["storage"] == formula, (r1["storage"], r0["storage"])
    shapes = memory.param_shapes(MC, lora_rank)
    whole = 4 * memory.numel(shapes) + 12 * memory.numel(shapes, trained_only=True)
    close(sum(r[k] for r in (r0, r1) for k in ("params", "grads", "adam")), whole, 0.0,
          "both ranks' shards together vs each tensor once")


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_whole_gradients_held_while_sync_is_off_are_the_formula(fsdp_results, lora_rank):
    """(b) With set_requires_gradient_sync(False) (grad_sync = "last"), after each of the first two micro-batches
    every rank holds every trained parameter's whole fp32 gradient (FSDPParam's unsharded .grad on CPU,
    unsharded_accumulated_grad with a reduce dtype on CUDA): the plan's unsharded_grads; none after the synced
    backward."""
    formula = two_gpu_plan(lora_rank)["unsharded_grads"]
    for rank in (0, 1):
        held = fsdp_results[rank, lora_rank, False]["held"]
        for b in (0, 1):
            close(held[b], formula, 0.0, f"whole gradients after micro-batch {b}, rank {rank}, LoRA {lora_rank}")
        close(held[2], 0, 0.0, f"whole gradients after the synced backward, rank {rank}")


@pytest.mark.slow
def test_no_whole_gradients_are_held_with_sync_every_micro_batch(fsdp_results):
    """(b) grad_sync = "every": each backward reduce-scatters, so no whole gradient outlives it (0 extra), as
    the plan says; the sharded state is the same."""
    assert two_gpu_plan(sync_every=True)["unsharded_grads"] == 0
    for rank in (0, 1):
        r = fsdp_results[rank, 0, True]
        for b, held in enumerate(r["held"]):
            close(held, 0, 0.0, f"sync every: whole gradients after micro-batch {b}, rank {rank}")
        assert r["params"] + r["grads"] + r["adam"] == (
            fsdp_results[rank, 0, False]["params"] + fsdp_results[rank, 0, False]["grads"]
            + fsdp_results[rank, 0, False]["adam"])


# ------------------------------------------------------------------------------- (c) activations
def saved_bytes(m: Transformer) -> int:
    """Bytes of what autograd saves in one completion_logprobs forward (each storage once, parameters not)."""
    params, seen = {p.untyped_storage().data_ptr() for p in m.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(m, PROMPTS, COMPLETIONS, 1.0)
    return sum(seen.values())


def batch_shape() -> tuple[int, int, int, int, int]:
    """completion_forward's batch (model.Prefix): distinct prompts, the longest prompt, rows, the padded completion
    length, completion tokens."""
    return (len({tuple(p) for p in PROMPTS}), max(map(len, PROMPTS)), len(COMPLETIONS), max(map(len, COMPLETIONS)),
            sum(map(len, COMPLETIONS)))


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@DTYPES
def test_saved_activations_without_checkpointing_are_the_formula(dtype):
    """(c) Off: every block's saved tensors (norms' fp32 inputs, 1/rms, normalised inputs, the linears' inputs,
    flash attention's q, k, v, output, log-sum-exp, the SwiGLU's four) plus the ids, RoPE's tables, the final norm
    and the head's inputs: memory.activations at the dtype's size, to the byte. bfloat16 weights take RMSNorm's
    upcasting path, as FSDP2's bf16 parameters do on CUDA."""
    torch.manual_seed(0)
    m = Transformer(MC).to(dtype)
    m.checkpointing = False
    formula = memory.activations(MC, *batch_shape(), elt=dtype.itemsize, checkpointing=False)
    close(saved_bytes(m), sum(formula.values()), 0.0, f"saved activations, {dtype}, checkpointing off")
    assert formula["masks"] > 0  # the Prefix's biases, saved by every block's attention: counted once


@pytest.mark.skipif(not hasattr(Transformer, "checkpointing"), reason="model.py has no activation checkpointing")
@DTYPES
def test_saved_activations_with_checkpointing_and_the_recompute_are_the_formula(monkeypatch, dtype):
    """(c) On: the forward keeps each block's input (and what is outside the blocks); backward reruns one block at a
    time, and what that rerun holds for its backward (measured as the live bytes it allocates, each block's rerun
    in turn) is one block's saved tensors: memory.activations' "blocks" + "outside" and "recompute"."""
    torch.manual_seed(0)
    m = Transformer(MC).to(dtype)
    m.checkpointing = True
    formula = memory.activations(MC, *batch_shape(), elt=dtype.itemsize, checkpointing=True)
    # (the Prefix holds formula["masks"] through backward: made in the forward, saved by no checkpointed block)
    close(saved_bytes(m), formula["blocks"] + formula["outside"], 0.0, f"saved in forward, {dtype}, checkpointing on")
    forward, reruns, mem = model.Block.forward, [], []

    def rerun(self, *args, **kwargs):  # in backward: the live bytes the block's rerun leaves
        if not mem:
            return forward(self, *args, **kwargs)
        before = mem[0].now
        try:  # (torch.utils.checkpoint stops a rerun once it has what backward needs: an exception)
            return forward(self, *args, **kwargs)
        finally:
            reruns.append(mem[0].now - before)
    monkeypatch.setattr(model.Block, "forward", rerun)
    logp, _ = completion_logprobs(m, PROMPTS, COMPLETIONS, 1.0)
    with LiveBytes({p.untyped_storage().data_ptr() for p in m.parameters()}) as live:
        mem.append(live)
        logp.sum().backward()
    assert len(reruns) == MC.n_layers, reruns
    for i, held in enumerate(reruns):
        close(held, formula["recompute"], 0.0, f"one block's recompute in backward ({i + 1} of {MC.n_layers})")


# --------------------------------------------------------------------------------- (d) KV buffers
def static_bytes(m) -> int:
    """What decode._BUFFERS holds for model m: every buffer set's tensors, each storage once."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for _, tensors in decode._BUFFERS.get(m, {}).values() for t in tensors}
    return sum(seen.values())


def test_static_decode_buffers_are_the_formula(monkeypatch):
    """(d) generate(static=True) calls of P prompts × G samples × L tokens (the CUDA path's buffers; the step run
    eagerly on CPU): decode._BUFFERS holds exactly memory.kv_bytes of the power-of-two batches the calls compacted
    to at reserve's capacity, those batches are within the plan's chain, and the bytes within the plan's worst
    case (every batch of the chain). A first call of 64 rows compacts through 64, 32, 16, 8; a second of 72 × 8
    rows runs in chunks of MAX_ROWS (512 and 64 rows)."""
    monkeypatch.setattr(rollout, "compiled_step", lambda device_type: decode.step)  # no compile on CPU
    torch.manual_seed(0)
    m = Transformer(MC).eval()
    torch.nn.init.zeros_(m.lm_head.weight)  # uniform next tokens: each of 3 stop ids ends 1/51 of the rows a step
    g, calls = torch.Generator().manual_seed(0), []
    for P, G, L in ((8, 8, 64), (72, 8, 48)):
        prompts = [[1] + torch.randint(3, MC.vocab_size, (n,), generator=g).tolist()
                   for n in torch.randint(2, 12, (P,), generator=g).tolist()]
        rollout.generate(m, prompts, G, L, 1.0, stop_ids=[3, 4, 5], seed=0, static=True)
        calls.append((memory.first_batch(P, G), memory.slots(max(map(len, prompts)), L, "cpu"), L))
        W, Lc, R = decode._CAP[m]
        batches = sorted(k for k in decode._BUFFERS[m] if isinstance(k, int))
        B0 = max(c[0] for c in calls)
        print(f"call of {P} x {G} x {L}: batches {batches}, capacity {W} slots, {Lc} tokens, {R} rows")
        assert set(batches) <= set(memory.chain(B0)) and R == B0 and len(batches) >= 3, (batches, B0)
        close(static_bytes(m), memory.kv_bytes(MC, batches, W, Lc, R, 4), 0.0, "decode._BUFFERS")
        worst = memory.kv_bytes(MC, memory.chain(B0), max(c[1] for c in calls), max(c[2] for c in calls), B0, 4)
        print(f"  the plan's worst case (every batch of {memory.chain(B0)}): {worst:,} B")
        assert static_bytes(m) <= worst
    assert memory.first_batch(72, 8) == rollout.MAX_ROWS and 512 in batches


# ----------------------------------------------------------------------------- (e) the LM head
@DTYPES
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_heads_chunked_working_memory_is_the_formula(monkeypatch, temperature, dtype):
    """(e) rollout.HeadLogProbs on M = 300 tokens of a 1,000-token vocabulary in chunks of 2^15 logits (32 rows):
    the most bytes its forward or its backward allocates at once (the [chunk, V] block, its fp32 copy and
    temporaries; the head's fp32 gradient, a chunk's product and the hidden states' gradient) is
    memory.logits_bytes; bfloat16 weights and hidden states as FSDP2 and autocast give them on CUDA."""
    V, C, M = 1000, 64, 300
    monkeypatch.setitem(rollout.LOGITS_PER_CHUNK, "cpu", 2 ** 15)
    torch.manual_seed(0)
    h = torch.randn(M, C, dtype=dtype, requires_grad=True)
    w = torch.randn(V, C, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, V, (M,))
    old = [x.untyped_storage().data_ptr() for x in (h, w, targets)]
    chunk = 2 ** 15 // V
    with LiveBytes(old) as fwd:
        logp, _ = rollout.HeadLogProbs.apply(h, w, targets, temperature, 0, 1.0, chunk)
    with LiveBytes(old) as bwd:
        logp.sum().backward()
    formula = memory.logits_bytes(dataclasses.replace(MC, vocab_size=V, hidden_size=C), M, dtype.itemsize, "cpu",
                                  temperature)
    print(f"forward peak {fwd.peak:,} B, backward peak {bwd.peak:,} B")
    close(max(fwd.peak, bwd.peak), formula, 0.01, f"the head's working memory, {dtype}, T = {temperature}")


# ------------------------------------------------------------------------------------ resolve, shapes, presets
def test_resolve_keeps_the_cpu_default_and_the_settings_given():
    """On CPU "auto" is off and "last" (the CPU default unchanged); "true" / "every" are taken as given."""
    cpu = infra.Proc(0, 1, torch.device("cpu"))
    assert memory.resolve(train.Config(), MC, cpu) == (False, False)
    given = train.Config(activation_checkpointing="true", grad_sync="every")
    assert memory.resolve(given, MC, cpu) == (True, True)
    assert memory.resolve(train.Config(activation_checkpointing="false", grad_sync="last"), MC, cpu) == (False, False)


def test_auto_on_cuda_turns_checkpointing_on_first_then_sync_every(monkeypatch):
    """On CUDA, "auto": nothing while the plan fits 90% of the device; checkpointing once it does not; then
    grad_sync = "every" if it still does not (the 7B preset's shape, its settings made auto)."""
    cfg = train.parse_args(["--config", os.path.join(ROOT, "configs", "qwen2.5-7b-gsm8k.toml"),
                            "--activation_checkpointing=auto", "--grad_sync=auto"])
    mc = memory.known_config("Qwen2.5-7B-Instruct")
    totals = {(c, s): sum(memory.plan(mc, cfg, 8, c, s).values()) for c in (False, True) for s in (False, True)}
    print({k: f"{v / 1e9:.1f} GB" for k, v in totals.items()})
    assert totals[False, False] > totals[True, False] > totals[True, True]
    for memory_bytes, want in ((totals[False, False] / 0.89, (False, False)),
                               (totals[True, False] / 0.89, (True, False)), (80e9, (True, True))):
        props = type("Props", (), {"total_memory": memory_bytes})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=props: p)
        assert memory.resolve(cfg, mc, infra.Proc(0, 8, torch.device("cuda", 0))) == want, memory_bytes


@pytest.mark.parametrize("name, billions", [
    ("Qwen2.5-0.5B-Instruct", 0.494), ("Qwen2.5-1.5B-Instruct", 1.544), ("Qwen2.5-3B-Instruct", 3.086),
    ("Qwen2.5-7B-Instruct", 7.616), ("Llama-3.2-1B-Instruct", 1.236), ("Llama-3.2-3B-Instruct", 3.213),
    ("Llama-3.1-8B-Instruct", 8.030)])
def test_known_shapes_have_their_published_parameter_counts(name, billions):
    """The table of known shapes gives each model's published parameter count (to 0.5%)."""
    close(memory.numel(memory.param_shapes(memory.known_config(name))), round(billions * 1e9), 0.005, name,
          "parameters")


def test_an_existing_folder_is_read_not_looked_up(hf_folder):
    """A folder that exists is read (model.read_config), whatever its name."""
    assert memory.folder_config(hf_folder("qwen")) == model.read_config(hf_folder("qwen"))


@pytest.mark.parametrize("preset", ["qwen2.5-7b-gsm8k", "qwen2.5-3b-math"])
def test_the_long_completion_presets_fit_80_gb_with_a_tenth_to_spare(preset, capsys):
    """`python memory.py --config configs/PRESET.toml --gpus 8 --gpu_gb 80`: the plan as the preset sets it fits
    with >= 10% of the 80 GB left, and without checkpointing or per-micro-batch sync (before) it would not fit."""
    path = os.path.join(ROOT, "configs", f"{preset}.toml")
    print(memory.main(["--config", path, "--gpus", "8", "--gpu_gb", "80"]))
    cfg = train.parse_args(["--config", path])
    mc = memory.folder_config(cfg.init_from)
    settings = memory.decide(cfg, mc, 8, 0.9 * 80e9)
    after, before = (sum(memory.plan(mc, cfg, 8, *s).values()) for s in (settings, (False, False)))
    print(f"{preset}: {after / 1e9:.1f} GB after, {before / 1e9:.1f} GB before, of 80 GB")
    assert settings == (True, True) and after <= 0.9 * 80e9 < 80e9 < before
    assert "| **total** |" in capsys.readouterr().out

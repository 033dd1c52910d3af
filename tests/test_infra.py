"""infra.py's FSDP2 pieces on CPU (gloo): gradients reduce-scattered once per optimizer step and equal to the plain
module's (one rank, train.sft_update's micro-batch loop); the sampling copy's refresh gathers one parameter at a
time (two ranks: its extra peak memory is one parameter, not the model)."""
import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import infra
import model
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("every", [False, True], ids=["grad_sync=last", "grad_sync=every"])
def test_sft_update_reduces_gradients_once_per_optimizer_step(one_rank_group, monkeypatch, every):
    """train.sft_update over 4+ micro-batches: with FSDP2 on one gloo rank, each sharded module's gradients are
    reduced once (before: once per micro-batch), and they equal the plain module's to float32 rounding; with
    grad_sync = "every" (no full fp32 gradients held between micro-batches) once per micro-batch, equal too."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    cfg = train.parse_args(["--config", os.path.join(ROOT, "configs", "smoke.toml"), "--micro_batch_tokens=60",
                            "--threads=1", "--device=cpu", "--n_layers=2"])
    run = train.build_run(cfg)
    sharded = copy.deepcopy(run.model)
    for block in sharded.model.layers:
        fully_shard(block)
    fully_shard(sharded)
    g = torch.Generator().manual_seed(0)
    V = run.model.config.vocab_size
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (16,), generator=g)]
    comps = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (16,), generator=g)]
    grads, reductions, step = {}, [], train.optimizer_step

    def capture(r, opt):  # the gradients the optimizer would see
        grads[r.model] = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for k, p in r.model.named_parameters()}
        return step(r, opt)
    monkeypatch.setattr(train, "optimizer_step", capture)
    reduce = group.foreach_reduce  # FSDP2's reduce-scatter of one module's gradients (a copy on one rank)
    monkeypatch.setattr(group, "foreach_reduce", lambda *a, **kw: reductions.append(1) or reduce(*a, **kw))
    n_micro = len(infra.micro_batches(prompts, comps, run.cfg.micro_batch_tokens)[0])
    for model in (run.model, sharded):
        opt, sched = train.make_optimizer(dataclasses.replace(run, model=model), 1e-3, 10)
        train.sft_update(dataclasses.replace(run, model=model, sync_every=every), opt, sched, prompts, comps)
    want = 3 * (n_micro if every else 1)  # 2 blocks + the root, once each (every: in each micro-batch)
    assert n_micro >= 4 and len(reductions) == want, (n_micro, len(reductions))
    for k, want in grads[run.model].items():
        assert torch.allclose(grads[sharded][k], want, rtol=1e-5, atol=1e-7), k


WORKER = r"""
import os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import infra
from live_bytes import LiveBytes
from model import ModelConfig, Transformer


dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=512, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=160)
model, plain = Transformer(cfg), Transformer(cfg)
plain.load_state_dict(model.state_dict())
for block in model.model.layers:
    fully_shard(block)
fully_shard(model)
copy = Transformer(cfg)
old = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for m in (model, copy) for p in m.parameters()}
with LiveBytes(old) as mem:
    infra.refresh(copy, model)
sizes = [4 * p.numel() for p in plain.parameters()]
assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), plain.parameters()))
print(f"rank {dist.get_rank()}: peak {mem.peak} B, largest parameter {max(sizes)} B, model {sum(sizes)} B")
assert mem.peak <= 2 * max(sizes) < sum(sizes) / 3, (mem.peak, max(sizes), sum(sizes))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_refresh_gathers_one_parameter_at_a_time(tmp_path):
    """Two gloo ranks: infra.refresh's extra live memory peaks at about one gathered parameter (before: the whole
    model's full state dict, gathered at once in float32), and the copy equals the unsharded weights."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "worker.py")], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("peak") == 2, p.stdout


def test_a_resume_reads_the_optimizer_state_only_where_it_is_used(tmp_path):
    """latest_checkpoint maps trainer_state.pt (mmap): a sampler rank, which reads only the TrainState, does not
    pay the fp32 Adam state in host memory (at 7B: ~90 GB a rank, ~490 GB on one node before)."""
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    torch.save({"optimizer": {"exp_avg": torch.ones(64 << 20)}, "state": {"rl_cursor": 5}},  # 256 MiB
               ckpt / "trainer_state.pt")
    code = ("import resource, sys; sys.path.insert(0, sys.argv[2]); import infra\n"
            "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() >> 20\n"
            "before = rss()\n"
            "n, path, saved = infra.latest_checkpoint(sys.argv[1])\n"
            "assert n == 3 and saved['state'] == {'rl_cursor': 5}\n"
            "print(rss() - before)\n"
            "assert float(saved['optimizer']['exp_avg'][-1]) == 1.0  # a trainer reads what it uses\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), ROOT], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 64, out.stdout  # MiB of peak RSS added by the load


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_cpu_run_reuses_freed_large_blocks_without_page_faults():
    """infra.setup on CPU (keep_freed_memory): freed 128 MiB tensors' memory stays in the heap and serves the next
    ones: after three allocations, four more page-fault at most one block's 32,768 pages in all (the heap may grow
    once more, when a small allocation took the front of the freed block: 7 runs in 30 here, none twice; after one
    allocation it grew twice in 3 runs of 30); glibc's default unmaps each block, and each of the four faults in all
    its pages again."""
    code = ("import resource, sys; sys.path.insert(0, sys.argv[1]); import torch, infra\n"
            "if sys.argv[2] == 'setup': infra.setup('cpu')\n"
            "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(3):\n"  # allocated, written, freed
            "    x = torch.ones(32 << 20)\n"
            "    del x\n"
            "before = faults()\n"
            "for _ in range(4):\n"
            "    x = torch.ones(32 << 20)\n"
            "    del x\n"
            "print(faults() - before)\n")
    runs = {how: int(subprocess.run([sys.executable, "-c", code, ROOT, how], capture_output=True, text=True,
                                    check=True).stdout.split()[-1]) for how in ("setup", "default")}
    assert runs["setup"] < 32768 + 1000 < 4 * 30000 < runs["default"], runs


SHARDED = r"""
import os, sys
import torch, torch.distributed as dist
import infra
from model import ModelConfig, Transformer, build_char_tokenizer
out, proc = sys.argv[1], infra.setup("cpu", 1, 60)
cfg = ModelConfig(vocab_size=40, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=64,
                  max_seq_len=32)


def build(seed):
    torch.manual_seed(seed)
    model = infra.shard(Transformer(cfg), proc)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def flat(x, key=""):  # a nested state dict's leaves by path
    if isinstance(x, (dict, list, tuple)):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        return {k2: v for k, v in items for k2, v in flat(v, f"{key}/{k}").items()}
    return {key: x}


def same(a, b):
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


model, opt = build(0)
x = torch.randint(0, 40, (4, 8))
for _ in range(2):
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
infra.save_checkpoint(proc, out, 7, model, build_char_tokenizer("abc"), opt, {"step": 7})
files = sorted(os.listdir(os.path.join(out, "step_7", infra.SHARDS)))
assert sum(f.endswith(".distcp") for f in files) == 2, files  # each rank wrote its own shards
assert "optimizer" not in torch.load(os.path.join(out, "step_7", "trainer_state.pt"), weights_only=False)
other, other_opt = build(1)
infra.load_shards(other, other_opt, os.path.join(out, "step_7"))
want, got = (infra.full_state(m, o, rank0_only=False) for m, o in ((model, opt), (other, other_opt)))
for a, b in zip(want, got):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys() and all(same(fa[k], fb[k]) for k in fa), [k for k in fa if not same(fa[k], fb[k])]
# the resume step is rank 0's, whatever a rank's own disk holds
rank = proc.rank
for name, steps in (("agree", {0: [3], 1: [3, 5]}), ("missing", {0: [4], 1: []})):
    d = os.path.join(out, f"{name}{rank}")
    for n in steps[rank]:
        os.makedirs(os.path.join(d, f"step_{n}"))
        torch.save({"state": {}}, os.path.join(d, f"step_{n}", "trainer_state.pt"))
    try:
        print(f"rank {rank} {name}: step {infra.latest_checkpoint(d)[0]}", flush=True)
    except RuntimeError as e:
        print(f"rank {rank} {name}: error {e}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_checkpoints_are_written_by_every_rank_and_resume_exactly(tmp_path):
    """Two gloo ranks: save_checkpoint writes each rank's shards of the fp32 weights and the optimizer (no rank
    gathers the optimizer), load_shards restores both exactly into differently initialised copies, and the resume
    step is rank 0's: a rank that sees a newer step resumes rank 0's, one that lacks rank 0's says so."""
    (tmp_path / "worker.py").write_text(SHARDED)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "worker.py"), str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rank 0 agree: step 3" in p.stdout and "rank 1 agree: step 3" in p.stdout, p.stdout
    assert "rank 0 missing: step 4" in p.stdout, p.stdout
    assert "rank 1 missing: error rank 1: rank 0 resumes" in p.stdout and "out_dir must be one folder" in p.stdout


def test_a_frozen_copy_is_built_without_a_random_init(monkeypatch):
    """infra.frozen_copy (the sampling copy, π_ref, a sampler rank's model): made on the meta device in its dtype,
    then filled from the policy; no normal_ init (at 7B: a minute and 30 GB of host RAM per copy before)."""
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    policy = Transformer(ModelConfig(vocab_size=40, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                     intermediate_size=64, max_seq_len=32))

    drawn, normal = [], torch.nn.init.normal_

    def recorded(*a, **kw):
        drawn.append((a[0] if a else kw["tensor"]).device.type)
        return normal(*a, **kw)
    monkeypatch.setattr(torch.nn.init, "normal_", recorded)
    copy_ = infra.frozen_copy(policy, torch.device("cpu"))
    assert drawn and set(drawn) == {"meta"}  # the init ran on no storage
    x = torch.randint(0, 40, (2, 6))
    assert torch.equal(copy_(x), policy(x)) and not any(p.requires_grad for p in copy_.parameters())


def test_cpu_has_bf16_is_false_where_onednn_cannot_say(monkeypatch):
    """cpu_bf16 = "auto" asks model.cpu_has_bf16 on every run: oneDNN's answer, and False (float32, no crash) where
    the torch build has no oneDNN to ask."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert model.cpu_has_bf16() is True

    def missing():
        raise RuntimeError("no mkldnn in this build")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert model.cpu_has_bf16() is False


def test_check_weights_counts_exactly_and_a_norm_that_overflows_is_no_error():
    """check_weights' early exit (every weight's norm finite) and its count: a NaN and two infs are 3 weights,
    named in the error; finite weights whose squares overflow float32 (a norm of inf) are not an error."""
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.fill_(3e38)  # every |w| finite, ||w|| = inf in float32
    infra.check_weights(lin, None, "out")
    with torch.no_grad():
        lin.weight.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    with pytest.raises(RuntimeError, match="^3 of the policy's weights are not finite"):
        infra.check_weights(lin, None, "out")

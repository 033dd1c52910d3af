"""The machinery a reader of train.py can skip: processes, collectives, FSDP2, checkpoints, logging.

  1. setup reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (one process per device; nccl on CUDA,
     gloo on CPU); teardown leaves together, so no rank tears the process group down under a peer
     still working.
  2. all_sum (or max) / any_rank / all_gather_list: the collectives, each handed its tensor on the
     run's DEVICE (NCCL rejects CPU tensors; gloo accepts them, so CPU tests can't see the mistake).
  3. shard: FSDP2, each block then the root, bf16 compute + fp32 reduction on CUDA at any world
     size (one GPU computes as eight do); frozen_copy: plain full weights (π_ref; the sampling
     copy, re-gathered lazily, one parameter at a time); gradients reduce-scattered once per
     optimizer step, or every micro-batch (grad_sync = "every": no full fp32 gradients held
     between them; memory.py decides "auto"); compiled_sampling: whether generate runs the
     compiled decode step (train.py's cpu_compile).
  4. save_checkpoint: step_N/ = a Hugging Face folder (the export transformers and vLLM load) +
     shards/ (torch.distributed.checkpoint: every rank writes its own shards of the fp32 weights
     and the optimizer, in parallel) + trainer_state.pt, renamed into place only when complete;
     load_shards resumes from them exactly.
The Logger (console, metrics.jsonl, W&B) lives in logger.py.
"""
import ctypes
import dataclasses
import datetime
import glob
import os
import shutil
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp_io
from torch.distributed.checkpoint import state_dict as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import decode
import lora
from model import Transformer


DEVICE = torch.device("cpu")  # the run's device, set by setup(): where collectives' tensors live
GROUP = None  # this side's group (async_rl.split: trainer or sampler ranks); None: the world
TICKS = 0  # collectives this process has entered: the progress async_rl's beat reports


class Proc(NamedTuple):
    rank: int              # this process, 0..world-1; rank 0 logs and writes checkpoints
    world: int             # number of processes (one per device)
    device: torch.device


def setup(device: str = "auto", threads: int = 0, timeout: float = 3600.0) -> Proc:
    """Join the process group torchrun describes (or run alone); device auto: cuda:LOCAL_RANK if
    available; timeout: seconds a collective may wait (a checkpoint's write, an evaluation)."""
    env = (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
    rank, world, local = (int(os.environ.get(k, d)) for k, d in env)
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    dev = torch.device(f"cuda:{local}" if cuda else "cpu" if device in ("auto", "cuda") else device)
    if cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():  # NCCL's own default would be 10 minutes
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    # FSDP2's mixed precision on one GPU too: a 1-rank process group
    elif cuda and not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if threads:
        torch.set_num_threads(threads)
    if dev.type == "cpu":
        keep_freed_memory()
    globals()["DEVICE"] = dev
    return Proc(rank, world, dev)


def keep_freed_memory():
    """glibc's malloc hands each freed block of >= 32 MB (a [chunk, V] block of logits, a
    weight-sized gradient) back to the OS, so the next one is page-faulted in anew: ~0.1 s per
    100 MB on this project's CPU host. Without mmap those blocks stay in the heap and are reused
    (SmolLM2's training 1.14x, RESULTS.md §15). Elsewhere than glibc: nothing."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(-4, 0)            # M_MMAP_MAX: no block by mmap
    mallopt(-1, 2 ** 31 - 1)  # M_TRIM_THRESHOLD: free memory stays in the heap up to 2 GB


def teardown():
    """Leave together: a rank tearing gloo down while its peer still works can abort."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()
        # skip interpreter teardown, where gloo's threads have aborted (SIGABRT) about 1 run in 12
        os._exit(0)


def all_sum(x, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """x (a tensor anywhere, or a number) summed over ranks, as a tensor on DEVICE."""
    global TICKS
    x, TICKS = torch.as_tensor(x).to(DEVICE), TICKS + 1
    if dist.is_initialized():
        dist.all_reduce(x, op=op, group=GROUP)
    return x


def any_rank(flag: bool) -> bool:  # true on every rank if it is true on any
    return bool(all_sum(float(flag)) > 0)


def all_gather_list(items: list) -> list:
    """Every rank's list, concatenated in rank order (picklable items)."""
    global TICKS
    TICKS += 1
    if not dist.is_initialized():
        return items
    out = [None] * dist.get_world_size(GROUP)
    dist.all_gather_object(out, items, group=GROUP)
    return [x for part in out for x in part]


def micro_batches(prompts: list, completions: list, budget: int) -> tuple[list[list[int]], int]:
    """This rank's rows in micro-batches of rows × longest row (prompt + completion) <= budget
    tokens (one row at least), longest rows first, so that rows of similar length share one
    (padding costs tokens; the normaliser is global, so any grouping gives the same gradient) ->
    (the micro-batches as row indices, padding passes: the busiest rank's count less this one's, so
    every rank runs as many forward and backward passes and FSDP's collectives line up)."""
    plan, lengths = [], [len(p) + len(c) for p, c in zip(prompts, completions)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if not plan or (len(plan[-1]) + 1) * lengths[plan[-1][0]] > budget:
            plan.append([])
        plan[-1].append(i)
    return plan, int(all_sum(len(plan), dist.ReduceOp.MAX)) - len(plan)


def padding_passes(model, n: int, backward: bool = True, every: bool = False):
    """n forward (and backward) passes of one token that add nothing to any gradient, for a rank
    with fewer micro-batches than the busiest (micro_batches); the last backward reduce-scatters
    the step's gradients (every: each one does, as the busiest rank's micro-batches do)."""
    for i in range(n):
        if backward and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(every or i == n - 1)
        out = model(torch.zeros(1, 1, dtype=torch.long, device=DEVICE))  # [1, 1, V] logits
        if backward:
            (out.sum() * 0.0).backward()


def reduce_metrics(parts: list[dict]) -> dict:
    """A step's metrics from its micro-batches' dicts of 0-d tensors: each key summed over the
    micro-batches (in order) and the ranks; a key ending in "_max", the maximum (of values >= 0).
    A key a rank has not got (a rank with no rows this step) counts 0 there."""
    keys = list(dict.fromkeys(k for ks in all_gather_list([[*d] for d in parts]) for k in ks))
    zero = torch.zeros((), device=DEVICE)  # [..., zero] below: a stack is never empty
    values = {k: [d[k].detach().float() for d in parts if k in d] for k in keys}
    sums = {k: sum(v, zero) for k, v in values.items() if not k.endswith("_max")}
    tops = {k: torch.stack([zero, *v]).amax() for k, v in values.items() if k.endswith("_max")}
    return {**dict(zip(sums, all_sum(torch.stack([*sums.values(), zero])))),
            **dict(zip(tops, all_sum(torch.stack([*tops.values(), zero]), dist.ReduceOp.MAX)))}


def shard(model: Transformer, proc: Proc):
    """FSDP2: each block, then the root; bf16 compute with fp32 gradient reduction on CUDA, fp32 on
    CPU (where one process keeps the plain module)."""
    if proc.world == 1 and proc.device.type != "cuda":
        return model
    cuda = proc.device.type == "cuda"
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if cuda else MixedPrecisionPolicy()
    # a mesh over this side's ranks (async_rl), else the world
    mesh = DeviceMesh.from_group(GROUP, proc.device.type) if GROUP is not None else None
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def full_state(model, opt=None, rank0_only=True, weights=True):
    """Unsharded model (and optimizer) state dicts, keyed by parameter names; every rank of this
    side calls (each sharded tensor is all-gathered in turn, then moved to the CPU, so the peak
    extra device memory is one tensor); rank0_only: only this side's rank 0 keeps them (None values
    on the others); weights=False: no model state (None)."""
    if not dist.is_initialized():
        return model.state_dict(), opt and opt.state_dict()
    # keep: this side's rank 0 (dcp's own rank 0 is global)
    opts, keep = dcp.StateDictOptions(), not rank0_only or dist.get_rank(GROUP) == 0

    def gather(x):
        if isinstance(x, dict):
            return {k: gather(v) for k, v in x.items()}
        if isinstance(x, list):
            return [gather(v) for v in x]
        x = x.full_tensor() if isinstance(x, DTensor) else x
        return (x.cpu() if keep else None) if isinstance(x, torch.Tensor) else x
    model_sd = gather(dcp.get_model_state_dict(model, options=opts)) if weights else None
    return model_sd, opt and gather(dcp.get_optimizer_state_dict(model, opt, options=opts))


def frozen_copy(model, device, dtype=None) -> Transformer:
    """A plain unsharded copy in `dtype`, by default the compute dtype: bf16 on CUDA as FSDP
    computes (π_ref: KL 0 at the start; the sampling weights: 2 bytes/param per rank, decoding
    outside FSDP's hooks, never a gather per token)."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with torch.device("meta"):  # no random init, no fp32 host copy: storage made in dtype, filled
        ref = Transformer(model.config).to(dtype)
    ref = ref.to_empty(device=device)
    refresh(ref, model)
    return ref.requires_grad_(False).eval()


@torch.no_grad()
def refresh(copy, model, lazy=False):
    """copy ← model's weights (LoRA: W + (α/r)·BA) in place: a CUDA graph reads addresses; one
    parameter at a time in one order on every rank, cast to copy's dtype (bf16 on CUDA) before it
    is gathered: the peak is one parameter. lazy (an optimizer step): only mark it stale."""
    if copy is not None:
        dst, dtype = dict(copy.named_parameters()), next(copy.parameters()).dtype
        # LoRA: what never changes (all but the merged weights) is copied at the first refresh only
        frozen = not getattr(copy, "frozen_copied", False)
        for name, x in lora.merged_parameters(model, dtype, frozen) if not lazy else ():
            dst[name].copy_(x)
        copy.stale = lazy
        copy.frozen_copied = getattr(copy, "frozen_copied", False) or not lazy


def sampling_copy(model, proc: Proc, bf16: bool) -> Transformer | None:
    """generate's weights: a plain (merged) copy if FSDP2 shards the policy, LoRA wraps it or the
    decode runs in bf16 (`bf16`: CUDA, and CPU with train.py's cpu_bf16), else the policy itself."""
    plain = proc.world == 1 and not bf16 and not lora.adapters(model)
    return None if plain else frozen_copy(model, proc.device, torch.bfloat16 if bf16 else None)


def compiled_sampling(cfg) -> bool | None:
    """generate's static for train.py's cpu_compile: True, or None (the device's default: CUDA
    compiled, CPU eager); "auto" compiles from decode.CPU_COMPILE_RL_STEPS planned RL steps, where
    the compile pays (decode.py's rule), except in a run timed by rl_minutes (an equal-time arm of a
    few minutes would spend one of them compiling)."""
    planned = cfg.rl_steps >= decode.CPU_COMPILE_RL_STEPS and not cfg.rl_minutes
    auto = cfg.cpu_compile == "auto" and planned
    return cfg.cpu_compile == "true" or auto or None


@torch.no_grad()
def check_weights(model, sampler, out_dir: str):
    """No non-finite weight reaches a sampler: this rank's non-finite parameter count (its shards
    under FSDP2) summed over ranks in one all-reduce must be 0, else a RuntimeError on every rank;
    then the sampler's copy (if any) is stale: sampling gathers it first."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # shards
    # counted where a tensor's norm is not finite (a read each: 12x faster on CPU than counting all;
    # a norm can overflow where no weight is infinite: then its count is 0)
    bad = all_sum(sum((~x.isfinite()).sum() for x in local if not x.norm().isfinite()))
    if bad:
        raise RuntimeError(f"{int(bad)} of the policy's weights are not finite after an optimizer "
                           "step: no sampler gets them; the last good checkpoint is intact in "
                           f"{out_dir} (a lower lr or grad_clip, or the data, is where to look)")
    if sampler is not None:
        sampler.stale = True


def sampling(copy, model):
    """generate's module: `model`, or its copy, re-gathered if stale (every rank calls: all gather
    or none does)."""
    if copy is not None and copy.stale:
        refresh(copy, model)
    return model if copy is None else copy


def load_optimizer(model, opt, sd: dict):
    # a full (unsharded) optimizer state dict back into this rank's optimizer
    if not dist.is_initialized():
        return opt.load_state_dict(sd)
    dcp.set_optimizer_state_dict(model, opt, sd, options=dcp.StateDictOptions(full_state_dict=True))


def complete_checkpoints(out_dir: str) -> list[int]:
    """Steps N of the step_N/ folders that hold a trainer_state.pt (written last, so the folder is
    whole)."""
    return [int(p.split("_")[-1]) for p in glob.glob(os.path.join(out_dir, "step_*"))
            if p.split("_")[-1].isdigit() and os.path.exists(os.path.join(p, "trainer_state.pt"))]


def latest_checkpoint(out_dir: str) -> tuple[int, str, dict | None]:
    """(N, out_dir/step_N, its trainer_state) of the newest complete checkpoint, or (0, "", None).
    Rank 0 decides (each rank listing its own disk could disagree) and every rank reads it: out_dir
    must be shared."""
    n = max(complete_checkpoints(out_dir), default=0)
    if dist.is_initialized():
        dist.broadcast_object_list(box := [n], src=0)
        n = box[0]
    path = os.path.join(out_dir, f"step_{n}")
    if n and not os.path.exists(os.path.join(path, "trainer_state.pt")):
        raise RuntimeError(f"rank {dist.get_rank()}: rank 0 resumes {path}, which this rank does "
                           "not see: out_dir must be one folder every node shares")
    # mmap: a tensor's pages are read when used (an earlier layout's optimizer, unread by
    # sampler ranks), and the ranks of a node share one page cache
    state = n and torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False, mmap=True)
    return (n, path, state) if n else (0, "", None)


def save_run(run, state, step: int, stage: str, opt, sched):
    """train.py's atomic step_N/ checkpoint: the Hugging Face folder and everything resume needs
    (train.TrainState, the scheduler, the RNG, the config, an async run's pending rollouts)."""
    cfg = run.cfg
    rollouts = run.link.checkpoint(state, step) if run.link and stage == "rl" else []  # async
    trainer_state = {"rollouts": rollouts, "scheduler": sched.state_dict(), "step": step,
                     "stage": stage, "state": dataclasses.asdict(state),
                     "rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg)}
    dtype = getattr(torch, cfg.save_dtype) if cfg.save_dtype else None
    save_checkpoint(run.proc, cfg.out_dir, step, run.model, run.task.tok, opt, trainer_state,
                    ref=run.ref, keep=cfg.keep_ckpts, dtype=dtype, base=cfg.init_from)


def save_checkpoint(proc: Proc, out_dir: str, step: int, model, tokenizer, opt, trainer_state: dict,
                    ref=None, keep: int = 0, dtype=None, base: str = ""):
    """out_dir/step_N/: save_pretrained's Hugging Face folder (weights in `dtype`, default the
    source folder's; its tokenizer and generation files, else `tokenizer`), shards/ (every rank's
    shards of the fp32 model and the optimizer, written in parallel: load_shards), trainer_state.pt
    (written last) and ref_model.pt when a reference model is given; keeps the newest `keep`
    checkpoints (0: all). A LoRA model: the merged weights, and its adapter in PEFT's format over
    `base` (lora.py step 3)."""
    adapter = lora.adapter_state(model)  # every rank gathers; {} without LoRA
    model_sd = full_state(model, weights=not adapter)[0]  # the export's weights, on rank 0
    model_sd = lora.merged_state(model, keep=proc.rank == 0) if adapter else model_sd
    final = os.path.join(out_dir, f"step_{step}")
    tmp = final + ".tmp"
    if proc.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()  # a clean tmp/ before any rank writes into it
    dcp_io.save(training_state(model, opt), checkpoint_id=os.path.join(tmp, SHARDS),
                process_group=GROUP)
    if proc.rank == 0:
        model.save_pretrained(tmp, tokenizer=tokenizer, dtype=dtype, state_dict=model_sd)
        if adapter:
            lora.save_adapter(os.path.join(tmp, lora.ADAPTER_DIR), model, adapter, base)
        if ref is not None:
            torch.save(ref.state_dict(), os.path.join(tmp, "ref_model.pt"))
        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(complete_checkpoints(out_dir))[:-keep] if keep else []:
            shutil.rmtree(os.path.join(out_dir, f"step_{old}"), ignore_errors=True)
    barrier()


SHARDS = "shards"  # step_N/'s torch.distributed.checkpoint folder


def barrier():
    if dist.is_initialized():
        dist.barrier(GROUP)


def training_state(model, opt) -> dict:
    """This rank's shards of the model (fp32, whatever the export's dtype) and the optimizer, by
    parameter name: what torch.distributed.checkpoint writes and reads in place."""
    return {"model": dcp.get_model_state_dict(model),
            "optimizer": dcp.get_optimizer_state_dict(model, opt)}


def load_shards(model, opt, path: str):
    """Resume exactly: checkpoint folder `path`'s shards/ into this rank's model and optimizer;
    a checkpoint of the earlier layout (the optimizer in trainer_state.pt) is read from there."""
    if not os.path.isdir(os.path.join(path, SHARDS)):
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False, mmap=True)
        return load_optimizer(model, opt, state["optimizer"])
    state = training_state(model, opt)
    dcp_io.load(state, checkpoint_id=os.path.join(path, SHARDS), process_group=GROUP)
    dcp.set_model_state_dict(model, state["model"])
    dcp.set_optimizer_state_dict(model, opt, state["optimizer"])

"""Asynchronous RL inside one torchrun world (prime-rl's split; no Ray, no servers): the first k ranks only sample,
the other ranks train (FSDP2 over their own group), and the samplers run at most K policy versions ahead.

  python -m torch.distributed.run --standalone --nproc_per_node=2 train.py --config configs/smoke.toml \
      --sampler_ranks=1 --max_staleness=1                                   # CPU: 1 sampler + 1 trainer (gloo)
  torchrun --standalone --nproc_per_node=8 train.py --config configs/qwen2.5-0.5b-gsm8k.toml \
      --sampler_ranks=1 --max_staleness=1                                   # 1 GPU samples, 7 train
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py \
      --config ... --sampler_ranks=4 --max_staleness=2                      # two nodes: global ranks 0-3 sample

Versions. π_v is the policy after optimizer step v; v0 is the RL stage's start (the cold start's last step). The
rollouts of RL step s are sampled with π_v, v = max(v0, s − 1 − K) exactly, so their staleness, the optimizer steps
between the sampling weights and π_old (the weights step s starts from), is s − 1 − v = min(K, s − 1 − v0) ≤ K.
K = 0 is the synchronous loop: the same weights, per-row seeds and numbers. The version is a function of s, never
of timing: a run is reproducible and resumes exactly, and the samplers never wait while sampling a step takes no
longer than training one (with K ≥ 1). The trainer asserts s − 1 − v ≤ K on every batch it takes.

  1. At the RL stage's start the trainer leader (global rank k) sends the samplers a header (the TrainState: prompt
     cursor and pass-rate memory; the version; the steps allowed) and π_v0; steps v0 + 1 .. v0 + 1 + K are allowed.
  2. The samplers sample each allowed step with DAPO's dynamic sampling and refill over the sampler ranks
     (train.dynamic_sampling, the function the colocated loop calls); the sampler leader (rank 0) broadcasts
     (step, version, groups, stats, TrainState after it) to the trainers, which receive P informative groups.
  3. After optimizer step s the trainers gather the weights once (infra.sampling) and the leader posts them as
     flat buckets of BUCKET_BYTES, one asynchronous broadcast each over a group of its own (the leader and the
     samplers), then the header: version s, steps allowed up to s + 1 + K. A sampler picks them up between steps.
  4. The loss (objective() prints it): the sampler's log-probs are the behaviour policy μ = π_v; the PPO ratio is
     against the trainer's recomputed π_old, and tis reweights each token by w = min(π_old / μ, C) (decoupled PPO,
     Hilton et al. 2022; tis = "auto" is "token" / truncate for K > 0: an unclipped IS weight destabilised at K = 3
     in tinker-cookbook, a clipped one did not). train/mismatch_kl logs KL(μ‖π_old) on the sampled tokens (k3).
No wait is unbounded: each process beats a counter in the store from a thread; a waiter whose peer's beat has not
moved for async_timeout seconds, or whose collective fails (a dead peer's socket), raises an error naming its side,
rank and step, and the whole torchrun job stops.
Checkpoints at step s: the trainers first take the rollouts of steps s + 1 .. s + K (sampled with π_≤s−1, so
already under way) and save them in trainer_state.pt with the samplers' TrainState after step s + K; a resume loads
them, sends π_s and allows step s + K + 1. Nothing is re-sampled, so a resumed run equals the uninterrupted one.
"""
import dataclasses
import os
import pickle
import threading
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

import infra
from cli import UserError

BUCKET_BYTES = 128 << 20  # weights per broadcast: few collectives, and a bounded staging buffer each
BEAT_S = 1.0              # how often each process beats its counter in the store


class SideError(RuntimeError):
    """A wait across the two sides that failed or timed out; the message names the side, rank and step."""


def split(proc: infra.Proc, cfg) -> tuple[infra.Proc, "Link | None"]:
    """(this side's Proc, its Link) for cfg.sampler_ranks = k > 0; (proc, None) for the colocated loop. Every rank
    creates every group in the same order (torch.distributed's rule); infra's collectives then run on this side's."""
    k = cfg.sampler_ranks
    if not k:
        return proc, None
    if k >= proc.world:
        raise UserError(f"sampler_ranks = {k} leaves no trainer rank: the world has {proc.world} (torchrun's "
                        "--nproc_per_node × --nnodes must exceed it)")
    world, timeout = proc.world, timedelta(seconds=cfg.async_timeout)
    groups = [dist.new_group(r, timeout=timeout) for r in (list(range(k)), list(range(k, world)),
                                                           [0] + list(range(k, world)), list(range(k + 1)))]
    for g in groups:  # meet once in each group of ours, in one order: NCCL builds its communicators here, not
        if dist.get_rank(g) >= 0:  # later inside an asynchronous broadcast that a busy peer has not joined yet
            dist.barrier(g)
    trains = proc.rank >= k
    infra.GROUP = groups[int(trains)]
    side = infra.Proc(proc.rank - k if trains else proc.rank, world - k if trains else k, proc.device)
    return side, Link(cfg, side, trains, data=groups[2], weights=groups[3])


class Link:
    """One side's end of the two channels: rollouts (sampler leader → trainers, the `data` group) and weights with
    their headers (trainer leader → samplers, the `weights` group; headers in the store)."""

    def __init__(self, cfg, proc: infra.Proc, trains: bool, data, weights):
        self.K, self.timeout, self.proc, self.trains = cfg.max_staleness, cfg.async_timeout, proc, trains
        self.side = "trainer" if trains else "sampler"
        self.rank = proc.rank + (cfg.sampler_ranks if trains else 0)  # global rank
        self.leader, self.data, self.weights = cfg.sampler_ranks, data, weights  # trainer leader = global rank k
        self.peer = 0 if trains else cfg.sampler_ranks  # the other side's leader, whose beat a wait watches
        self.step, self.heads, self.pending, self.works = 0, 0, deque(), []
        self.allowed = self.received = 0  # the last step the samplers may sample; the last step taken from them
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        prefix = f"async_rl/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # a restarted job's keys are new
        self.store = dist.PrefixStore(prefix, dist.TCPStore(addr, port, is_master=False, timeout=timedelta(
            seconds=cfg.async_timeout)))
        beat = dist.PrefixStore(prefix, dist.TCPStore(addr, port, is_master=False))  # the beat thread's own client
        threading.Thread(target=self._beat, args=(beat,), daemon=True).start()

    def _beat(self, store):
        while True:
            store.add(f"beat/{self.rank}", 1)
            time.sleep(BEAT_S)

    def fail(self, what: str, err: Exception | None = None):
        peer = "sampler" if self.trains else "trainer"
        raise SideError(f"{self.side} rank {self.rank} at step {self.step}: {what} ({peer} side, leader rank "
                        f"{self.peer})" + (f": {err}" if err else "")) from err

    def wait_key(self, key: str, what: str) -> bytes:
        """The store's value at key once the other side sets it; raises once the peer's beat stops for timeout s.
        Polls (check, then a sleep growing to 10 ms): a timed store.wait logs a warning each time it expires."""
        last, seen, nap = None, time.time(), 1e-4
        while True:
            try:
                if self.store.check([key]):
                    return self.store.get(key)
                beat = self.store.add(f"beat/{self.peer}", 0)
            except dist.DistError as e:  # the store's host (rank 0 without torchrun's agent) is gone
                self.fail(f"the store went away while waiting for {what}", e)
            if beat != last:
                last, seen = beat, time.time()
            elif time.time() - seen > self.timeout:
                self.fail(f"no {what} and no sign of life for async_timeout = {self.timeout:g} s")
            time.sleep(nap)
            nap = min(2 * nap, 0.01)

    def collective(self, fn, what: str):
        try:
            return fn()
        except Exception as e:  # gloo: the peer's socket closed; NCCL: the group's timeout
            self.fail(f"{what} failed (the other side died or timed out)", e)

    # ----------------------------------------------------------------------------------------- weights → samplers
    def buckets(self, model) -> list[list[torch.Tensor]]:
        """The parameters in named_parameters order (the same on both sides), cut into buckets of BUCKET_BYTES."""
        out, size = [[]], 0
        for p in model.parameters():
            if out[-1] and size + p.numel() * p.element_size() > BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(p)
            size += p.numel() * p.element_size()
        return out

    def publish(self, run, version: int, last: int, state=None, rollouts=None, group_cls=None):
        """Trainers, after optimizer step `version` (every trainer rank calls: the gather is collective): post π_v and
        allow steps up to min(version + 1 + K, last). With `state` (the RL stage's start): the header carries it,
        and `rollouts` (a checkpoint's) are queued, so the samplers start after them."""
        model = infra.sampling(run.sampler, run.model)  # the full weights on every trainer rank
        self.step = version
        if state is not None:
            self.pending = deque(dict(m, groups=[group_cls(**g) for g in m["groups"]]) for m in rollouts or [])
            self.received = self.allowed = version + len(self.pending)
        head = {"version": version, "allowed": min(version + 1 + self.K, last), "next": self.allowed + 1,
                "state": dataclasses.asdict(state) if state is not None else None}
        self.allowed = head["allowed"]
        if self.proc.rank != 0:
            return
        self.await_posts("the previous weight broadcast")  # received by now in any run that keeps K's promise
        flat = [torch.cat([p.detach().reshape(-1) for p in b]) for b in self.buckets(model)]
        self.post(head)  # the header first: a sampler joins the broadcasts once it reads it
        self.works = [self.collective(lambda: dist.broadcast(f, self.leader, group=self.weights, async_op=True),
                                      "posting the weights") for f in flat]

    def await_posts(self, what: str):
        """Trainer leader: the weight broadcasts posted last have reached the samplers (their buffers may go)."""
        for w in self.works:
            self.collective(lambda: w.wait(timedelta(seconds=self.timeout)), what)

    def post(self, head: dict):
        self.store.set(f"head/{self.heads}", pickle.dumps(head))
        self.heads += 1

    def receive_weights(self, model) -> dict:
        """Samplers: the next header, and the weights it announces copied in place (CUDA graphs keep addresses)."""
        head = pickle.loads(self.wait_key(f"head/{self.heads}", "a weight header"))
        self.heads += 1
        if head.get("stop"):
            return head
        for b in self.buckets(model):
            flat = torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            self.collective(lambda: dist.broadcast(flat, self.leader, group=self.weights), "receiving the weights")
            for p, x in zip(b, flat.split([p.numel() for p in b])):
                p.data.copy_(x.view_as(p))
        return head

    # ----------------------------------------------------------------------------------------- rollouts → trainers
    def send(self, msg: dict):
        """Sampler leader: one step's rollouts to every trainer (they wait for the key, then join the broadcast)."""
        self.store.set(f"roll/{msg['step']}", b"1")
        self.collective(lambda: dist.broadcast_object_list([msg], src=0, group=self.data, device=infra.DEVICE),
                        f"sending the rollouts of step {msg['step']}")

    def receive(self, state) -> dict:
        """Trainers: the next step's rollouts; the samplers' TrainState after them becomes ours (it is checkpointed)."""
        step = self.received + 1
        self.wait_key(f"roll/{step}", f"the rollouts of step {step}")
        box = [None]
        self.collective(lambda: dist.broadcast_object_list(box, src=0, group=self.data, device=infra.DEVICE),
                        f"receiving the rollouts of step {step}")
        msg, self.received = box[0], step
        state.rl_cursor, state.pass_history = msg["state"]["rl_cursor"], msg["state"]["pass_history"]
        return msg

    def take(self, state, step: int) -> tuple[list, dict]:
        """Trainers: (groups, stats) of RL step `step`, with its staleness (asserted ≤ K) and both sides' times."""
        self.step, t0 = step, time.time()
        msg = self.pending.popleft() if self.pending else self.receive(state)
        waited, stale = time.time() - t0, step - 1 - msg["version"]
        if msg["step"] != step or not 0 <= stale <= self.K:
            raise SideError(f"trainer rank {self.rank}: rollouts of step {msg['step']} sampled with π_{msg['version']}"
                            f" offered to step {step} (staleness {stale}, max_staleness = {self.K})")
        return msg["groups"], {**msg["stats"], "train/staleness": stale, "time/trainer_wait_s": waited,
                               "time/sampler_wait_s": msg["wait_s"], "time/rollout_s": msg["sample_s"],
                               "time/sample_tok_per_s": msg["tokens"] / max(msg["sample_s"], 1e-9)}

    def checkpoint(self, state, step: int) -> list[dict]:
        """Trainers, at a checkpoint of step `step`: the rollouts of steps step + 1 .. step + K, taken now (state
        follows them) so a resume starts the samplers after them; plain dicts, not train.Group, in the file."""
        while self.received < min(step + self.K, self.allowed):
            self.pending.append(self.receive(state))
        return [dict(m, groups=[vars(g) for g in m["groups"]]) for m in self.pending]

    def stop(self, state):
        """Trainers: take what the samplers were allowed and not yet given (a time-limited stage ends early), then stop
        them. The samplers leave their loop; every rank then meets in infra.teardown."""
        while self.received < self.allowed:
            self.receive(state)
        if self.proc.rank == 0:
            self.await_posts("the last weight broadcast")
            self.post({"stop": True})


def sampler_loop(run, state, draw) -> dict:
    """A sampler rank's whole run: wait for the RL stage, then sample every allowed step with the newest weights it
    was sent (draw = train.dynamic_sampling) until the trainers say stop."""
    link, t0 = run.link, time.time()
    head = link.receive_weights(run.model)
    for k, v in head["state"].items():
        setattr(state, k, v)
    nxt = head["next"]
    while not head.get("stop"):
        waited = time.time() - t0
        while nxt <= head["allowed"]:
            link.step, t1 = nxt, time.time()
            groups, stats = draw(run, state, nxt)
            msg = {"step": nxt, "version": head["version"], "groups": groups, "stats": stats, "wait_s": waited,
                   "sample_s": time.time() - t1, "tokens": sum(len(c) for g in groups for c in g.comps),
                   "state": {"rl_cursor": state.rl_cursor, "pass_history": state.pass_history}}
            if run.proc.rank == 0:
                link.send(msg)
            nxt, waited = nxt + 1, 0.0
        t0 = time.time()
        head = link.receive_weights(run.model)
    return {}

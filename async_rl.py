"""Asynchronous RL inside one torchrun world (prime-rl's split; no Ray, no servers): the first k
ranks only sample, the other ranks train (FSDP2 over their own group), and the samplers run at most
K policy versions ahead. Commands, and how to choose k: the README's "Asynchronous RL";
measurements: RESULTS.md §10.

Versions. π_v is the policy after optimizer step v; v0 is the RL stage's start (the cold start's
last step). The rollouts of RL step s are sampled with π_v, v = max(v0, s − 1 − K) exactly, so
their staleness (optimizer steps between the sampling weights and π_old) is s − 1 − v ≤ K,
asserted on every batch. K = 0 is the synchronous loop (same weights, seeds, numbers). The version
is a function of s, never of timing: runs reproduce and resume exactly.
  1. At the RL stage's start the trainer leader (global rank k) sends π_v0 as in 3, the TrainState
     in its header.
  2. The samplers sample each allowed step (train.dynamic_sampling over the sampler ranks); their
     leader (rank 0) puts (step, version, groups, stats, TrainState after it) in the store in
     chunks; every trainer reads it there.
  3. After optimizer step s the trainers gather the weights (infra.sampling); the leader posts the
     header (version s, steps allowed up to s + 1 + K), then broadcasts the weights in BUCKET_BYTES
     buckets over a group of its own (the leader and the samplers). A sampler takes the next header
     once it has sampled every step allowed so far.
  4. The loss: the sampler's log-probs are μ = π_v; the PPO ratio is against the trainer's
     recomputed π_old, and tis reweights each token by min(π_old / μ, C) (decoupled PPO, Hilton
     et al. 2022; tis = "auto" truncates at K > 0: an unclipped weight destabilised at K = 3 in
     tinker-cookbook). train/mismatch_kl: k3 of KL(μ‖π_old).
No wait can close a cycle: a sampler waits for a trainer only for a header, posted before its
broadcast starts, so a pending broadcast completes once the samplers finish their current step,
whatever the trainers do (evaluate, save); that broadcast is the only collective between the sides
(one order: safe under CUDA_DEVICE_MAX_CONNECTIONS=1). The leader settles it (waits, frees its
buffers) before the next one, an eval or a save. Each process beats (step, collectives done) into
the store from a thread; a waiter raises, naming both sides, when the peer's beat stops for
async_timeout (dead) or its progress for collective_timeout (hung; also the groups' op timeout).
Checkpoints at step s hold the rollouts of steps s + 1 .. s + K (already under way) and the
samplers' TrainState after step s + K; a resume sends π_s and allows step s + K + 1. Nothing is
re-sampled: resumed equals uninterrupted.
"""
import dataclasses
import io
import itertools
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

# weights per broadcast: few collectives, and a bounded staging buffer each
BUCKET_BYTES = 128 << 20
# one store value of a rollout message (torch's libuv TCPStore refuses values > 8 MiB)
CHUNK_BYTES = 4 << 20
# how often each process beats its counter in the store (at most; async_timeout / 10)
BEAT_S = 1.0


class SideError(RuntimeError):
    """A wait across the two sides that failed or timed out; the message names the side, rank and
    step."""


def split(proc: infra.Proc, cfg) -> tuple[infra.Proc, "Link | None"]:
    """(this side's Proc, its Link) for cfg.sampler_ranks = k > 0; (proc, None) for the colocated
    loop. Every rank creates every group in the same order (torch.distributed's rule); infra's
    collectives then run on this side's."""
    k = cfg.sampler_ranks
    if not k:
        return proc, None
    if k >= proc.world:
        raise UserError(f"sampler_ranks = {k} leaves no trainer rank: the world has {proc.world} "
                        "(torchrun's --nproc_per_node × --nnodes must exceed it)")
    world, timeout = proc.world, timedelta(seconds=cfg.collective_timeout)
    groups = [dist.new_group(r, timeout=timeout) for r in (list(range(k)), list(range(k, world)),
                                                           list(range(k + 1)))]
    # meet once in each group of ours, in one order: NCCL builds its communicators here, not later
    # inside an asynchronous broadcast that a busy peer has not joined yet
    for g in groups:
        if dist.get_rank(g) >= 0:
            dist.barrier(g)
    trains = proc.rank >= k
    infra.GROUP = groups[int(trains)]
    side = infra.Proc(proc.rank - k if trains else proc.rank, world - k if trains else k,
                      proc.device)
    # peer: the other side's leader
    wire = Wire(cfg, proc.rank, "trainer" if trains else "sampler", 0 if trains else k)
    return side, TrainerLink(cfg, side, wire, groups[2]) if trains else SamplerLink(wire, groups[2])


class _CPUOnly(pickle.Pickler):
    """Pickles a rollout message; a tensor off the CPU would unpickle on the reader's device of that
    index."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise SideError(f"a rollout message holds a tensor on {obj.device}: "
                            "move it to the CPU before sending")
        return NotImplemented


class Wire:
    """The store both sides share: this process's beat and progress, chunked messages, and waits
    that time out."""

    def __init__(self, cfg, rank: int, side: str, peer: int):
        # peer: the other side's leader
        self.rank, self.side, self.peer, self.step = rank, side, peer, 0
        self.dead_s, self.hung_s = cfg.async_timeout, cfg.collective_timeout
        # ten beats missed before a peer counts as dead
        self.beat_s = min(BEAT_S, cfg.async_timeout / 10)
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # a restarted job's keys are new
        prefix = f"async_rl/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = dist.PrefixStore(prefix, dist.TCPStore(
            addr, port, is_master=False, timeout=timedelta(seconds=cfg.collective_timeout)))
        # the beat thread's own client
        beat = dist.PrefixStore(prefix, dist.TCPStore(addr, port, is_master=False))
        self.closed = threading.Event()
        self.beater = threading.Thread(target=self._beat, args=(beat,), daemon=True)
        self.beater.start()

    def _beat(self, store):
        """Every beat_s: a new beat, this process's step and its progress (infra.TICKS: collectives
        entered)."""
        for n in itertools.count():
            try:
                store.set(f"alive/{self.rank}", f"{n} {self.step} {infra.TICKS}")
            except dist.DistError:
                # the store's host is gone (the job is ending): nobody is left to watch
                return
            if self.closed.wait(self.beat_s):
                return

    def close(self):
        """Stop beating (a process that ends without it just stops: its peers are leaving too)."""
        self.closed.set()
        self.beater.join()

    def fail(self, what: str, err: Exception | None = None):
        peer = "sampler" if self.side == "trainer" else "trainer"
        raise SideError(f"{self.side} rank {self.rank} at step {self.step}: {what} "
                        f"({peer} side, leader rank {self.peer})"
                        + (f": {err}" if err else "")) from err

    def wait_key(self, key: str, what: str) -> bytes:
        """The store's value at key once the other side sets it, polled (a timed store.wait warns
        each time it expires); raises once the peer's beat stops for async_timeout or its progress
        for collective_timeout."""
        seen, nap = {"beat": (None, time.time()), "ticks": (None, time.time())}, 1e-4
        while True:
            try:
                if self.store.check([key]):
                    return self.store.get(key)
                beat_key = f"alive/{self.peer}"
                alive = self.store.check([beat_key]) and self.store.get(beat_key).decode().split()
            except dist.DistError as e:
                # the store's host (rank 0 without torchrun's agent) is gone
                self.fail(f"the store went away while waiting for {what}", e)
            beat, step, ticks = alive or (None, "?", None)
            for name, value in (("beat", beat), ("ticks", ticks)):
                if value != seen[name][0]:
                    seen[name] = (value, time.time())
            if time.time() - seen["beat"][1] > self.dead_s:
                self.fail(f"no {what} and no sign of life for async_timeout = {self.dead_s:g} s")
            # hung: alive (a beat within the last few beat intervals), yet no progress; a peer
            # with no recent beat is dead only after async_timeout, whichever timeout is shorter
            beating = beat is not None and time.time() - seen["beat"][1] < 3 * self.beat_s
            if beating and time.time() - seen["ticks"][1] > self.hung_s:
                self.fail(f"no {what}; the peer is alive at its step {step} but has made no "
                          f"progress for collective_timeout = {self.hung_s:g} s")
            time.sleep(nap)
            nap = min(2 * nap, 0.01)

    # fn() (a collective, a store op); a failure: a SideError naming what
    def guard(self, fn, what: str):
        try:
            return fn()
        except Exception as e:
            # gloo: the peer's socket closed; NCCL: the group's timeout; the store's host gone
            self.fail(f"{what} failed (the other side died or timed out)", e)

    def put(self, key: str, obj):
        """obj pickled (CPU tensors only) in chunks under key/0, key/1, ..., then key = their count
        (set last)."""
        buf = io.BytesIO()
        _CPUOnly(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        data = buf.getbuffer()
        chunks = [bytes(data[at:at + CHUNK_BYTES])
                  for at in range(0, max(len(data), 1), CHUNK_BYTES)]
        for k, value in ([(f"{key}/{i}", c) for i, c in enumerate(chunks)]
                         + [(key, str(len(chunks)))]):
            self.guard(lambda: self.store.set(k, value), f"posting {key}")  # the count last

    def get(self, key: str, what: str, readers: int):
        """put's object, once it is there; the last of `readers` processes to read it deletes its
        keys."""
        n = int(self.wait_key(key, what))  # the store's host may die from here on too
        parts = [self.guard(lambda: self.store.get(f"{key}/{i}"), f"reading {what}")
                 for i in range(n)]
        if self.guard(lambda: self.store.add(f"{key}/read", 1), f"reading {what}") == readers:
            for k in [f"{key}/{i}" for i in range(n)] + [key, f"{key}/read"]:
                self.guard(lambda: self.store.delete_key(k), f"deleting {what}")
        return pickle.loads(b"".join(parts))


def buckets(model) -> list[list[torch.Tensor]]:
    """The parameters in named_parameters order (the same on both sides), cut into buckets of
    BUCKET_BYTES."""
    out, size = [[]], 0
    for p in model.parameters():
        if out[-1] and size + p.numel() * p.element_size() > BUCKET_BYTES:
            out, size = out + [[]], 0
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return out


class SamplerLink:
    """A sampler's end: the trainer leader's headers (store) and weights (`weights` group) in;
    rollouts out (put)."""
    trains = False

    def __init__(self, wire: Wire, weights):
        self.wire, self.weights, self.heads = wire, weights, 0

    def receive_weights(self, model) -> dict:
        """The next header, and the weights it announces copied in place (CUDA graphs keep
        addresses)."""
        head = pickle.loads(self.wire.wait_key(f"head/{self.heads}", "a weight header"))
        self.heads += 1
        for b in buckets(model) if head.get("weights") else []:
            flat = torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            self.wire.guard(lambda: dist.broadcast(flat, self.wire.peer, self.weights),
                            "receiving the weights")
            for p, x in zip(b, flat.split([p.numel() for p in b])):
                p.data.copy_(x.view_as(p))
        return head


class TrainerLink:
    """A trainer's end: rollouts in (store; every trainer reads them); headers and weights out, from
    the leader."""
    trains = True

    def __init__(self, cfg, proc: infra.Proc, wire: Wire, weights):
        self.K, self.proc, self.wire, self.weights = cfg.max_staleness, proc, wire, weights
        self.heads, self.pending, self.works, self.settled_s = 0, deque(), [], 0.0
        # take's phase mark (train.py's time/<phase>_s): nowhere until publish hands it the run's
        self.laps, self.clock = deque(maxlen=1), time.perf_counter
        # the last step the samplers may sample; the last step taken from them
        self.allowed = self.received = 0

    def publish(self, run, version: int, last: int, state=None, rollouts=None, group_cls=None):
        """After optimizer step `version` (every rank: the gather is collective): allow steps up to
        min(version + 1 + K, last) and post π_v, unless no new step is allowed (the last K + 1
        steps: no sampler would use it). With `state` (the RL stage's start): the header carries it;
        `rollouts` (a checkpoint's) are queued first."""
        self.wire.step, self.laps, self.clock = version, run.laps, run.clock  # take's phase mark
        if state is not None:
            self.pending = deque(dict(m, groups=[group_cls(**g) for g in m["groups"]])
                                 for m in rollouts or [])
            self.received = self.allowed = version + len(self.pending)
        head = {"version": version, "allowed": min(version + 1 + self.K, last),
                "next": self.allowed + 1,
                "state": dataclasses.asdict(state) if state is not None else None}
        head["weights"], self.allowed = (state is not None or head["allowed"] > self.allowed,
                                         head["allowed"])
        # the full weights, every rank
        model = infra.sampling(run.sampler, run.model) if head["weights"] else None
        if self.proc.rank != 0:
            return
        self.settle("the previous weight broadcast")  # its buffers go before the next are built
        self.post(head)  # the header first: a sampler joins the broadcasts once it reads it
        for flat in ([torch.cat([p.detach().reshape(-1) for p in b]) for b in buckets(model)]
                     if model else []):
            self.works.append(self.wire.guard(
                lambda: dist.broadcast(flat, self.wire.rank, group=self.weights, async_op=True),
                "posting the weights"))

    def settle(self, what: str = "the last weight broadcast"):
        """Waits for the leader's last weight broadcasts to the samplers and frees them: before
        publish, eval, save."""
        t0 = time.time()
        for w in self.works:
            self.wire.guard(lambda: w.wait(timedelta(seconds=self.wire.hung_s)), what)
        # idle: the next take's wait
        self.works, self.settled_s = [], self.settled_s + time.time() - t0

    def post(self, head: dict):
        self.wire.guard(lambda: self.wire.store.set(f"head/{self.heads}", pickle.dumps(head)),
                        "posting a header")
        self.heads += 1

    def receive(self, state) -> dict:
        """The next step's rollouts; the samplers' TrainState after them becomes ours (it is
        checkpointed)."""
        self.received += 1
        msg = self.wire.get(f"roll/{self.received}", f"the rollouts of step {self.received}",
                            self.proc.world)
        vars(state).update(msg["state"])  # rl_cursor, pass_history, keep_rate
        return msg

    def take(self, state, step: int) -> tuple[list, dict]:
        """(groups, stats) of RL step `step`, with its staleness (asserted ≤ K) and both sides'
        times (the trainer's wait: for these rollouts, and for the broadcasts settled since the last
        take)."""
        self.wire.step, t0 = step, time.time()
        msg = self.pending.popleft() if self.pending else self.receive(state)
        waited, stale, self.settled_s = (time.time() - t0 + self.settled_s,
                                         step - 1 - msg["version"], 0.0)
        if msg["step"] != step or not 0 <= stale <= self.K:
            raise SideError(f"trainer rank {self.wire.rank}: rollouts of step {msg['step']} "
                            f"sampled with π_{msg['version']} offered to step {step} "
                            f"(staleness {stale}, max_staleness = {self.K})")
        self.laps.append(("wait", self.clock()))  # the step's time/wait_s (train.py's phases)
        return msg["groups"], {**msg["stats"], "train/staleness": stale,
                               "time/trainer_wait_s": waited,
                               "time/sampler_wait_s": msg["wait_s"],
                               "time/rollout_s": msg["sample_s"],
                               "time/sample_tok_per_s": msg["tokens"] / max(msg["sample_s"], 1e-9)}

    def checkpoint(self, state, step: int) -> list[dict]:
        """At step `step`'s checkpoint: the rollouts of steps step + 1 .. step + K, taken now (state
        follows them; a resume starts the samplers after them), as plain dicts."""
        self.settle()
        while self.received < min(step + self.K, self.allowed):
            self.pending.append(self.receive(state))
        return [dict(m, groups=[vars(g) for g in m["groups"]]) for m in self.pending]

    def stop(self, state):
        """Take the allowed rollouts not yet taken (a clocked stage ends early), then stop the
        samplers."""
        while self.received < self.allowed:
            self.receive(state)
        if self.proc.rank == 0:
            self.settle()
            self.post({"stop": True})


Link = SamplerLink | TrainerLink  # split's answer on this rank: the end of the link its side holds


def sampler_loop(run, state, draw) -> dict:
    """A sampler rank's run: sample every allowed step with the newest weights it was sent (draw =
    train.dynamic_sampling) until told to stop. Its idle time (wait_s): everything between two
    steps' sampling."""
    link, head = run.link, run.link.receive_weights(run.model)
    # no RL stage (rl_steps = 0, or a resume of a finished run): nothing to sample
    if head.get("stop"):
        return {}
    vars(state).update(head["state"])
    nxt, idle_from = head["next"], time.time()
    while not head.get("stop"):
        while nxt <= head["allowed"]:
            link.wire.step, t1 = nxt, time.time()
            groups, stats = draw(run, state, nxt)
            msg = {"step": nxt, "version": head["version"], "groups": groups, "stats": stats,
                   "wait_s": t1 - idle_from, "sample_s": time.time() - t1,
                   "tokens": sum(len(c) for g in groups for c in g.comps),
                   "state": {k: vars(state)[k] for k in ("rl_cursor", "pass_history",
                                                         "keep_rate")}}
            idle_from = time.time()
            if run.proc.rank == 0:  # into the store: no wait for the trainers (see the docstring)
                link.wire.put(f"roll/{nxt}", msg)
            nxt += 1
        head = link.receive_weights(run.model)
    return {}

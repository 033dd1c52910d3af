"""async_rl.py: sampler ranks vs trainer ranks. K = 0 equals the colocated loop bit for bit (1 sampler + 1 trainer vs
1 rank; 1 sampler + 2 trainers vs 2 ranks), K = 1 trains on rollouts exactly one version old, a killed side stops
the other with an error naming it, and a run killed with -9 at K = 1 resumes to the uninterrupted run's weights."""
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import records

import async_rl
import infra
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ARGS = ["--config", SMOKE, "--threads=1", "--sft_steps=3", "--rl_steps=4", "--overlong_buffer=20", "--eval_every=100",
        "--eval_n=8", "--ckpt_every=100", "--async_timeout=60"]  # overlong shaping: every group has reward spread


def launch(args, nproc, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] * (nproc > 1)
    return subprocess.Popen((cmd or [sys.executable]) + [os.path.join(ROOT, "train.py")] + args, cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def run(args, nproc):
    p = launch(args, nproc)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out[-4000:]
    return out


def same_run(a, b, tol=0.0):
    """Every logged number but timings and the async-only keys equal (within tol); step_7's weights bit-equal."""
    ra, rb = records(a), records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        for k in x:
            if not k.startswith("time/"):
                assert abs(x[k] - y[k]) <= tol * (k == "train/mismatch_kl") if isinstance(x[k], float) \
                    else x[k] == y[k], (x["step"], k, x[k], y[k])
    wa, wb = (load_file(os.path.join(d, "step_7", "model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    return rb


@pytest.mark.slow
def test_one_sampler_rank_at_staleness_0_is_the_colocated_run(tmp_path):
    run(ARGS + [f"--out_dir={tmp_path / 'one'}"], 1)
    out = run(ARGS + ["--sampler_ranks=1", "--max_staleness=0", f"--out_dir={tmp_path / 'two'}"], 2)
    recs = same_run(tmp_path / "one", tmp_path / "two")
    assert [r["train/staleness"] for r in recs if "train/staleness" in r] == [0, 0, 0, 0]
    assert "world size 1" in out and "w^TIS" not in out  # the trainer side's world; tis = auto is none at K = 0


@pytest.mark.slow
def test_one_sampler_and_two_trainers_equal_two_colocated_ranks(tmp_path):
    args = ARGS + ["--prompts_per_step=3"]  # the trainers hold 2 and 1 groups
    run(args + [f"--out_dir={tmp_path / 'two'}"], 2)
    run(args + ["--sampler_ranks=1", f"--out_dir={tmp_path / 'three'}"], 3)
    # the sampler's log-probs come from one batch of 3 prompts, not two of 2 and 1: the same tokens, and log-prob
    # bits that move only KL(μ‖π_old) (~1e-14); everything trained on is equal
    same_run(tmp_path / "two", tmp_path / "three", tol=1e-12)


@pytest.mark.slow
def test_staleness_1_trains_each_step_on_the_previous_version(tmp_path):
    out = run(ARGS + ["--sampler_ranks=1", "--max_staleness=1", f"--out_dir={tmp_path / 'k1'}"], 2)
    recs = [r for r in records(tmp_path / "k1") if "train/staleness" in r]
    assert [r["train/staleness"] for r in recs] == [0, 1, 1, 1]  # step 4 is the first: π_3 is the newest there is
    assert all(r["train/tis_max"] >= 1 and r["train/mismatch_kl"] >= 0 for r in recs)
    assert max(r["train/mismatch_kl"] for r in recs[1:]) > 1e3 * recs[0]["train/mismatch_kl"]  # stale: μ ≠ π_old
    assert "w^TIS_token (truncate, C = 2)" in out  # tis = auto: the clipped behaviour correction at K > 0


@pytest.mark.slow
def test_a_clock_stopped_stage_takes_what_the_samplers_were_allowed_then_stops_them(tmp_path):
    # rl_minutes ends RL after its first step while step 5 (K = 2: steps 5 and 6) is sampled or under way
    run(ARGS + ["--sampler_ranks=1", "--max_staleness=2", "--rl_minutes=1e-6", f"--out_dir={tmp_path / 'k2'}"], 2)
    assert [r["step"] for r in records(tmp_path / "k2") if "train/staleness" in r] == [4]
    assert os.path.exists(tmp_path / "k2" / "step_4" / "model.safetensors")


def spawn(rank, args, port):
    """One rank without torchrun (whose agent would stop the survivor itself): rank 0 hosts the store."""
    env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py")] + args, cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("victim,survivor_says", [
    (0, "trainer rank 1 at step"),  # the sampler (and the store it hosts) dies: the trainer's wait fails at once
    (1, "sampler rank 0 at step")])  # the trainer dies: the sampler sees its beat stop, async_timeout later
def test_a_killed_side_stops_the_other_with_an_error_naming_it(tmp_path, victim, survivor_says):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    args = ARGS + ["--sampler_ranks=1", "--max_staleness=1", "--rl_steps=200", "--async_timeout=5",
                   f"--out_dir={out}"]
    procs = [spawn(r, args, port) for r in (0, 1)]
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(out / "metrics.jsonl") and
                                          any(r["stage"] == "rl" for r in records(out, live=True))):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[0][-3000:]
        time.sleep(0.05)
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.time()
    text = procs[1 - victim].communicate(timeout=60)[0]
    assert procs[1 - victim].returncode != 0 and time.time() - t0 < 5 + 20, text[-3000:]
    assert "SideError" in text and survivor_says in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("K,in_flight", [(1, [(6, 4)]), (2, [(6, 3), (7, 4)])])  # (step, version) saved at 5
def test_killed_async_run_resumes_exactly(tmp_path, K, in_flight):
    """kill -9 at step 7, resume from step 5's checkpoint (which holds the K steps in flight), evals every other
    step and a checkpoint in the middle: the uninterrupted run's metrics and weights."""
    args = ARGS + ["--sampler_ranks=1", f"--max_staleness={K}", "--rl_steps=8", "--ckpt_every=5", "--keep_ckpts=0",
                   "--train_size=6", "--eval_every=2"]  # the prompt stream and pass-rate memory travel with them
    run(args + [f"--out_dir={tmp_path / 'full'}"], 2)
    out = tmp_path / "killed"
    p = launch(args + [f"--out_dir={out}"], 2, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:  # kill every process once step 7 is logged (checkpoint: 5)
        if os.path.exists(out / "step_5") and any(r["step"] >= 7 for r in records(out, live=True)):
            os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    saved = torch.load(out / "step_5" / "trainer_state.pt", weights_only=False)
    assert [(m["step"], m["version"]) for m in saved["rollouts"]] == in_flight
    run(args + [f"--out_dir={out}", "--resume"], 2)
    strip = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records(out)]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records(tmp_path / "full")]
    a, b = (load_file(d / "step_11" / "model.safetensors") for d in (tmp_path / "full", out))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sampler_ranks_must_leave_a_trainer():
    with pytest.raises(Exception, match="sampler_ranks = 1 leaves no trainer rank"):
        train.build_run(train.parse_args(["--config", SMOKE, "--sampler_ranks=1"]))


@pytest.mark.slow
def test_sharded_trainers_resume_from_a_checkpoint_exactly(tmp_path):
    """FSDP2 over 2 trainer ranks beside a sampler (the side's own group), K = 1: a resume from step 5's
    checkpoint (the later ones removed) ends where the whole run did. infra.full_state gathers the optimizer state
    itself; dcp's "rank 0 only" would mean global rank 0, the sampler."""
    nproc, args = 3, ARGS + ["--sampler_ranks=1", "--max_staleness=1", "--rl_steps=6", "--ckpt_every=5",
                             "--keep_ckpts=0", "--prompts_per_step=3"]
    run(args + [f"--out_dir={tmp_path / 'full'}"], nproc)
    shutil.copytree(tmp_path / "full", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "step_9")
    run(args + [f"--out_dir={tmp_path / 'again'}", "--resume"], nproc)
    strip = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records(tmp_path / "again")]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records(tmp_path / "full")]
    a, b = (load_file(tmp_path / d / "step_9" / "model.safetensors") for d in ("full", "again"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("K", [2, 3])
def test_staleness_2_and_3_run_to_the_end_with_evals_and_a_checkpoint_between_steps(tmp_path, K):
    """K >= 2 deadlocked at the second RL step (the sampler sent step v + K before it took π_v, while the trainer
    leader waited for π_v's broadcast): 8 RL steps, an eval every other step, checkpoints at 5 and 10."""
    run(ARGS + ["--sampler_ranks=1", f"--max_staleness={K}", "--rl_steps=8", "--eval_every=2", "--ckpt_every=5",
                f"--out_dir={tmp_path / 'k'}"], 2)
    recs = records(tmp_path / "k")
    assert [r["train/staleness"] for r in recs if "train/staleness" in r] == [min(K, s) for s in range(8)]
    assert [r["step"] for r in recs if "eval/pass@1" in r] == [0, 2, 3, 4, 6, 8, 10, 11]  # base, SFT end, end
    assert os.path.exists(tmp_path / "k" / "step_10" / "trainer_state.pt")


@pytest.mark.slow
def test_no_rl_stage_and_a_finished_run_resumed_stop_the_samplers_cleanly(tmp_path):
    """The first header the samplers read is "stop" (it used to be a KeyError on the sampler)."""
    run(ARGS + ["--sampler_ranks=1", "--rl_steps=0", f"--out_dir={tmp_path / 'sft'}"], 2)
    assert [r["stage"] for r in records(tmp_path / "sft")] == ["base", "sft", "sft", "sft", "sft"]
    args = ARGS + ["--sampler_ranks=1", "--max_staleness=1", "--rl_steps=2", f"--out_dir={tmp_path / 'done'}"]
    run(args, 2)
    before = records(tmp_path / "done")
    run(args + ["--resume"], 2)
    assert records(tmp_path / "done") == before  # nothing left to do, nothing logged twice


@pytest.mark.slow
def test_an_eval_longer_than_async_timeout_is_no_failure(tmp_path):
    """async_timeout bounds a silent peer (its beat); the groups' op timeout is collective_timeout. With one
    timeout for both, the sampler's send of step s + 1 timed out during the trainers' eval of step s."""
    out = run(ARGS + ["--sampler_ranks=1", "--max_staleness=1", "--rl_steps=3", "--eval_every=4", "--eval_n=2000",
                      "--eval_k=8", "--eval_batch=2000", "--async_timeout=2", f"--out_dir={tmp_path / 'k1'}"], 2)
    evals = {r["step"]: r["time/eval_s"] for r in records(tmp_path / "k1") if "time/eval_s" in r}
    assert list(evals) == [3, 4, 6] and evals[4] > 2, (evals, out[-2000:])  # step 4's eval outlasted the timeout,
    # while the sampler sent step 6's rollouts (allowed by π_4's header at K = 1)


@pytest.mark.slow
def test_at_staleness_0_the_sampler_waits_through_each_training_step(tmp_path):
    """time/sampler_wait_s is everything between two steps' sampling (sending, the header, the weights): at K = 0
    the sampler cannot start step s before the trainer has trained step s - 1."""
    run(ARGS + ["--sampler_ranks=1", "--max_staleness=0", "--rl_steps=4", f"--out_dir={tmp_path / 'k0'}"], 2)
    recs = [r for r in records(tmp_path / "k0") if "train/staleness" in r]
    assert all(b["time/sampler_wait_s"] >= a["time/train_s"] for a, b in zip(recs, recs[1:]))
    # the trainer's phases: its wait for the rollouts (take's mark), then the update; it samples nothing itself
    assert all(r["time/wait_s"] > 0 and r["time/forward_s"] > 0 and "time/sample_s" not in r for r in recs), recs


def test_a_rollout_message_with_a_tensor_off_the_cpu_is_refused():
    box = {"groups": [{"logprobs": [torch.zeros(3), torch.zeros(2, device="meta")]}]}
    with pytest.raises(async_rl.SideError, match="holds a tensor on meta"):
        async_rl._CPUOnly(io.BytesIO()).dump(box)
    async_rl._CPUOnly(io.BytesIO()).dump({"groups": [{"logprobs": [torch.zeros(3)]}]})  # CPU tensors pickle


def _wire(monkeypatch, rank, side, peer, port, dead=600.0, hung=3600.0):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    cfg = types.SimpleNamespace(async_timeout=dead, collective_timeout=hung)
    return async_rl.Wire(cfg, rank, side, peer)


def test_a_wait_names_a_dead_peer_and_a_hung_one(monkeypatch):
    """A peer with no beat is dead after async_timeout; one that beats but makes no progress (its collectives)
    is hung after collective_timeout: the error says which, and the peer's step."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    waiter = _wire(monkeypatch, 1, "trainer", 0, host.port, dead=1.0, hung=2.0)
    t0 = time.time()
    with pytest.raises(async_rl.SideError, match="no the rollouts of step 1 and no sign of life for async_timeout = 1 s"):
        waiter.wait_key("roll/1", "the rollouts of step 1")  # rank 0 never beats
    assert time.time() - t0 < 5
    peer = _wire(monkeypatch, 0, "sampler", 1, host.port)  # beats; nothing in this process runs a collective
    peer.step = 7
    with pytest.raises(async_rl.SideError, match="alive at its step 7 but has made no progress for "
                                                 "collective_timeout = 2 s"):
        waiter.wait_key("roll/1", "the rollouts of step 1")
    for w in (waiter, peer):
        w.close()  # before the store's host goes


def test_a_message_goes_through_the_store_in_chunks_and_the_last_reader_deletes_it(monkeypatch):
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setattr(async_rl, "CHUNK_BYTES", 1000)
    a, b = (_wire(monkeypatch, r, "trainer", 0, host.port) for r in (1, 2))
    msg = {"step": 3, "groups": [list(range(2000))], "logprobs": torch.randn(500)}
    a.put("roll/3", msg)
    assert int(a.store.get("roll/3")) > 5  # several chunks
    for w in (a, b):
        got = w.get("roll/3", "the rollouts of step 3", readers=2)
        assert got["groups"] == msg["groups"] and torch.equal(got["logprobs"], msg["logprobs"])
    assert not a.store.check(["roll/3"]) and not a.store.check(["roll/3/0"])
    for w in (a, b):
        w.close()


def test_the_store_dying_after_a_message_arrived_is_a_side_error(monkeypatch):
    """The store's host (rank 0) killed between wait_key's answer and the read (a CI flake: a bare
    DistNetworkError escaped): reading the chunks, counting the readers, deleting and posting fail as a
    SideError naming this side and what it was doing."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    w = _wire(monkeypatch, 1, "trainer", 0, host.port)
    real = w.store

    def dies_at(op):  # the key itself still answers (wait_key saw it); then `op` finds the host gone
        def gone(key, *a):
            if op == "set" or key != "roll/3":
                raise dist.DistNetworkError("Connection reset by peer")
            return getattr(real, op)(key, *a)
        ops = {name: getattr(real, name) for name in ("check", "get", "add", "delete_key")}
        return types.SimpleNamespace(**{**ops, op: gone})
    for op in ("get", "add", "delete_key"):
        w.put("roll/3", {"step": 3})
        w.store = dies_at(op)
        with pytest.raises(async_rl.SideError, match="trainer rank 1 at step 0: (reading|deleting) the "
                                                     "rollouts of step 3 failed .*reset by peer"):
            w.get("roll/3", "the rollouts of step 3", readers=1)
        w.store = real
    w.store = dies_at("set")
    with pytest.raises(async_rl.SideError, match="posting roll/4 failed .*reset by peer"):
        w.put("roll/4", {"step": 4})
    w.store = real
    w.close()


def test_evaluate_settles_the_weight_broadcast_before_it_samples(monkeypatch):
    """On NCCL a CUDA graph recorded during an eval synchronizes the device, pending broadcast included; the leader
    settles it first, so nothing pending is left for an eval (or a checkpoint) to wait on."""
    run, calls, sample = train.build_run(train.parse_args(["--config", SMOKE, "--eval_n=2", "--eval_k=1"])), [], \
        train.generate
    run.link = types.SimpleNamespace(settle=lambda: calls.append("settle"))
    monkeypatch.setattr(train, "generate", lambda *a, **k: calls.append("generate") or sample(*a, **k))
    train.evaluate(run, 0)
    assert calls[0] == "settle" and calls.count("settle") == 1 and "generate" in calls


def _beats(wires):
    """Until every wire's beat is in the store (the beat thread's first set comes a moment after the Wire)."""
    deadline = time.time() + 10
    while not all(w.store.check([f"alive/{w.rank}"]) for w in wires):
        assert time.time() < deadline, "no beat within 10 s"
        time.sleep(0.01)


def test_the_last_reader_leaves_no_key_of_the_step_behind(monkeypatch):
    """Three trainers read one step's message: until the last has read it, its count, chunks and read counter stay;
    after the last, the store holds exactly the keys it held before the message was put (the beats)."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setattr(async_rl, "CHUNK_BYTES", 1000)
    sampler = _wire(monkeypatch, 0, "sampler", 1, host.port)
    trainers = [_wire(monkeypatch, r, "trainer", 0, host.port) for r in (1, 2, 3)]
    _beats([sampler] + trainers)
    before, msg = host.num_keys(), {"step": 3, "groups": [list(range(1500))]}
    sampler.put("roll/3", msg)
    n = int(sampler.store.get("roll/3"))
    assert n > 2 and host.num_keys() == before + n + 1  # the chunks and their count
    for i, w in enumerate(trainers, 1):
        assert w.get("roll/3", "the rollouts of step 3", readers=3) == msg
        if i < 3:  # not the last reader: everything is still there for the others, and the count of reads so far
            assert all(w.store.check([f"roll/3/{c}"]) for c in range(n)) and w.store.check(["roll/3"])
            assert int(w.store.get("roll/3/read")) == i
    assert not any(sampler.store.check([k]) for k in ["roll/3", "roll/3/read"] + [f"roll/3/{c}" for c in range(n)])
    assert host.num_keys() == before
    for w in [sampler] + trainers:
        w.close()


def test_a_peer_making_progress_is_not_hung_however_long_the_wait(monkeypatch):
    """collective_timeout bounds a peer's silence in progress, not the wait: a sampler that stays at its step but
    keeps entering collectives (its ticks move) for 2.5 x collective_timeout is waited for, and its message read."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setattr(infra, "TICKS", infra.TICKS)  # restored after the test
    waiter = _wire(monkeypatch, 1, "trainer", 0, host.port, dead=30.0, hung=2.0)
    peer = _wire(monkeypatch, 0, "sampler", 1, host.port, dead=1.0)  # beats every 0.1 s
    done = threading.Event()

    def works():  # a collective every 0.05 s for 5 s, then the message
        t_end = time.time() + 5
        while time.time() < t_end:
            infra.TICKS += 1
            time.sleep(0.05)
        peer.store.set("roll/1", "ready")
        done.set()
    worker = threading.Thread(target=works, daemon=True)
    t0 = time.time()
    worker.start()
    try:
        assert waiter.wait_key("roll/1", "the rollouts of step 1") == b"ready"
        assert time.time() - t0 >= 5  # the wait did outlast collective_timeout
    finally:
        done.wait(10)
        for w in (waiter, peer):
            w.close()


def test_a_hung_peer_is_named_with_the_side_and_rank_that_waited_for_it(monkeypatch):
    """No progress for collective_timeout (the beat goes on): the error names the waiter (side, rank, step), what
    it waited for, and the peer (side, leader rank, step); both ways round, and never before collective_timeout."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    sampler = _wire(monkeypatch, 0, "sampler", 2, host.port, dead=30.0, hung=2.0)
    trainer = _wire(monkeypatch, 2, "trainer", 0, host.port, dead=30.0, hung=2.0)
    sampler.step, trainer.step = 9, 4
    _beats([sampler, trainer])
    for waiter, what, says in [
            (trainer, "the rollouts of step 5", "trainer rank 2 at step 4: no the rollouts of step 5; the peer is "
             "alive at its step 9 but has made no progress for collective_timeout = 2 s (sampler side, leader rank 0)"),
            (sampler, "a weight header", "sampler rank 0 at step 9: no a weight header; the peer is alive at its "
             "step 4 but has made no progress for collective_timeout = 2 s (trainer side, leader rank 2)")]:
        t0 = time.time()
        with pytest.raises(async_rl.SideError, match="^" + re.escape(says) + "$"):
            waiter.wait_key("never/set", what)
        assert 2 <= time.time() - t0 < 2 + 10
    for w in (sampler, trainer):
        w.close()


def test_a_dead_peer_is_dead_even_when_collective_timeout_is_the_shorter(monkeypatch):
    """collective_timeout < async_timeout: a peer that never beats is not 'alive but hung' after collective_timeout;
    it is dead after async_timeout (the error said 'alive at its step ?' before)."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    waiter = _wire(monkeypatch, 1, "trainer", 0, host.port, dead=3.0, hung=1.0)  # rank 0 never beats
    t0 = time.time()
    with pytest.raises(async_rl.SideError, match="no sign of life for async_timeout = 3 s"):
        waiter.wait_key("roll/1", "the rollouts of step 1")
    assert 3 <= time.time() - t0 < 3 + 10
    waiter.close()


def _trainer_link(monkeypatch, port, K=1, hung=3600.0):
    wire = _wire(monkeypatch, 1, "trainer", 0, port, hung=hung)
    cfg = types.SimpleNamespace(max_staleness=K)
    return async_rl.TrainerLink(cfg, infra.Proc(0, 1, torch.device("cpu")), wire, None)


def _rollouts(step, version):
    return {"step": step, "version": version, "groups": [f"groups of step {step}"], "stats": {"rl/x": 1.0},
            "wait_s": 0.0, "sample_s": 1.0, "tokens": 10, "state": {"rl_cursor": step, "pass_history": {}}}


def test_rollouts_staler_than_max_staleness_are_refused_not_trained_on(monkeypatch):
    """At K = 1, step s trains on π_{s-2} or π_{s-1}: rollouts of π_{s-3} (staleness 2) or of a version the trainer
    has not made yet (staleness -1) raise, naming the staleness; π_{s-2} (staleness K) is taken."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    link = _trainer_link(monkeypatch, host.port, K=1)
    link.received, link.allowed = 4, 7  # steps 1..4 taken; the samplers were allowed up to step 7
    for step, version in [(5, 2), (6, 4), (7, 7)]:
        link.wire.put(f"roll/{step}", _rollouts(step, version))
    state = types.SimpleNamespace(rl_cursor=0, pass_history={})
    with pytest.raises(async_rl.SideError, match=r"π_2 offered to step 5 \(staleness 2, max_staleness = 1\)"):
        link.take(state, 5)
    groups, stats = link.take(state, 6)
    assert groups == ["groups of step 6"] and stats["train/staleness"] == 1 and stats["rl/x"] == 1.0
    with pytest.raises(async_rl.SideError, match=r"π_7 offered to step 7 \(staleness -1, max_staleness = 1\)"):
        link.take(state, 7)
    link.wire.close()


def test_settle_waits_for_a_broadcast_no_sampler_joins_for_collective_timeout_then_names_it(monkeypatch):
    """A real gloo broadcast (two in-process ranks; the sampler never joins) pending on the leader: settle raises
    about collective_timeout = 2 s later, naming what it waited for, neither sooner nor only at the group's own
    op timeout (20 s here; a run sets both to collective_timeout)."""
    host, meet, pgs = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10)), dist.HashStore(), {}

    def join(rank):
        pgs[rank] = dist.ProcessGroupGloo(meet, rank, 2, timedelta(seconds=20))
    ranks = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(30)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    link = _trainer_link(monkeypatch, host.port, hung=2.0)
    link.works = [pgs[0].broadcast([torch.ones(1000)], opts)]
    t0 = time.time()
    try:
        with pytest.raises(async_rl.SideError, match=r"trainer rank 1 at step 0: the previous weight broadcast failed "
                                                     r"\(the other side died or timed out\) \(sampler side, "
                                                     r"leader rank 0\): .+"):  # the cause
            link.settle("the previous weight broadcast")
        assert 2 <= time.time() - t0 < 2 + 10
        got = torch.zeros(1000)  # the sampler joins at last: the broadcast was still pending, and now completes
        pgs[1].broadcast([got], opts).wait(timedelta(seconds=30))
        assert torch.equal(got, torch.ones(1000))
    finally:
        link.wire.close()

"""async_rl.py: sampler ranks vs trainer ranks. K = 0 equals the colocated loop bit for bit (1 sampler + 1 trainer vs
1 rank; 1 sampler + 2 trainers vs 2 ranks), K = 1 trains on rollouts exactly one version old, a killed side stops
the other with an error naming it, and a run killed with -9 at K = 1 resumes to the uninterrupted run's weights."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ARGS = ["--config", SMOKE, "--threads=1", "--sft_steps=3", "--rl_steps=4", "--overlong_buffer=20", "--eval_every=100",
        "--eval_n=8", "--ckpt_every=100", "--async_timeout=60"]  # overlong shaping: every group has reward spread


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f]


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
                                          any(r["stage"] == "rl" for r in records(out))):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[0][-3000:]
        time.sleep(0.05)
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.time()
    text = procs[1 - victim].communicate(timeout=60)[0]
    assert procs[1 - victim].returncode != 0 and time.time() - t0 < 5 + 20, text[-3000:]
    assert "SideError" in text and survivor_says in text, text[-3000:]


@pytest.mark.slow
def test_killed_async_run_resumes_exactly_at_staleness_1(tmp_path):
    args = ARGS + ["--sampler_ranks=1", "--max_staleness=1", "--rl_steps=8", "--ckpt_every=5", "--keep_ckpts=0",
                   "--train_size=6"]  # the prompt stream and its pass-rate memory travel with the rollouts
    run(args + [f"--out_dir={tmp_path / 'full'}"], 2)
    out = tmp_path / "killed"
    p = launch(args + [f"--out_dir={out}"], 2, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:  # kill every process once step 7 is logged (checkpoint: 5)
        if os.path.exists(out / "step_5") and any(r["step"] >= 7 for r in records(out)):
            os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    saved = torch.load(out / "step_5" / "trainer_state.pt", weights_only=False)
    assert [m["step"] for m in saved["rollouts"]] == [6] and saved["rollouts"][0]["version"] == 4
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

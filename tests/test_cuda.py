"""The CUDA path, for a developer with a GPU: python -m pytest -q -s tests/test_cuda.py (skipped without CUDA).

bf16 against float32 logits; the captured (CUDA graph) decode step against the eager one; generate on CUDA, and
the trainer's bf16 scores of its samples; a few SFT + RL steps
at world size 1 (FSDP2 on a 1-rank group: the dtypes of world size 8) with π_ref in bf16; the peak memory of one
RL micro-batch's log-probs at Qwen's 151,936-token vocabulary (printed); with 2+ GPUs, the smoke run on 2 NCCL
ranks against 1 rank.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from model import ModelConfig, Transformer
from rollout import generate, pad_batch, score

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ["--config", os.path.join(ROOT, "configs", "smoke.toml"), "--device=cuda", "--wandb_mode=disabled"]


def qwen(vocab=4096, hidden=256, layers=4):
    torch.manual_seed(0)
    return Transformer(ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=vocab, hidden_size=hidden,
                                   n_layers=layers, n_heads=4, n_kv_heads=2, intermediate_size=4 * hidden,
                                   max_seq_len=512)).cuda()


def test_bf16_logits_follow_float32():
    m = qwen()
    idx = torch.randint(0, 4096, (4, 64), device="cuda")
    with torch.no_grad():
        ref = m(idx).float().log_softmax(-1)
        with torch.autocast("cuda", torch.bfloat16):
            got = m(idx).float().log_softmax(-1)
        low = m.to(torch.bfloat16)(idx).float().log_softmax(-1)  # bf16 weights, as FSDP computes
    for x in (got, low):  # bf16 keeps 8 mantissa bits: log-probs agree to a few hundredths
        err = (x - ref).abs().max().item()
        print(f"max |log-prob bf16 - fp32| = {err:.4f}")
        assert err < 0.1 and (x.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_captured_decoding_samples_what_eager_decoding_samples():
    """float32, a vocabulary above decode.TWO_LEVEL_ABOVE (the two-level inverse CDF), stop ids that end rows apart
    (buckets halve), greedy and sampled: the same tokens; log-probs to 1e-4 (attention over more, masked slots)."""
    m = qwen(vocab=16384)
    prompts, stop = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]], list(range(3, 16384, 97))
    for T in (0.0, 1.0):
        eager = generate(m, prompts, 8, 48, temperature=T, stop_ids=stop, seed=0, static=False)
        captured = generate(m, prompts, 8, 48, temperature=T, stop_ids=stop, seed=0, static=True)
        assert torch.equal(eager.completion_ids, captured.completion_ids)
        assert torch.equal(eager.lengths, captured.lengths)
        assert (eager.logprobs - captured.logprobs).abs().max() < 1e-4
        print(f"T = {T}: lengths {sorted(set(eager.lengths.tolist()))}")


def test_generate_on_cuda_and_the_trainer_scores_it_the_same_way():
    m = qwen().to(torch.bfloat16)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    r = generate(m, prompts, 4, 32, temperature=1.0, seed=0)
    assert r.completion_ids.device.type == "cuda" and r.logprobs.dtype == torch.float32
    comps = [r.completion_ids[i, :r.lengths[i]].tolist() for i in range(12)]
    lp, _ = score(m, [prompts[i // 4] for i in range(12)], pad_batch(comps), 1.0, lengths=[len(c) for c in comps])
    gap = ((lp - r.logprobs[:, :lp.shape[1]]).abs() * r.completion_mask[:, :lp.shape[1]]).max().item()
    print(f"sampler vs trainer log-prob gap in bf16: {gap:.2e}")
    assert gap < 0.1  # the same weights, a different kernel mix (cached decode vs one causal forward)


def test_sft_and_rl_steps_at_world_size_1_in_bf16(tmp_path):
    out = tmp_path / "cuda"
    cfg = train.parse_args(SMOKE + [f"--out_dir={out}", "--beta=0.05", "--overlong_buffer=20",
                                    "--dynamic_sampling=false"])
    train.main(cfg)
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rl = [r for r in recs if r["stage"] == "rl" and "train/loss" in r]
    assert len(rl) == 4 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rl)
    assert rl[0]["train/kl"] == 0.0  # π_ref is π_θ in the same bf16 arithmetic: no spurious KL at the start
    print("RL steps:", [(r["train/loss"], r["train/kl"], r["train/logprob_gap_max"]) for r in rl])


def test_logprob_memory_of_one_rl_micro_batch_at_a_real_vocabulary():
    V, rows, prompt_len, new = 151936, 64, 192, 64  # 16,384 tokens: the qwen preset's micro_batch_tokens
    m = qwen(vocab=V, hidden=896, layers=2).to(torch.bfloat16)
    prompts = torch.randint(3, V, (rows, prompt_len)).tolist()
    comps = torch.randint(3, V, (rows, new))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, _ = score(m, prompts, comps, 1.0)
    (-lp.mean()).backward()
    peak = torch.cuda.max_memory_allocated() - base
    logits = rows * (prompt_len + new) * V * 4  # what full float32 logits of the micro-batch alone would take
    print(f"peak extra memory of log-probs + backward: {peak / 2 ** 30:.2f} GiB (full float32 logits: "
          f"{logits / 2 ** 30:.1f} GiB)")
    assert peak < logits / 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_ranks_match_one(tmp_path):
    args = SMOKE[:2] + ["--device=auto", "--wandb_mode=disabled", "--sft_steps=2", "--rl_steps=2", "--eval_every=100",
                        "--eval_n=8", "--dynamic_sampling=false", "--overlong_buffer=20", "--ckpt_every=100"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    for name, launch in [("one", [sys.executable]), ("two", [sys.executable, "-m", "torch.distributed.run",
                                                             "--standalone", "--nproc_per_node=2"])]:
        p = subprocess.run(launch + [os.path.join(ROOT, "train.py"), *args, f"--out_dir={tmp_path / name}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    one, two = ([json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("one", "two"))
    for a, b in zip(one, two):  # bf16 on both sides: rewards equal, losses close
        assert a.get("train/reward") == b.get("train/reward")
        if "train/loss" in a:
            assert abs(a["train/loss"] - b["train/loss"]) < 1e-2

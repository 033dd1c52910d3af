"""A decoder-only transformer of the Llama / Qwen2 family in plain PyTorch, with a preallocated
KV cache and Hugging Face-format checkpoint folders both ways (config.json + model.safetensors in
the source dtype; the source folder's tokenizer, chat template and generation files carried over
byte for byte).

The network (Llama, Touvron et al. 2023; Qwen2, Yang et al. 2024):
  1. h = embed_tokens[idx]                                                        [B, T, C]
  2. per block: h += o_proj(Attn(RoPE(q_proj(RMSNorm(h))), RoPE(k_proj(.)), v_proj(.)))  causal, GQA
                h += down_proj(silu(gate_proj(RMSNorm(h))) * up_proj(RMSNorm(h)))           SwiGLU
  3. logits = lm_head(RMSNorm(h))   (lm_head tied to embed_tokens or not)        [B, T, V]
RoPE (Su et al. 2021), half-split ("rotate_half") layout as in Hugging Face: for frequency i < D/2,
  θ_i = base^(−2i/D); at position p the pair (x_i, x_{i+D/2}) →
      (x_i cos pθ_i − x_{i+D/2} sin pθ_i, x_{i+D/2} cos pθ_i + x_i sin pθ_i).
Rows of a batch are left-padded: row b's real tokens start at slot start[b], its position at slot s
is s − start[b], and no query attends to a pad slot (a pad query attends to itself only, so it
never yields NaN). A training batch whose rows share prompts (a group's G samples) runs each
prompt once (Prefix). Module names are Hugging Face's, so state_dict() keys are checkpoint tensor
names: loading is strict=True.

  python -c "from model import *; m = Transformer(ModelConfig()); print(m)"
"""
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

# the files of a source folder that step_N/ does NOT carry over: weights, config.json (rewritten),
# model cards, dotfiles
NOT_CARRIED = ("config.json", "*.safetensors", "*.index.json", "*.bin", "*.pt", "*.pth", "*.gguf",
               "*.onnx", "*.h5", "*.msgpack", "README.md", ".*")
# oneDNN's GEMM on a weight reordered once into its blocked layout (as torch.compile's freezing
# does on CPU): decode's products 1.05-3.5x F.linear's speed on x86 (Transformer.packed)
PACKED_GEMM = (torch.backends.mkldnn.is_available()
               and torch.backends.cpu.get_cpu_capability().startswith("AVX"))


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies in bf16 natively (AVX512-BF16 or AMX, oneDNN's check): where
    train.py's cpu_bf16 = "auto" is on and bf16 weights pack. A torch built without oneDNN: no."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# float32 weights; bf16 ones (cpu_bf16's sampling copy) where oneDNN multiplies bf16 natively:
# 1.1-1.8x at 32 rows, the same bits as F.linear's (RESULTS.md §15)
PACKED_DTYPES = {torch.float32} | ({torch.bfloat16} if PACKED_GEMM and cpu_has_bf16() else set())
PACK_FROM = 2 ** 17  # weights of fewer elements (the CPU demo's) multiply faster unpacked
PRODUCTS_UPTO = 2 ** 22  # model.attention on CPU: by products up to 4M scores a call (16 MB)


@dataclass
class ModelConfig:
    model_type: str = "llama"          # "llama" (no q/k/v bias) or "qwen2" (q/k/v bias):
                                       #   the HF architecture
    vocab_size: int = 32               # V
    hidden_size: int = 128             # C
    n_layers: int = 4
    n_heads: int = 4                   # H
    n_kv_heads: int = 4                # H_kv; GQA (Ainslie et al. 2023) shares each K/V head
                                       #   by H / H_kv queries
    head_dim: int = 0                  # D; 0 means hidden_size // n_heads
    intermediate_size: int = 352       # SwiGLU hidden width (Shazeer 2020)
    max_seq_len: int = 256             # max_position_embeddings
    rope_theta: float = 10000.0        # RoPE base
    rope_scaling: dict | None = None   # None or Llama-3 style
                                       #   {"rope_type": "llama3", "factor", ...}
    rms_eps: float = 1e-6
    tie_embeddings: bool = True        # lm_head.weight is embed_tokens.weight
    attention_bias: bool = False       # bias on q/k/v (Qwen2: always; Llama: config.attention_bias)
    o_bias: bool = False               # bias on o_proj (Llama with attention_bias=True only)
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys,
                                                              #   written back unchanged

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.n_heads
        if self.model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type {self.model_type!r} is not supported: "
                             "use 'llama' or 'qwen2'")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.model_type == "qwen2" and (not self.attention_bias or self.o_bias):
            raise ValueError("qwen2 has q/k/v bias and no o_proj bias: "
                             "set attention_bias=True, o_bias=False")


# (our field, Hugging Face config.json key) for the keys every checkpoint must carry
HF_KEYS = [("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
           ("n_layers", "num_hidden_layers"),
           ("n_heads", "num_attention_heads"), ("intermediate_size", "intermediate_size"),
           ("max_seq_len", "max_position_embeddings"), ("rms_eps", "rms_norm_eps")]


def config_from_hf(d: dict, where: str) -> ModelConfig:
    """Hugging Face config.json dict -> ModelConfig; `where` names the file in every error."""
    mt = d.get("model_type")
    if mt not in ("llama", "qwen2"):
        raise ValueError(f"{where}: model_type {mt!r} is not supported "
                         "(expected 'llama' or 'qwen2')")
    if missing := [k for _, k in HF_KEYS if k not in d]:
        raise KeyError(f"{where}: missing config key(s) {missing}")
    kw = {ours: d[theirs] for ours, theirs in HF_KEYS}
    rope = d.get("rope_parameters") or {}           # transformers >= 5 nests the RoPE settings here
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                        else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", "llama3"):
        raise ValueError(f"{where}: rope scaling {scaling!r} is not supported (only 'llama3')")
    # Qwen2: layers >= max_window_layers slide
    n, win = d["num_hidden_layers"], d.get("sliding_window") or 0
    layers = d.get("layer_types") or ["sliding_attention"] * (
        n - min(n, d.get("max_window_layers", 28)))
    if (d.get("use_sliding_window") and 0 < win < d["max_position_embeddings"]
            and "sliding_attention" in layers):
        raise ValueError(f"{where}: sliding-window attention (window {win} on some layers) "
                         "is not supported")
    if bad := [k for k in ("attention_dropout", "quantization_config") if d.get(k)]:
        raise ValueError(f"{where}: {', '.join(bad)} not supported "
                         "(attention dropout must be 0, weights unquantized)")
    if d.get("mlp_bias") or d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: only a bias-free SwiGLU MLP "
                         "(hidden_act 'silu', mlp_bias false) is supported")
    bias = mt == "qwen2" or bool(d.get("attention_bias", False))
    known = {k for _, k in HF_KEYS} | {"model_type", "num_key_value_heads", "head_dim",
                                       "rope_theta", "rope_scaling", "rope_parameters",
                                       "tie_word_embeddings", "attention_bias"}
    return ModelConfig(model_type=mt,
                       n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                       head_dim=d.get("head_dim") or 0, rope_scaling=scaling,
                       o_bias=bias and mt == "llama",
                       rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 1e4))),
                       attention_bias=bias,
                       tie_embeddings=bool(d.get("tie_word_embeddings", True)),
                       extra={k: v for k, v in d.items() if k not in known}, **kw)


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    d = {"architectures": ["Qwen2ForCausalLM" if cfg.model_type == "qwen2" else "LlamaForCausalLM"],
         "hidden_act": "silu", "use_cache": True, **cfg.extra}
    d.update({theirs: getattr(cfg, ours) for ours, theirs in HF_KEYS})
    d.update(model_type=cfg.model_type, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
             rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
             # transformers < 4.56 reads the first
             **dict.fromkeys(("torch_dtype", "dtype"), str(dtype)[6:]))
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
    if cfg.model_type == "llama":
        d.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    return d


# -------------------------------------------------------------------------------------- the network
def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """θ_i = base^(−2i/D), i < D/2, float32 [D/2]; with Llama-3 frequency-dependent scaling when
    configured."""
    D = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    s = cfg.rope_scaling
    # Llama 3.1: slow down low frequencies by `factor`
    if s and s.get("rope_type", s.get("type")) == "llama3":
        f, lo, hi, old = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                          s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)             # linear blend between the two bands
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(mid, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    return inv


def rope_cos_sin(cfg: ModelConfig, n: int, device, dtype=torch.float32):
    """cos, sin [n, D] of the angles p·θ_i at positions p < n (computed in float32, then cast to
    dtype)."""
    ang = (torch.arange(n, device=device, dtype=torch.float32)[:, None]
           * rope_inv_freq(cfg, device)).repeat(1, 2)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B, H, T, D], cos/sin [B, 1, T, D]: rotate each (x_i, x_{i+D/2}) pair by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q, k, v, bias):
    """softmax(q kᵀ / √D + bias) v with GQA (q [B, H, T, D]; k, v [B, H_kv, S, D]; bias
    [B, 1, T, S]) by SDPA; on CPU up to PRODUCTS_UPTO scores, two batched products instead
    (float32 scores and softmax, then v's dtype), 2-3x faster than SDPA's CPU flash kernel at the
    trainer's rows of tens of tokens (RESULTS.md §15); the scores, saved for backward, grow as
    T·S: beyond, SDPA."""
    B, H, T, D = q.shape
    K, S = k.shape[1:3]
    if q.device.type != "cpu" or B * H * T * S > PRODUCTS_UPTO:
        return F.scaled_dot_product_attention(q, k, v, bias, enable_gqa=K < H)
    f = torch.promote_types(q.dtype, torch.float32)  # query head h reads key head h // (H / K):
    with torch.autocast("cpu", enabled=False):
        s = q.to(f).reshape(B, K, H // K * T, D) @ k.to(f).transpose(2, 3) * D ** -0.5
        p = (s.view(B, K, H // K, T, S) + bias[:, :, None]).softmax(-1).to(v.dtype)
        return (p.view(B, K, H // K * T, S) @ v).view(B, H, T, D)


def padded_causal(start: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, S] bool: query slot t sees key slot s iff s <= t, and s >= start[b] (no pad key)
    or s = t (a pad query sees itself: never NaN). start [B], slots [T], keys [S]."""
    own = keys[None, :] == slots[:, None]                                          # [T, S]
    return ((keys[None, :] <= slots[:, None]) & ((keys >= start[:, None])[:, None] | own))[:, None]


class Prefix:
    """A training batch laid out so that each distinct prompt runs once (the trainer's twin of the
    sampler's prefill shared by G samples): the U distinct prompts left-padded to S slots, then the
    n completion rows of T = L − 1 input tokens, row i continuing prompt rows[i], packed into one
    sequence idx [1, U·S + n·T], so per-token layers see one row and do each prompt's work once.
    Attention (attend) splits it: prompts attend causally among their own real slots; completion
    row i attends to its prompt's keys and values (indexed by rows: every row's gradient reaches
    the one prompt) and causally to its own. at [n, L]: the packed position whose output predicts
    completion token t (o_0: its prompt's last slot). ids, valid [n, L]: the completions, padded."""

    def __init__(self, prompts: list[list[int]], completions: list[list[int]], device):
        index = {}  # distinct prompt -> u, in order of first appearance
        rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
        U, S, n, L = len(index), max(map(len, index)), len(completions), max(map(len, completions))
        T = L - 1
        pad = [[0] * (S - len(p)) + list(p) for p in index]                             # [U, S]
        self.ids = torch.tensor([c + [0] * (L - len(c)) for c in completions], device=device)
        self.valid = torch.tensor([[t < len(c) for t in range(L)] for c in completions],
                                  device=device)                                        # [n, L]
        self.idx = torch.cat([torch.tensor(pad, device=device).view(-1),
                              self.ids[:, :-1].reshape(-1)])[None]                      # [1, .]
        self.rows = torch.tensor(rows, device=device)                                   # [n]
        start = torch.tensor([S - len(p) for p in index], device=device)              # [U]
        slots, own = torch.arange(S, device=device), torch.arange(T, device=device)
        self.pos = torch.cat([(slots - start[:, None]).clamp(min=0).view(-1),
                              ((S - start[self.rows])[:, None] + own).view(-1)])  # [U*S + n*T]
        self.prompt_mask = padded_causal(start, slots, slots)                    # [U, 1, S, S]
        # completions [n, 1, T, S + T]: their prompt's real slots, then their own tokens causally
        self.completion_mask = torch.cat([
            (slots >= start[self.rows][:, None])[:, None, :].expand(n, T, S),
            (own[None, :] <= own[:, None]).expand(n, T, T)], -1)[:, None]
        last = (torch.arange(U, device=device) * S + S - 1)[self.rows]                  # [n]
        self.at = torch.cat([last[:, None], U * S + torch.arange(n, device=device)[:, None] * T
                             + own], 1)                                                 # [n, L]
        self.U, self.S, self.n, self.T, self.biases = U, S, n, T, None
        # RoPE rows, and the longest real row's inputs (prompt + completion − 1)
        self.span = S + T
        self.length = max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1

    def attend(self, q, k, v, o_proj):
        """q [1, H, U·S + n·T, D], k, v [1, H_kv, ., D] -> o_proj(attention) [1, U·S + n·T, C],
        o_proj applied to each part (its input a view of the attention's output, not a copy)."""
        U, S, n, T = self.U, self.S, self.n, self.T
        if self.biases is None or self.biases[0].dtype != q.dtype:  # the masks as additive biases:
            # made once a forward, so every layer's attention saves the same two tensors
            self.biases = [torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~m, float("-inf")) for m in (self.prompt_mask, self.completion_mask)]

        def split(x):  # -> the prompts' slots [U, h, S, D], the rows' tokens [n, h, T, D]
            return (x[0, :, :U * S].unflatten(1, (U, S)).transpose(0, 1),
                    x[0, :, U * S:].unflatten(1, (n, T)).transpose(0, 1))
        (qp, qc), (kp, kc), (vp, vc) = split(q), split(k), split(v)
        y = attention(qp, kp, vp, self.biases[0])
        y = o_proj(y.transpose(1, 2).reshape(1, U * S, -1))                        # [1, U*S, C]
        if T == 0:  # one-token completions: o_0 comes from the prompt alone
            return y
        # each row over its prompt's keys and values, then its own tokens': [n, h, S + T, D]
        kc, vc = torch.cat([kp[self.rows], kc], 2), torch.cat([vp[self.rows], vc], 2)
        yc = attention(qc, kc, vc, self.biases[1])
        return torch.cat([y, o_proj(yc.transpose(1, 2).reshape(1, n * T, -1))], 1)  # [1, ., C]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    # normalise in float32 (float64 stays float64), as Hugging Face does, then scale in the input
    # dtype
    def forward(self, x):
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                              + self.eps)).to(x.dtype)


def linear(x, w, b=None, packed=None):
    """x wᵀ + b; without autograd and with `packed` (w as oneDNN reordered it), by that copy."""
    if packed is None or torch.is_grad_enabled():
        return F.linear(x, w, b)
    if torch.compiler.is_compiling():  # the compiled decode step's trace (define_packed_linear)
        return torch.ops.grpo.packed_linear(x, packed, b)
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def define_packed_linear():
    """The op grpo::packed_linear (once): linear's packed product as an op torch.compile calls as it
    is (inductor lowers oneDNN's own op only for weights frozen into the graph; these change every
    RL step). Defined by decode.compiled_step, not at import: torch.library's fake-tensor
    registration imports torch._dynamo, after which glibc's heap stops reusing freed large blocks
    (infra.py). A plain Library kernel: ~1 us a call, where torch.library.custom_op's ~13 us."""
    if hasattr(torch.ops.grpo, "packed_linear"):
        return
    lib = torch.library.Library("grpo", "DEF")
    lib.define("packed_linear(Tensor x, Tensor packed, Tensor? b) -> Tensor")
    for key in ("CPU", "MkldnnCPU"):  # the packed weight's key: a oneDNN tensor
        lib.impl("packed_linear", lambda x, packed, b: torch.ops.mkldnn._linear_pointwise(
            x, packed, b, "none", [], ""), key)
    torch.library.register_fake("grpo::packed_linear", lib=lib)(
        lambda x, packed, b: x.new_empty(*x.shape[:-1], packed.shape[0]))
    _LIBRARIES.append(lib)  # its registrations last as long as it does


_LIBRARIES = []


class Linear(nn.Linear):
    packed = None  # the weight reordered for oneDNN, while Transformer.packed holds (CPU decode)

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.packed)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Hkv, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q_proj = Linear(C, H * D, bias=cfg.attention_bias)
        self.k_proj = Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = Linear(H * D, C, bias=cfg.o_bias)

    packed = None  # q, k and v's weights stacked, reordered for oneDNN (Transformer.packed)

    def parts(self):
        return self.q_proj, self.k_proj, self.v_proj

    def project(self, x):  # q, k, v [B, T, ·]: one product while packed, else three
        if self.packed is None or torch.is_grad_enabled():
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = linear(x, None, self.packed_bias, self.packed)
        return qkv.split((self.H * self.D, self.Hkv * self.D, self.Hkv * self.D), -1)

    def forward(self, x, cos, sin, mask, cache, layer):
        B, T, _ = x.shape
        if cache is not None and T == 1:
            return self.decode(x, cos, sin, mask, cache, layer)
        q, k, v = self.project(x)
        q = q.view(B, T, self.H, self.D).transpose(1, 2)                    # [B, H, T, D]
        k = k.view(B, T, self.Hkv, self.D).transpose(1, 2)                  # [B, H_kv, T, D]
        v = v.view(B, T, self.Hkv, self.D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # write this chunk at slots [n, n+T), attend over every slot written so far
        if cache is not None:
            k, v = cache.write(layer, k, v)
        # masked GQA: SDPA's math kernel only on CUDA
        if mask is not None and x.is_cuda and self.Hkv < self.H:
            k, v = (k.repeat_interleave(self.H // self.Hkv, 1),
                    v.repeat_interleave(self.H // self.Hkv, 1))
        if isinstance(mask, Prefix):  # each prompt once, its completion rows over it
            return mask.attend(q, k, v, self.o_proj)
        y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None,
                                           enable_gqa=k.shape[1] < self.H)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.D))

    def decode(self, x, cos, sin, bias, cache, layer):
        """One token per row, K/V written at cache.slot: x [B, 1, C], cos/sin [B, 1, 1, D] (sin's
        first half negated), bias [B·H_kv, 1, W] (−inf: pad/future). Two batched matmuls per K/V
        head group (beat SDPA on CPU); bf16 scores q·k (training's flash keeps fp32): a
        sampler-trainer gap ~1e-2..1e-1 per token on GPU (logprob_gap_max, tis)."""
        B, Hkv, D, W = x.shape[0], self.Hkv, self.D, bias.shape[-1]
        q, k, v = self.project(x)
        q, k = (y * cos + y.roll(D // 2, -1) * sin for y in (q.view(B, self.H, 1, D),
                                                             k.view(B, Hkv, 1, D)))
        kc, vc = cache.k[layer], cache.v[layer]                             # [B, H_kv, slots, D]
        kc[:, :, cache.slot.view(1)], vc[:, :, cache.slot.view(1)] = k, v.view(B, Hkv, 1, D)
        kc, vc = (c[:, :, :W].reshape(B * Hkv, W, D) for c in (kc, vc))     # [B·H_kv, W, D], views
        q = q.view(B * Hkv, self.H // Hkv, D)
        if torch.compiler.is_compiling():  # the mask added in inductor's softmax: ~2% of a step
            att = torch.bmm(q * D ** -0.5, kc.transpose(1, 2)) + bias
        else:  # eagerly one op is faster
            att = torch.baddbmm(bias, q, kc.transpose(1, 2), alpha=D ** -0.5)
        y = torch.bmm(att.softmax(-1, dtype=torch.float32).to(vc.dtype), vc)  # [B·H_kv, H/H_kv, D]
        return self.o_proj(y.view(B, 1, self.H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    packed = None  # gate's and up's weights stacked, reordered for oneDNN (Transformer.packed)

    def parts(self):
        return self.gate_proj, self.up_proj

    def forward(self, x):
        if self.packed is None or torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = linear(x, None, None, self.packed).chunk(2, -1)  # one product
        return self.down_proj(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, mask, cache, layer):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class KVCache:
    """Preallocated keys/values [B, H_kv, slots, D] per layer in the compute dtype, filled left to
    right at one shared slot (rows are left-padded); `start` [B] is each row's first real slot; `n`
    counts the filled slots on the host, `slot` on the device. A decode step attends over the whole
    buffer, its unfilled slots masked: an eager cache (no `width`) is grown to fit (reserve), in
    doublings, so its K/V stay whole tensors, which the batched products read in place (a slice of
    them they would copy first, transposed: ~2x the attention's cost, RESULTS.md §15); a static
    step attends over `width` slots (no Python int changes per token), masked from (start, slot).
    RoPE cos/sin per position up to max_len. Never a buffer on the module."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device=None, dtype=torch.float32,
                 start=None):
        # a tensor per layer: a compiled step writes in place
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k, self.v = ([torch.zeros(shape, device=device, dtype=dtype)
                           for _ in range(cfg.n_layers)] for _ in "kv")
        self.start = (torch.zeros(batch, dtype=torch.long, device=device) if start is None
                      else start.to(device))
        self.n, self.slot, self.width = 0, torch.zeros((), dtype=torch.long, device=device), None
        self.cos, self.sin = rope_cos_sin(cfg, max_len, device, dtype)                # [max_len, D]

    def write(self, layer, k, v):  # a chunk at slots [n, n + T): returns the slots written so far
        n, T = self.n, k.shape[2]
        if self.width is None and layer == 0:
            self.reserve(n + T)
        self.k[layer][:, :, n:n + T], self.v[layer][:, :, n:n + T] = k, v
        return self.k[layer][:, :, :n + T], self.v[layer][:, :, :n + T]

    def index_rows(self, rows: torch.Tensor) -> "KVCache":
        """Keep (or repeat) rows: rows.repeat_interleave(G) shares a prefill by G samples, a subset
        drops finished rows. A copy, so the result owns its memory (an eager cache: of its filled
        slots, with room for the next)."""
        new = KVCache.__new__(KVCache)
        new.start, new.n, new.slot, new.width, new.cos, new.sin = (
            self.start[rows], self.n, self.slot.clone(), self.width, self.cos, self.sin)
        new.k, new.v = self.k, self.v
        new._move(rows, self.k[0].shape[2] if self.width else new._room(self.n + 1))
        return new

    def reserve(self, n: int):
        """An eager cache holds at least n slots: if it holds fewer, twice as many (up to
        max_len), the filled ones copied."""
        if n > self.k[0].shape[2]:
            self._move(None, self._room(n))

    def _room(self, n):  # slots for n filled ones and the doublings to come
        return min(len(self.cos), max(n, 2 * self.n, 1))

    def _move(self, rows, slots):  # these rows (None: all) of the filled slots into `slots` slots
        n = self.n if self.width is None else self.k[0].shape[2]

        def moved(c):
            out = c.new_zeros((len(self.start), c.shape[1], slots, c.shape[3]))
            out[:, :, :n] = c[:, :, :n] if rows is None else c[rows, :, :n]
            return out
        self.k, self.v = [moved(c) for c in self.k], [moved(c) for c in self.v]


class Transformer(nn.Module):
    # recompute each block's activations in backward (train.build_run sets it from memory.resolve);
    # frozen copies and from_pretrained models keep this default
    checkpointing = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()  # Hugging Face nests the body under `model.`
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = (None if cfg.tie_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # of the folder this came from: save_pretrained keeps them
        self.source_files, self.source_dtype = {}, None
        self.apply(self._init_weights)

    def _init_weights(self, m):  # GPT-2 style: N(0, 0.02), zero bias; RMSNorm weights stay 1
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, cache: KVCache | None = None, start=None, last_only=False, head=None,
                prefix: Prefix | None = None):
        """idx [B, T] token ids -> logits [B, T, V] (or [B, 1, V] with last_only). With a cache, idx
        fills slots [cache.n, cache.n + T) and cache.start gives the left padding; without one,
        `start` [B] does (default 0). head(h, w), if given, replaces the LM head (h [B, T, C] final
        hidden states, w [V, C] the head's weight, gathered by FSDP inside forward):
        rollout.completion_logprobs' head never makes all [B, T, V] logits. prefix: idx is
        prefix.idx, prompts run once for the completion rows that continue them (Prefix)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        B, T = idx.shape
        n0, start = (cache.n, cache.start) if cache is not None else (0, start)
        length = n0 + T if prefix is None else prefix.length
        if length > self.config.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        h = self.model.embed_tokens(idx)
        if prefix is not None:  # RoPE at each packed token's position; prefix.attend masks
            cos, sin = (t[prefix.pos][None, None]
                        for t in rope_cos_sin(self.config, prefix.span, idx.device, h.dtype))
            mask = prefix
        # decode: the step's RoPE rows and mask from (start, slot), on the device
        elif cache is not None and T == 1:
            if cache.width is None:  # eager: the whole buffer, grown to fit
                cache.reserve(n0 + 1)
            keys, slot = (torch.arange(cache.width or cache.k[0].shape[2], device=idx.device),
                          cache.slot)                                         # [W], 0-d
            cos, sin = (t[(slot - start).clamp(min=0)[:, None, None]]
                        for t in (cache.cos, cache.sin))                      # [B,1,1,D]
            # rotate_half's signs
            sin = torch.cat((-sin[..., :sin.shape[-1] // 2], sin[..., sin.shape[-1] // 2:]), -1)
            # no pads or future; a row sees itself
            ok = (keys <= slot) & ((keys >= start[:, None]) | (keys == slot))
            mask = torch.zeros(B, len(keys), dtype=h.dtype,
                               device=idx.device).masked_fill_(~ok, float("-inf"))
            # [B·H_kv, 1, W] bias
            mask = mask.repeat_interleave(self.config.n_kv_heads, 0)[:, None]
        else:
            slots = torch.arange(n0, n0 + T, device=idx.device)              # [T]
            cos, sin = (rope_cos_sin(self.config, T, idx.device, h.dtype) if cache is None
                        else (cache.cos, cache.sin))
            pos = (slots[None] if start is None
                   else (slots[None] - start[:, None]).clamp(min=0))         # [B or 1, T]
            cos, sin = cos[pos][:, None], sin[pos][:, None]                  # [B or 1, 1, T, D]
            mask = None  # plain causal, the fast path for unpadded training batches
            if cache is not None or start is not None:
                keys = torch.arange(n0 + T, device=idx.device)               # [S]
                st = torch.zeros(B, dtype=torch.long, device=idx.device) if start is None else start
                mask = padded_causal(st, slots, keys)                        # [B, 1, T, S]
        # activation checkpointing where a backward follows: keep only each block's input, rerun the
        # block in backward (FSDP2's hooks all-gather its weights again); never with a KV cache
        recompute = self.checkpointing and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.model.layers):
            if recompute:
                h = checkpoint(block, h, cos, sin, mask, cache, i, use_reentrant=False)
            else:
                h = block(h, cos, sin, mask, cache, i)
        if cache is not None:
            cache.slot += T
            cache.n += 0 if cache.width else T
        h = self.model.norm(h[:, -1:] if last_only else h)
        out = self.model.embed_tokens if self.lm_head is None else self.lm_head  # the LM head
        return head(h, out.weight) if head else linear(h, out.weight,
                                                       packed=getattr(out, "packed", None))

    @contextmanager
    def packed(self):
        """Within: each Linear and the LM head of >= PACK_FROM weights multiply, without autograd,
        by a copy of its weight that oneDNN reordered here (so this moment's weights; ~0.25 s and
        0.5 GB at 135M, freed on exit): decode 1.3-1.5x faster at 135M (RESULTS.md §15); a block's
        q, k, v and its gate, up as one product each, of their stacked weights. One
        layout, oneDNN's for 64 rows, at any row count (as fast at 8-512 rows): a row's products
        are the same in any batch. Only CPU tensors of PACKED_DTYPES where PACKED_GEMM holds (not
        FSDP's DTensors); elsewhere, and for smaller weights (faster unpacked), nothing changes. Not
        re-entrant: rollout.generate enters it once a call."""
        out = self.model.embed_tokens if self.lm_head is None else self.lm_head
        # q, k and v (gate and up) as one product of their stacked weights: the same bits as three
        # (two) (tests/test_model.py), fewer calls, and k/v's small products in a larger one
        fused = [m for m in self.model.modules() if isinstance(m, (Attention, MLP))
                 and all(type(p) is Linear for p in m.parts())]
        inner = {id(p) for m in fused for p in m.parts()}
        mods = [m for m in self.model.modules() if isinstance(m, Linear) and id(m) not in inner]
        weight = {m: [p.weight.detach() for p in m.parts()] if m in fused else [m.weight.detach()]
                  for m in mods + [out] + fused}
        weight = {m: ws for m, ws in weight.items() if sum(w.numel() for w in ws) >= PACK_FROM}
        if not PACKED_GEMM or any(type(w) is not torch.Tensor or w.dtype not in PACKED_DTYPES
                                  or w.device.type != "cpu" for ws in weight.values() for w in ws):
            yield
            return
        for m, ws in weight.items():  # smaller weights stay as they are: faster unpacked
            m.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(ws), 64)
            if m in fused:
                biases = [p.bias for p in m.parts()]
                m.packed_bias = None if biases[0] is None else torch.cat(biases).detach()
        try:
            yield
        finally:  # back as they were (a compiled step's guards see the modules unchanged)
            for m in weight:
                del m.packed
                m.__dict__.pop("packed_bias", None)

    # on the weights' device, in their dtype
    def new_cache(self, batch, max_len, start=None) -> KVCache:
        return KVCache(self.config, batch, max_len, (w := self.model.embed_tokens.weight).device,
                       w.dtype, start)

    # ------------------------------------------------------------------------- Hugging Face folders
    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None) -> "Transformer":
        """Load a Hugging Face folder (config.json, model.safetensors or a sharded index). Checks
        every tensor's name and shape before loading anything; errors name the file and the key or
        tensor. Keeps the folder's stored dtype and its other files (tokenizer, chat template,
        generation config) for save_pretrained."""
        cfg = read_config(path)
        with torch.device("meta"):
            model = cls(cfg)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        sd = {}
        for fname in _weight_files(path):
            for k, t in load_file(os.path.join(path, fname)).items():
                if k == "lm_head.weight" and cfg.tie_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                if k not in expected:
                    raise KeyError(f"{os.path.join(path, fname)}: unexpected tensor {k!r}")
                if t.shape != expected[k]:
                    raise ValueError(f"{os.path.join(path, fname)}: tensor {k!r} has shape "
                                     f"{tuple(t.shape)}, config.json implies {tuple(expected[k])}")
                sd[k], model.source_dtype = t.to(dtype) if dtype is not None else t, t.dtype
        if missing := sorted(set(expected) - set(sd)):
            raise KeyError(f"{path}: missing tensor(s) "
                           f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        model.load_state_dict(sd, strict=True, assign=True)
        files = [*Path(path).iterdir(),
                 *Path(path, "additional_chat_templates").glob("*")]  # not Llama's original/
        model.source_files = {f.relative_to(path).as_posix(): f.read_bytes()  # small: no weights
                              for f in files
                              if f.is_file() and not any(fnmatch(f.name, p) for p in NOT_CARRIED)}
        return model.to(device) if device is not None else model

    def save_pretrained(self, path, tokenizer=None, dtype=None, state_dict=None):
        """Write config.json + model.safetensors (Hugging Face names; `state_dict` or the model's
        own) in `dtype`, by default the dtype of the folder this model was loaded from (else its
        parameters'), then that folder's other files byte for byte (tokenizer, chat template,
        generation config), or `tokenizer` (a tokenizers.Tokenizer)."""
        os.makedirs(path, exist_ok=True)
        dtype = dtype or self.source_dtype or next(self.parameters()).dtype
        sd = {k: v.detach().to(dtype).contiguous().cpu()
              for k, v in (state_dict or self.state_dict()).items()}
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        Path(path, "config.json").write_text(json.dumps(config_to_hf(self.config, dtype), indent=2))
        for name, data in self.source_files.items():
            Path(path, name).parent.mkdir(exist_ok=True)
            Path(path, name).write_bytes(data)
        if tokenizer is not None and not self.source_files:
            save_tokenizer(tokenizer, path)


def read_config(path) -> ModelConfig:
    if not (fname := Path(path, "config.json")).is_file():
        raise FileNotFoundError(f"{fname} is missing" if Path(path).is_dir()
                                else f"no checkpoint folder {path!r}")
    return config_from_hf(json.loads(fname.read_text()), str(fname))


def _weight_files(path) -> list[str]:
    if (index := Path(path, "model.safetensors.index.json")).is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if not Path(path, "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: neither model.safetensors nor "
                                "model.safetensors.index.json found")
    return ["model.safetensors"]


# ---------------------------------------------------------------------------------------- tokenizer
SPECIALS = ("<pad>", "<bos>", "<eos>")


def build_char_tokenizer(chars: str):
    """A character-level tokenizers.Tokenizer: ids 0..2 are <pad>, <bos>, <eos>, then one id per
    character; encode() prepends <bos>, so every user of the folder (ours, transformers, vLLM) sees
    the same prompt ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in {chars!r}")
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    # every character is a token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join without spaces
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    return tok


def save_tokenizer(tok, path):
    """tokenizer.json, and for our char-level tokenizer a tokenizer_config.json that transformers'
    AutoTokenizer loads and a generation_config.json with its bos/eos/pad ids."""
    tok.save(os.path.join(path, "tokenizer.json"))
    ids = {s[1:-1]: tok.token_to_id(s)
           for s in SPECIALS if tok.token_to_id(s) is not None}  # pad, bos, eos
    if ids:
        Path(path, "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **{f"{k}_token": f"<{k}>" for k in ids}},
            indent=2))
        Path(path, "generation_config.json").write_text(json.dumps(
            {f"{k}_token_id": i for k, i in ids.items()}))


def load_tokenizer(path):
    from tokenizers import Tokenizer
    if not (fname := Path(path, "tokenizer.json")).is_file():
        raise FileNotFoundError(f"{fname} is missing")
    return Tokenizer.from_file(str(fname))


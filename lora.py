"""Low-rank adapters (LoRA, Hu et al. 2021) on the policy's linear layers, for RL with a
frozen base.

  1. wrap(model, r, alpha, targets): every target nn.Linear (default all seven of a block: q, k, v,
     o, gate, up, down) becomes a LoRALinear holding the same frozen weight W (and bias) and two
     trained matrices, A [r, in] (PEFT's init: Kaiming-uniform) and B [out, r] = 0, so that
         y = x Wᵀ + b + (α/r) · (x Aᵀ) Bᵀ,
     and at step 0 (B = 0) y is the base model's, exactly.
     Only A and B require gradients: AdamW keeps state (8 bytes a parameter, fp32 m and v) for them
     alone. FSDP2 shards A and B with their block like every other parameter (infra.shard).
  2. merged_parameters(model): the plain weights W + (α/r)·B A, name by name in named_parameters
     order. The sampling copy (infra.refresh: at every refresh, so the sampler is on the adapted
     policy by construction), π_ref and step_N/'s Hugging Face folder receive these: a checkpoint
     loads in transformers and vLLM unchanged. The merge, not the adapter in the decode step,
     because the CUDA graphs and the compiled decode step stay those of a plain model, and a refresh
     is one r-rank product per matrix, against two extra matmuls per layer and token while sampling.
  3. save_adapter / load_adapter: step_N/adapter/ = adapter_config.json + adapter_model.safetensors
     in PEFT's format (PeftModel.from_pretrained and vLLM's LoRA loading read it; A and B in
     float32), which a --resume loads back onto the same base (init_from, or the seeded fresh
     model): exact. A subfolder, because transformers' from_pretrained of a folder holding
     adapter_config.json loads it as base + adapter: over the merged weights, the adapter would
     count twice.
No dropout: on-policy RL needs π_old = π_θ at the first epoch (ρ = 1),
which a random mask breaks.

  python train.py --config configs/smoke.toml --lora_rank=8 --lora_alpha=32 --lr=1e-3
  python -m pytest -q tests/test_lora.py
"""
import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<our name>.lora_A.weight
ADAPTER_DIR = "adapter"  # step_N/adapter/: the PEFT files (step 3)


class LoRALinear(nn.Module):
    """nn.Linear's weight and bias (same names, frozen) plus lora_A [r, in] and lora_B [out, r]."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.weight, self.bias, self.scale = linear.weight, linear.bias, alpha / rank
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        out_features, in_features = linear.weight.shape
        like = dict(device=linear.weight.device, dtype=torch.float32)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's init_lora_weights=True
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, **like))

    def forward(self, x):  # x [..., in] -> [..., out]; B = 0 adds exact zeros
        low = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return F.linear(x, self.weight, self.bias) + self.scale * low


def full(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (every rank of its mesh calls), a plain tensor as it is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def targets_ok(targets: str) -> bool:
    """"all", or a comma list of TARGETS' names (spaces around a name allowed, no empty name)."""
    return targets == "all" or {t.strip() for t in targets.split(",")} <= set(TARGETS)


def parse_targets(targets: str) -> tuple[str, ...]:
    """lora_targets -> the tuple of names (targets_ok's rule; otherwise a ValueError)."""
    if not targets_ok(targets):
        raise ValueError(f"lora_targets {targets!r}: use 'all' or a comma list of "
                         f"{', '.join(TARGETS)}")
    return TARGETS if targets == "all" else tuple(t.strip() for t in targets.split(","))


def wrap(model: nn.Module, rank: int, alpha: float, targets: str = "all",
         adapter: str = "") -> nn.Module:
    """Freeze every parameter, then replace each target nn.Linear by a LoRALinear (step 1); with
    `adapter`, a folder, its A and B (load_adapter)."""
    names = parse_targets(targets)
    model.requires_grad_(False)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in names and isinstance(child, nn.Linear):
                setattr(parent, child_name, LoRALinear(child, rank, alpha))
    model.lora = {"r": rank, "alpha": alpha, "targets": list(names)}
    if adapter:
        load_adapter(model, adapter)
    return model


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """Module name -> LoRALinear, in module order ({} for a plain model)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merged_parameters(model: nn.Module, dtype=None, frozen: bool = True):
    """(name, tensor) of the plain model's parameters: W + (α/r)·B A at each LoRALinear's weight,
    lora_A / lora_B left out, everything else as it is (frozen=False: without the parameters that
    never change under LoRA, those outside the merged weights); whole tensors (every rank calls), in
    `dtype` if given (the merge itself in float32)."""
    layers = adapters(model)
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        if module in layers and leaf == "weight":
            x = merged_weight(p.detach(), layers[module], dtype or p.dtype)
        elif frozen or p.requires_grad:
            x = full(p.detach().to(dtype or p.dtype))
        else:
            continue
        yield name, x


def merged_weight(w: torch.Tensor, layer: LoRALinear, dtype) -> torch.Tensor:
    """W + (α/r)·B A, whole, in dtype. Under FSDP2, each rank merges its own rows of W and B (they
    shard alike, by rows; A, r x in, is gathered whole) and only the merged rows, in dtype, are
    gathered: not W in float32."""
    a = full(layer.lora_A.detach()).float()                                           # [r, in]
    b = layer.lora_B.detach()                                                         # [out, r]
    if not isinstance(w, DTensor):
        return (w.float() + layer.scale * (b.float() @ a)).to(dtype)
    assert b.placements == w.placements and b.shape[0] == w.shape[0], (b.placements, w.placements)
    rows = (w.to_local().float() + layer.scale * (b.to_local().float() @ a)).to(dtype)
    return DTensor.from_local(rows, w.device_mesh, w.placements, shape=w.shape,
                              stride=w.stride()).full_tensor()


def merged_state(model: nn.Module, keep: bool) -> dict:
    """merged_parameters as a CPU state dict (None values where not `keep`; every rank calls)."""
    return {name: x.cpu() if keep else None for name, x in merged_parameters(model)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's names -> A and B (float32, CPU, whole tensors; every rank calls)."""
    out = {}
    for name, m in adapters(model).items():
        for key in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{name}.{key}.weight"] = full(getattr(m, key).detach()).float().cpu()
    return out


def save_adapter(path: str, model: nn.Module, state: dict, base: str):
    """adapter_config.json + adapter_model.safetensors (PEFT's LoRA format) into folder `path`."""
    info = model.lora
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info["r"],
              "lora_alpha": info["alpha"], "target_modules": info["targets"], "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "modules_to_save": None,
              "base_model_name_or_path": base or None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def load_adapter(model: nn.Module, path: str):
    """A and B from checkpoint folder `path`'s adapter/ into a wrapped, unsharded model: the saved
    rank, alpha and targets (adapter_config.json) must be the model's, every adapter there with its
    shape and none left over (an error names the file, the setting or the tensor)."""
    fname = os.path.join(path, ADAPTER_DIR, "adapter_model.safetensors")
    if not os.path.exists(fname):
        raise FileNotFoundError(f"{fname} is missing: the checkpoint holds no LoRA adapter")
    config = os.path.join(path, ADAPTER_DIR, "adapter_config.json")
    with open(config) as f:
        kept = json.load(f)
    info = model.lora
    for key, ours in (("r", info["r"]), ("lora_alpha", info["alpha"]),
                      ("target_modules", info["targets"])):
        if kept.get(key) != ours:  # a resume with other LoRA settings would load another model
            raise ValueError(f"{config}: {key} = {kept.get(key)!r}, but this run's is {ours!r} "
                             "(lora_rank, lora_alpha, lora_targets must be the checkpoint's)")
    saved = load_file(fname)
    extra = set(saved) - {f"{PEFT_PREFIX}{name}.{key}.weight" for name in adapters(model)
                          for key in ("lora_A", "lora_B")}
    if extra:
        raise KeyError(f"{fname}: {len(extra)} tensors no adapter of this model takes, e.g. "
                       f"{min(extra)!r}")
    for name, m in adapters(model).items():
        for key in ("lora_A", "lora_B"):
            k, p = f"{PEFT_PREFIX}{name}.{key}.weight", getattr(m, key)
            if k not in saved or saved[k].shape != p.shape:
                raise KeyError(f"{fname}: tensor {k!r} missing or not of shape {tuple(p.shape)}")
            p.copy_(saved[k])

"""What the pi0 / pi05 families train of the library's model: LoRA adapters through `peft`, a freeze list, gradient
checkpointing that keeps the prefix KV cache, and the tensors a weight sync ships.

Keys (declared in tasks/policies/pi0/configuration.py; their rules: tasks.policies.pi0.memory.check_training_keys):
  policy.lora_rank     r > 0: rank-r LoRA adapters (peft `LoraConfig(r, lora_alpha, lora_dropout=0)`, B = 0 at the
                       start, so the adapted model computes exactly what the base does) on the Linear modules named by
                       `lora_targets`; every parameter of the library's model is then frozen except the adapters, and
                       the policy's own heads (value head, Flow-Noise std head: parameters outside the library's model)
                       stay trainable. 0: full fine-tuning.
  policy.lora_alpha    the adapters' scale is lora_alpha / lora_rank (Hu et al. 2021, peft's `scaling`).
  policy.lora_targets  fnmatch patterns over the library model's module names, matched at a dot boundary ("dit.*_proj"
                       matches "model.dit.layers.0.self_attn.q_proj"); a bare name ("q_proj") matches that module name
                       anywhere. Default: q/k/v/o and gate/up/down of PaliGemma's Gemma (`language_model`) and of the
                       action expert (`dit`); the SigLIP vision tower (q/k/v_proj, out_proj, fc1/fc2) is not adapted.
  policy.freeze        parameter-name prefixes (the policy's `named_parameters()` names, as `algorithm.lr_scale`'s)
                       frozen whatever the rank, e.g. the vision tower `hf.model.vlm.vision_tower`.
  policy.gradient_checkpointing  recompute each decoder layer (Gemma, action expert, SigLIP) in the backward pass
                       instead of keeping its activations (`enable_checkpointing`).

Why not transformers' own `gradient_checkpointing_enable`: its `GradientCheckpointingLayer` drops the `cache`
argument of every layer that writes a KV cache (transformers 5.25 modeling_layers.py), and PI0's forward passes the
prefix to the action expert through that cache: with it on, `PI0ForConditionalGeneration(..., actions=...)` fails
(`'NoneType' object has no attribute 'get_seq_length'`, measured). `enable_checkpointing` checkpoints the layer's
`forward` with the cache kept: before a recompute it crops the layer's cache entry back to the length it had when
the layer first ran, so the replay appends the same keys/values once (tested: gradients equal those without it).

What LoRA reaches: the action expert reads only the keys/values of each VLM layer, so the last Gemma layer's q/o
projections and MLP feed nothing and their adapters get no gradient (tested); pi05's expert is gated by its adaptive
RMSNorm `dense` layers, which transformers initialises to 0, so on a fresh random pi05 (not a checkpoint) the expert's
adapters get no gradient while those frozen gates stay 0 (tested).

Weight sync: with frozen parameters, an update changes only the trainable ones. `sync_state` is the state-dict entries
of the trainable parameters (adapters + heads), `load_sync_state` loads them into a replica that holds the same frozen
weights (strict about names and shapes): pi0 base in float32, 14,008 MB full vs 108 MB at rank 16 (+ the heads);
full fine-tuning ships 12,955 MB (the unused expert embedding, 1,053 MB, frozen: `UNUSED`). The policy's
`sync_state()` / `load_sync_state()` methods expose them to the actor (`Actor.sync_weights`, and on R FSDP ranks
`tasks.actor.distributed.sync_weights_rank`, which gathers only the trainable tensors from the shards): partial
weights on top of the init's full weights, tasks.weights; checkpoints and exports stay full. `merged_state_dict`
folds the adapters into the base weights under the library's own key names (what plain `transformers`
`from_pretrained` loads; the family's `save_pretrained` writes it), `load_base_state` loads such a plain state dict
into an adapted model.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Mapping

import torch

from tasks.config.errors import ConfigError

ADAPTER = "default"  # peft's adapter name


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def lora_target_names(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """The names (in `model.named_modules()` order) of the `torch.nn.Linear` modules (adapted ones included) matched
    by any of `patterns` (fnmatch at a dot boundary; module docstring).

    Raises:
        ConfigError (policy.lora_targets): a pattern that matches no Linear module (lists some names to use).
    """
    patterns = list(patterns)
    linear = [n for n, m in model.named_modules()  # an adapted Linear counts as its name (not its base_layer)
              if isinstance(m, torch.nn.Linear) and not (".base_layer" in n or ".lora_" in n)
              or isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]
    for pat in patterns:
        if not any(_matches(n, pat) for n in linear):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ConfigError("policy.lora_targets", patterns,
                              f"{pat!r} matches no Linear module of the {type(model).__name__}; its Linear names end "
                              f"in {leaves}")
    return [n for n in linear if any(_matches(n, pat) for pat in patterns)]


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, targets: Iterable[str]) -> list[str]:
    """Inject rank-`rank` LoRA adapters (peft `inject_adapter_in_model`, dropout 0, peft's default init: A Kaiming,
    B = 0, so outputs are unchanged) into the Linear modules of `model` matched by `targets`, in place.

    Each adapted `Linear(in, out)` computes W x + b + (alpha / rank) B A x with A [rank, in], B [out, rank] (float32,
    the dtype of W); its state-dict keys become `<name>.base_layer.weight/bias`, `<name>.lora_A.default.weight`,
    `<name>.lora_B.default.weight`. Returns the adapted module names.

    Raises:
        ConfigError: rank < 1 (policy.lora_rank), a pattern matching nothing (policy.lora_targets).
    """
    from peft import LoraConfig, inject_adapter_in_model
    if rank < 1:
        raise ConfigError("policy.lora_rank", rank, "apply_lora needs a rank >= 1")
    names = lora_target_names(model, targets)
    # exact names as a regex: peft matches a string target_modules with re.fullmatch
    regex = "|".join(n.replace(".", r"\.") for n in names)
    inject_adapter_in_model(LoraConfig(r=int(rank), lora_alpha=float(alpha), lora_dropout=0.0, target_modules=regex,
                                       bias="none"), model, adapter_name=ADAPTER)
    return names


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's (`.lora_A.` / `.lora_B.` in it)."""
    return ".lora_A." in name or ".lora_B." in name


# modules of the library's model its forward never calls, frozen whatever the keys (kept in the state dict, so
# checkpoints and exports stay the library's layout): pi0's action expert is a whole GemmaModel called with
# `inputs_embeds`, so its token embedding `model.dit.embed_tokens` (257,152 x 1,024 = 263,323,648 parameters in the
# base config, 7.5 % of pi0's 3.501 B) gets no gradient and feeds nothing (tested). pi05's expert has none.
UNUSED = ("model.dit.embed_tokens",)


def unused_parameters(base: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the library's model `base` under the `UNUSED` module names it has (none for pi05)."""
    out = []
    for name in UNUSED:
        try:
            out.extend(base.get_submodule(name).parameters())
        except AttributeError:
            pass
    return out


def set_trainable(policy: torch.nn.Module, base: torch.nn.Module, *, lora: bool, freeze: Iterable[str]) -> None:
    """Set `requires_grad` of every parameter of `policy` (which holds the library's model `base` as a submodule):
    with `lora`, the parameters of `base` other than the adapters are frozen and the rest (adapters, the policy's own
    heads) trainable; without, every parameter is trainable; then each parameter whose name starts with a `freeze`
    prefix (at a dot boundary) is frozen, and so is every parameter the library's forward never uses
    (`unused_parameters`: pi0's `model.dit.embed_tokens`).

    Raises:
        ConfigError (policy.freeze): a prefix under which the policy has no parameter (lists its top modules).
    """
    in_base = {id(p) for p in base.parameters()}
    unused = {id(p) for p in unused_parameters(base)}
    named = list(policy.named_parameters())
    for pre in freeze:
        if not any(n == pre or n.startswith(pre + ".") for n, _ in named):
            top = sorted({".".join(n.split(".")[:3]) for n, _ in named})
            raise ConfigError("policy.freeze", list(freeze),
                              f"no parameter of the {type(policy).__name__} is under {pre!r}; its modules: {top}")
    for n, p in named:
        trainable = not (lora and id(p) in in_base and not is_adapter(n))
        if id(p) in unused or any(n == pre or n.startswith(pre + ".") for pre in freeze):
            trainable = False
        p.requires_grad_(trainable)


def configure_training(policy: torch.nn.Module, base: torch.nn.Module, p) -> None:
    """THE entry for a pi0/pi05 policy: after building (and loading) the library's model `base` inside `policy`,
    apply the training keys of policy config `p` (lora_rank, lora_alpha, lora_targets, freeze,
    gradient_checkpointing): LoRA adapters (lora_rank > 0), the trainable set (`set_trainable`),
    gradient checkpointing. Call it before `.to(device)` and before any FSDP wrap. Raises ConfigError as those do."""
    if p.lora_rank:
        apply_lora(base, rank=p.lora_rank, alpha=p.lora_alpha, targets=p.lora_targets)
    set_trainable(policy, base, lora=bool(p.lora_rank), freeze=p.freeze)
    if p.gradient_checkpointing:
        enable_checkpointing(base)


# ---------------------------------------------------------------- gradient checkpointing that keeps the cache
def _cache_layer(cache, idx: int | None):
    layers = getattr(cache, "layers", None)
    if cache is None or idx is None or layers is None or idx >= len(layers):
        return None
    return layers[idx]


def _checkpointed(layer: torch.nn.Module):
    from torch.utils.checkpoint import checkpoint
    inner = layer.forward  # the bound forward (transformers' wrapper; it checkpoints nothing while its flag is off)
    idx = getattr(getattr(layer, "self_attn", None), "layer_idx", None)

    def forward(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return inner(*args, **kwargs)
        cache = kwargs.get("cache")
        entry = _cache_layer(cache, idx)
        start = entry.get_seq_length() if entry is not None else 0

        def run(*a):
            e = _cache_layer(cache, idx)  # the replay: drop what the first run appended, so it appends once
            if e is not None and e.get_seq_length() > start:
                e.crop(start - e.get_seq_length())
            return inner(*a, **kwargs)

        return checkpoint(run, *args, use_reentrant=False)

    return forward


def decoder_layers(base: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of the library's model, in module order: every submodule with a `self_attn` child and an
    `mlp` child (SigLIP's encoder layers, PaliGemma's Gemma layers, the action expert's layers). What
    `enable_checkpointing` recomputes and FSDP2 shards as its own units (the policy's `fsdp_units`)."""
    return [m for m in base.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]


def enable_checkpointing(base: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of `base` (every submodule with a `self_attn` child and an `mlp` child: the
    Gemma, action-expert and SigLIP layers) with torch's non-reentrant `checkpoint`, keeping the KV cache (module
    docstring). Only in training mode with gradients on; eval and `no_grad` calls run the layer as is. Idempotent.
    Returns the number of layers checkpointed."""
    n = 0
    for m in decoder_layers(base):
        if not getattr(m, "_dagrl_checkpointed", False):
            m.forward = _checkpointed(m)  # an instance attribute: module hooks (FSDP2's) stay outside the checkpoint
            m._dagrl_checkpointed = True
            n += 1
    return n


# ---------------------------------------------------------------- what a weight sync ships
def trainable_names(policy: torch.nn.Module) -> list[str]:
    """Names of the parameters with requires_grad (what an update can change), in `named_parameters()` order."""
    return [n for n, p in policy.named_parameters() if p.requires_grad]


def sync_state(policy: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict:
    """The entries of the policy's state dict an update can change: the trainable parameters (LoRA: adapters and
    the policy's heads; full fine-tuning: every parameter). `state_dict`: a state dict of `policy` already taken that
    holds at least those entries (a full one, or the trainable tensors gathered from an FSDP2 policy's shards, whose
    names are the plain module's: tasks.actor.distributed.sync_weights_rank); default the policy's own (detached CPU
    copies). Frozen parameters and buffers are left out: a replica holds them from its first full load and no
    update changes them. Raises KeyError when `state_dict` lacks a trainable parameter."""
    names = trainable_names(policy)
    if state_dict is None:
        sd = policy.state_dict()
        return {n: sd[n].detach().to("cpu", copy=True) for n in names}
    return {n: state_dict[n] for n in names}


def load_sync_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a `sync_state` into `module` (a replica holding the same frozen weights): every key must be a
    parameter of `module` with the same shape; the other entries of its state dict keep their values.

    Raises:
        KeyError: a key that is not a parameter of `module` (another family, LoRA settings or targets).
        ValueError: a shape mismatch (other sizes or rank).
    """
    params = dict(module.named_parameters())
    unknown = [k for k in state if k not in params]
    if unknown:
        raise KeyError(f"sync state names {unknown[:3]} are no parameters of the {type(module).__name__} "
                       f"(another LoRA rank/targets or family?)")
    bad = [k for k, v in state.items() if tuple(v.shape) != tuple(params[k].shape)]
    if bad:
        raise ValueError(f"sync state shapes differ for {bad[:3]}: {[tuple(state[k].shape) for k in bad[:3]]} vs "
                         f"{[tuple(params[k].shape) for k in bad[:3]]}")
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v)


def _adapted(base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """name -> peft LoRA layer of `base` (a module with `base_layer` and `lora_A`; no peft import without LoRA)."""
    return {n: m for n, m in base.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def load_base_state(base: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a plain state dict of the library's model (its own key names, e.g. `from_pretrained`'s) into `base`,
    whose adapted Linear modules keep theirs under `.base_layer.`; the adapters keep their values. Without adapters
    it is `load_state_dict(state)`, strict.

    Raises:
        RuntimeError: missing or unexpected keys, or shapes that differ (torch's message).
    """
    adapted = set(_adapted(base))
    mapped = {}
    for k, v in state.items():
        owner, _, leaf = k.rpartition(".")
        mapped[f"{owner}.base_layer.{leaf}" if owner in adapted else k] = v
    missing, unexpected = base.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if not is_adapter(k)]
    if missing or unexpected:
        raise RuntimeError(f"the library model's state dict does not fit: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}")


@torch.no_grad()
def merged_state_dict(base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the library's model `base` with its LoRA adapters folded in, under the library's own key
    names: W' = W + (alpha / rank) B A for each adapted Linear (`.base_layer.` removed from its keys, the adapters'
    keys dropped); CPU float32 copies of the rest. Without adapters: the state dict itself (copies). What plain
    `transformers` `from_pretrained` loads. Tensors: W [out, in], A [r, in], B [out, r]."""
    sd = {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items() if not is_adapter(k)}
    for name, m in _adapted(base).items():
        if ADAPTER in m.lora_A:
            a, b = m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight  # [r, in], [out, r]
            w = sd.pop(f"{name}.base_layer.weight")
            sd[f"{name}.weight"] = w + m.scaling[ADAPTER] * (b.float() @ a.float()).to(w.dtype).cpu()
            if f"{name}.base_layer.bias" in sd:
                sd[f"{name}.bias"] = sd.pop(f"{name}.base_layer.bias")
    return sd

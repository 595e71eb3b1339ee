"""Building blocks shared by the VLA policy families (token_vla; pi0's value head).

- `ByteTokenizer`: byte-level instruction tokenizer (transformers' ByT5 tokenizer: no vocab file, works offline).
- `PrefixEncoder`: the VLM prefix of pi0 / PaliGemma: a SigLIP vision tower, a linear projector into the LM width
  and a Gemma LM run with full (bidirectional, prefix-LM) attention over
  [image patch tokens ; prompt tokens ; optional state token].
- `ValueHead`: pooled prefix features -> small MLP -> values (RLinf's critic on the VLM output).
- `resolve_sizes`: size presets merged with `policy.sizes` overrides.
- `VLACheckpointMixin`: `save_pretrained(dir)` / `from_pretrained(dir)` in the transformers layout
  (`config.json` + `model.safetensors` + tokenizer files). Local directories only: nothing is ever downloaded.

transformers is imported inside the functions that need it, so importing this module (e.g. for config checks)
stays cheap.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from tasks.config import ConfigError, PolicyConfig, family_class

POOLINGS = ("mean_token", "first_token", "last_token")

# Sizes every VLA family needs for its prefix (a family's presets add its own keys).
PREFIX_SIZE_KEYS = ("patch_size", "vision_width", "vision_layers", "vision_heads", "vision_mlp",
                    "lm_width", "lm_layers", "lm_heads", "lm_kv_heads", "lm_head_dim", "lm_mlp", "vocab_size",
                    "value_hidden")


# ----------------------------------------------------------------------------------------------- sizes / config
def resolve_sizes(presets: dict[str, dict[str, int]], preset: str, overrides: dict[str, int]) -> dict[str, int]:
    """The preset's sizes with `policy.sizes` overrides applied.

    Raises:
        ConfigError("policy.preset"): unknown preset (lists the known ones).
        ConfigError("policy.sizes"): an override key the preset does not have (lists the known keys), or a value
            that is not a positive int.
    """
    if preset not in presets:
        raise ConfigError("policy.preset", preset, f"known presets: {sorted(presets)}")
    sizes = dict(presets[preset])
    for key, value in (overrides or {}).items():
        if key not in sizes:
            raise ConfigError("policy.sizes", {key: value}, f"unknown size key {key!r}; known keys: {sorted(sizes)}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError("policy.sizes", {key: value}, "sizes are positive integers")
        sizes[key] = value
    return sizes


def check_common_config(cfg: PolicyConfig, presets: dict[str, dict[str, int]]) -> dict[str, int]:
    """Offline checks shared by the VLA families; returns the resolved sizes. Raises ConfigError."""
    sizes = resolve_sizes(presets, cfg.preset, cfg.sizes)
    if cfg.value_head not in POOLINGS:
        raise ConfigError("policy.value_head", cfg.value_head, f"use one of {list(POOLINGS)}")
    if cfg.max_prompt_len < 2:
        raise ConfigError("policy.max_prompt_len", cfg.max_prompt_len, "use >= 2 (the prompt ends with EOS)")
    if cfg.num_action_chunks < 1:
        raise ConfigError("policy.num_action_chunks", cfg.num_action_chunks, "use >= 1")
    if sizes["vocab_size"] < ByteTokenizer.VOCAB_SIZE:
        raise ConfigError("policy.sizes", {"vocab_size": sizes["vocab_size"]},
                          f"use >= {ByteTokenizer.VOCAB_SIZE} (the byte tokenizer's vocabulary)")
    if sizes["lm_heads"] % sizes["lm_kv_heads"]:
        raise ConfigError("policy.sizes", {"lm_heads": sizes["lm_heads"], "lm_kv_heads": sizes["lm_kv_heads"]},
                          "lm_heads must be a multiple of lm_kv_heads")
    if sizes["vision_width"] % sizes["vision_heads"]:
        raise ConfigError("policy.sizes", {"vision_width": sizes["vision_width"]},
                          "vision_width must be a multiple of vision_heads")
    return sizes


# ----------------------------------------------------------------------------------------------------- tokenizer
class ByteTokenizer:
    """Byte-level tokenizer (UTF-8 bytes + 3, as ByT5): pad 0, EOS 1, unk 2, vocabulary 384 ids.

    Wraps `transformers.ByT5Tokenizer`, which needs no vocabulary file, so it works offline; it is saved next to
    the model (`save_pretrained`) so a checkpoint carries its tokenizer.
    """

    VOCAB_SIZE = 384
    PAD_ID = 0

    def __init__(self, hf_tokenizer: Any | None = None):
        if hf_tokenizer is None:
            from transformers import ByT5Tokenizer
            hf_tokenizer = ByT5Tokenizer()
        self.hf = hf_tokenizer

    def __call__(self, texts: list[str], max_len: int) -> torch.Tensor:
        return self.tokenize(texts, max_len)

    def tokenize(self, texts: list[str], max_len: int) -> torch.Tensor:
        """texts (B strings) -> int64 [B, max_len]: bytes + EOS, right-padded with 0 or truncated to max_len."""
        if isinstance(texts, str):
            raise TypeError("tokenize takes a list of strings, not one string")
        enc = self.hf(list(texts), padding="max_length", truncation=True, max_length=max_len,
                      return_tensors="pt")
        return enc["input_ids"].to(torch.int64)

    def save_pretrained(self, path: str | Path) -> None:
        self.hf.save_pretrained(str(path))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ByteTokenizer":
        from transformers import ByT5Tokenizer
        return cls(ByT5Tokenizer.from_pretrained(str(path), local_files_only=True))


# ------------------------------------------------------------------------------------------------ prefix encoder
def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, Q, K] (True = may attend) -> float [B, 1, Q, K]: 0 where allowed, dtype's min elsewhere.

    A prepared 4D mask is used by transformers' attention as is (eager adds it; SDPA accepts it)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg)[:, None]


class PrefixOutput(NamedTuple):
    """hidden [B, P, W] float (after the LM's final norm); mask [B, P] bool (False = prompt padding);
    positions [B, P] int64 (rotary positions: cumulative count of valid tokens - 1); kv: per LM layer
    (keys, values), each [B, kv_heads, P, head_dim] (only with `with_kv=True`; pi0's prefix KV cache)."""

    hidden: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None


def gemma_config(*, width: int, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int,
                 vocab_size: int, max_positions: int = 8192):
    """A `GemmaConfig` with full (non-causal) attention; masks are passed as prepared 4D masks anyway."""
    from transformers import GemmaConfig
    cfg = GemmaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_positions, use_bidirectional_attention=True,
                      tie_word_embeddings=False, pad_token_id=0 if vocab_size > 1 else None,
                      bos_token_id=None, eos_token_id=None)
    # eager attention with prepared additive masks: the same kernels in act and evaluate (bit-identical log-probs
    # for identical batches on CPU, ratio = 1 exactly at the start of a PPO update), and no SDPA-specific mask rules
    cfg._attn_implementation = "eager"
    return cfg


class PrefixEncoder(nn.Module):
    """pi0's VLM prefix: [SigLIP patch tokens -> Linear ; prompt token embeddings ; Linear(state)] -> Gemma.

    Args:
        sizes: resolved sizes (keys `PREFIX_SIZE_KEYS`).
        obs_dim: O, the length of obs["state"] (used when `use_state`).
        image_size: H = W of obs["rgb"] in pixels, or None: no vision tower (state-only envs; image tokens skipped).
        use_state: append one state token Linear(O -> W)(obs["state"]) to the prefix. (pi0 feeds the state to
            the action expert instead; pi0.5 puts it in the prefix. Here it is in the prefix so the value head
            sees it too.)

    Attention: full attention among all valid prefix tokens (pi0's prefix block is bidirectional); prompt
    padding (id 0) is masked as keys. Each token always attends to itself, so padded rows never produce NaN.

    Raises:
        ConfigError("policy.sizes"): image_size not a multiple of patch_size.
    """

    def __init__(self, sizes: dict[str, int], obs_dim: int, image_size: int | None, use_state: bool):
        super().__init__()
        from transformers import GemmaModel, SiglipVisionConfig, SiglipVisionModel
        self.image_size, self.use_state, self.width = image_size, use_state, sizes["lm_width"]
        if image_size is not None:
            if image_size % sizes["patch_size"]:
                raise ConfigError("policy.sizes", {"patch_size": sizes["patch_size"]},
                                  f"image_size {image_size} must be a multiple of patch_size")
            vcfg = SiglipVisionConfig(hidden_size=sizes["vision_width"], intermediate_size=sizes["vision_mlp"],
                                      num_hidden_layers=sizes["vision_layers"],
                                      num_attention_heads=sizes["vision_heads"], image_size=image_size,
                                      patch_size=sizes["patch_size"], vision_use_head=False)
            vcfg._attn_implementation = "eager"
            self.vision = SiglipVisionModel(vcfg)
            self.projector = nn.Linear(sizes["vision_width"], self.width)
            self.num_patches = (image_size // sizes["patch_size"]) ** 2
        else:
            self.vision, self.projector, self.num_patches = None, None, 0
        self.lm_config = gemma_config(width=self.width, layers=sizes["lm_layers"], heads=sizes["lm_heads"],
                                      kv_heads=sizes["lm_kv_heads"], head_dim=sizes["lm_head_dim"],
                                      mlp=sizes["lm_mlp"], vocab_size=sizes["vocab_size"])
        self.lm = GemmaModel(self.lm_config)
        self.state_proj = nn.Linear(obs_dim, self.width) if use_state else None
        if use_state:  # the state's standardisation (identity unless set_state_stats; saved with the weights)
            self.register_buffer("state_mean", torch.zeros(obs_dim))
            self.register_buffer("state_std", torch.ones(obs_dim))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Weights saved before the state standardisation existed (hf/ exports and run checkpoints alike) lack its
        buffers: they load with the identity, the raw state those weights were trained on."""
        if self.state_proj is not None:
            for name, fill in (("state_mean", 0.0), ("state_std", 1.0)):
                state_dict.setdefault(prefix + name, torch.full_like(getattr(self, name), fill))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_state_stats(self, mean, std) -> None:
        """Standardise the state as (state - mean) / std before its projection: mean, std array-like [O], std > 0.

        Raises ValueError on another shape or a std that is not positive."""
        mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        O = self.state_mean.numel()
        if mean.shape != (O,) or std.shape != (O,):
            raise ValueError(f"state mean / std must be [O={O}], got {tuple(mean.shape)} / {tuple(std.shape)}")
        if not bool((std > 0).all()):
            raise ValueError(f"state std must be > 0 in every dimension, got {std.tolist()}")
        self.state_mean.copy_(mean)
        self.state_std.copy_(std)

    def image_tokens(self, rgb: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> float [B, N_patches, W_lm] (pixels scaled to [-1, 1], as SigLIP/PaliGemma)."""
        if rgb.shape[1] != self.image_size or rgb.shape[2] != self.image_size:
            raise ValueError(f"obs['rgb'] is {tuple(rgb.shape)}; this model was built for "
                             f"{self.image_size}x{self.image_size} images")
        dtype = self.projector.weight.dtype
        pixels = rgb.to(dtype).permute(0, 3, 1, 2) / 127.5 - 1.0  # [B, H, W, 3] -> [B, 3, H, W] in [-1, 1]
        feats = self.vision(pixel_values=pixels).last_hidden_state  # [B, N, W_v]
        return self.projector(feats)

    def forward(self, obs: dict[str, torch.Tensor], with_kv: bool = False) -> PrefixOutput:
        """Encode the prefix.

        Args:
            obs: {"prompt": int64 [B, L] (required), "rgb": uint8 [B, H, W, 3] (required iff the model has a
                vision tower), "state": float [B, O] (required iff use_state)}.
            with_kv: also return the LM's per-layer keys/values (the prefix KV cache an action expert attends to).

        Returns:
            PrefixOutput(hidden [B, P, W], mask [B, P] bool, positions [B, P], kv), P = N_patches + L + use_state.

        Raises:
            KeyError: a required observation key is missing. ValueError: wrong image size.
        """
        if "prompt" not in obs:
            raise KeyError("obs['prompt'] is required (int64 [B, L] from policy.tokenize)")
        prompt = obs["prompt"].long()
        B = prompt.shape[0]
        embed = self.lm.get_input_embeddings()
        parts = [embed(prompt)]  # [B, L, W]
        masks = [prompt != ByteTokenizer.PAD_ID]
        if self.vision is not None:
            if "rgb" not in obs:
                raise KeyError("obs['rgb'] is required: this model was built with a vision tower")
            img = self.image_tokens(obs["rgb"])
            parts.insert(0, img)
            masks.insert(0, torch.ones(img.shape[:2], dtype=torch.bool, device=img.device))
        if self.state_proj is not None:
            state = (obs["state"].to(self.state_mean.dtype) - self.state_mean) / self.state_std
            st = self.state_proj(state.to(self.state_proj.weight.dtype))[:, None]  # [B, 1, W]
            parts.append(st)
            masks.append(torch.ones(B, 1, dtype=torch.bool, device=st.device))
        x = torch.cat(parts, dim=1)  # [B, P, W]
        mask = torch.cat(masks, dim=1)  # [B, P]
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        P = x.shape[1]
        allowed = mask[:, None, :] | torch.eye(P, dtype=torch.bool, device=x.device)[None]  # [B, P, P]
        out = self.lm(inputs_embeds=x, attention_mask=additive_mask(allowed, x.dtype), position_ids=positions,
                      use_cache=with_kv)
        kv = None
        if with_kv:
            kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        return PrefixOutput(out.last_hidden_state, mask, positions, kv)


# ---------------------------------------------------------------------------------------------------- value head
def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden [B, P, W], mask [B, P] bool -> [B, W]: masked mean | first token | last valid token."""
    if pooling == "mean_token":
        m = mask.to(hidden.dtype)[..., None]
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    if pooling == "first_token":
        return hidden[:, 0]
    if pooling == "last_token":
        idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, idx, torch.zeros_like(idx)).amax(1)  # [B] index of the last valid token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"policy.value_head={pooling!r}: use one of {list(POOLINGS)}")


class ValueHead(nn.Module):
    """Critic on the prefix: [pool(hidden, mask) [B, W] ; state [B, S] (state_dim S > 0 only)] -> Linear -> GELU
    -> Linear -> [B] (num_values 1) or [B, C].

    The prefix features are detached or not by the policy (`_critic_features`, `policy.value_detach`); with
    `state_dim` the raw state vector joins them (`policy.critic_state`: an asymmetric critic, Pinto et al. 2018,
    "Asymmetric Actor Critic for Image-Based Robot Learning").

    Raises:
        ValueError: unknown pooling; a state of the wrong width (or none) when state_dim > 0.
    """

    def __init__(self, width: int, hidden: int, num_values: int, pooling: str, state_dim: int = 0):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"policy.value_head={pooling!r}: use one of {list(POOLINGS)}")
        self.pooling, self.num_values, self.state_dim = pooling, num_values, state_dim
        self.mlp = nn.Sequential(nn.Linear(width + state_dim, hidden), nn.GELU(), nn.Linear(hidden, num_values))
        nn.init.zeros_(self.mlp[-1].bias)
        nn.init.normal_(self.mlp[-1].weight, std=1.0 / math.sqrt(hidden))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        x = pool(hidden, mask, self.pooling)  # [B, W]
        if self.state_dim:
            if state is None or state.shape[-1] != self.state_dim:
                raise ValueError(f"the value head reads a state of {self.state_dim} dims, got "
                                 f"{None if state is None else tuple(state.shape)}")
            x = torch.cat([x, state.to(x.dtype)], dim=-1)  # [B, W + S]
        v = self.mlp(x)  # [B, V]
        return v.squeeze(-1) if self.num_values == 1 else v


# ---------------------------------------------------------------------------------------------------- checkpoints
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


class VLACheckpointMixin:
    """`save_pretrained` / `from_pretrained` for an `nn.Module` policy built as
    `cls(cfg, obs_dim, action_dim, num_values, image_size)` that has a `tokenizer` (ByteTokenizer).

    Layout of the directory (the transformers layout): `config.json` ({"family", "policy": PolicyConfig fields,
    "obs_dim", "action_dim", "num_values", "image_size"}), `model.safetensors` (the state dict) and the tokenizer's
    files. The constructor never reads `cfg.model_path`: `tasks.policies.make_policy` loads it (replicas that get
    their weights from the actor skip that), `from_pretrained` loads explicitly.
    """

    family: str = "?"

    def _critic_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Prefix features for the value head: detached with `policy.value_detach` (the critic's gradient then
        stops at the trunk)."""
        return hidden.detach() if self.cfg.value_detach else hidden

    def _values(self, hidden: torch.Tensor, mask: torch.Tensor, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The value head on prefix features hidden [B, P, W] / mask [B, P] (and obs["state"] [B, O] with
        `policy.critic_state`): [B] or [B, C]."""
        state = obs["state"] if self.cfg.critic_state else None
        return self.value_head(self._critic_features(hidden), mask, state)

    def _checkpoint_config(self) -> dict:
        return {"family": self.family, "policy": dataclasses.asdict(self.cfg), "obs_dim": self.obs_dim,
                "action_dim": self.action_dim, "num_values": self.num_values, "image_size": self.image_size}

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json, model.safetensors and the tokenizer files into directory `path` (created)."""
        from safetensors.torch import save_model
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self._checkpoint_config(), indent=2, sort_keys=True))
        save_model(self, str(path / WEIGHTS_NAME))
        self.tokenizer.save_pretrained(path)

    @classmethod
    def from_pretrained(cls, path: str | Path, **policy_overrides: Any):
        """Rebuild the policy saved in local directory `path` (weights and tokenizer restored exactly).

        `policy_overrides` replace PolicyConfig fields that do not change the architecture (e.g. noise_level).

        Raises:
            FileNotFoundError: no config.json in `path`. ValueError: the checkpoint is of another family.
        """
        path = Path(path)
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path / CONFIG_NAME} not found (a save_pretrained directory is expected)")
        meta = json.loads((path / CONFIG_NAME).read_text())
        if meta.get("family") != cls.family:
            raise ValueError(f"{path} holds a {meta.get('family')!r} checkpoint, not {cls.family!r}")
        config_class = family_class("policy", cls.family)  # the family's config (its keys only)
        fields = {f.name for f in dataclasses.fields(config_class)}
        policy = {k: v for k, v in meta["policy"].items() if k in fields}
        policy.update(policy_overrides, model_path=str(path))
        model = cls(config_class(**policy), meta["obs_dim"], meta["action_dim"], meta["num_values"],
                    meta["image_size"])
        model.load_weights(path)
        return model

    def load_weights(self, model_path: str | Path) -> None:
        """Load weights (strictly) and tokenizer from `model_path`, a save_pretrained directory.

        Raises:
            ConfigError("policy.model_path"): missing files, or weights that do not fit this model.
        """
        from safetensors.torch import load_model
        path = Path(model_path)
        if not (path / WEIGHTS_NAME).is_file():
            raise ConfigError("policy.model_path", model_path, f"expected {WEIGHTS_NAME} there (save_pretrained)")
        try:
            load_model(self, str(path / WEIGHTS_NAME), strict=True)
        except RuntimeError as e:
            raise ConfigError("policy.model_path", model_path,
                              f"weights do not fit this policy's sizes ({str(e).splitlines()[0]})") from e
        self.tokenizer = ByteTokenizer.from_pretrained(path)

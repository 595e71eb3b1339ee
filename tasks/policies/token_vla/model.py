"""OpenVLA-OFT-style token-action VLA: discretised actions, decoded in parallel in one LM pass.

Architecture (OpenVLA, Kim et al. 2024, "OpenVLA: An Open-Source Vision-Language-Action Model"; OFT, Kim et al.
2025, "Fine-Tuning Vision-Language-Action Models: Optimizing Speed and Success", parallel decoding):
  prefix   `vla_common.PrefixEncoder`'s modules: SigLIP patches -> Linear ; prompt tokens ; state token, embedded
           here and run through its Gemma LM together with the action placeholders below (ONE forward pass).
  actions  C*D learned placeholder embeddings, one per (chunk position c, action dimension d), appended after the
           prefix. Placeholders attend to every valid prefix token and to each other (bidirectional, OFT's
           parallel decoding); prefix tokens never attend to the placeholders, so the prefix features (and the
           value) are exactly those of the prefix alone.
  head     Linear(W -> bins) on each placeholder's output: logits [B, C, D, bins]; one token per action dimension.
  value    `vla_common.ValueHead` on the prefix features (RLinf's critic on the VLM output).

Action tokens (OpenVLA's ActionTokenizer, with uniform bins): an env action a (per dimension d) is normalised with
the 1st/99th percentiles of the training actions, x = 2 (a - q01) / (q99 - q01) - 1, clipped to [-1, 1] (OpenVLA's
"bounds_q99" normalisation); [-1, 1] is cut into `policy.action_bins` equal bins of width 2 / bins; token = bin index,
decoded to the bin centre -1 + (k + 1/2) * 2 / bins, then un-normalised a = 0.5 (x + 1) (q99 - q01) + q01 (OpenVLA's
`predict_action`). The default stats q01 = -1, q99 = 1 are the identity, for envs whose actions are already in
[-1, 1]. (OpenVLA itself digitises against 256 edges and decodes with the 255 centres between them, so its last
token is never produced; here every one of the `bins` tokens has its own centre.) Stats are buffers: they travel
with the state dict, the weight sync to rollout replicas and `save_pretrained` (also written to config.json).

Policy distribution: pi(token | obs) = softmax(logits / temperature) per action dimension, independent across the
C*D tokens given the observation (they are decoded in parallel). `temperature` (attribute, from
`policy.temperature`, default 1.0) is used by `act` (sampling and log-probs), `evaluate` and the entropy
alike, so the PPO ratio stays 1 before an update (RLinf computes training log-probs with the rollout's sampling
temperature for the same reason). Deterministic `act` takes the argmax token.
`sft_loss` is the cross-entropy of the raw logits (temperature 1).

Log-probs / entropies are per token = per action dimension [B, C, D] (`logprob_type` token_level keeps them;
action_level / chunk_level sum them with `tasks.algorithms.reduce_logprobs`).

Presets: `tiny` (trains on CPU) and `openvla_oft`, OpenVLA-7B's sizes: the LM has Llama-2-7B's dimensions (width
4096, 32 layers, 32 heads = 32 KV heads of dim 128, MLP 11008, vocabulary 32000) and the vision tower is
SigLIP-So400m/14 at 224 px (width 1152, 27 layers, MLP 4304). Approximations: (1) OpenVLA fuses DINOv2-L/14
(~0.30 B parameters) with SigLIP; this preset has SigLIP only (PrefixEncoder has one vision tower), so it counts
~0.3 B fewer parameters; (2) the LM is the Gemma block with Llama's dimensions (the same parameter shapes, but GeGLU
instead of SwiGLU, Gemma's RMSNorm and sqrt(width) embedding scale); (3) the projector is one Linear (OpenVLA: a
3-layer MLP) and the token head covers the bins only (Llama's 32000-way LM head is not built). The preset is meant
for parameter counts / memory planning (constructible on the meta device), not for loading OpenVLA weights.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tasks.algorithms.losses import masked_mean
from tasks.config import ConfigError, PolicyConfig
from tasks.policies.vla_common import (ByteTokenizer, PrefixEncoder, VLACheckpointMixin, ValueHead, additive_mask,
                                       check_common_config)

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(patch_size=8, vision_width=32, vision_layers=1, vision_heads=2, vision_mlp=64,
                 lm_width=64, lm_layers=2, lm_heads=4, lm_kv_heads=1, lm_head_dim=16, lm_mlp=128, vocab_size=384,
                 value_hidden=64),
    "openvla_oft": dict(patch_size=14, vision_width=1152, vision_layers=27, vision_heads=16, vision_mlp=4304,
                        lm_width=4096, lm_layers=32, lm_heads=32, lm_kv_heads=32, lm_head_dim=128, lm_mlp=11008,
                        vocab_size=32000, value_hidden=1024),
}


def check_config(cfg: PolicyConfig) -> dict[str, int]:
    """Offline checks of a token_vla policy config; returns the resolved sizes. Raises ConfigError."""
    sizes = check_common_config(cfg, PRESETS)
    if isinstance(cfg.action_bins, bool) or not isinstance(cfg.action_bins, int) or cfg.action_bins < 2:
        raise ConfigError("policy.action_bins", cfg.action_bins, "use an integer >= 2 (bins per action dimension)")
    return sizes


# --------------------------------------------------------------------------------------------- action tokens
def bin_centers(num_bins: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """[num_bins] centres of `num_bins` equal bins over [-1, 1]: -1 + (k + 1/2) * 2 / num_bins."""
    k = torch.arange(num_bins, device=device, dtype=torch.float64)
    return (-1.0 + (k + 0.5) * 2.0 / num_bins).to(dtype)


def normalized_to_bins(x: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Normalised actions x (float, any shape; clipped to [-1, 1]) -> int64 bin indices in [0, num_bins).

    Bin k covers [-1 + 2k/n, -1 + 2(k+1)/n); x = 1 falls into the last bin."""
    x = x.to(torch.float64).clamp(-1.0, 1.0)
    return torch.floor((x + 1.0) * 0.5 * num_bins).long().clamp(0, num_bins - 1)


def action_stats_from_data(actions: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension 1st / 99th percentiles (OpenVLA's q01 / q99) of demonstration actions.

    Args:
        actions: array-like (numpy or torch) [N, ..., D]; all leading dims are pooled.
    Returns:
        (q01 [D], q99 [D]) float32 tensors (numpy's linear-interpolation percentiles).
    Raises:
        ValueError: fewer than 1 dim or no samples.
    """
    a = np.asarray(actions.detach().cpu() if isinstance(actions, torch.Tensor) else actions, dtype=np.float64)
    if a.ndim < 1 or a.size == 0:
        raise ValueError(f"actions must be a non-empty [N, ..., D] array, got shape {a.shape}")
    flat = a.reshape(-1, a.shape[-1])  # [N, ..., D] -> [M, D]
    q01, q99 = np.percentile(flat, [1.0, 99.0], axis=0)
    return torch.as_tensor(q01, dtype=torch.float32), torch.as_tensor(q99, dtype=torch.float32)


class TokenVLAPolicy(VLACheckpointMixin, nn.Module):
    """OpenVLA-OFT-style token-action VLA (see the module docstring for the model and the formulas).

    Args:
        cfg: policy config: preset/sizes, use_state, max_prompt_len, value_head, num_action_chunks C,
            action_bins. (`model_path` is not read here: `make_policy` / `from_pretrained` load checkpoints.)
        obs_dim: O, length of obs["state"]. action_dim: D.
        num_values: 1 (chunk-level values [B]) or C (action-level values [B, C]).
        image_size: H = W of obs["rgb"], or None (state-only env: no vision tower, no image tokens).

    Observations: {"prompt": int64 [B, L] (from `tokenize`), "rgb": uint8 [B, H, W, 3] (if image_size),
    "state": float32 [B, O] (if use_state)}.

    Attributes:
        temperature: float > 0, the policy's softmax temperature (act, evaluate, entropy): `policy.temperature`
            (the actor and the rollout replicas are built from the same config).
        action_q01, action_q99: float32 [D] buffers, the un-normalisation statistics (`set_action_stats`).

    Raises:
        ConfigError: bad config (see `check_config`), image_size not a multiple of the patch size.
        ValueError: num_values not 1 or C; action_dim < 1.
    """

    family = "token_vla"
    needs_prompt = True

    def __init__(self, cfg: PolicyConfig, obs_dim: int, action_dim: int, num_values: int = 1,
                 image_size: int | None = None):
        super().__init__()
        sizes = check_config(cfg)
        if num_values not in (1, cfg.num_action_chunks):
            raise ValueError(f"num_values={num_values}: use 1 or num_action_chunks={cfg.num_action_chunks}")
        if action_dim < 1:
            raise ValueError(f"action_dim must be >= 1, got {action_dim}")
        self.cfg, self.sizes = cfg, sizes
        self.obs_dim, self.action_dim, self.num_values, self.image_size = obs_dim, action_dim, num_values, image_size
        self.C, self.D, self.bins = cfg.num_action_chunks, action_dim, cfg.action_bins
        self.temperature = float(cfg.temperature)
        self.tokenizer = ByteTokenizer()
        self.prefix = PrefixEncoder(sizes, obs_dim, image_size, cfg.use_state)
        width = sizes["lm_width"]
        self.action_queries = nn.Parameter(torch.randn(self.C * self.D, width) * 0.02)  # [C*D, W]
        self.action_head = nn.Linear(width, self.bins)
        self.value_head = ValueHead(width, sizes["value_hidden"], num_values, cfg.value_head,
                                    obs_dim if cfg.critic_state else 0)
        self.register_buffer("action_q01", torch.full((action_dim,), -1.0))
        self.register_buffer("action_q99", torch.full((action_dim,), 1.0))

    # ---------------------------------------------------------------------------------------- action stats
    def set_action_stats(self, q01: Any, q99: Any) -> None:
        """Set the un-normalisation statistics: q01, q99 array-like [D] with q01 <= q99.

        Raises ValueError on a shape other than [D] or q01 > q99 in some dimension."""
        q01 = torch.as_tensor(q01, dtype=torch.float32).reshape(-1)
        q99 = torch.as_tensor(q99, dtype=torch.float32).reshape(-1)
        if q01.shape != (self.D,) or q99.shape != (self.D,):
            raise ValueError(f"q01 / q99 must be [D={self.D}], got {tuple(q01.shape)} / {tuple(q99.shape)}")
        if bool((q01 > q99).any()):
            raise ValueError(f"q01 must be <= q99 in every dimension, got q01={q01.tolist()} q99={q99.tolist()}")
        self.action_q01.copy_(q01)
        self.action_q99.copy_(q99)

    @property
    def action_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q01 [D], q99 [D]); assigning a pair calls `set_action_stats`."""
        return self.action_q01.clone(), self.action_q99.clone()

    @action_stats.setter
    def action_stats(self, stats: tuple[Any, Any]) -> None:
        self.set_action_stats(*stats)

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions [..., D] -> normalised [..., D] in [-1, 1]: 2 (a - q01) / (q99 - q01) - 1, clipped.
        A dimension with q01 == q99 maps to -1 (it decodes back to q01)."""
        q01, q99 = self.action_q01.to(actions.device), self.action_q99.to(actions.device)
        scale = (q99 - q01).clamp_min(1e-8)
        return (2.0 * (actions.float() - q01) / scale - 1.0).clamp(-1.0, 1.0)

    def unnormalize_actions(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised [..., D] -> env actions: 0.5 (x + 1) (q99 - q01) + q01 (OpenVLA)."""
        q01, q99 = self.action_q01.to(x.device), self.action_q99.to(x.device)
        return 0.5 * (x.float() + 1.0) * (q99 - q01) + q01

    def actions_to_bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions float [..., D] -> tokens int64 [..., D] in [0, bins)."""
        return normalized_to_bins(self.normalize_actions(actions), self.bins)

    def bins_to_actions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens int64 [..., D] -> env actions float32 [..., D] (bin centres, un-normalised).
        Raises ValueError for tokens outside [0, bins)."""
        tokens = tokens.long()
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.bins):
            raise ValueError(f"tokens must be in [0, {self.bins}), got range [{int(tokens.min())}, "
                             f"{int(tokens.max())}]")
        centers = bin_centers(self.bins, device=tokens.device)
        return self.unnormalize_actions(centers[tokens])

    # ------------------------------------------------------------------------------------------------ model
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """texts (B strings) -> int64 [B, max_prompt_len] byte tokens (pad 0)."""
        return self.tokenizer.tokenize(texts, self.cfg.max_prompt_len)

    def _prefix_embeddings(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The PrefixEncoder's input tokens: ([image ; prompt ; state] embeddings [B, P, W], valid mask [B, P]).

        Same order, modules and mask as `PrefixEncoder.forward` (which runs the LM itself and so cannot take the
        action placeholders)."""
        enc = self.prefix
        if "prompt" not in obs:
            raise KeyError("obs['prompt'] is required (int64 [B, L] from policy.tokenize)")
        prompt = obs["prompt"].long()
        B = prompt.shape[0]
        parts = [enc.lm.get_input_embeddings()(prompt)]  # [B, L, W]
        masks = [prompt != ByteTokenizer.PAD_ID]
        if enc.vision is not None:
            if "rgb" not in obs:
                raise KeyError("obs['rgb'] is required: this model was built with a vision tower")
            img = enc.image_tokens(obs["rgb"])  # [B, N_patches, W]
            parts.insert(0, img)
            masks.insert(0, torch.ones(img.shape[:2], dtype=torch.bool, device=img.device))
        if enc.state_proj is not None:
            if "state" not in obs:
                raise KeyError("obs['state'] is required: policy.use_state is on")
            st = enc.state_proj(obs["state"].to(enc.state_proj.weight.dtype))[:, None]  # [B, 1, W]
            parts.append(st)
            masks.append(torch.ones(B, 1, dtype=torch.bool, device=st.device))
        return torch.cat(parts, dim=1), torch.cat(masks, dim=1)

    def forward_tokens(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One LM pass over [prefix ; C*D action placeholders].

        Returns:
            (logits float [B, C, D, bins] (raw, temperature not applied), values [B] or [B, C]).
        """
        x_pre, mask = self._prefix_embeddings(obs)  # [B, P, W], [B, P]
        B, P, _ = x_pre.shape
        K = self.C * self.D
        dev = x_pre.device
        queries = self.action_queries.to(x_pre.dtype)[None].expand(B, K, -1)  # [C*D, W] -> [B, C*D, W]
        x = torch.cat([x_pre, queries], dim=1)  # [B, P + C*D, W]
        key_valid = torch.cat([mask, torch.ones(B, K, dtype=torch.bool, device=dev)], dim=1)  # [B, P + K]
        is_action = torch.arange(P + K, device=dev) >= P  # [P + K]
        # prefix queries see valid prefix keys only; action queries see valid prefix keys and every action key
        allowed = key_valid[:, None, :] & (is_action[:, None] | ~is_action[None, :])[None]  # [B, P+K, P+K]
        allowed = allowed | torch.eye(P + K, dtype=torch.bool, device=dev)[None]
        pre_pos = (mask.long().cumsum(1) - 1).clamp_min(0)  # [B, P], as PrefixEncoder
        act_pos = mask.long().sum(1, keepdim=True) + torch.arange(K, device=dev)[None]  # [B, K]
        out = self.prefix.lm(inputs_embeds=x, attention_mask=additive_mask(allowed, x.dtype),
                             position_ids=torch.cat([pre_pos, act_pos], dim=1), use_cache=False)
        hidden = out.last_hidden_state  # [B, P + K, W]
        logits = self.action_head(hidden[:, P:]).view(B, self.C, self.D, self.bins)  # [B, C*D, bins] -> [B,C,D,bins]
        return logits.float(), self._values(hidden[:, :P], mask, obs)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        return torch.log_softmax(logits / self.temperature, dim=-1)  # [..., bins]

    def values(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """obs -> values [B] (num_values 1) or [B, C] float32 (prefix-only pass)."""
        pre = self.prefix(obs)
        return self._values(pre.hidden, pre.mask, obs)

    # ------------------------------------------------------------------------------------------------ protocol
    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> dict:
        """Decode an action chunk: one token per action dimension, all C*D in parallel.

        Args:
            obs: see the class docstring (batch B).
            deterministic: argmax tokens (eval) instead of sampling softmax(logits / temperature) (global torch RNG).

        Returns:
            {"actions" float32 [B, C, D] (bin centres, un-normalised), "logprobs" float32 [B, C, D] (log-prob of each
             chosen token under softmax(logits / temperature)), "values" [B] or [B, C],
             "extras": {"tokens" int64 [B, C, D]}}.
        """
        logits, values = self.forward_tokens(obs)
        logp = self._log_probs(logits)  # [B, C, D, bins]
        if deterministic:
            tokens = logp.argmax(-1)  # [B, C, D]
        else:
            tokens = torch.multinomial(logp.exp().reshape(-1, self.bins), 1).view(logp.shape[:-1])
        token_lp = logp.gather(-1, tokens[..., None])[..., 0]  # [B, C, D]
        return {"actions": self.bins_to_actions(tokens), "logprobs": token_lp, "values": values,
                "extras": {"tokens": tokens}}

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 extras: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Differentiable token log-probs of the stored tokens and the categorical entropies.

        Args:
            obs: as for `act` (batch N). actions: [N, C, D] from `act`.
            extras: {"tokens" int64 [N, C, D]} from `act`; without it the tokens are recomputed from `actions`
                (exact for actions `act` produced: bins -> actions -> bins is the identity).

        Returns:
            {"logprobs" [N, C, D], "entropy" [N, C, D] (of softmax(logits / temperature)), "values" [N] or [N, C]};
            with unchanged parameters the log-probs equal `act`'s (ratio 1).

        Raises:
            ValueError: actions / tokens that are not [N, C, D].
        """
        if actions.dim() != 3 or actions.shape[1:] != (self.C, self.D):
            raise ValueError(f"actions {tuple(actions.shape)}: expected [N, {self.C}, {self.D}]")
        tokens = (extras or {}).get("tokens")
        if tokens is None:
            tokens = self.actions_to_bins(actions)
        tokens = tokens.long()
        if tokens.shape != actions.shape:
            raise ValueError(f"actions {tuple(actions.shape)} / tokens {tuple(tokens.shape)}: expected "
                             f"[N, {self.C}, {self.D}]")
        logits, values = self.forward_tokens(obs)
        logp = self._log_probs(logits)  # [N, C, D, bins]
        token_lp = logp.gather(-1, tokens.to(logp.device)[..., None])[..., 0]  # [N, C, D]
        entropy = -(logp.exp() * logp).sum(-1)  # [N, C, D]
        return {"logprobs": token_lp, "entropy": entropy, "values": values}

    def sft_loss(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Behaviour cloning: mean token cross-entropy (raw logits) of the binned demonstrations.

        Args:
            obs: batch N. actions: float env actions [N, C, D] (normalised with the stats, then binned).
            mask: optional bool [N, C]: the actions that count (the mean over each action's D tokens, then over the
                set entries; 0 when none is set). None: every token.
        Returns:
            scalar float32 loss (mean over N*C*D tokens). Raises ValueError on an action or mask shape mismatch.
        """
        if actions.dim() != 3 or actions.shape[1:] != (self.C, self.D):
            raise ValueError(f"actions {tuple(actions.shape)}: expected [N, {self.C}, {self.D}]")
        logits, _ = self.forward_tokens(obs)
        targets = self.actions_to_bins(actions.to(logits.device))  # [N, C, D]
        if mask is None:
            return nn.functional.cross_entropy(logits.reshape(-1, self.bins), targets.reshape(-1))
        ce = nn.functional.cross_entropy(logits.reshape(-1, self.bins), targets.reshape(-1), reduction="none")
        return masked_mean(ce.reshape(targets.shape).mean(-1), mask)  # [N, C, D] -> [N, C] -> scalar

    # ------------------------------------------------------------------------------------------- checkpoint
    def _checkpoint_config(self) -> dict:
        meta = super()._checkpoint_config()
        # informative copy; the buffers in model.safetensors are what is loaded
        meta["action_stats"] = {"q01": self.action_q01.tolist(), "q99": self.action_q99.tolist()}
        return meta


def read_action_stats(path: str | Path) -> dict[str, list[float]]:
    """The q01/q99 statistics recorded in a token_vla checkpoint's config.json (for inspection)."""
    return json.loads((Path(path) / "config.json").read_text())["action_stats"]


__all__ = ["PRESETS", "TokenVLAPolicy", "action_stats_from_data", "bin_centers", "check_config",
           "normalized_to_bins", "read_action_stats"]

"""pi0-style flow-matching VLA with the piRL stochastic samplers (Flow-SDE, Flow-Noise) for RL post-training.

Architecture (pi0, Black et al. 2024, "pi0: A Vision-Language-Action Flow Model for General Robot Control"):
  prefix  `vla_common.PrefixEncoder`: SigLIP patches -> Linear ; prompt tokens ; state token -> Gemma LM
          (full attention inside the prefix). Its per-layer keys/values are kept (the prefix KV cache).
  expert  a second, narrower Gemma (`transformers.GemmaModel` on `inputs_embeds`) over C action tokens. Every
          expert layer attends to [the prefix LM's keys/values of the same layer ; the action tokens' own
          keys/values]: pi0's shared-attention "mixture of experts" exactly, run as pi0 runs inference (the prefix
          never attends to the actions, so its KV cache is computed once per observation and reused for all K
          denoising steps). This is why the expert shares the LM's layer count, KV heads and head dim (as pi0's
          Gemma-300M expert does with Gemma-2B); only its width and MLP size differ. Action tokens attend to
          each other bidirectionally and to every valid prefix token.
  tokens  action token = MLP_swish([Linear(A -> W_e)(x_t) ; sincos(t)]) (pi0's action_time_mlp, sin-cos time
          embedding with periods 4e-3 .. 4, as openpi); velocity = Linear(W_e -> A)(expert output).
  value   `vla_common.ValueHead` on the prefix features (RLinf's `value_after_vlm` critic).

Flow convention (pi0 / openpi): x_t = t * noise + (1 - t) * action, t = 1 is pure noise, t = 0 the action; the
network predicts the velocity v = dx_t/dt = noise - action. Inference integrates from t = 1 to t = 0 on the grid
t_k = 1 - k/K, k = 0..K (step size delta = 1/K): Euler x_{k+1} = x_k - delta * v(x_k, t_k).

SFT (`sft_loss`): MSE between v(x_t, t) and (noise - action) over all A model dims (env actions zero-padded from
D to A, as pi0 pads to 32), t = 0.001 + 0.999 * Beta(1.5, 1) (openpi's sampling, which puts more weight on the
noisy end t -> 1; pi0 paper Sec. 4 "Beta((s - tau)/s; 1.5, 1)", s = 0.999, in the paper's flipped time).

Stochastic sampling for RL (`tasks.policies.flow_sampling`, shared with the pi0 / pi05 families; piRL, Chen et
al. 2025, "piRL: Online RL Fine-tuning for Flow-based VLA Models", and RLinf's openpi integration). With
x0_hat = x - t v and x1_hat = x + (1 - t) v, a transition is Gaussian N(mean, std^2) per element:
  deterministic (ODE):  mean = x0_hat (1 - t + delta) + x1_hat (t - delta)        = x - delta v,   std = 0
  Flow-SDE:             sigma_k = a sqrt(t_k / (1 - t_k)), a = policy.noise_level, with the t = 1 endpoint
                        clamped as RLinf does (1 - t_0 is replaced by 1 - t_1 = delta, so sigma_0 = a sqrt(K));
                        mean = x0_hat (1 - t + delta) + x1_hat (t - delta - sigma^2 delta / (2 t))
                             = x - delta [v + sigma^2 / (2 t) (x + (1 - t) v)]   (the SDE with the ODE's marginals),
                        std  = sqrt(delta) * sigma_k.
                        ONE step index k* ~ U{0..K-1} per sample is stochastic, all others deterministic
                        (piRL's ODE-SDE mix; RLinf draws one index per batch, here one per sample).
                        log-prob = log N(x_{k*+1}; mean, std) of that transition.
  Flow-Noise:           mean = the Euler mean, std = noise head(expert features) in [noise_std_min, noise_std_max]
                        (tanh -> log-variance interpolated between log min^2 and log max^2, RLinf's
                        ExploreNoiseNet), EVERY step stochastic; log-prob = the MEAN over the K transitions,
                        as RLinf's joint_logprob averages over the steps (it also averages in the log-density
                        of the initial noise, a term that does not depend on the parameters; left out here).
                        A sum would make log-ratios K times larger and PPO's clipping K times tighter.
Log-probs and entropies are per element [B, C, D] (the padded A - D model dims never reach the env and are not
counted, as RLinf slices to action_env_dim). The entropy is that of the transition Gaussians, 0.5 log(2 pi e std^2),
of the stochastic step (Flow-SDE; constant in the parameters) or averaged over the steps (Flow-Noise).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tasks.algorithms.losses import masked_mean
from tasks.config import ConfigError, PolicyConfig
from tasks.policies.flow_sampling import (NOISE_METHODS, NoiseStdHead, chain_logprobs, flow_transition,  # noqa: F401
                                         sample_chain, sde_sigmas, time_grid)
from tasks.policies.vla_common import (ByteTokenizer, PrefixEncoder, VLACheckpointMixin, ValueHead, additive_mask,
                                       check_common_config, gemma_config)


# pi0: SigLIP So400m/14 at 224 px (width 1152, 27 layers, MLP 4304, 16 heads), Gemma 2B prefix LM (width 2048,
# 18 layers, MLP 16384, 8 query heads, 1 KV head, head dim 256, PaliGemma vocabulary 257152), Gemma-300M action
# expert (width 1024, MLP 4096, the LM's 18 layers / heads / head dim), A = 32 model action dims. pi0 also uses
# C = 50 actions per chunk and K = 10 denoising steps: policy.num_action_chunks / policy.num_denoise_steps.
# The byte tokenizer uses ids < 384; the pi0 preset keeps PaliGemma's embedding table size so that parameter
# counts match the real model.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(patch_size=8, vision_width=64, vision_layers=2, vision_heads=4, vision_mlp=128,
                 lm_width=64, lm_layers=2, lm_heads=4, lm_kv_heads=1, lm_head_dim=16, lm_mlp=128, vocab_size=384,
                 value_hidden=64, expert_width=64, expert_mlp=128, action_dim=8),
    "pi0": dict(patch_size=14, vision_width=1152, vision_layers=27, vision_heads=16, vision_mlp=4304,
                lm_width=2048, lm_layers=18, lm_heads=8, lm_kv_heads=1, lm_head_dim=256, lm_mlp=16384,
                vocab_size=257152, value_hidden=512, expert_width=1024, expert_mlp=4096, action_dim=32),
}


def check_config(cfg: PolicyConfig) -> dict[str, int]:
    """Offline checks of a flow_vla policy config; returns the resolved sizes. Raises ConfigError."""
    sizes = check_common_config(cfg, PRESETS)
    if cfg.noise_method not in NOISE_METHODS:
        raise ConfigError("policy.noise_method", cfg.noise_method, f"use one of {list(NOISE_METHODS)}")
    if cfg.num_denoise_steps < 1:
        raise ConfigError("policy.num_denoise_steps", cfg.num_denoise_steps, "use >= 1 (pi0 uses 10)")
    if cfg.noise_method == "flow_sde" and not cfg.noise_level > 0:
        raise ConfigError("policy.noise_level", cfg.noise_level, "use > 0 (piRL uses 0.5)")
    if cfg.noise_method == "flow_noise" and not 0 < cfg.noise_std_min <= cfg.noise_std_max:
        raise ConfigError("policy.noise_std_min", (cfg.noise_std_min, cfg.noise_std_max),
                          "need 0 < noise_std_min <= noise_std_max (piRL uses 0.08, 0.16)")
    return sizes


def sincos_time(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """t [N] -> [N, dim] sine-cosine embedding with geometric periods in [min_period, max_period] (openpi)."""
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    ang = t.float()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)


class FlowVLAPolicy(VLACheckpointMixin, nn.Module):
    """pi0-style flow-matching VLA (see the module docstring for the model and the formulas).

    Args:
        cfg: policy config: preset/sizes, use_state, max_prompt_len, value_head, num_action_chunks C,
            num_denoise_steps K, noise_method, noise_level, noise_std_min/max. (`model_path` is not read here:
            `make_policy` / `from_pretrained` load checkpoints.)
        obs_dim: O, length of obs["state"]. action_dim: D <= the model's A (`sizes.action_dim`).
        num_values: 1 (chunk-level values [B]) or C (action-level values [B, C]).
        image_size: H = W of obs["rgb"], or None (state-only env: no vision tower, no image tokens).

    Observations: {"prompt": int64 [B, L] (from `tokenize`), "rgb": uint8 [B, H, W, 3] (if image_size),
    "state": float32 [B, O] (if use_state)}.

    Raises:
        ConfigError: bad config (see `check_config`), D > A, image_size not a multiple of the patch size.
        ValueError: num_values not 1 or C.
    """

    family = "flow_vla"
    needs_prompt = True

    def __init__(self, cfg: PolicyConfig, obs_dim: int, action_dim: int, num_values: int = 1,
                 image_size: int | None = None):
        super().__init__()
        from transformers import GemmaModel
        sizes = check_config(cfg)
        if action_dim > sizes["action_dim"]:
            raise ConfigError("policy.sizes", {"action_dim": sizes["action_dim"]},
                              f"the env has {action_dim} action dims; set policy.sizes.action_dim >= {action_dim}")
        if num_values not in (1, cfg.num_action_chunks):
            raise ValueError(f"num_values={num_values}: use 1 or num_action_chunks={cfg.num_action_chunks}")
        self.cfg, self.sizes = cfg, sizes
        self.obs_dim, self.action_dim, self.num_values, self.image_size = obs_dim, action_dim, num_values, image_size
        self.C, self.D, self.A, self.K = cfg.num_action_chunks, action_dim, sizes["action_dim"], cfg.num_denoise_steps
        self.tokenizer = ByteTokenizer()
        self.prefix = PrefixEncoder(sizes, obs_dim, image_size, cfg.use_state)
        we = sizes["expert_width"]
        self.expert = GemmaModel(gemma_config(width=we, layers=sizes["lm_layers"], heads=sizes["lm_heads"],
                                              kv_heads=sizes["lm_kv_heads"], head_dim=sizes["lm_head_dim"],
                                              mlp=sizes["expert_mlp"], vocab_size=1))
        self.action_in_proj = nn.Linear(self.A, we)
        self.action_time_mlp_in = nn.Linear(2 * we, we)
        self.action_time_mlp_out = nn.Linear(we, we)
        self.action_out_proj = nn.Linear(we, self.A)
        self.value_head = ValueHead(sizes["lm_width"], sizes["value_hidden"], num_values, cfg.value_head,
                                    obs_dim if cfg.critic_state else 0)
        self.noise_head = (NoiseStdHead(we, self.A, cfg.noise_std_min, cfg.noise_std_max)
                           if cfg.noise_method == "flow_noise" else None)
        # the actions' standardisation (identity unless set_action_norm; saved with the weights): the flow runs on
        # (a - action_mean) / action_std, and act returns x * action_std + action_mean
        self.register_buffer("action_mean", torch.zeros(self.D))
        self.register_buffer("action_std", torch.ones(self.D))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Weights saved before the action standardisation existed load with the identity (raw actions)."""
        for name, fill in (("action_mean", 0.0), ("action_std", 1.0)):
            state_dict.setdefault(prefix + name, torch.full_like(getattr(self, name), fill))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_action_norm(self, mean, std) -> None:
        """Run the flow on standardised actions (a - mean) / std: mean, std array-like [D], std > 0. The chain,
        its log-probs and the SFT targets live in that space; `act` returns actions in the env's units (the
        log-probs differ from the env-space ones by the constant log|std|: PPO ratios are unchanged).

        Raises ValueError on another shape or a std that is not positive."""
        mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        if mean.shape != (self.D,) or std.shape != (self.D,):
            raise ValueError(f"action mean / std must be [D={self.D}], got {tuple(mean.shape)} / {tuple(std.shape)}")
        if not bool((std > 0).all()):
            raise ValueError(f"action std must be > 0 in every dimension, got {std.tolist()}")
        self.action_mean.copy_(mean)
        self.action_std.copy_(std)

    # ------------------------------------------------------------------------------------------------ pieces
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """texts (B strings) -> int64 [B, max_prompt_len] byte tokens (pad 0)."""
        return self.tokenizer.tokenize(texts, self.cfg.max_prompt_len)

    def _velocity(self, kv, prefix_mask: torch.Tensor, x: torch.Tensor, t: torch.Tensor):
        """One expert pass: x [N, C, A], t [N] -> (velocity [N, C, A], expert features [N, C, W_e]).

        kv: the prefix KV cache, per layer (keys, values) [N, kv_heads, P, head_dim]; prefix_mask [N, P] bool."""
        from transformers import DynamicCache
        N, C, _ = x.shape
        dtype = self.action_in_proj.weight.dtype
        a_emb = self.action_in_proj(x.to(dtype))  # [N, C, W_e]
        t_emb = sincos_time(t, a_emb.shape[-1]).to(dtype)[:, None].expand_as(a_emb)  # [N, C, W_e]
        tok = self.action_time_mlp_out(nn.functional.silu(self.action_time_mlp_in(torch.cat([a_emb, t_emb], -1))))
        P = prefix_mask.shape[1]
        allowed = torch.cat([prefix_mask[:, None, :].expand(N, C, P),
                             torch.ones(N, C, C, dtype=torch.bool, device=x.device)], dim=2)  # [N, C, P + C]
        positions = prefix_mask.long().sum(1, keepdim=True) + torch.arange(C, device=x.device)[None]  # [N, C]
        out = self.expert(inputs_embeds=tok, attention_mask=additive_mask(allowed, dtype), position_ids=positions,
                          cache=DynamicCache(ddp_cache_data=kv), use_cache=False)
        feats = out.last_hidden_state
        return self.action_out_proj(feats), feats

    def _transition(self, x: torch.Tensor, v: torch.Tensor, feats: torch.Tensor, k: torch.Tensor,
                    stochastic: torch.Tensor):
        """Gaussian of step k (grid index [N]) from x [N, C, A]: (mean [N, C, A], std [N, C, A])
        (`flow_sampling.flow_transition`). `stochastic` [N] bool: False -> the deterministic Euler step (std 0)."""
        return flow_transition(x, v, feats, k, stochastic, num_steps=self.K, noise_level=self.cfg.noise_level,
                               noise_head=self.noise_head)

    def values(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """obs -> values [B] (num_values 1) or [B, C] float32."""
        pre = self.prefix(obs)
        return self._values(pre.hidden, pre.mask, obs)

    # ------------------------------------------------------------------------------------------------ protocol
    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False,
            noise: torch.Tensor | None = None) -> dict:
        """Sample an action chunk by integrating the flow from noise (t = 1) to actions (t = 0) in K steps.

        Args:
            obs: see the class docstring (batch B).
            deterministic: the plain ODE (eval): no stochastic step, log-probs are 0.
            noise: optional initial x_1 [B, C, A] (default: standard normal from the global torch RNG; the SDE
                noise and the stochastic step index also come from it).

        Raises:
            ValueError: `noise` of another shape. KeyError: a missing observation key.

        Returns:
            {"actions" [B, C, D] = the final x_0 (sliced to D, un-normalised: `set_action_norm`),
             "logprobs" [B, C, D], "values" [B] or [B, C],
             "extras": {"chain" [B, K+1, C, A] float32 (x at t_0 = 1 .. t_K = 0),
                        "denoise_idx" int64 [B] (flow_sde: the stochastic step; -1 when deterministic or
                        flow_noise, where every step is stochastic)}}.
        """
        B = obs["prompt"].shape[0]
        dev = self.action_in_proj.weight.device
        pre = self.prefix(obs, with_kv=True)
        if noise is not None and noise.shape != (B, self.C, self.A):
            raise ValueError(f"noise {tuple(noise.shape)}: expected [B, C, A] = {(B, self.C, self.A)}")
        x = torch.randn(B, self.C, self.A, device=dev) if noise is None else noise.to(dev, torch.float32)
        x, chain, logp, denoise_idx = sample_chain(
            lambda xk, t: self._velocity(pre.kv, pre.mask, xk, t), x, num_steps=self.K,
            noise_level=self.cfg.noise_level, noise_head=self.noise_head, deterministic=deterministic)
        actions = x[..., :self.D] * self.action_std.to(x.dtype) + self.action_mean.to(x.dtype)
        return {"actions": actions, "logprobs": logp[..., :self.D],
                "values": self._values(pre.hidden, pre.mask, obs),
                "extras": {"chain": chain, "denoise_idx": denoise_idx}}

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Differentiable log-probs of the stored transitions under the current parameters.

        Args:
            obs: as for `act` (batch N). actions: [N, C, D] (only checked for shape: the log-prob is that of the
                stored denoising chain, whose last element they are).
            extras: {"chain" [N, K+1, C, A], "denoise_idx" int64 [N]} from `act`.

        Returns:
            {"logprobs" [N, C, D], "entropy" [N, C, D], "values" [N] or [N, C]}; with unchanged parameters the
            log-probs equal `act`'s (ratio 1).

        Raises:
            ValueError: shapes that do not match this policy, or a deterministic (denoise_idx -1) flow_sde chain.
        """
        chain, idx = extras["chain"], extras["denoise_idx"].long()
        if chain.shape[1:] != (self.K + 1, self.C, self.A) or actions.shape[1:] != (self.C, self.D):
            raise ValueError(f"chain {tuple(chain.shape)} / actions {tuple(actions.shape)} do not match "
                             f"K+1={self.K + 1}, C={self.C}, A={self.A}, D={self.D}")
        pre = self.prefix(obs, with_kv=True)
        logp, ent = chain_logprobs(lambda xk, t: self._velocity(pre.kv, pre.mask, xk, t), chain, idx,
                                   num_steps=self.K, noise_level=self.cfg.noise_level, noise_head=self.noise_head)
        return {"logprobs": logp[..., :self.D], "entropy": ent[..., :self.D],
                "values": self._values(pre.hidden, pre.mask, obs)}

    def sft_loss(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Flow-matching behaviour-cloning loss (pi0): mean over [N, C, A] of (v(x_t, t) - (noise - a))^2.

        Args:
            obs: batch N. actions: float [N, C, D] demonstrations (zero-padded to A here).
            mask: optional bool [N, C]: the actions that count (the mean over A of each, then the mean over the
                set entries; 0 when none is set). None: every action, as in SFT.
        Returns:
            scalar float32 loss. Raises ValueError on an action or mask shape mismatch.
        """
        if actions.shape[1:] != (self.C, self.D):
            raise ValueError(f"actions {tuple(actions.shape)}: expected [N, {self.C}, {self.D}]")
        N = actions.shape[0]
        a = (actions.float() - self.action_mean) / self.action_std  # the flow's space (set_action_norm)
        a = nn.functional.pad(a, (0, self.A - self.D))  # [N, C, D] -> [N, C, A]
        noise = torch.randn_like(a)
        t = 0.001 + 0.999 * torch.distributions.Beta(1.5, 1.0).sample((N,)).to(a.device)  # [N]
        x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * a
        pre = self.prefix(obs, with_kv=True)
        v, _ = self._velocity(pre.kv, pre.mask, x_t, t)
        err = (v - (noise - a)) ** 2  # [N, C, A]
        return err.mean() if mask is None else masked_mean(err.mean(-1), mask)

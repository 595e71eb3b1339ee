"""pi0 (transformers' `PI0ForConditionalGeneration`) behind dagrl's Policy protocol, with piRL's stochastic samplers.

The model is the library's (`self.hf`: PaliGemma prefix `hf.model.vlm`, Gemma action expert `hf.model.dit`, the
action/time embedding and `action_out_proj`); dagrl adds the RL glue:
  inputs    the model's own processor (`PI0Processor`: <image> tokens per camera, BOS, the task, "\\n"; the state
            normalised with the processor's statistics and zero-padded to max_state_dim; pi05: `PI05Processor`
            writes the discretised state into the prompt) from the env's observations: obs "rgb" (and
            "wrist_rgb" when an env gives a wrist camera) uint8 [B, H, W, 3], resized by the processor's image
            processor to the vision tower's size; `pixel_attention_mask` marks the cameras present.
  velocity  the library's forward(noise=x_t, timestep=t, cache=prefix cache): the prefix KV cache is computed once
            per policy call (embed_prefix + the VLM, exactly as `sample_actions`) and cropped back to the prefix
            after every denoising step (`cache.crop`), as `sample_actions` does.
  sampling  `tasks.policies.flow_sampling`: the ODE (eval), Flow-SDE and Flow-Noise with the denoising chain kept in
            `extras` and the log-probs recomputed exactly in `evaluate` (ratio 1 with unchanged parameters). The
            deterministic path equals the library's `sample_actions` for the same inputs and initial noise.
  value     `vla_common.ValueHead` on the VLM's prefix features (pooled over the valid prompt and image tokens),
            for pi0 joined by the processor's normalised state (pi0 feeds the state to the action expert only, so the
            prefix does not see it; pi05 has it in the prompt). Why not the action expert's features, where RLinf
            puts pi0's critic: those depend on the sampling noise x_t and the time t, so V(s) would be a random
            variable of the sampler (RLinf averages it over the steps); the prefix features are a function of the
            observation alone, come free with the KV cache every call computes anyway, and `values(obs)` needs no
            denoising pass.
  Flow-Noise's std head reads the action expert's features (the input of `action_out_proj`).
  SFT       the library's flow-matching loss (forward with `actions=`: t ~ 0.001 + 0.999 Beta(1.5, 1), MSE of the
            velocity against noise - action over the whole chunk and all max_action_dim dims).
Chunks: the model predicts `chunk_size` T actions of max_action_dim A; the env executes the first
policy.num_action_chunks C <= T of them, D = the env's action dims <= A. Log-probs and entropies cover those [C, D]
(the rest never reaches the env, as RLinf slices to action_env_dim); the chain keeps [T, A].

Checkpoints (`save_pretrained`): a transformers directory: config.json (the library's config with dagrl's keys
`family`, `policy`, `obs_dim`, `action_dim`, `num_values`, `image_size` added: transformers keeps unknown keys),
model.safetensors (the library's weights), processor_config.json + tokenizer files (the processor, with the
normalisation statistics), and `dagrl_heads.safetensors` (the RL-only value and Flow-Noise heads, which plain
transformers does not read). `policy.model_path` also takes a plain transformers directory (no dagrl keys, no
heads file): the architecture, tokenizer and statistics are the directory's, the RL heads start fresh.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from tasks.config import ConfigError, PolicyConfig, family_class
from tasks.policies.flow_sampling import NoiseStdHead, chain_logprobs, sample_chain
from tasks.policies.vla_common import ValueHead

CAMERAS = ("rgb", "wrist_rgb")  # obs keys of camera images, in prompt order
HEADS_FILE = "dagrl_heads.safetensors"
HEAD_PREFIXES = ("value_head.", "noise_head.")


def check_config(cfg: PolicyConfig) -> None:
    """Offline checks that need nothing but the config (the family's rules run with the config's). Returns None:
    the processor resizes any camera image, so the env's image size is free."""
    return None


def _keep_input(module: nn.Module, args, output) -> None:
    """Forward hook on the library's `action_out_proj`: keep its input (the action expert's features [N, T, W_e])
    for the Flow-Noise std head (a module-level function: copies of the policy keep their own)."""
    module.dagrl_features = args[0]


class PI0Policy(nn.Module):
    """pi0 from transformers with dagrl's RL (see the module docstring).

    Args:
        cfg: the family's config (tasks.policies.pi0.configuration). With `cfg.model_path` the directory's
            config.json and processor are read here (architecture, tokenizer, statistics; not the weights:
            `make_policy` / `from_pretrained` load those), else `cfg.preset` builds a fresh model.
        obs_dim: O, the env's state length (<= max_state_dim for pi0). action_dim: D <= max_action_dim.
        num_values: 1 (values [B]) or C (values [B, C]).
        image_size: the env's camera size (any: the processor resizes); None is refused (pi0 reads images).

    Raises:
        ConfigError: no images, D / O / C larger than the model takes, statistics of other lengths than the env's.
        ValueError: num_values not 1 or C.
    """

    family = "pi0"
    needs_prompt = True
    state_input = True  # the library's forward takes `state` (pi0); pi05 has the state in the prompt

    def __init__(self, cfg: PolicyConfig, obs_dim: int, action_dim: int, num_values: int = 1,
                 image_size: int | None = None):
        super().__init__()
        from tasks.policies.pi0 import library, processor as proc
        if image_size is None:
            raise ConfigError("env.obs_mode", "state", f"policy={self.family} reads camera images: use "
                                                       f"env.obs_mode=rgb")
        if num_values not in (1, cfg.num_action_chunks):
            raise ValueError(f"num_values={num_values}: use 1 or num_action_chunks={cfg.num_action_chunks}")
        self.cfg, self.obs_dim, self.action_dim = cfg, obs_dim, action_dim
        self.num_values, self.image_size = num_values, image_size
        if cfg.model_path:
            lib_cfg = library.directory_config(self.family, cfg.model_path)
            self.processor = proc.load_processor(self.family, cfg.model_path)
        else:
            lib_probe = library.preset_config(self.family, cfg.preset, chunk_size=cfg.num_action_chunks,
                                              num_steps=cfg.num_denoise_steps)
            vision = lib_probe.vlm_config.vision_config
            self.processor = proc.new_processor(self.family, image_size=vision.image_size,
                                                patch_size=vision.patch_size, obs_dim=obs_dim,
                                                action_dim=action_dim, max_state_dim=self._pad_dim(lib_probe),
                                                chunk_size=lib_probe.chunk_size)
            lib_cfg = library.preset_config(self.family, cfg.preset, chunk_size=cfg.num_action_chunks,
                                            num_steps=cfg.num_denoise_steps, vocab_size=len(self.processor.tokenizer),
                                            image_token_id=self.processor.image_token_id)
        self.C, self.D, self.K = cfg.num_action_chunks, action_dim, cfg.num_denoise_steps
        self.T, self.A = lib_cfg.chunk_size, lib_cfg.max_action_dim
        self._check_sizes(lib_cfg)
        self.hf = library.model_class(self.family)(lib_cfg)
        self.hf.action_out_proj.register_forward_hook(_keep_input)
        width = lib_cfg.vlm_config.text_config.hidden_size
        self.value_head = ValueHead(width, min(width, 512), num_values, cfg.value_head,
                                    lib_cfg.max_state_dim if self.state_input else 0)
        self.noise_head = (NoiseStdHead(lib_cfg.dit_config.hidden_size, self.A, cfg.noise_std_min, cfg.noise_std_max)
                           if cfg.noise_method == "flow_noise" else None)
        self._texts: dict[tuple[int, ...], str] = {}
        from tasks.policies.pi0.lora import configure_training
        configure_training(self, self.hf, cfg)  # lora_*, freeze, gradient_checkpointing (tasks.policies.pi0.lora)

    @classmethod
    def offline_parameter_names(cls, cfg) -> list[str]:
        """The `named_parameters()` names of the policy Config `cfg` builds, offline (tasks.policies.pi0.names: the
        library's model on the meta device, LoRA applied, beside the heads): what tasks.policies.check_lr_scale reads.
        Raises ConfigError / OSError / ValueError as tasks.policies.pi0.names.meta_policy."""
        from tasks.policies.pi0.names import parameter_names
        return parameter_names(cfg)

    @staticmethod
    def _pad_dim(lib_cfg) -> int:
        """The processor's `max_state_dim`: pi0 pads the state to it; PI05Processor pads actions to it (pi05's
        config has no state width: the state is in the prompt)."""
        return getattr(lib_cfg, "max_state_dim", None) or lib_cfg.max_action_dim

    def _check_sizes(self, lib_cfg) -> None:
        key = "policy.model_path" if self.cfg.model_path else "policy.preset"
        value = self.cfg.model_path or self.cfg.preset
        if self.D > self.A:
            raise ConfigError(key, value, f"the model outputs {self.A} action dims, the env takes {self.D}")
        if self.state_input and self.obs_dim > lib_cfg.max_state_dim:
            raise ConfigError(key, value, f"the model reads {lib_cfg.max_state_dim} state dims (max_state_dim), "
                                          f"the env gives {self.obs_dim}: use a model made for this env's state")
        if self.C > self.T:
            raise ConfigError("policy.num_action_chunks", self.C, f"the model predicts chunks of {self.T} actions: "
                                                                  f"use <= {self.T}")
        p = self.processor
        stats = {"state": p.state_mean if p.state_mean is not None else getattr(p, "state_q01", None),
                 "actions": p.actions_mean if p.actions_mean is not None else getattr(p, "actions_q01", None)}
        for name, want in (("state", self.obs_dim), ("actions", self.D)):
            if stats[name] is not None and len(stats[name]) != want:
                raise ConfigError(key, value, f"its processor's {name} statistics have {len(stats[name])} dims, "
                                              f"the env's {name} {want}")

    # ------------------------------------------------------------------------------------------------ inputs
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """texts (B strings) -> int64 [B, max_prompt_len]: the processor's tokenizer ids of each task text (no
        special tokens; right-padded with the pad id, truncated). The processor builds the model's prompt from
        the text again at every call (`_inputs`: image tokens, BOS, pi05's state), so the ids are remembered."""
        if isinstance(texts, str):
            raise TypeError("tokenize takes a list of strings, not one string")
        tok = self.processor.tokenizer
        ids = tok(list(texts), add_special_tokens=False, padding="max_length", truncation=True,
                  max_length=self.cfg.max_prompt_len, return_tensors="pt")["input_ids"].to(torch.int64)
        for row, text in zip(ids.tolist(), texts):
            self._texts[tuple(row)] = text
        return ids

    def _text(self, row: list[int]) -> str:
        text = self._texts.get(tuple(row))
        return text if text is not None else self.processor.tokenizer.decode(row, skip_special_tokens=True)

    def _inputs(self, obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The processor's model inputs for a batch of observations: input_ids / attention_mask int64 [B, L]
        (L = cameras x image_seq_length + max_prompt_len), pixel_values [B, n_cam, 3, S, S] (model dtype),
        pixel_attention_mask bool [B, n_cam], and for pi0 state float32 [B, max_state_dim], on the model's device.

        Raises KeyError: no prompt or no camera image in `obs`; ConfigError (policy.max_prompt_len): a prompt longer
        than max_prompt_len tokens."""
        if "prompt" not in obs:
            raise KeyError("obs['prompt'] is required (int64 [B, L] from policy.tokenize)")
        cams = [k for k in CAMERAS if k in obs]
        if not cams:
            raise KeyError(f"obs has no camera image (one of {list(CAMERAS)}, uint8 [B, H, W, 3])")
        texts = [self._text(row) for row in obs["prompt"].tolist()]
        B = len(texts)
        # uint8 [B, H, W, 3] -> per sample a list of [3, H, W] images, one per camera
        images = [[obs[k][i].detach().cpu().permute(2, 0, 1) for k in cams] for i in range(B)]
        state = obs["state"].detach().float().cpu()
        length = len(cams) * self.processor.image_seq_length + self.cfg.max_prompt_len
        try:  # never truncated: a cut prompt would lose pi05's state or its "Action: " suffix
            enc = self.processor(images=images, text=texts, state=state, padding="max_length", max_length=length,
                                 truncation=False, return_tensors="pt")
        except ValueError:  # prompts of several lengths above max_length: no tensor of one length
            enc = None
        if enc is None or enc["input_ids"].shape[1] != length:
            from tasks.policies.pi0.processor import longest_prompt  # any state of these tasks fits that length
            need, _ = longest_prompt(self.processor, texts, num_cameras=len(cams), state_dim=state.shape[-1])
            raise ConfigError("policy.max_prompt_len", self.cfg.max_prompt_len,
                              "a prompt the processor built (BOS, the task text" +
                              (", the discretised state" if not self.state_input else "") +
                              f") is longer: use policy.max_prompt_len={need} (or more)")
        dev, dtype = self.hf.action_out_proj.weight.device, self.hf.action_out_proj.weight.dtype
        out = {k: v.to(dev) for k, v in enc.items()}
        out["pixel_values"] = out["pixel_values"].to(dtype)
        return out

    def _prefix(self, inp: dict[str, torch.Tensor]):
        """The VLM over the prefix, as `sample_actions` runs it: (last hidden states [B, L, W], the KV cache)."""
        position_ids = inp["attention_mask"].cumsum(-1) - 1
        embeds = self.hf.model.embed_prefix(inp["input_ids"], inp["pixel_values"], inp["pixel_attention_mask"])
        token_type_ids = torch.zeros_like(embeds)[:, :, 0]
        out = self.hf.model.vlm(inputs_embeds=embeds, attention_mask=inp["attention_mask"], position_ids=position_ids,
                                token_type_ids=token_type_ids, use_cache=True)
        return out.last_hidden_state, out.cache

    def _velocity_fn(self, inp: dict[str, torch.Tensor], cache):
        """velocity(x [N, T, A], t [N]) -> (v [N, T, A] float32, expert features [N, T, W_e]): one library forward
        on the prefix cache, which is cropped back to the prefix afterwards (as `sample_actions`)."""
        prefix_length = cache.get_seq_length()
        extra = {"state": inp["state"]} if self.state_input else {}

        def velocity(x: torch.Tensor, t: torch.Tensor):
            out = self.hf(noise=x.to(self.hf.action_out_proj.weight.dtype), timestep=t,
                          pixel_attention_mask=inp["pixel_attention_mask"], attention_mask=inp["attention_mask"],
                          cache=cache, **extra)
            cache.crop(prefix_length - cache.get_seq_length())
            return out.logits.float(), self.hf.action_out_proj.__dict__.pop("dagrl_features")
        return velocity

    def _values(self, hidden: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        feats = hidden.detach() if self.cfg.value_detach else hidden
        state = inp["state"] if self.state_input else None
        return self.value_head(feats.float(), inp["attention_mask"].bool(), state)

    def values(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """obs -> values [B] (num_values 1) or [B, C] float32 (the VLM only: no denoising)."""
        inp = self._inputs(obs)
        hidden, _ = self._prefix(inp)
        return self._values(hidden, inp)

    def fsdp_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards as their own units (tasks.actor.distributed): every decoder layer of the
        library's model (SigLIP, Gemma, action expert: tasks.policies.pi0.lora.decoder_layers)."""
        from tasks.policies.pi0.lora import decoder_layers
        return decoder_layers(self.hf)

    def sync_state(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """What a weight sync ships (tasks.weights' partial weights): CPU copies of the trainable parameters
        (tasks.policies.pi0.lora.sync_state: LoRA adapters and the heads, or everything but `policy.freeze` and the
        unused expert embedding), or None when nothing is frozen (the full state dict is shipped). `state_dict`:
        the entries to pick them from, already gathered (the sharded actor's trainable tensors:
        tasks.actor.distributed.sync_weights_rank); default this module's own."""
        from tasks.policies.pi0.lora import sync_state
        if all(p.requires_grad for p in self.parameters()):
            return None
        return sync_state(self, state_dict)

    def load_sync_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a `sync_state` on top of the frozen weights this replica holds (tasks.policies.pi0.lora.
        load_sync_state; KeyError / ValueError on names or shapes that are not this policy's)."""
        from tasks.policies.pi0.lora import load_sync_state
        load_sync_state(self, state)

    # ------------------------------------------------------------------------------------------------ protocol
    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False,
            noise: torch.Tensor | None = None) -> dict:
        """Sample an action chunk: K denoising steps from x_1 = noise (t = 1) to x_0 (t = 0).

        Args:
            obs: {"prompt" int64 [B, L], "rgb" uint8 [B, H, W, 3] (+ "wrist_rgb"), "state" float32 [B, O]}.
            deterministic: the ODE (eval): log-probs 0. noise: optional x_1 [B, T, A] (default: standard normal
                from the global torch RNG, which also draws the SDE noise and Flow-SDE's step index).

        Returns:
            {"actions" [B, C, D] (the processor's statistics undone), "logprobs" [B, C, D], "values" [B] / [B, C],
             "extras": {"chain" [B, K+1, T, A] float32, "denoise_idx" int64 [B]}} (flow_sampling.sample_chain).

        Raises:
            ValueError: `noise` of another shape. KeyError: a missing observation key.
        """
        from tasks.policies.pi0.processor import unnormalize_actions
        inp = self._inputs(obs)
        B, dev = inp["input_ids"].shape[0], inp["input_ids"].device
        if noise is not None and tuple(noise.shape) != (B, self.T, self.A):
            raise ValueError(f"noise {tuple(noise.shape)}: expected [B, T, A] = {(B, self.T, self.A)}")
        hidden, cache = self._prefix(inp)
        x = torch.randn(B, self.T, self.A, device=dev) if noise is None else noise.to(dev, torch.float32)
        x, chain, logp, denoise_idx = sample_chain(self._velocity_fn(inp, cache), x, num_steps=self.K,
                                                   noise_level=self.cfg.noise_level, noise_head=self.noise_head,
                                                   deterministic=deterministic)
        actions = unnormalize_actions(self.processor, x[:, :self.C, :self.D])
        return {"actions": actions, "logprobs": logp[:, :self.C, :self.D], "values": self._values(hidden, inp),
                "extras": {"chain": chain, "denoise_idx": denoise_idx}}

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Differentiable log-probs of the stored chains under the current parameters (ratio 1 when unchanged).

        Args: obs as for `act` (batch N); actions [N, C, D] (shape-checked only: the chain's end); extras
        {"chain" [N, K+1, T, A], "denoise_idx" int64 [N]} from `act`.
        Returns {"logprobs" [N, C, D], "entropy" [N, C, D], "values" [N] / [N, C]}.
        Raises ValueError: shapes of another policy, a deterministic Flow-SDE chain (denoise_idx -1)."""
        chain, idx = extras["chain"], extras["denoise_idx"]
        if tuple(chain.shape[1:]) != (self.K + 1, self.T, self.A) or tuple(actions.shape[1:]) != (self.C, self.D):
            raise ValueError(f"chain {tuple(chain.shape)} / actions {tuple(actions.shape)} do not match "
                             f"K+1={self.K + 1}, T={self.T}, A={self.A}, C={self.C}, D={self.D}")
        inp = self._inputs(obs)
        hidden, cache = self._prefix(inp)
        logp, ent = chain_logprobs(self._velocity_fn(inp, cache), chain.float(), idx, num_steps=self.K,
                                   noise_level=self.cfg.noise_level, noise_head=self.noise_head)
        return {"logprobs": logp[:, :self.C, :self.D], "entropy": ent[:, :self.C, :self.D],
                "values": self._values(hidden, inp)}

    def sft_loss(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """The library's flow-matching loss for demonstrations actions [N, C, D] (env units; normalised by the
        processor, zero-padded to [N, T, A]): the forward with `actions=`, t ~ 0.001 + 0.999 Beta(1.5, 1) and the
        noise drawn as the library draws them (`_draws`: the same numbers from the same RNG state).

        With C == T and no mask it is the forward's own `loss` (MSE over [N, T, A]); otherwise the squared error
        of the velocity counts on the first C actions (mean over A of each), of those set in `mask` (bool [N, C];
        0 when none is set). Returns a scalar float32. Raises ValueError on an action or mask shape mismatch."""
        from tasks.algorithms.losses import masked_mean
        if tuple(actions.shape[1:]) != (self.C, self.D):
            raise ValueError(f"actions {tuple(actions.shape)}: expected [N, {self.C}, {self.D}]")
        N = actions.shape[0]
        keep = torch.ones(N, self.C, dtype=torch.bool) if mask is None else mask.bool()
        if tuple(keep.shape) != (N, self.C):
            raise ValueError(f"mask {tuple(keep.shape)}: expected [N, {self.C}]")
        inp = self._inputs(obs)
        dtype = inp["pixel_values"].dtype
        a = self.processor.normalize(actions.detach().float().cpu(), "actions").to(inp["input_ids"].device)
        a = nn.functional.pad(a, (0, self.A - self.D, 0, self.T - self.C)).to(dtype)  # [N, C, D] -> [N, T, A]
        kwargs = {k: inp[k] for k in ("input_ids", "pixel_values", "pixel_attention_mask", "attention_mask")}
        if self.state_input:
            kwargs["state"] = inp["state"]
        t, noise = self._draws(N, a.device, dtype)
        out = self.hf(actions=a, noise=noise, timestep=t, **kwargs)
        if self.C == self.T and mask is None:
            return out.loss.float()
        err = ((out.logits.float() - (noise - a).float()) ** 2).mean(-1)[:, :self.C]  # [N, T, A] -> [N, C]
        return masked_mean(err, keep.to(err.device))

    def _draws(self, n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The flow-matching time t [n] and noise [n, T, A] in the order the library's forward draws them when
        given neither (pi0: t first; `PI05Policy` overrides: the noise first)."""
        return self._draw_time(n, device), self._draw_noise(n, device, dtype)

    def _draw_time(self, n: int, device) -> torch.Tensor:
        c = self.hf.config
        beta = torch.distributions.Beta(torch.tensor(c.time_sampling_beta_alpha, dtype=torch.float32),
                                        torch.tensor(c.time_sampling_beta_beta, dtype=torch.float32))
        return (beta.sample((n,)).to(device) * c.time_sampling_scale + c.time_sampling_offset).float()

    def _draw_noise(self, n: int, device, dtype) -> torch.Tensor:
        return torch.randn(n, self.T, self.A, device=device, dtype=dtype)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str | Path) -> None:
        """Write a transformers directory: the library's config.json (+ dagrl's keys) and model.safetensors, the
        processor's files, and dagrl_heads.safetensors (value / Flow-Noise heads)."""
        from safetensors.torch import save_file
        from tasks.policies.pi0.processor import save_processor
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        from tasks.policies.pi0.lora import merged_state_dict
        from tasks.policies.pi0.library import no_progress_bars
        with no_progress_bars():
            self.hf.save_pretrained(str(path), state_dict=merged_state_dict(self.hf))  # LoRA folded in: plain keys
        save_processor(self.processor, path)
        conf = json.loads((path / "config.json").read_text())
        conf.update(family=self.family, policy=dataclasses.asdict(self.cfg), obs_dim=self.obs_dim,
                    action_dim=self.action_dim, num_values=self.num_values, image_size=self.image_size)
        (path / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))
        heads = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items() if k.startswith(HEAD_PREFIXES)}
        save_file(heads, str(path / HEADS_FILE))

    @classmethod
    def from_pretrained(cls, path: str | Path, **policy_overrides):
        """The policy in local directory `path`: a dagrl export (its keys in config.json) or a plain transformers
        directory (then O / D from the processor's statistics, C = the model's chunk, one value, the family's
        defaults for the rest). `policy_overrides` replace config fields (not the architecture's).

        Raises FileNotFoundError (no config.json), ValueError (another model_type)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path / 'config.json'} not found (a transformers directory is expected)")
        meta = json.loads((path / "config.json").read_text())
        if meta.get("model_type") != cls.family:
            raise ValueError(f"{path} holds a model_type={meta.get('model_type')!r} model, not {cls.family!r}")
        config_class = family_class("policy", cls.family)
        fields = {f.name for f in dataclasses.fields(config_class)}
        if meta.get("family") == cls.family:
            policy = {k: v for k, v in meta["policy"].items() if k in fields}
            dims = (meta["obs_dim"], meta["action_dim"], meta["num_values"], meta["image_size"])
        else:
            from tasks.policies.pi0.processor import load_processor
            p = load_processor(cls.family, path)
            obs = p.state_mean if p.state_mean is not None else getattr(p, "state_q01", None)
            act = p.actions_mean if p.actions_mean is not None else getattr(p, "actions_q01", None)
            if obs is None or act is None:
                raise ValueError(f"{path}: the processor has no state / action statistics")
            policy = {"num_action_chunks": meta["chunk_size"]}
            dims = (len(obs), len(act), 1, meta["vlm_config"]["vision_config"].get("image_size", 224))
        policy.update(policy_overrides, model_path=str(path))
        model = cls(config_class(**policy), *dims)
        model.load_weights(path)
        return model

    def load_weights(self, path: str | Path) -> None:
        """The library's weights from directory `path` (transformers' `from_pretrained`: its key conversions for
        published checkpoints apply) and the RL heads from dagrl_heads.safetensors where present with these
        shapes (else they keep their initialisation). Raises ConfigError("policy.model_path")."""
        from safetensors.torch import load_file
        from tasks.policies.pi0.library import model_class, no_progress_bars
        path = Path(path)
        try:
            with no_progress_bars():
                loaded = model_class(self.family).from_pretrained(str(path), local_files_only=True)
            from tasks.policies.pi0.lora import load_base_state
            load_base_state(self.hf, loaded.state_dict())  # under LoRA, into the adapted modules' base layers
        except (OSError, RuntimeError, ValueError) as e:
            raise ConfigError("policy.model_path", str(path),
                              f"its weights do not fit this policy ({str(e).splitlines()[0]})") from e
        if (path / HEADS_FILE).is_file():
            own = self.state_dict()
            heads = {k: v for k, v in load_file(str(path / HEADS_FILE)).items() if k in own and own[k].shape == v.shape}
            self.load_state_dict(heads, strict=False)

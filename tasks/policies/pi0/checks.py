"""The rules of the pi0 / pi05 families (functions of the whole Config; raise ConfigError) and their
value-dependent inert keys."""
from __future__ import annotations

import functools

from tasks.config.errors import ConfigError
from tasks.policies.pi0.memory import check_memory_plan, check_training_keys

PRESETS = ("tiny", "base")
NOISE_METHODS = ("flow_sde", "flow_noise")
VALUE_HEADS = ("mean_token", "first_token", "last_token")


def check_pi0(cfg) -> None:
    """Preset, sampler and prompt keys of policy=pi0 / pi05. Raises ConfigError (policy.*)."""
    p = cfg.policy
    if cfg.env.obs_mode != "rgb":
        raise ConfigError("env.obs_mode", cfg.env.obs_mode, f"policy.name={p.name} reads camera images: use "
                                                             f"env.obs_mode=rgb (e.g. env=pushcube_vla)")
    if p.preset not in PRESETS:
        raise ConfigError("policy.preset", p.preset, f"use one of {list(PRESETS)} (or policy.model_path=DIR)")
    if p.noise_method not in NOISE_METHODS:
        raise ConfigError("policy.noise_method", p.noise_method, "use flow_sde or flow_noise")
    if p.num_denoise_steps < 1:
        raise ConfigError("policy.num_denoise_steps", p.num_denoise_steps, "use >= 1 (pi0 infers with 10)")
    if p.noise_method == "flow_sde" and not p.noise_level >= 0:
        raise ConfigError("policy.noise_level", p.noise_level, "use >= 0 (piRL uses 0.5; 0 is the ODE)")
    if p.noise_method == "flow_noise" and not 0 < p.noise_std_min <= p.noise_std_max:
        raise ConfigError("policy.noise_std_min", (p.noise_std_min, p.noise_std_max),
                          "need 0 < noise_std_min <= noise_std_max (piRL uses 0.08, 0.16)")
    if p.max_prompt_len < 2:
        raise ConfigError("policy.max_prompt_len", p.max_prompt_len, "use >= 2 (BOS and the task's text)")
    if p.value_head not in VALUE_HEADS:
        raise ConfigError("policy.value_head", p.value_head, f"use one of {list(VALUE_HEADS)}")


def inert_keys(cfg, command: str, cuda_count: int = 0) -> list[tuple[str, str]]:
    """The keys of policy=pi0 / pi05 that do nothing for `cfg` under `command`: the noise keys of the noise method
    not chosen, the value head's keys without a critic."""
    if command != "run":
        return []
    p, a = cfg.policy, cfg.algorithm
    # policy.preset with a model_path is not flagged: the directory's config.json decides the architecture, and the
    # presets (pi0_base, pi0_tiny) are how a user picks the family's settings for a checkpoint too
    out = []
    if p.noise_method == "flow_sde":
        why = ("bounds the learned std of policy.noise_method=flow_noise; flow_sde uses policy.noise_level: drop it "
               "or set policy.noise_method=flow_noise")
        out += [("policy.noise_std_min", why), ("policy.noise_std_max", why)]
    else:
        out.append(("policy.noise_level", "is the noise scale of policy.noise_method=flow_sde; flow_noise learns "
                                          "its std (policy.noise_std_min/max): drop it or set "
                                          "policy.noise_method=flow_sde"))
    critic = a.spec.critic if a.spec.estimator else cfg.sft.value_coef > 0
    if not critic:
        why = f"shapes the value head, which algorithm.name={a.name} does not train: drop it"
        out += [(k, why) for k in ("policy.value_head", "policy.value_detach")]
    if not p.lora_rank:
        why = "shapes the LoRA adapters, which policy.lora_rank=0 (full fine-tuning) does not make: drop it"
        out += [(k, why) for k in ("policy.lora_alpha", "policy.lora_targets")]
    return out


def offline_processor(p):
    """The processor policy config `p` (pi0 / pi05) prompts with, built offline: `model_path`'s (its tokenizer files,
    read locally) or, for a preset, the tiny tokenizer's at the preset's image size (tasks.policies.pi0.model does
    the same). None when `model_path` holds no processor of this family (the model_path check names that)."""
    return _processor(p.name, p.model_path, p.preset)


@functools.lru_cache(maxsize=8)
def _processor(family: str, model_path: str | None, preset: str):
    from tasks.policies.pi0 import library, processor as proc
    if model_path:
        try:
            library.directory_config(family, model_path)
            return proc.load_processor(family, model_path)
        except (OSError, ValueError):
            return None
    vision = library.preset_config(family, preset, chunk_size=1, num_steps=1).vlm_config.vision_config
    return proc.processor_class(family)(image_processor=proc.image_processor(vision.image_size, vision.patch_size),
                                        tokenizer=proc.tiny_tokenizer())


def check_prompt_length(cfg) -> None:
    """`policy.max_prompt_len` holds the longest prompt the family's processor builds for the env's tasks (a
    component check: it reads the env's instruction table, LIBERO's from its installed suite, and a checkpoint's
    tokenizer files): BOS, the task text and, for pi05, the state discretised into the prompt (the env's state
    length when known offline, else the checkpoint's statistics'; unknown: the text alone, a lower bound, and the
    policy refuses a longer prompt when it first builds one).

    Raises:
        ConfigError (policy.max_prompt_len): the tokens the longest prompt needs, its task, and that length as the fix.
    """
    from tasks.envs import eval_task_names, num_cameras, state_dim
    from tasks.policies.pi0.processor import longest_prompt
    from tasks.prompts import instructions
    p = cfg.policy
    processor = offline_processor(p)
    if processor is None:
        return
    table = instructions(cfg)
    chosen = [int(t) for t in eval_task_names(cfg.env)] or range(len(table))  # the selected tasks (LIBERO)
    dims = state_dim(cfg.env)
    if dims is None and p.model_path:
        stats = processor.state_mean if processor.state_mean is not None else getattr(processor, "state_q01", None)
        dims = len(stats) if stats is not None else None
    cams = min(max(num_cameras(cfg.env), 1), type(p).cameras)
    need, text = longest_prompt(processor, [table[t] for t in chosen], num_cameras=cams, state_dim=dims)
    if need > p.max_prompt_len:
        state = f" and the {dims}-D state discretised" if processor.state_in_prompt and dims else ""
        raise ConfigError("policy.max_prompt_len", p.max_prompt_len,
                          f"the {p.name} processor's prompt for the task {text!r} (BOS, its text{state}) takes {need} "
                          f"tokens after the image tokens: use policy.max_prompt_len={need} (or more)")


CHECKS = (check_pi0, check_training_keys, check_memory_plan)
COMPONENT_CHECKS = (check_prompt_length,)  # run where the components are checked (tasks.policies.check_components)

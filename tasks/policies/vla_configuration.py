"""The keys every VLA family has (token_vla, ...): `VLAConfig`, the base of their configuration classes,
with the rules and the value-dependent inert keys they share."""
from __future__ import annotations

from dataclasses import dataclass, field

from tasks.config.errors import ConfigError
from tasks.config.schema import Config, PolicyConfig

VALUE_HEADS = ("mean_token", "first_token", "last_token")


@dataclass(frozen=True)
class VLAConfig(PolicyConfig):
    """A vision-language-action policy: a preset of model sizes, the prompt, the state input and the value head."""

    preset: str = "tiny"  # model sizes: tiny (trains on CPU) or a real-size preset (see the policy module)
    sizes: dict[str, int] = field(default_factory=dict)  # per-key overrides of the preset's sizes
    use_state: bool = True  # condition on the env's state vector (pi0's proprio input)
    # SFT from scratch standardises the state per dimension with the mean / std of sft.store's samples (kept in the
    # checkpoint; std floored at 0.01): without it a linear projection of raw values sees the gripper's 0.035 m
    # open/close swing next to ~1 m positions, and a LIBERO clone ignored the state (docs/guides/libero.md)
    normalize_state: bool = False
    # SFT from scratch: standardise the action targets per dimension with the mean / std of sft.store's executed
    # actions (std floored at 0.01), for a family whose model un-normalises what it outputs (`set_action_norm`;
    # `normalizes_actions`). No current family does (token_vla bins by q01/q99; pi0 / pi05 normalise with their
    # processor's statistics): set, it is refused as doing nothing
    normalize_actions: bool = False
    max_prompt_len: int = 48  # instruction tokens (byte-level tokenizer), padded/truncated
    value_head: str = "mean_token"  # mean_token | first_token | last_token: pooling of prefix features
    value_detach: bool = False  # the critic's gradient stops at the prefix features (the VLA trunk is not
    # shaped by the value loss); False = RLinf's default
    critic_state: bool = False  # the value head also reads the raw state vector: [pooled prefix ; state]
    # (an asymmetric critic, Pinto et al. 2018; the simulator's state is there in training even if the actor is
    # vision-only)


def check_vla(cfg: Config) -> None:
    """The rules every VLA family shares. Raises ConfigError (policy.*)."""
    p = cfg.policy
    if p.value_head not in VALUE_HEADS:
        raise ConfigError("policy.value_head", p.value_head, "use mean_token, first_token or last_token")
    if p.max_prompt_len < 1:
        raise ConfigError("policy.max_prompt_len", p.max_prompt_len, "must be >= 1 (action_bins >= 2)")


def inert_vla_keys(cfg: Config, command: str, *, normalizes_actions: bool) -> list[tuple[str, str]]:
    """The keys of a VLA family that do nothing for `cfg` under `command` (tasks.config.checks.inert_keys): the
    dataset statistics outside SFT from scratch, the value head without a critic. `normalizes_actions`: the
    family reads policy.normalize_actions."""
    if command != "run":
        return []
    p, a = cfg.policy, cfg.algorithm
    spec, out = a.spec, []
    from_scratch = not spec.estimator and not p.model_path  # SFT (no estimator) trains it from scratch
    if not from_scratch or not p.use_state:
        out.append(("policy.normalize_state", "sets a VLA's state statistics from sft.store when SFT trains it from "
                                              "scratch (algorithm.name=sft, no policy.model_path, use_state); a "
                                              "loaded checkpoint keeps its own: drop it"))
    if not normalizes_actions or not from_scratch:
        why = ("is read only by a family that un-normalises its own actions (none of the current VLA families: pi0 / "
               "pi05 normalise with their processor's statistics)" if not normalizes_actions else
               "sets the action statistics from sft.store when SFT trains from scratch (algorithm.name=sft, no "
               "policy.model_path); a loaded checkpoint keeps its own")
        out.append(("policy.normalize_actions", f"{why}: drop it"))
    critic = spec.critic if spec.estimator else cfg.sft.value_coef > 0
    if not critic:
        why = (f"shapes the value head, which algorithm.name={a.name} does not train"
               f"{' (critic-free)' if spec.estimator else ' (sft.value_coef=0: no value warm start)'}: drop it")
        out.extend((k, why) for k in ("policy.value_head", "policy.value_detach", "policy.critic_state"))
    return out

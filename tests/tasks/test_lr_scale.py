"""algorithm.lr_scale: per-module learning rates and frozen modules (tasks.actor.optim.make_optimizer)."""
import pytest
import torch

from pipelines.config import load_config
from tasks.config import ConfigError
from tasks.actor.state import load_optimizer_state, optimizer_state
from tasks.policies import make_policy
from tasks.actor.optim import make_optimizer, param_lr


def _policy_and_cfg(overrides, components=True):
    cfg = load_config(overrides, components=components)[0]
    return make_policy(cfg.policy, obs_dim=5, action_dim=2, seed=0), cfg


def _lrs(opt):
    return {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}


def test_longest_prefix_sets_each_parameters_learning_rate_and_zero_freezes():
    policy, cfg = _policy_and_cfg(["algorithm.lr=0.01", "+algorithm.lr_scale={actor_mean:0.5,actor_mean.6:2,critic:0}"])
    opt = make_optimizer(cfg, policy)
    lrs = _lrs(opt)
    for name, p in policy.named_parameters():
        want = 0.01 * (2.0 if name.startswith("actor_mean.6.") else 0.5 if name.startswith("actor_mean.")
                       else 0.0 if name.startswith("critic.") else 1.0)
        assert param_lr(cfg.algorithm, name) == pytest.approx(want)
        if want == 0.0:
            assert not p.requires_grad and id(p) not in lrs, name
        else:
            assert p.requires_grad and lrs[id(p)] == pytest.approx(want), name
    # one step: frozen parameters stay bit-identical, every other moves by ~its lr (Adam's first step is lr * sign)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    sum(((p + 1.0) ** 2).sum() for p in policy.parameters()).backward()  # every gradient entry nonzero
    opt.step()
    for name, p in policy.named_parameters():
        moved = (p.detach() - before[name]).abs().max().item()
        lr = param_lr(cfg.algorithm, name)
        if lr == 0.0:
            assert moved == 0.0 and p.grad is None, name
        else:
            assert moved == pytest.approx(lr, rel=1e-3), name


def test_optimizer_state_of_scaled_groups_round_trips_by_name():
    policy, cfg = _policy_and_cfg(["+algorithm.lr_scale={critic:0.1}"])
    opt = make_optimizer(cfg, policy)
    sum((p ** 2).sum() for p in policy.parameters()).backward()
    opt.step()
    saved = optimizer_state(policy, opt)
    assert [g["lr"] for g in saved["param_groups"]] == pytest.approx([cfg.algorithm.lr, 0.1 * cfg.algorithm.lr])
    policy2, _ = _policy_and_cfg(["+algorithm.lr_scale={critic:0.1}"])
    opt2 = make_optimizer(cfg, policy2)
    load_optimizer_state(policy2, opt2, saved)
    for p, q in zip(opt.param_groups[1]["params"], opt2.param_groups[1]["params"]):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
    # the same state into an optimizer without the scale (one group): refused, naming the keys to check
    policy3, cfg3 = _policy_and_cfg([])
    with pytest.raises(ValueError, match="lr_scale"):
        load_optimizer_state(policy3, make_optimizer(cfg3, policy3), saved)


def test_unknown_prefix_and_negative_factor_are_refused():
    # 'actor' is no module ('actor_mean' is): refused offline (load_config's components) and by the actor
    policy, cfg = _policy_and_cfg(["+algorithm.lr_scale={actor:0}"], components=False)
    with pytest.raises(ValueError, match=r"lr_scale.actor: .*actor_mean"):
        make_optimizer(cfg, policy)
    with pytest.raises(ConfigError, match=r"algorithm.lr_scale.actor=0.0: .*did you mean .*'actor_mean'"):
        load_config(["+algorithm.lr_scale={actor:0}"])
    with pytest.raises(ConfigError, match="algorithm.lr_scale.critic"):
        load_config(["+algorithm.lr_scale={critic:-1}"])


def test_lr_anneal_steps_decays_every_group_linearly_by_weight_version_and_survives_a_state_round_trip():
    from tasks.actor.optim import lr_factor, set_annealed_lr
    policy, cfg = _policy_and_cfg(["algorithm.lr=0.01", "algorithm.lr_anneal_steps=4",
                                   "+algorithm.lr_scale={critic:0.1}"])
    opt = make_optimizer(cfg, policy)
    # ManiSkill/CleanRL anneal_lr: lr_v = lr * (1 - v / N), here N = 4 updates; 0 from version N on
    for v, frac in [(0, 1.0), (1, 0.75), (3, 0.25), (4, 0.0), (9, 0.0)]:
        assert lr_factor(cfg.algorithm, v) == pytest.approx(frac)
    set_annealed_lr(cfg.algorithm, opt, 1)
    set_annealed_lr(cfg.algorithm, opt, 2)  # from the group's initial lr, not compounding the previous factor
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01 * 0.5, 0.001 * 0.5])
    # a restored optimizer (resume) keeps the initial lr and continues the same schedule
    saved = optimizer_state(policy, opt)
    policy2, _ = _policy_and_cfg(["algorithm.lr=0.01", "+algorithm.lr_scale={critic:0.1}"])
    opt2 = make_optimizer(cfg, policy2)
    load_optimizer_state(policy2, opt2, saved)
    set_annealed_lr(cfg.algorithm, opt2, 3)
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([0.01 * 0.25, 0.001 * 0.25])
    # constant without the key (the default job sets it: null it)
    _, cfg0 = _policy_and_cfg(["algorithm.lr_anneal_steps=null"])
    assert lr_factor(cfg0.algorithm, 100) == 1.0 and lr_factor(cfg0.algorithm, 10_000) == 1.0


def test_lr_anneal_steps_below_one_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="algorithm.lr_anneal_steps"):
        load_config(["algorithm.lr_anneal_steps=0"])


# ----- the prefixes checked offline, for every policy family (tasks.policies.check_lr_scale) ---------------------
FAMILIES = {"mlp": ["policy=mlp"],
            "token_vla": ["env=pushcube_vla", "policy=token_vla_tiny"], "pi0": ["env=pushcube_vla", "policy=pi0_tiny"],
            "pi05": ["env=pushcube_vla", "policy=pi05_tiny"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_prefixes_are_checked_offline_against_the_built_policys_names(family):
    """Offline (no weights, no worker), the names lr_scale is matched against are the built policy's: each top-level
    module of the policy make_policy builds passes, a prefix one letter off is refused naming the key, the prefix
    and the module it is close to; through load_config (the check path of run and validate) too."""
    from tasks.envs import action_dim, state_dim
    from tasks.policies import check_lr_scale, parameter_names
    from tasks.config import replace_key
    base = ["conf=smoke", *FAMILIES[family]]
    cfg = load_config(base, components=False)[0]
    image = cfg.env.image_size if cfg.env.obs_mode == "rgb" else None
    policy = make_policy(cfg.policy, obs_dim=state_dim(cfg.env) or 8, action_dim=action_dim(cfg.env) or 8,
                         **({"image_size": image} if image else {}))
    names = [n for n, _ in policy.named_parameters()]
    assert parameter_names(cfg) == names
    top = sorted({n.split(".")[0] for n in names})
    check_lr_scale(replace_key(cfg, "algorithm.lr_scale", {t: 0.5 for t in top}))
    wrong = top[0] + "x"  # one letter off
    with pytest.raises(ConfigError) as e:
        check_lr_scale(replace_key(cfg, "algorithm.lr_scale", {wrong: 0.5}))
    hint = str(e.value).split("did you mean ")[1].split("?")[0]
    assert e.value.key == f"algorithm.lr_scale.{wrong}" and f"'{top[0]}'" in hint
    with pytest.raises(ConfigError, match=f"algorithm.lr_scale.{wrong}="):
        load_config([*base, f"+algorithm.lr_scale={{{wrong}: 0.5}}"])


def test_an_empty_dict_on_the_command_line_clears_the_experiments_entries():
    """Hydra merges a dict override into the experiment's dict; `algorithm.lr_scale={}` empties it instead (the
    experiment's `prefix: 0.0` gone), a non-empty dict still merges, and the file's value stays without either. (No
    shipped experiment sets lr_scale: an earlier `+algorithm.lr_scale` on the command line stands for the file's.)"""
    exp = ["conf=pushcube_pi0_grpo", "policy.model_path=null", "+algorithm.lr_scale={prefix: 0.0}"]
    assert dict(load_config(exp, components=False)[0].algorithm.lr_scale) == {"prefix": 0.0}
    assert dict(load_config([*exp, "algorithm.lr_scale={}"], components=False)[0].algorithm.lr_scale) == {}
    merged = load_config([*exp, "+algorithm.lr_scale={dit: 0.5}"], components=False)[0].algorithm.lr_scale
    assert dict(merged) == {"prefix": 0.0, "dit": 0.5}

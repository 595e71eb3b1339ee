"""Configs that compose: conf/'s groups are presets an experiment picks, and `env=E policy=P algorithm=A` composes
from the command line wherever the combination makes sense (offline: no cluster, no simulator step).

* a policy preset (conf/policy/*.yaml) carries its family's update settings (learning rate, epochs, minibatches, KL
  stop), so an algorithm group (ppo, grpo, sft) names none of them and works with every policy family;
* an algorithm group states what it needs of other sections (grpo: env.auto_reset false);
* an experiment's `experiment` name is its file's name unless set;
* a combination that cannot work is refused in one line naming the key and why.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelines.config import load_config
from tasks.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


@pytest.fixture(autouse=True)
def _cpu_only_machine(monkeypatch):
    """The expectations are those of a CPU-only machine (logical GPU workers: cluster.num_gpu_workers)."""
    import pipelines.clusters.placement
    monkeypatch.setattr(pipelines.clusters.placement, "_cuda_device_count", lambda: 0)


def _stems(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _header_package(path: Path, group: str) -> str:
    """The package a conf file's keys land in (Hydra: a `# @package _global_` header, else the group's name)."""
    first = path.read_text().splitlines()[0]
    return "" if first.strip() == "# @package _global_" else group


def _set_keys(group: str, name: str) -> set[str]:
    """The dotted keys conf/GROUP/NAME.yaml sets, those of the files its defaults list includes too."""
    path = CONF / group / f"{name}.yaml"
    node = OmegaConf.to_container(OmegaConf.load(path))
    keys: set[str] = set()
    for entry in node.pop("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            keys |= _set_keys(group, entry)

    def walk(value, prefix):
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            keys.add(prefix)
    walk(node, _header_package(path, group))
    return keys


# ----- the algorithm groups work with every policy family -----

ALGORITHMS = _stems("algorithm")
POLICIES = [p for p in _stems("policy") if "policy.name" in _set_keys("policy", p)]  # _vla_finetune names none


def test_an_include_file_names_no_family_and_cannot_be_chosen(tmp_path, capsys):
    """A group file whose name starts with "_" is an include of other presets: it selects no family (so choosing it
    alone would run the default family with another family's update settings) and `GROUP=_NAME` is refused in one
    line listing the group's real choices; every other policy file selects a family."""
    from pipelines.compose import choices, compose
    includes = [p for p in _stems("policy") if p.startswith("_")]
    assert includes and all("policy.name" not in _set_keys("policy", p) for p in includes)
    assert sorted(POLICIES) == choices("policy")
    for name in includes:
        with pytest.raises(ConfigError, match=r"included by other presets.*choose one of") as err:
            compose([f"policy={name}"])
        assert err.value.key == "policy" and all(c in str(err.value) for c in choices("policy"))


def test_the_algorithm_groups_are_the_estimators_and_sft():
    """One file per algorithm (its `algorithm.name`), none a variant for one family (the former ppo_vla, grpo_vla)."""
    names = {a: OmegaConf.load(CONF / "algorithm" / f"{a}.yaml") for a in ALGORITHMS}
    assert {a: (n.get("name") or n.get("algorithm", {}).get("name")) for a, n in names.items()} == \
        {a: a for a in ALGORITHMS}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_preset_carries_its_familys_update_settings(policy):
    """The learning rate and the update's size are the family's (the tiny VLAs take small steps from a pretrained
    model; the mlp trains from scratch): each preset sets them, no algorithm group does, so that no algorithm
    group overrides a family's settings whatever the defaults order."""
    family = {"algorithm.lr", "algorithm.update_epochs", "algorithm.num_minibatches", "algorithm.target_kl"}
    assert family <= _set_keys("policy", policy)
    for algorithm in ALGORITHMS:
        assert not _set_keys("algorithm", algorithm) & _set_keys("policy", policy), algorithm


def test_a_policy_presets_settings_are_the_same_under_every_algorithm():
    """algorithm=ppo|grpo changes the estimator, not the family's learning rate or update size."""
    for policy in POLICIES:
        seen = set()
        for algorithm in ("ppo", "grpo"):
            a = OmegaConf.to_container(_compose(policy, algorithm)["algorithm"])
            seen.add((a["lr"], a["update_epochs"], a["num_minibatches"], a["target_kl"]))
        assert len(seen) == 1, (policy, seen)


def _compose(policy: str, algorithm: str):
    from pipelines.config import compose
    return compose([f"policy={policy}", f"algorithm={algorithm}"])


# ----- an algorithm group states what it needs of the env -----

def test_grpo_brings_the_env_setting_it_needs():
    """GRPO scores each env's first episode of a rollout, so every rollout must start new episodes: the group sets
    env.auto_reset=false itself (the env group's value and the schema's true give way); a command-line value still
    wins, and auto_reset=true is then refused by the whole-episodes check in one line naming the key."""
    cfg, _ = load_config(["env=pushcube", "algorithm=grpo"], components=False, notes=[])
    assert cfg.algorithm.name == "grpo" and cfg.env.auto_reset is False and cfg.algorithm.group_size >= 2
    with pytest.raises(ConfigError) as err:
        load_config(["env=pushcube", "algorithm=grpo", "env.auto_reset=true", "env.ignore_terminations=false"],
                    components=False, notes=[])
    assert err.value.key == "env.auto_reset"


def test_validate_env_pushcube_algorithm_grpo_passes_without_hand_edits(tmp_path, capsys, monkeypatch):
    """The issue's example, as a user types it (the default experiment, its mlp, GRPO instead of PPO)."""
    from pipelines import validate
    monkeypatch.chdir(tmp_path)
    assert validate.main(["env=pushcube", "algorithm=grpo", f"run_root={tmp_path / 'runs'}"]) == 0, \
        capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ok: ")


# ----- an experiment is named after its file -----

def test_an_experiment_is_named_after_its_file_unless_set():
    """conf=NAME runs as experiment NAME (runs/NAME/<run_id>, MLflow experiment NAME) without its file repeating the
    name; `experiment=` on the command line still names it; without conf= the default experiment's file names it."""
    from pipelines.config import compose
    for path in sorted((CONF / "conf").glob("*.yaml")):
        assert OmegaConf.load(path).get("experiment") != path.stem, f"{path.name} repeats its own name"
        assert compose([f"conf={path.stem}"]).experiment == path.stem
    assert compose(["conf=smoke", "experiment=smoke_trial_3"]).experiment == "smoke_trial_3"
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    assert compose([]).experiment == [d["conf"] for d in defaults if not isinstance(d, str) and "conf" in d][-1]


# ----- env x policy x algorithm -----

# ManiSkill envs on the default experiment (conf=pushcube_ppo, nothing given); LIBERO on conf=libero_smoke, the
# LIBERO experiment sized for this machine (the default's 64 envs need ~50 GiB of LIBERO per env worker: a
# refusal about memory, not about the combination).
ENVS = {"pushcube": [], "pushcube_vla": [], "libero_spatial": ["conf=libero_smoke"]}
RGB = {e for e in ENVS if OmegaConf.select(OmegaConf.load(CONF / "env" / f"{e}.yaml"), "obs_mode") == "rgb"
       or any(OmegaConf.select(OmegaConf.load(CONF / "env" / f"{d}.yaml"), "obs_mode") == "rgb"
              for d in OmegaConf.load(CONF / "env" / f"{e}.yaml").get("defaults", []) if d != "_self_")}


def _critic(policy: str) -> bool:
    return "policy.value_head" in _set_keys("policy", policy)


def _family(preset: str) -> str | None:
    """policy.name of a policy preset file, set there or by a preset it includes (its defaults list)."""
    node = OmegaConf.load(CONF / "policy" / f"{preset}.yaml")
    if OmegaConf.select(node, "policy.name") is not None:
        return OmegaConf.select(node, "policy.name")
    return next((f for d in node.get("defaults", []) if isinstance(d, str) and d != "_self_"
                 and (f := _family(d)) is not None), None)


def _refusal(env: str, policy: str, algorithm: str) -> str | None:
    """The key a combination is refused on, derived from what each part is: the mlp reads only the state vector (an
    rgb env would render images for nothing), pi0 / pi05 need camera images (a state-only env) and, with the tiny
    tokenizer, a prompt length above the longest instruction's bytes; a value head that no
    loss trains (critic-free GRPO; SFT without sft.value_coef, which none of these commands sets) is refused."""
    if policy == "mlp" and env in RGB:
        return "policy.name"
    if _family(policy) in ("pi0", "pi05"):
        if env not in RGB:  # transformers' pi0 / pi0.5 read camera images only
            return "env.obs_mode"
        # without a checkpoint the tiny byte-level tokenizer spends a token per UTF-8 byte (+ BOS): an instruction
        # longer than the preset's max_prompt_len cannot be prompted
        from pipelines.config import compose, to_config
        from tasks.prompts import instructions
        cfg = to_config(compose([*ENVS[env], f"env={env}", f"policy={policy}"]), validate=False)
        table = instructions(cfg)  # index = task_id; the env's selected tasks are prompted
        ids = getattr(cfg.env, "task_ids", None) or range(len(table))
        longest = max(len(table[i].encode()) for i in ids)
        if longest + 1 > cfg.policy.max_prompt_len:
            return "policy.max_prompt_len"
    if algorithm in ("grpo", "sft") and _critic(policy):
        return "policy.value_head"
    return None


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """`demos(overrides)`: a fake demo store (`test_config._fake_sft_store`) that fits the composed config: its
    env's state length, its policy's chunk of C actions, LIBERO's gripper convention for LIBERO."""
    from pipelines.config import compose, to_config
    from tasks.envs import state_dim
    from tests.pipelines.test_config import _fake_sft_store
    root, made = tmp_path_factory.mktemp("demos"), {}

    def store(overrides: list[str]) -> Path:
        cfg = to_config(compose(overrides), validate=False)
        libero = cfg.env.simulator == "libero"
        key = (state_dim(cfg.env), cfg.policy.num_action_chunks, libero)  # state length: None until ManiSkill runs
        if key not in made:
            made[key] = _fake_sft_store(root / f"demos_{len(made)}.zarr", C=key[1],
                                        gripper_convention="close_positive" if libero else None,
                                        **({"obs_dim": key[0]} if key[0] else {}))
        return made[key]
    return store


# every policy preset but token_vla_tiny_critic: token_vla_tiny with a value head, under the same
# rules (its composition: test_config.py's test_group_files_hold_their_groups_keys_only); ~1-2 s a combination
MATRIX_POLICIES = [p for p in POLICIES if p != "token_vla_tiny_critic"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("policy", MATRIX_POLICIES)
@pytest.mark.parametrize("env", list(ENVS))
def test_env_x_policy_x_algorithm_composes_from_the_command_line(env, policy, algorithm, demos, tmp_path):
    overrides = [*ENVS[env], f"env={env}", f"policy={policy}", f"algorithm={algorithm}", f"run_root={tmp_path}"]
    if algorithm == "sft":
        overrides.append(f"sft.store={demos(overrides)}")
    want = _refusal(env, policy, algorithm)
    notes: list[str] = []
    try:
        cfg, _ = load_config(overrides, notes=notes)
    except ConfigError as exc:
        line = str(exc)
        assert want is not None, f"{' '.join(overrides)} refused: {line}"
        assert exc.key == want and "\n" not in line, line
        return
    assert want is None, f"{' '.join(overrides)} was not refused on {want}"
    assert (cfg.algorithm.name, cfg.env.obs_mode == "rgb") == (algorithm, env in RGB)


def test_the_presets_an_unknown_key_error_offers_select_that_family():
    """A key of another family is refused with the presets of the family that has it (`pipelines.families.
    family_presets`): each preset named for a family composes to a config of that family's class, and every family
    with a conf file has at least one."""
    from pipelines.config import load_config
    from pipelines.families import family_presets
    from tasks.config import families, family_class
    from tasks.config.registry import SELECTORS
    for section in SELECTORS:
        for name in families(section):
            presets = family_presets(section, name)
            if section != "cluster" or name in ("local", "address"):
                assert presets, (section, name)
            for preset in presets:
                overrides = (["conf=libero_smoke"] if section == "env" and name == "libero" else
                             ["cluster.address=tcp://127.0.0.1:8786"] if preset == "address" else
                             ["cluster.image=registry.example.com/dagrl:test", "cluster.runs_volume_claim=runs",
                              "cluster.runs_mount_path=/", "run_root=/runs"] if preset == "kubernetes" else
                             ["env=pushcube_vla"] if name in ("pi0", "pi05") else [])  # they read images
                cfg, _ = load_config([*overrides, f"{section}={preset}"], components=False)
                assert type(getattr(cfg, section)) is family_class(section, name), (section, preset)

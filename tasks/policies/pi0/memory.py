"""The offline memory plan of a pi0 / pi05 policy per actor GPU, its family check against `cluster.gpu_memory_gib`,
and the rules of the training keys (policy.lora_*, freeze, gradient_checkpointing: tasks.policies.pi0.lora).

The plan (bytes on one actor GPU during the update; GiB = 2^30 bytes), for P parameters of which T train (what
the runtime's rule leaves trainable, tasks.policies.pi0.lora.set_trainable applied to the meta-device model: LoRA's
adapters or every parameter, less those under a `policy.freeze` prefix and pi0's never-used expert token embedding,
`lora.UNUSED`: 263 M of pi0 base's 3.5 B), over R
FSDP2 ranks (`algorithm.num_actor_ranks`), micro-batch M (`tasks.config.batch.batch_plan`; SFT: sft.batch_size / R):
  weights      4 P / R            float32 master weights (the actor keeps fp32; bf16 is autocast), sharded
  gathered     4 (2 L + E)        R > 1 only: FSDP2's all-gathered units, the largest decoder layer L twice (the one
                                  running and the one prefetched) and the parameters outside decoder layers E
                                  (embeddings, projections: the root unit, gathered for the whole step)
  grads        4 T / R            float32 gradients of the trainable parameters, sharded (reduce-scatter)
  optimizer    8 T / R            Adam's exp_avg and exp_avg_sq, float32, sharded (frozen parameters have none)
  activations  M x A              A: bytes autograd keeps per sample (below)
  casts        2 P  | 2 (L + E)   bf16 autocast only: the bfloat16 copies of the weights that matmuls save for the
                                  backward (every weight without checkpointing, whatever R: FSDP2 reshards the
                                  float32 units, not the saved casts; with checkpointing one layer's and the root's)
  replica      b P                a rollout replica on the same GPU (rollout placed with the actor, the default),
                                  b = 2 (policy.dtype=bfloat16) or 4; 0 with algorithm.offload (the update runs with
                                  the replicas moved off: tasks.offload)
  reserve      1 GiB              CUDA context, cuBLAS/cuDNN workspaces, allocator fragmentation (an allowance, not
                                  measured here)
LoRA changes T only (the adapters + heads): the base weights still sit in float32 on the actor.

Activations per sample A, from the library config: for a stack of N layers over S tokens, autograd keeps per token
per layer (elements, counted from the tensors transformers 5.25's layers save for backward with SDPA attention, which
keeps no S x S scores; the same count as Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.1, adapted to a gated MLP and grouped-query attention and without dropout masks):
  Gemma layer (width h, H heads, G kv heads, head dim d, MLP width I):
      RMSNorm in + out (2h) twice (4h); q, k, v and rotated q, k (2Hd + 3Gd); attention output (Hd); gate, up,
      act(gate), act(gate)*up (4I)                                  -> 4h + 3Hd + 3Gd + 4I
  SigLIP layer (width h, MLP width I): LayerNorm in + out twice (4h); q, k, v (3h); attention output (h); fc1 out,
      GELU out (2I)                                                 -> 8h + 2I
  tokens: SigLIP cameras x (image / patch)^2 each; the Gemma trunk the image tokens + policy.max_prompt_len; the
  action expert the chunk (+ 1 state token for pi0's config: `max_state_dim` projected as a token when the config
  has `state_proj`) once per denoising step the update re-runs (`policy.num_denoise_steps`: the RL update recomputes
  the chain's log-probs; SFT: 1).
  bytes per element: 2 under bf16 autocast, 4 in float32.
Checked against the tensors autograd saves (`saved_tensors_hooks`) for the base pi0 built on the meta device, float32,
2 cameras, 48 prompt tokens, 1 expert pass: 4.68 GiB per sample measured, 4.04 GiB from the formula; the rest is
the S x S attention scores the meta device's math SDPA keeps and the GPU's flash / memory-efficient kernels do not
(tests/tasks/policies/test_pi0_memory.py). Under bf16 autocast the 2 bytes an element are not measured here (no GPU):
norms compute in float32, so the true figure lies between 2 and 4 bytes an element.
With gradient checkpointing each layer keeps only its input (h per token) and one layer's full activations live
during its recompute (the largest one of any stack).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from tasks.config.errors import ConfigError

GIB = 2**30
RESERVE_BYTES = 1 * GIB  # CUDA context + workspaces + fragmentation allowance (module docstring)
LORA_SUGGESTED_RANK = 16  # the rank the refusal's LoRA fix proposes


# ---------------------------------------------------------------- the training keys' rules
def check_training_keys(cfg) -> None:
    """The rules of policy.lora_rank / lora_alpha / lora_targets / freeze (a family check: a function of the whole
    Config). Raises ConfigError naming the key: a negative or fractional rank, alpha <= 0 with LoRA, no target with
    LoRA, an empty target or prefix."""
    p = cfg.policy
    if int(p.lora_rank) != p.lora_rank or p.lora_rank < 0:
        raise ConfigError("policy.lora_rank", p.lora_rank, "must be an integer >= 0 (0: full fine-tuning)")
    if p.lora_rank and not p.lora_alpha > 0:
        raise ConfigError("policy.lora_alpha", p.lora_alpha, "must be > 0 (the adapters' scale is alpha / rank)")
    if p.lora_rank and not p.lora_targets:
        raise ConfigError("policy.lora_targets", p.lora_targets,
                          "name the Linear modules to adapt (fnmatch patterns, e.g. 'dit.*_proj'), or set "
                          "policy.lora_rank=0")
    for key, vals in (("policy.lora_targets", p.lora_targets), ("policy.freeze", p.freeze)):
        if any(not str(v).strip() for v in vals):
            raise ConfigError(key, list(vals), "an empty entry: remove it")
    if (p.lora_rank and p.lora_targets) or p.freeze:  # names checked offline, on the library model built on meta
        _check_names(p)


def _check_names(p) -> None:
    """`policy.lora_targets` and `policy.freeze` name modules of the model the config builds: checked on the policy's
    parameter layout built on the meta device (tasks.policies.pi0.names: `hf.<name>` and the RL heads `value_head`,
    `noise_head` as this config has them). Raises ConfigError naming the key, the entry that matches nothing, close
    matches and the top modules to use."""
    from tasks.policies import prefix_hint
    from tasks.policies.pi0.names import meta_policy
    try:
        conf = library_config(p)
    except (OSError, ValueError):  # not a checkpoint of this family: the model_path check names that (components)
        return
    names = [n for n, _ in meta_policy(p, conf, freeze=()).named_parameters()]  # LoRA targets: ConfigError here
    for pre in p.freeze:
        pre = str(pre)
        if any(n == pre or n.startswith(pre + ".") for n in names):
            continue
        hint = prefix_hint(pre, names)
        top = sorted({".".join(n.split(".")[:3]) for n in names})
        raise ConfigError("policy.freeze", list(p.freeze),
                          f"no parameter of the {p.name} policy is under {pre!r} (prefixes at a dot boundary); "
                          + (f"{hint} " if hint else "") + f"its modules: {top}")


# ---------------------------------------------------------------- the model's shape, from its library config
@dataclass(frozen=True)
class ModelShape:
    """What the plan reads of a model: parameter counts and activation bytes per sample (module docstring)."""

    params: int  # P: every parameter
    trainable: int  # T: those an update changes
    largest_layer: int  # L: parameters of the largest decoder layer (an FSDP unit)
    outside_layers: int  # E: parameters outside the decoder layers (the root FSDP unit)
    act_bytes: int  # A: activation bytes per sample without checkpointing
    act_bytes_ckpt: int  # A with gradient checkpointing


def gemma_layer_elems(c) -> int:
    """Activation elements one Gemma decoder layer keeps per token: 4h + 3Hd + 3Gd + 4I (module docstring)."""
    h, H, G, d, I = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    return 4 * h + 3 * H * d + 3 * G * d + 4 * I


def siglip_layer_elems(c) -> int:
    """Activation elements one SigLIP encoder layer keeps per token: 8h + 2I (module docstring)."""
    return 8 * c.hidden_size + 2 * c.intermediate_size


def activation_bytes(hf_config, *, num_cameras: int, prompt_len: int, expert_passes: int, elem_bytes: int,
                     checkpointing: bool) -> int:
    """A: activation bytes per sample of one forward + backward of a PI0/PI05 model (module docstring's formula).

    Args:
        hf_config: a transformers PI0Config / PI05Config (vlm_config.text_config, vlm_config.vision_config,
            dit_config, chunk_size).
        num_cameras: images per sample; prompt_len: text tokens after the image tokens; expert_passes: action-expert
            forwards per sample (denoising steps the update recomputes); elem_bytes: 2 (bf16 autocast) or 4.
    """
    t, v, e = hf_config.vlm_config.text_config, hf_config.vlm_config.vision_config, hf_config.dit_config
    img_tokens = (v.image_size // v.patch_size) ** 2
    suffix = hf_config.chunk_size + (1 if _has_state_token(hf_config) else 0)
    stacks = [  # (layers, tokens, width, elements per token per layer)
        (v.num_hidden_layers, num_cameras * img_tokens, v.hidden_size, siglip_layer_elems(v)),
        (t.num_hidden_layers, num_cameras * img_tokens + prompt_len, t.hidden_size, gemma_layer_elems(t)),
        (e.num_hidden_layers, expert_passes * suffix, e.hidden_size, gemma_layer_elems(e)),
    ]
    if not checkpointing:
        return elem_bytes * sum(n * s * per for n, s, _, per in stacks)
    kept = sum(n * s * h for n, s, h, _ in stacks)  # each layer's input
    replay = max(s * per for _, s, _, per in stacks)  # one layer's full activations during its recompute
    return elem_bytes * (kept + replay)


def _has_state_token(hf_config) -> bool:
    # pi0 feeds the state through `state_proj` as one suffix token; pi05 puts it into the prompt as text
    return type(hf_config).__name__ == "PI0Config"


def model_shape(hf_config, *, lora_rank: int = 0, lora_targets=(), freeze=(), heads: int = 0, num_cameras: int,
                prompt_len: int, expert_passes: int, elem_bytes: int, checkpointing: bool) -> ModelShape:
    """The ModelShape of the library model of `hf_config`, built on the meta device (no memory, < 1 s for base):
    parameters counted from the module, plus `heads` (the policy's own heads, trainable); the trainable ones are
    those the runtime's rule leaves trainable (tasks.policies.pi0.lora.set_trainable, applied to the meta model by
    tasks.policies.pi0.names): with `lora_rank` > 0 the adapters of the Linear modules `lora_targets` match (r (in +
    out) each), else every parameter; less those under a `freeze` prefix (the policy's names: `hf.<name>`) and the
    parameters the library's forward never uses (lora.UNUSED: pi0's expert token embedding), which get no gradient
    and no optimizer state. Raises ConfigError (policy.lora_targets / policy.freeze) for an entry matching nothing."""
    from tasks.policies.pi0.names import _meta_policy
    name, text = type(hf_config).__name__, hf_config.to_json_string()
    P, L, E, A = _counts(name, text, int(lora_rank), tuple(lora_targets))
    hf_freeze = tuple(str(f) for f in freeze if str(f) == "hf" or str(f).startswith("hf."))  # the heads: `heads`
    meta = _meta_policy(name, text, int(lora_rank), 16.0, tuple(lora_targets) if lora_rank else (), hf_freeze,
                        "mean_token", False, False)
    T = sum(q.numel() for q in meta.hf.parameters() if q.requires_grad) + heads
    kw = dict(num_cameras=num_cameras, prompt_len=prompt_len, expert_passes=expert_passes, elem_bytes=elem_bytes)
    return ModelShape(P + heads, T, L, E + heads, activation_bytes(hf_config, checkpointing=False, **kw),
                      activation_bytes(hf_config, checkpointing=True, **kw))


@functools.lru_cache(maxsize=16)
def _counts(cls_name: str, config_json: str, lora_rank: int, lora_targets: tuple) -> tuple[int, int, int, int]:
    """(parameters, largest decoder layer's, those outside decoder layers, LoRA adapter parameters) of the library
    model of a config (its class name and JSON), built on the meta device (tasks.policies.pi0.names, shared with
    the trainable count); cached (the refusal tries its fixes)."""
    from tasks.policies.pi0.lora import decoder_layers, lora_target_names
    from tasks.policies.pi0.names import _meta_policy
    model = _meta_policy(cls_name, config_json, 0, 16.0, (), (), "mean_token", False, False).hf  # no adapters
    P = sum(p.numel() for p in model.parameters())
    A = 0
    if lora_rank:
        mods = dict(model.named_modules())
        A = sum(lora_rank * (mods[n].in_features + mods[n].out_features)
                for n in lora_target_names(model, lora_targets))
    layers = decoder_layers(model)
    in_layers = {id(p) for m in layers for p in m.parameters()}
    L = max(sum(p.numel() for p in m.parameters()) for m in layers)
    E = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    return P, L, E, A


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per actor GPU during the update (module docstring's formula), and the settings that gave them."""

    weights: int
    gathered: int
    grads: int
    optimizer: int
    activations: int
    casts: int
    replica: int
    reserve: int
    ranks: int
    micro_batch: int
    checkpointing: bool
    offload: bool

    @property
    def total(self) -> int:
        return (self.weights + self.gathered + self.grads + self.optimizer + self.activations + self.casts
                + self.replica + self.reserve)

    def describe(self) -> str:
        """One line: the total and each term in GiB."""
        g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
        return (f"{g(self.total)} GiB per GPU (weights {g(self.weights)}, all-gathered {g(self.gathered)}, grads "
                f"{g(self.grads)}, Adam {g(self.optimizer)}, activations {g(self.activations)} at micro-batch "
                f"{self.micro_batch}{' with checkpointing' if self.checkpointing else ''}, bf16 casts {g(self.casts)}, "
                f"rollout replica "
                f"{g(self.replica)}, reserve {g(self.reserve)}; {self.ranks} FSDP rank{'s' if self.ranks > 1 else ''})")


def plan_memory(shape: ModelShape, *, ranks: int, micro_batch: int, checkpointing: bool, replica_bytes: int,
                offload: bool, autocast: bool) -> MemoryPlan:
    """The MemoryPlan of `shape` (module docstring's terms). `replica_bytes`: bytes per element of a rollout replica
    sharing the actor's GPU (0: none there); `offload`: replicas moved off during the update (no replica term);
    `autocast`: bf16 autocast (the casts term)."""
    R = max(int(ranks), 1)
    return MemoryPlan(
        weights=-(-4 * shape.params // R),
        gathered=4 * (2 * shape.largest_layer + shape.outside_layers) if R > 1 else 0,
        grads=-(-4 * shape.trainable // R),
        optimizer=-(-8 * shape.trainable // R),
        activations=micro_batch * (shape.act_bytes_ckpt if checkpointing else shape.act_bytes),
        casts=0 if not autocast else 2 * (shape.largest_layer + shape.outside_layers if checkpointing
                                          else shape.params),
        replica=0 if offload else replica_bytes * shape.params,
        reserve=RESERVE_BYTES, ranks=R, micro_batch=int(micro_batch), checkpointing=checkpointing, offload=offload)


# ---------------------------------------------------------------- the family check
def _devices(spec: str) -> set[int] | None:
    """A placement value's device indices ('N', 'A-B', 'A,B', 'A-B,C'); None for 'all' or '' (the default)."""
    spec = str(spec).strip()
    if spec in ("", "all"):
        return None
    out: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def replica_shares_actor_gpu(placement: dict) -> bool:
    """Whether `cluster.component_placement` puts rollout replicas on an actor device: rollout left out or empty
    (it goes with the actor), 'all' on either side, or overlapping device sets."""
    specs: dict[str, str] = {}
    for key, val in (placement or {}).items():
        for comp in str(key).split(","):
            specs[comp.strip()] = val
    actor, rollout = specs.get("actor", ""), specs.get("rollout", "")
    if str(rollout).strip() == "":
        return True
    a, r = _devices(actor if str(actor).strip() else "0"), _devices(rollout)
    return a is None or r is None or bool(a & r)


def library_config(p):
    """The transformers config the policy config `p` builds (tasks.policies.pi0.library.offline_config)."""
    from tasks.policies.pi0.library import offline_config
    return offline_config(p)


def micro_batch(cfg) -> int:
    """Samples per forward/backward on one rank: the RL update's `batch_plan` (one rank: the minibatch,
    batch / algorithm.num_minibatches), SFT's sft.batch_size (SFT runs on one rank)."""
    if cfg.algorithm.spec.estimator:
        from tasks.config.batch import batch_plan
        return batch_plan(cfg).micro_batch_size
    return cfg.sft.batch_size


def _smaller_batches(cfg) -> list[tuple[str, int]]:
    """The smaller micro-batches `cfg`'s keys can give, largest first, as (the override, samples per rank): the RL
    update's algorithm.micro_batch_size (dividing the rank's share of an optimizer step, global / ranks: the
    gradients accumulate, the update stays the same, on one rank as on several), SFT's sft.batch_size (halved)."""
    a = cfg.algorithm
    m = micro_batch(cfg)
    if not a.spec.estimator:
        return [(f"sft.batch_size={b}", b) for b in (m // 2 ** i for i in range(1, 12)) if b >= 1]
    from tasks.config.batch import batch_plan
    per_rank = batch_plan(cfg).per_rank_batch_size
    return [(f"algorithm.micro_batch_size={d}", d) for d in range(m - 1, 0, -1) if per_rank % d == 0]


NUM_CAMERAS = 2  # the plan's cameras per sample: LIBERO's agentview + wrist (ManiSkill's one camera needs less)


def config_plan(cfg, **over) -> MemoryPlan:
    """The MemoryPlan of Config `cfg` (policy pi0/pi05), with `over` replacing any of: lora_rank, ranks,
    micro_batch, checkpointing, offload (what the refusal's fixes try)."""
    p, a = cfg.policy, cfg.algorithm
    rank = over.get("lora_rank", p.lora_rank)
    ckpt = over.get("checkpointing", p.gradient_checkpointing)
    elem = 2 if p.dtype == "bfloat16" else 4
    shape = model_shape(library_config(p), lora_rank=rank, lora_targets=p.lora_targets, freeze=p.freeze,
                        num_cameras=NUM_CAMERAS, prompt_len=p.max_prompt_len,
                        expert_passes=p.num_denoise_steps if a.spec.estimator else 1, elem_bytes=elem,
                        checkpointing=ckpt)
    shares = replica_shares_actor_gpu(cfg.cluster.component_placement) and bool(a.spec.rollout)
    return plan_memory(shape, ranks=over.get("ranks", a.num_actor_ranks),
                       micro_batch=over.get("micro_batch", micro_batch(cfg)), checkpointing=ckpt,
                       replica_bytes=elem if shares else 0, offload=over.get("offload", a.offload),
                       autocast=p.dtype == "bfloat16")


def check_memory_plan(cfg) -> None:
    """The family check of `cluster.gpu_memory_gib` (None: not checked): the plan's total per actor GPU must fit.

    Raises:
        ConfigError (cluster.gpu_memory_gib): the plan's number and terms, and each fix that fits alone (more FSDP
            ranks, LoRA, gradient checkpointing, a smaller micro-batch, offload), with its own total; or, when none
            does alone, that fact and the totals they reach.
    """
    cap = cfg.cluster.gpu_memory_gib
    if cap is None:
        return
    if not cap > 0:
        raise ConfigError("cluster.gpu_memory_gib", cap, "must be > 0 (GiB of one GPU), or null to skip the memory plan")
    p, a = cfg.policy, cfg.algorithm
    try:
        library_config(p)
    except (OSError, ValueError):  # not a checkpoint of this family: the model_path check names that (components)
        return
    plan = config_plan(cfg)
    if plan.total <= cap * GIB:
        return
    fixes: list[tuple[str, MemoryPlan]] = []
    fits = lambda plan_: plan_.total <= cap * GIB  # noqa: E731
    if a.spec.rollout:  # SFT's update runs on one rank
        from tasks.config.batch import batch_plan
        for r in (2, 4, 8, 16, 32, 64):
            if r <= a.num_actor_ranks:
                continue
            try:
                m = batch_plan(cfg, num_ranks=r).micro_batch_size
            except ConfigError:  # the batch does not split over r ranks
                continue
            fixes.append((f"algorithm.num_actor_ranks={r} (and cluster.component_placement.actor=0-{r - 1})",
                          config_plan(cfg, ranks=r, micro_batch=m)))
            if fits(fixes[-1][1]):
                break
    if not p.lora_rank:
        fixes.append((f"policy.lora_rank={LORA_SUGGESTED_RANK}", config_plan(cfg, lora_rank=LORA_SUGGESTED_RANK)))
    if not p.gradient_checkpointing:
        fixes.append(("policy.gradient_checkpointing=true", config_plan(cfg, checkpointing=True)))
    for key, m in _smaller_batches(cfg):  # the largest micro-batch that fits
        fixes.append((key, config_plan(cfg, micro_batch=m)))
        if fits(fixes[-1][1]):
            break
    if not a.offload and plan.replica:
        fixes.append(("algorithm.offload=true", config_plan(cfg, offload=True)))
    fit = [(k, f) for k, f in fixes if fits(f)]
    best = {}
    for k, f in fixes:  # per kind of fix, the last tried (the most of it)
        best[k.split("=")[0]] = (k, f)
    shown = fit or list(best.values())
    head = "fixes that fit alone" if fit else "no single fix fits; combine them (each alone reaches)"
    raise ConfigError("cluster.gpu_memory_gib", cap,
                      f"policy.name={p.name} needs {plan.describe()} > {cap} GiB; {head}: "
                      + "; ".join(f"{k} -> {f.total / GIB:.1f} GiB" for k, f in shown))


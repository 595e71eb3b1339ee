"""The pi0 / pi05 presets as transformers configs (`PI0Config` / `PI05Config`), and reading one from a directory.

- `base`: the published configs (transformers' defaults, checkpoint layout of `lerobot/pi0_base`): PaliGemma
  (SigLIP So400m/14 at 224 px, Gemma 2B: 18 layers x 2048), the Gemma-300M action expert (18 x 1024), chunk 50,
  state / action padded to 32; 3.501 B (pi0) / 3.353 B (pi05) parameters.
- `tiny`: the same classes at toy sizes that train on a CPU: Gemma 2 layers x 64 (2 heads, 1 KV head, head dim
  32, MLP 128), SigLIP 2 layers x 32 (patch 8 at 32 px: 16 image tokens per camera), expert 2 layers x 32 (the
  VLM's heads and head dim: every expert layer attends to the VLM layer's keys / values), state padded to 64
  (ManiSkill PushCube's state has 35 dims), actions to 8.
Both take the vocabulary and the <image> id from the tokenizer (the tiny tokenizer for a fresh model: 1413 ids),
`chunk_size` = policy.num_action_chunks for tiny (base keeps the published 50: the first C actions are executed)
and `num_inference_steps` = policy.num_denoise_steps.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

TINY = dict(text=dict(model_type="gemma", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32),
            vision=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, patch_size=8, image_size=32, vision_use_head=False),
            dit=dict(model_type="gemma", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32),
            max_state_dim=64, max_action_dim=8)


def config_class(family: str):
    """transformers' config class of `family` ("pi0" | "pi05")."""
    from transformers import PI0Config, PI05Config
    return {"pi0": PI0Config, "pi05": PI05Config}[family]


def model_class(family: str):
    """transformers' model class of `family` ("pi0" | "pi05")."""
    from transformers import PI0ForConditionalGeneration, PI05ForConditionalGeneration
    return {"pi0": PI0ForConditionalGeneration, "pi05": PI05ForConditionalGeneration}[family]


def preset_config(family: str, preset: str, *, chunk_size: int, num_steps: int, vocab_size: int | None = None,
                  image_token_id: int | None = None):
    """The transformers config of `preset` ("tiny" | "base") for `family`. `vocab_size` / `image_token_id`: the
    tokenizer's (None keeps the published PaliGemma values, 257152 / 257152: a config for parameter counts).

    Raises ValueError for an unknown preset."""
    cls = config_class(family)
    if preset == "base":
        cfg = cls(num_inference_steps=num_steps)
        if vocab_size is not None:  # the embedding table keeps PaliGemma's size unless the tokenizer needs more
            cfg.vlm_config.image_token_id = image_token_id
        return cfg
    if preset != "tiny":
        raise ValueError(f"unknown preset {preset!r}: use tiny or base")
    vocab = vocab_size or 1413
    text = dict(TINY["text"], vocab_size=vocab)
    vision = dict(TINY["vision"], vocab_size=vocab)
    vlm = dict(text_config=text, vision_config=vision, projection_dim=text["hidden_size"],
               image_token_id=vocab - 1153 if image_token_id is None else image_token_id)
    state = {"max_state_dim": TINY["max_state_dim"]} if family == "pi0" else {}  # pi05's state is in the prompt
    return cls(vlm_config=vlm, dit_config=dict(TINY["dit"]), chunk_size=chunk_size,
               max_action_dim=TINY["max_action_dim"], num_inference_steps=num_steps, **state)


def directory_config(family: str, path: str | Path):
    """The transformers config saved in directory `path` (its config.json; extra keys such as dagrl's `dagrl`
    entry are kept as attributes). Raises FileNotFoundError / ValueError (another model_type)."""
    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    if meta.get("model_type") != family:
        raise ValueError(f"{path} holds a model_type={meta.get('model_type')!r} model, not {family!r}")
    return config_class(family).from_pretrained(str(path), local_files_only=True)


def offline_config(p):
    """The transformers config the policy config `p` (pi0 / pi05) builds, read offline: `model_path`'s config.json
    or the preset (parameter counts do not depend on the tokenizer: the published vocabulary). Raises as
    `directory_config` / `preset_config`."""
    if p.model_path:
        return directory_config(p.name, p.model_path)
    return preset_config(p.name, p.preset, chunk_size=p.num_action_chunks, num_steps=p.num_denoise_steps)


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off inside the block (its "Loading weights" / "Writing model shards" bars would
    cut into dagrl's own progress line at every checkpoint and load), restored after."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()

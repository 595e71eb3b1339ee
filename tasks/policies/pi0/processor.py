"""The pi0 / pi05 processors as dagrl builds, loads and saves them: transformers' `PI0Processor` / `PI05Processor`
(prompts with the image tokens, pi05's discretised state in the prompt, the state / action normalisation
statistics), with

- `tiny_tokenizer()`: a PaliGemma-style tokenizer made offline in code (byte-level BPE without merges: 4 special
  tokens <pad> 0, <eos> 1, <bos> 2, <unk> 3, then the 256 byte symbols; the processor adds <image>, 1024 <loc> and
  128 <seg> tokens: 1413 ids in all), for the tiny / fresh presets and the tests. A real checkpoint brings its
  own tokenizer files.
- `PI0ImageProcessorPil`: transformers' `PI0ImageProcessor` settings on the PIL backend (transformers' class needs
  torchvision, which dagrl does not install). It saves as `PI0ImageProcessor`, so plain transformers (with
  torchvision) loads a dagrl export's processor with its own class.
- `load_processor(dir)` / `save_processor(proc, dir)`: the files of a transformers directory
  (processor_config.json with the statistics and the image processor's settings, tokenizer files).
- `unnormalize_actions`: the inverse of the processor's `normalize(actions)` (the processors only normalise).

Everything is local: nothing is downloaded.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3, as PaliGemma's tokenizer
PROCESSOR_FILE = "processor_config.json"


class PI0ImageProcessorPil(PilBackend):
    """transformers' `PI0ImageProcessor` (models/pi0/image_processing_pi0.py) on the PIL backend: bicubic resize
    to at most size x size, pad to pad_size, rescale to [0, 1], normalise with mean = std = 0.5 (pixels in
    [-1, 1], SigLIP's input). `image_seq_length` = image tokens per camera in the prompt."""

    resample = PILImageResampling.BICUBIC
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    size = {"max_height": 224, "max_width": 224}
    default_to_square = False
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    image_seq_length = 256
    pad_size = {"height": 224, "width": 224}
    do_pad = True


def image_processor(image_size: int, patch_size: int) -> PI0ImageProcessorPil:
    """The image processor of a vision tower at `image_size` px with `patch_size` px patches:
    (image_size / patch_size)^2 image tokens per camera."""
    return PI0ImageProcessorPil(size={"max_height": image_size, "max_width": image_size},
                                pad_size={"height": image_size, "width": image_size},
                                image_seq_length=(image_size // patch_size) ** 2)


def tiny_tokenizer():
    """A PaliGemma-style tokenizer built offline (no file, no download): byte-level BPE without merges over the 256
    byte symbols after <pad> <eos> <bos> <unk> (every text is representable). Returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def processor_class(family: str):
    """transformers' processor class of `family` ("pi0" | "pi05")."""
    from transformers import PI0Processor, PI05Processor
    return {"pi0": PI0Processor, "pi05": PI05Processor}[family]


def new_processor(family: str, *, image_size: int, patch_size: int, obs_dim: int, action_dim: int,
                  max_state_dim: int, chunk_size: int, tokenizer=None):
    """A processor for a fresh model: the tiny tokenizer (or `tokenizer`), identity statistics (state mean 0 /
    std 1 over `obs_dim`, actions over `action_dim`)."""
    return processor_class(family)(
        image_processor=image_processor(image_size, patch_size), tokenizer=tokenizer or tiny_tokenizer(),
        state_mean=[0.0] * obs_dim, state_std=[1.0] * obs_dim, actions_mean=[0.0] * action_dim,
        actions_std=[1.0] * action_dim, max_state_dim=max_state_dim, chunk_size=chunk_size)


def load_processor(family: str, path: str | Path):
    """The processor saved in the transformers directory `path` (processor_config.json, with the image
    processor's settings inside it or in preprocessor_config.json, and the tokenizer files), built with
    `PI0ImageProcessorPil`. Raises FileNotFoundError when `path` has no processor_config.json."""
    from transformers import AutoTokenizer
    path = Path(path)
    if not (path / PROCESSOR_FILE).is_file():
        raise FileNotFoundError(f"{path / PROCESSOR_FILE} not found (a transformers processor directory is expected)")
    conf = json.loads((path / PROCESSOR_FILE).read_text())
    image_conf = conf.get("image_processor")
    if image_conf is None and (path / "preprocessor_config.json").is_file():
        image_conf = json.loads((path / "preprocessor_config.json").read_text())
    image_conf = {k: v for k, v in (image_conf or {}).items() if k not in ("image_processor_type", "processor_class")}
    cls = processor_class(family)
    known = set(inspect.signature(cls.__init__).parameters) - {"self", "image_processor", "tokenizer", "kwargs"}
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return cls(image_processor=PI0ImageProcessorPil(**image_conf), tokenizer=tokenizer,
               **{k: v for k, v in conf.items() if k in known})


def save_processor(processor, path: str | Path) -> None:
    """Write `processor` into the directory `path` (transformers' `save_pretrained`: plain
    `PI0Processor.from_pretrained(path)` reads it back)."""
    processor.save_pretrained(str(path))


def unnormalize_actions(processor, x: torch.Tensor) -> torch.Tensor:
    """Actions in the env's units from the model's normalised ones x [..., D]: the inverse of the processor's
    `normalize(actions)`: quantiles (pi05 with actions_q01 / q99: (x + 1) / 2 * (q99 - q01) + q01, a zero range
    replaced by 1e-8 as the processor does) or mean / std (x * (std + 1e-8) + mean).

    Raises ValueError when the processor has neither statistic."""
    q01, q99 = getattr(processor, "actions_q01", None), getattr(processor, "actions_q99", None)
    if q01 is not None and q99 is not None:
        lo, hi = torch.tensor(q01, dtype=x.dtype, device=x.device), torch.tensor(q99, dtype=x.dtype, device=x.device)
        span = torch.where(hi - lo == 0, torch.full_like(hi, 1e-8), hi - lo)
        return (x + 1.0) / 2.0 * span + lo
    if processor.actions_mean is None or processor.actions_std is None:
        raise ValueError("the processor has no action statistics (actions_mean / std or actions_q01 / q99): the "
                         "checkpoint's processor_config.json must carry the dataset's")
    mean = torch.tensor(processor.actions_mean, dtype=x.dtype, device=x.device)
    std = torch.tensor(processor.actions_std, dtype=x.dtype, device=x.device)
    return x * (std + 1e-8) + mean


def longest_prompt(processor, texts, *, num_cameras: int, state_dim: int | None) -> tuple[int, str]:
    """(tokens, text): the most tokens after the image tokens of the prompts `processor` builds (its own
    `build_prompts` and tokenizer, as its `__call__` does: BOS, the task text; pi05's ", State: ..." too) for `texts`
    (strings) with `num_cameras` cameras, and the text that gives them. pi05's state (`state_dim` dims; None: not
    known, left out, so the count is a lower bound) is taken at the 256-bin value whose text spends the most tokens,
    in every dimension (PI05Processor.build_prompts: bucketize(v, linspace(-1, 1, 257)[:-1], right=True) - 1, values
    -1..255): exact for the tiny byte-level tokenizer and for tokenizers that split digits (Gemma's)."""
    texts = list(dict.fromkeys(texts))
    images = [[None] * num_cameras] * len(texts)
    skip = num_cameras * processor.image_seq_length

    def counts(prompts: list[str]) -> list[int]:
        return [len(ids) - skip for ids in processor.tokenizer(prompts)["input_ids"]]

    state = None
    if state_dim and getattr(processor, "state_in_prompt", False):
        edges = torch.linspace(-1, 1, 256 + 1)[:-1]  # bin b >= 0 starts at edges[b]; below -1: bin -1
        values = [-2.0] + edges.tolist()  # the normalised values of bins -1, 0, ..., 255
        longest = texts[max(range(len(texts)), key=lambda i: counts(processor.build_prompts(
            [texts[i]], images[:1], None))[0])]
        per_bin = counts(processor.build_prompts([longest] * len(values), [images[0]] * len(values),
                                                 torch.tensor(values)[:, None].repeat(1, state_dim)))
        worst = values[max(range(len(values)), key=per_bin.__getitem__)]
        state = torch.full((len(texts), state_dim), worst)
    n = counts(processor.build_prompts(texts, images, state))
    i = max(range(len(texts)), key=n.__getitem__)
    return n[i], texts[i]

"""vla_common: byte tokenizer, size presets, prefix encoder (masks, state-only), pooling / value head."""
from __future__ import annotations

import pytest
import torch

from tasks.config import ConfigError
from tasks.policies.vla_common import (POOLINGS, ByteTokenizer, PrefixEncoder, ValueHead, pool, resolve_sizes)

SIZES = dict(patch_size=8, vision_width=32, vision_layers=1, vision_heads=2, vision_mlp=64, lm_width=32,
             lm_layers=2, lm_heads=2, lm_kv_heads=1, lm_head_dim=16, lm_mlp=64, vocab_size=384, value_hidden=16)


def test_tokenizer_bytes_pad_truncate_and_roundtrip(tmp_path):
    tok = ByteTokenizer()
    ids = tok(["ab", "pick the cube"], 6)
    assert ids.dtype == torch.int64 and ids.shape == (2, 6)
    # UTF-8 bytes + 3, then EOS (1), then pad (0); the long text is truncated with EOS kept last
    assert ids[0].tolist() == [ord("a") + 3, ord("b") + 3, 1, 0, 0, 0]
    assert ids[1].tolist() == [ord(c) + 3 for c in "pick "] + [1]
    tok.save_pretrained(tmp_path)
    assert torch.equal(ByteTokenizer.from_pretrained(tmp_path)(["ab", "pick the cube"], 6), ids)
    with pytest.raises(TypeError):
        tok("one string", 4)


def test_resolve_sizes_overrides_and_errors():
    presets = {"tiny": {"a": 1, "b": 2}}
    assert resolve_sizes(presets, "tiny", {"b": 5}) == {"a": 1, "b": 5}
    with pytest.raises(ConfigError) as e:
        resolve_sizes(presets, "tiny", {"c": 3})
    assert e.value.key == "policy.sizes" and "'a'" in str(e.value) and "'b'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve_sizes(presets, "huge", {})
    assert e.value.key == "policy.preset" and "tiny" in str(e.value)
    with pytest.raises(ConfigError):
        resolve_sizes(presets, "tiny", {"a": 0})


def _obs(tok, texts, L, B=2, img=16, O=5):
    torch.manual_seed(1)
    return {"prompt": tok(texts, L), "rgb": torch.randint(0, 256, (B, img, img, 3), dtype=torch.uint8),
            "state": torch.randn(B, O)}


def test_prefix_layout_masks_and_padding_invariance():
    torch.manual_seed(0)
    enc = PrefixEncoder(SIZES, 5, 16, use_state=True).eval()
    tok = ByteTokenizer()
    obs = _obs(tok, ["push the cube", "go"], 16)
    out = enc(obs, with_kv=True)
    P = 4 + 16 + 1  # (16/8)^2 patches + prompt + state token
    assert out.hidden.shape == (2, P, 32) and out.mask.shape == (2, P) and out.mask.dtype == torch.bool
    assert out.mask.sum(1).tolist() == [4 + 14 + 1, 4 + 3 + 1]
    assert out.positions[1, -1].item() == 4 + 3  # padding does not advance positions
    assert len(out.kv) == 2 and out.kv[0][0].shape == (2, 1, P, 16)
    assert torch.isfinite(out.hidden).all()
    # the same prompts padded to another length give the same features for every valid token
    out2 = enc(dict(obs, prompt=tok(["push the cube", "go"], 24)))
    torch.testing.assert_close(out2.hidden[:, -1], out.hidden[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2.hidden[:, :4], out.hidden[:, :4], atol=1e-5, rtol=1e-5)


def test_prefix_state_only_and_errors():
    tok = ByteTokenizer()
    enc = PrefixEncoder(SIZES, 5, None, use_state=False)
    obs = {"prompt": tok(["a", "b"], 8), "state": torch.randn(2, 5)}
    out = enc(obs)
    assert out.hidden.shape == (2, 8, 32) and out.kv is None
    with_img = PrefixEncoder(SIZES, 5, 16, use_state=True)
    with pytest.raises(KeyError):
        with_img(obs)
    with pytest.raises(ValueError):
        with_img(dict(obs, rgb=torch.zeros(2, 8, 8, 3, dtype=torch.uint8)))
    with pytest.raises(KeyError):
        enc({"state": torch.randn(2, 5)})
    with pytest.raises(ConfigError):
        PrefixEncoder(SIZES, 5, 20, use_state=True)  # 20 px is not a multiple of the 8 px patch


def test_pooling_by_hand_and_value_head_shapes():
    h = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    m = torch.tensor([[True, True, False, False], [True, False, True, False]])
    torch.testing.assert_close(pool(h, m, "mean_token"), torch.stack([h[0, :2].mean(0), h[1, [0, 2]].mean(0)]))
    torch.testing.assert_close(pool(h, m, "first_token"), h[:, 0])
    torch.testing.assert_close(pool(h, m, "last_token"), torch.stack([h[0, 1], h[1, 2]]))
    for p in POOLINGS:
        assert ValueHead(3, 8, 1, p)(h, m).shape == (2,)
        assert ValueHead(3, 8, 5, p)(h, m).shape == (2, 5)
    with pytest.raises(ValueError):
        ValueHead(3, 8, 1, "max_token")

"""The tiny CosyVoice2 stand-in assets: the two ONNX front-end models and the CosyVoice-BlankEN folder."""

from __future__ import annotations

import importlib.machinery
import json
import math
import struct
import sys
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cosybatch.cosyvoice.tiny import assets as tiny_assets

BLANK_EN_FILES = {
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors",
    "tokenizer_config.json",
    "vocab.json",
}
ENGLISH = [
    "Good morning, everyone!",
    "The train leaves at 7:45 from platform 3, so we should hurry.",
    "\"Don't panic,\" she said; it's only 12.5% of $1,000.",
    "Zebras can't fly, but they've got four legs (usually).",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_cosyvoice2")
    tiny_assets.write_campplus_onnx(root / "campplus.onnx")
    tiny_assets.write_speech_tokenizer_onnx(root / "speech_tokenizer_v2.onnx")
    tiny_assets.write_blank_en(root / "CosyVoice-BlankEN")
    return root


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def fbank(rng: np.random.Generator, frames: int, batch: int = 1) -> np.ndarray:
    """Mean-normalised over time, as upstream's frontend feeds campplus."""
    feat = rng.normal(-8.0, 3.0, (batch, frames, 80)).astype(np.float32)
    return feat - feat.mean(axis=1, keepdims=True)


def tokenize(sess: ort.InferenceSession, feats: np.ndarray, length: int | None = None) -> np.ndarray:
    length = feats.shape[2] if length is None else length
    return sess.run(None, {"feats": feats, "feats_length": np.array([length], dtype=np.int32)})[0]


# ---------------------------------------------------------------------------- campplus


def test_campplus_signature_and_shapes(assets):
    sess = session(assets / "campplus.onnx")
    (inp,) = sess.get_inputs()
    (out,) = sess.get_outputs()
    assert (inp.name, inp.type) == ("input", "tensor(float)")
    assert isinstance(inp.shape[0], str) and isinstance(inp.shape[1], str) and inp.shape[2] == 80
    assert out.type == "tensor(float)" and out.shape[1] == 192
    rng = np.random.default_rng(0)
    for batch, frames in [(1, 1), (1, 37), (3, 250)]:
        emb = sess.run(None, {inp.name: fbank(rng, frames, batch)})[0]
        assert emb.shape == (batch, 192) and emb.dtype == np.float32
        assert np.isfinite(emb).all()
    assert (assets / "campplus.onnx").stat().st_size < 1_000_000


def test_campplus_deterministic_and_input_dependent(assets, tmp_path):
    again = tiny_assets.write_campplus_onnx(tmp_path / "again.onnx")
    assert again.read_bytes() == (assets / "campplus.onnx").read_bytes()
    other_seed = tiny_assets.write_campplus_onnx(tmp_path / "seed1.onnx", seed=1)
    assert other_seed.read_bytes() != again.read_bytes()

    sess = session(assets / "campplus.onnx")
    rng = np.random.default_rng(1)
    a, b = fbank(rng, 120), fbank(rng, 120)
    emb_a = sess.run(None, {"input": a})[0]
    assert np.array_equal(emb_a, sess.run(None, {"input": a})[0])
    emb_b = sess.run(None, {"input": b})[0]
    cosine = float(emb_a[0] @ emb_b[0] / np.linalg.norm(emb_a) / np.linalg.norm(emb_b))
    assert cosine < 0.999, "different audio must give a different speaker embedding"
    # A batch row equals the same row run alone.
    both = sess.run(None, {"input": np.concatenate([a, b])})[0]
    np.testing.assert_allclose(both, np.concatenate([emb_a, emb_b]), rtol=1e-5, atol=1e-6)
    emb_seed1 = session(other_seed).run(None, {"input": a})[0]
    assert not np.allclose(emb_a, emb_seed1)


# ---------------------------------------------------------------------------- speech tokenizer


def test_speech_tokenizer_signature(assets):
    sess = session(assets / "speech_tokenizer_v2.onnx")
    feats, length = sess.get_inputs()
    (out,) = sess.get_outputs()
    assert (feats.name, feats.type) == ("feats", "tensor(float)")
    assert feats.shape[:2] == [1, 128] and isinstance(feats.shape[2], str)
    assert (length.name, length.type, length.shape) == ("feats_length", "tensor(int32)", [1])
    assert (out.name, out.type) == ("indices", "tensor(int64)")
    assert out.shape[0] == 1 and isinstance(out.shape[1], str)
    assert (assets / "speech_tokenizer_v2.onnx").stat().st_size < 1_000_000


@pytest.mark.parametrize("frames", [*range(1, 10), 400, 3000])
def test_speech_tokenizer_token_count(assets, frames):
    sess = session(assets / "speech_tokenizer_v2.onnx")
    tokens = tokenize(sess, np.random.default_rng(frames).standard_normal((1, 128, frames)).astype(np.float32))
    assert tokens.shape == (1, math.ceil(frames / 4)) and tokens.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() < 6561


def test_speech_tokenizer_deterministic_and_input_dependent(assets, tmp_path):
    again = tiny_assets.write_speech_tokenizer_onnx(tmp_path / "again.onnx")
    assert again.read_bytes() == (assets / "speech_tokenizer_v2.onnx").read_bytes()
    sess = session(assets / "speech_tokenizer_v2.onnx")
    rng = np.random.default_rng(2)
    a = rng.uniform(-1.0, 1.5, (1, 128, 2000)).astype(np.float32)
    b = rng.uniform(-1.0, 1.5, (1, 128, 2000)).astype(np.float32)
    tokens_a = tokenize(sess, a)
    assert np.array_equal(tokens_a, tokenize(sess, a))
    assert np.mean(tokens_a != tokenize(sess, b)) > 0.9
    assert len(np.unique(tokens_a)) > 300, "ids should spread over the 6561 codes"
    # A 4-frame group only depends on its own frames, and feats_length trims the output.
    assert np.array_equal(tokenize(sess, a[:, :, :400]), tokens_a[:, :100])
    assert np.array_equal(tokenize(sess, a, length=401), tokens_a[:, :101])
    other = tiny_assets.write_speech_tokenizer_onnx(tmp_path / "seed1.onnx", seed=1)
    assert np.mean(tokens_a != tokenize(session(other), a)) > 0.9


# ---------------------------------------------------------------------------- CosyVoice-BlankEN


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    assert header.pop("__metadata__") == {"format": "pt"}
    data = raw[8 + size :]
    tensors = {}
    end = 0
    for name, info in header.items():
        assert info["dtype"] == "F32"
        start, stop = info["data_offsets"]
        tensors[name] = np.frombuffer(data[start:stop], dtype="<f4").reshape(info["shape"])
        end = max(end, stop)
    assert end == len(data)
    return tensors


def test_blank_en_layout(assets, tmp_path):
    folder = assets / "CosyVoice-BlankEN"
    assert {p.name for p in folder.iterdir()} == BLANK_EN_FILES  # the real folder has no tokenizer.json
    config = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["use_sliding_window"] is False
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert len(vocab) == 1000 and sorted(vocab.values()) == list(range(1000))
    assert all(len(symbol) == 1 for symbol, i in vocab.items() if i < 256)
    assert config["bos_token_id"] == config["eos_token_id"] == 1000
    added = {int(i): entry["content"] for i, entry in tok_config["added_tokens_decoder"].items()}
    assert added == {1000: "<|endoftext|>", 1001: "<|im_start|>", 1002: "<|im_end|>"}
    assert tok_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= 1000 + 3 + 17

    merges = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2" and len(merges) - 1 == 1000 - 256
    for rank, line in enumerate(merges[1:]):
        left, right = line.split(" ")
        assert vocab[left + right] == 256 + rank

    weights = read_safetensors(folder / "model.safetensors")
    hidden, kv = 64, 64 // 4 * 2
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], hidden)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (kv, hidden)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (hidden, 128)
    assert "lm_head.weight" not in weights and len(weights) == 1 + 2 * 12 + 1

    again = tiny_assets.write_blank_en(tmp_path / "again")
    for name in BLANK_EN_FILES:
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


def test_blank_en_loads_in_transformers(assets):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    folder = assets / "CosyVoice-BlankEN"

    fast = transformers.AutoTokenizer.from_pretrained(folder)
    slow = transformers.AutoTokenizer.from_pretrained(folder, use_fast=False)
    assert type(slow).__name__ == "Qwen2Tokenizer"
    assert fast.eos_token_id == fast.pad_token_id == 1000
    assert fast.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1001, 1002]
    for text in [*ENGLISH, "naïve café, 你好 😀\n  two  spaces"]:
        ids = fast.encode(text)
        assert ids == slow.encode(text)
        assert fast.decode(ids) == text
        assert max(ids) < 1000
    assert len(fast.encode(ENGLISH[0])) < len(ENGLISH[0].encode()) / 2, "the BPE should merge common English"

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert all(not info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    ids = torch.tensor([fast.encode(ENGLISH[1])])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all() and out.hidden_states[-1].shape == (1, ids.shape[1], 64)


def _stub_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


@pytest.mark.slow
def test_blank_en_with_upstream_qwen_tokenizer(assets, monkeypatch):
    pytest.importorskip("transformers")
    import upstream

    upstream.load()
    # cosyvoice.tokenizer.tokenizer imports whisper and tiktoken for its other (CosyVoice 1) tokenizer;
    # QwenTokenizer uses neither, so empty stand-ins do when they are not installed.
    for name, attrs in [("whisper", {"__path__": []}), ("whisper.tokenizer", {"Tokenizer": object}), ("tiktoken", {})]:
        try:
            __import__(name)
        except ImportError:
            monkeypatch.setitem(sys.modules, name, _stub_module(name, **attrs))
    from cosyvoice.tokenizer.tokenizer import QwenTokenizer

    tokenizer = QwenTokenizer(str(assets / "CosyVoice-BlankEN"))
    config = json.loads((assets / "CosyVoice-BlankEN" / "config.json").read_text())
    # Upstream's extra special tokens land right after ours and still fit the embedding table.
    assert len(tokenizer.tokenizer) == 1020 <= config["vocab_size"]
    extra = tokenizer.tokenizer.convert_tokens_to_ids(list(tiny_assets.UPSTREAM_EXTRA_SPECIALS))
    assert extra == list(range(1003, 1020))
    for text in ENGLISH:
        ids = tokenizer.encode(text)
        assert ids and tokenizer.decode(ids) == text
    ids = tokenizer.encode("Say it again.<|endofprompt|>[breath] Hello.")
    assert 1003 in ids and 1004 in ids
    assert tokenizer.decode(ids) == "Say it again. Hello."

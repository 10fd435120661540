"""--precision int8 for Piper voices: the calibrated QDQ model, its cache and the engine on it.

The real build here calibrates on 4 sentences (the product uses 50) so the suite stays quick; the
quality and speed figures come from benchmarks/piper_int8.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.piper import PiperOptions
from cosybatch.engines.piper import quant as piper_quant
from cosybatch.engines.piper.voice import bundled_voice
from cosybatch.errors import UsageError
from cosybatch.plan import Unit


@pytest.fixture(scope="module")
def int8_cache(tmp_path_factory):
    """A cache folder holding the bundled voice's INT8 model, calibrated on 4 sentences."""
    cache = tmp_path_factory.mktemp("xdg")
    few = piper_quant.read_sentences(piper_quant.CALIBRATION_TEXT)[:4]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.setattr(piper_quant, "read_sentences", lambda path: few)
        model, config = bundled_voice()
        path = piper_quant.cached_int8(model, config)
    return cache, path


@pytest.fixture(scope="module")
def engines(int8_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(int8_cache[0]))
        fp32 = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions()))
        int8 = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(precision="int8")))
    return fp32, int8


def synth(engine, text: str, item_id: str) -> np.ndarray:
    prepared = engine.prepare(text, item_id)
    units = [Unit(0, part, piece.cost, "", piece.payload)
             for part, piece in enumerate(prepared.pieces)]
    return np.concatenate(engine.synthesize(units).audio)


def test_int8_model_is_quantized_where_the_variant_says(int8_cache):
    model = onnx.load(str(int8_cache[1]))
    quantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    convs = {n.name: n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose", "MatMul")}
    int8_convs = {name for name, n in convs.items() if n.input[0] in quantized}
    assert int8_convs == set(piper_quant.nodes_to_quantize(onnx.load(str(bundled_voice()[0])),
                                                           piper_quant.VARIANTS[piper_quant.DEFAULT_VARIANT]))
    assert not any(name.startswith(("/enc_p/", "/dp/")) for name in int8_convs)  # durations stay fp32's
    # The noise ops are unseeded again, as in the voice (the engine replaces them by seeded inputs).
    noise = [n for n in model.graph.node if n.op_type == "RandomNormalLike"]
    assert noise and not any(a.name == "seed" for n in noise for a in n.attribute)


def test_int8_audio_has_fp32_durations_and_follows_it(engines, texts):
    fp32, int8 = engines
    assert piper_quant.VARIANTS[piper_quant.DEFAULT_VARIANT].keeps_durations
    for i, text in enumerate(texts[2:6]):
        a, b = synth(fp32, text, f"id-{i}"), synth(int8, text, f"id-{i}")
        assert len(a) == len(b)  # same seeded noise, fp32 durations: the same length to the sample
        assert np.isfinite(b).all() and np.abs(b).max() > 0.05
        # The same speech: frame by frame, the loudness follows fp32's (the waveforms' phase may
        # not, once the flow is int8).
        hop = fp32.config.hop
        level = [10 * np.log10(np.mean(x[: len(x) // hop * hop].reshape(-1, hop) ** 2, axis=1) + 1e-8) for x in (a, b)]
        assert np.corrcoef(*level)[0, 1] > 0.9
        assert np.median(np.abs(level[0] - level[1])) < 3  # dB


def test_fingerprint_records_int8(engines):
    fp32, int8 = engines
    assert "precision" not in fp32.fingerprint()  # fp32 fingerprints are unchanged from before int8
    fp = int8.fingerprint()
    assert fp["precision"] == "int8" and fp["int8_variant"] == piper_quant.DEFAULT_VARIANT
    assert fp["model_sha256"] == fp32.fingerprint()["model_sha256"]  # the voice, not the int8 file
    assert fp["int8_key"] == piper_quant.cache_key(fp["model_sha256"])


def test_cache_key_names_everything_the_file_depends_on():
    key = piper_quant.cache_key("a" * 64)
    assert key == piper_quant.cache_key("a" * 64)
    assert len({key, piper_quant.cache_key("b" * 64), piper_quant.cache_key("a" * 64, "convs"),
                piper_quant.cache_key("a" * 64, sentences=10)}) == 4
    with pytest.raises(UsageError, match="choose one of"):
        piper_quant.cache_key("a" * 64, "everything")


def fake_builds(monkeypatch, delay_s: float = 0.0) -> list:
    """Replace the slow quantizer by one that writes a small file, counting its calls."""
    calls = []

    def build(model, config, out, variant, sentences):
        calls.append(out)
        time.sleep(delay_s)
        Path(out).write_bytes(b"int8 model " + variant.encode())
        return out

    monkeypatch.setattr(piper_quant, "quantize_voice", build)
    return calls


def test_cache_builds_once_atomically_and_rebuilds_a_damaged_file(tmp_path, monkeypatch):
    calls = fake_builds(monkeypatch, delay_s=0.3)
    model, config = bundled_voice()
    folder = tmp_path / "piper-int8"
    found = []
    workers = [threading.Thread(target=lambda: found.append(piper_quant.cached_int8(
        model, config, folder=folder, voice_sha256="c" * 64))) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(calls) == 1 and len(set(found)) == 1  # concurrent callers wait for one build
    path = found[0]
    key = piper_quant.cache_key("c" * 64)
    assert path.parent == folder and path.name.startswith(key + "-") and path.suffix == ".onnx"
    assert not list(folder.glob(".*.tmp"))  # the temporary file was renamed into place
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    path.write_bytes(b"truncated")  # its bytes no longer match the digest in its name
    again = piper_quant.cached_int8(model, config, folder=folder, voice_sha256="c" * 64)
    assert len(calls) == 2 and again.read_bytes().startswith(b"int8 model")


def test_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    fake_builds(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, config = bundled_voice()
    path = piper_quant.cached_int8(model, config, voice_sha256="d" * 64)
    assert path.parent == tmp_path / "cosybatch" / "piper-int8"


def test_precision_is_checked():
    with pytest.raises(UsageError, match="fp32 or int8"):
        PiperOptions(precision="fp16")


@pytest.mark.slow
def test_quantize_command_prints_the_cached_model(int8_cache):
    cache, path = int8_cache
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "cosybatch", "quantize"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["path"] == str(path)  # found in the cache, not built again
    assert result["precision"] == "int8" and result["voice"] == "en_US-joe-medium"

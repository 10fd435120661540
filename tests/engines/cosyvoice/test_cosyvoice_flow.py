"""CosyVoice2 flow and token2wav: the official-format tiny model, parity with upstream, batching."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import upstream

from cosybatch.cosyvoice.flow.cfm import FlowInput
from cosybatch.cosyvoice.model import load_flow, read_config
from cosybatch.cosyvoice.pipeline import Token2Wav
from cosybatch.cosyvoice.weights import ModelDirError
from cosybatch.cosyvoice.yamlconf import Call, load_yaml

# (tokens, prompt tokens): with and without a zero-shot prompt, lengths far apart.
SHAPES = [(13, 0), (7, 4), (31, 6), (3, 0), (20, 5)]


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    return float(10 * np.log10((reference**2).sum() / max(((reference - other) ** 2).sum(), 1e-30)))


# Waveforms are compared by SNR, mels by max abs diff. The harmonic source integrates f0 into a phase
# of thousands of radians, so a last-bit difference in a mel (batched vs single matmuls: ~5e-7 here)
# moves samples by up to ~1e-3 while the signal stays the same (SNR ~90 dB measured; upstream run on
# another device or thread count shows the same). 60 dB is far above audible and far below any bug.
MIN_SNR_DB = 60.0


def make_items(shapes=SHAPES, seed=5) -> list[FlowInput]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for tokens, prompt in shapes:
        items.append(
            FlowInput(
                tokens=torch.randint(0, 6561, (tokens,), generator=gen),
                embedding=torch.randn(192, generator=gen),
                prompt_tokens=torch.randint(0, 6561, (prompt,), generator=gen) if prompt else None,
                prompt_mel=torch.randn(2 * prompt, 80, generator=gen) if prompt else None,
            )
        )
    return items


@pytest.fixture(scope="module")
def t2w(cosyvoice_dir) -> Token2Wav:
    return Token2Wav(cosyvoice_dir, device="cpu")


@pytest.fixture(scope="module")
def oracle(cosyvoice_dir):
    return upstream.token2wav_models(cosyvoice_dir)


@pytest.mark.slow
def test_flow_batch_matches_upstream_single_items(t2w, oracle):
    up_flow, _ = oracle
    items = make_items()
    batch = t2w.mels(items)
    for item, mel in zip(items, batch, strict=True):
        want = upstream.flow_inference(up_flow, item)
        assert mel.shape == (80, 2 * len(item.tokens)) == want.shape
        assert torch.isfinite(mel).all()
        assert (mel - want).abs().max() <= 1e-4, "batched mel differs from upstream's single-item mel"


def test_flow_item_does_not_depend_on_its_batch(t2w):
    items = make_items()
    batch = t2w.mels(items)
    # The shortest item alone, with one partner, and in the full batch: its tail included.
    alone = t2w.mels([items[3]])[0]
    pair = t2w.mels([items[2], items[3]])[1]
    for other in (pair, batch[3]):
        assert (other - alone).abs().max() <= 1e-4
    # Different items really differ (the comparison above is not vacuous).
    assert (batch[0][:, :6] - alone).abs().max() > 1e-2


@pytest.mark.slow
def test_token2wav_matches_upstream_chain(t2w, oracle):
    up_flow, up_hift = oracle
    items = make_items()
    seeds = [11, 12, 13, 14, 15]
    audio = t2w(items, seeds)
    for item, seed, wav in zip(items, seeds, audio, strict=True):
        assert wav.dtype.name == "float32"
        assert len(wav) == 2 * 480 * len(item.tokens), "2 mel frames per token, 480 samples per frame"
        with torch.inference_mode():
            mel = upstream.flow_inference(up_flow, item)
            torch.manual_seed(seed)
            want, _ = up_hift.inference(speech_feat=mel[None], cache_source=torch.zeros(1, 1, 0))
        want = want[0].numpy()
        assert want.shape == wav.shape
        assert snr_db(want, wav) >= MIN_SNR_DB
        assert abs(wav).max() > 1e-3, "silence would make the comparison vacuous"


def test_same_seed_same_audio_whatever_the_batch(t2w):
    items = make_items()
    seeds = [1, 2, 3, 4, 5]
    full = t2w(items, seeds)
    for i in (2, 3):  # the longest and the shortest
        alone = t2w([items[i]], seeds=[seeds[i]])[0]
        assert len(alone) == len(full[i])
        assert snr_db(alone, full[i]) >= MIN_SNR_DB
    other_seed = t2w([items[3]], seeds=[99])[0]
    assert snr_db(other_seed, full[3]) < 40, "the vocoder's noise must follow the item's seed"


def test_yaml_is_read_as_data_never_executed(tmp_path):
    marker = tmp_path / "executed"
    (tmp_path / "m.yaml").write_text(
        f"boom: !apply:os.system ['touch {marker}']\n"
        "rate: 25\nratio: 2\n"
        "chunk: !ref <rate> * <ratio>\n"
        "thing: !new:os.remove\n    path: /nonexistent\n"
        "alias: !ref <thing>\n"
    )
    data = load_yaml(tmp_path / "m.yaml")
    assert not marker.exists()
    assert "boom" not in data
    assert data["chunk"] == 50
    assert isinstance(data["thing"], Call) and data["thing"].target == "os.remove"
    assert data["alias"] == data["thing"]


def test_yaml_rejects_code_in_references(tmp_path):
    (tmp_path / "m.yaml").write_text("a: 1\nb: !ref __import__('os').getcwd() or <a>\n")
    with pytest.raises(ValueError, match="cannot evaluate"):
        load_yaml(tmp_path / "m.yaml")
    # No arithmetic bombs, and a chain of references resolves each key once.
    (tmp_path / "m.yaml").write_text("x: !ref 9 ** 9 ** 9\n")
    with pytest.raises(ValueError, match="cannot evaluate"):
        load_yaml(tmp_path / "m.yaml")
    (tmp_path / "m.yaml").write_text("k0: 1\n" + "".join(f"k{i}: !ref <k{i - 1}> + <k{i - 1}>\n" for i in range(1, 55)))
    with pytest.raises(ValueError, match="over"):
        load_yaml(tmp_path / "m.yaml")
    (tmp_path / "m.yaml").write_text("k0: 1\n" + "".join(f"k{i}: !ref <k{i - 1}> + <k{i - 1}>\n" for i in range(1, 40)))
    assert load_yaml(tmp_path / "m.yaml")["k39"] == 2**39


def test_model_dir_errors_name_the_problem(cosyvoice_dir, tmp_path):
    with pytest.raises(ModelDirError, match=r"no CosyVoice yaml \(cosyvoice\.yaml, cosyvoice2\.yaml, cosyvoice3"):
        read_config(tmp_path)
    broken = tmp_path / "model"
    broken.mkdir()
    text = (cosyvoice_dir / "cosyvoice2.yaml").read_text()
    (broken / "cosyvoice2.yaml").write_text(text)
    with pytest.raises(ModelDirError, match=r"flow\.pt: missing"):
        load_flow(read_config(broken))
    # Weights of a different size than the yaml says: the keys are named.
    (broken / "cosyvoice2.yaml").write_text(text.replace("num_mid_blocks: 2", "num_mid_blocks: 3"))
    os.symlink(cosyvoice_dir / "flow.pt", broken / "flow.pt")
    with pytest.raises(ModelDirError, match=r"missing: decoder\.estimator\.mid_blocks\.2"):
        load_flow(read_config(broken))
    # A checkpoint that would run code when unpickled is refused, not executed.
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (broken / "flow.pt").unlink()
    (broken / "flow.pt").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ModelDirError, match="cannot be loaded as weights"):
        load_flow(read_config(broken))
    assert not marker.exists()
    # Another model family is refused by name.
    (broken / "cosyvoice2.yaml").write_text(text.replace("CausalMaskedDiffWithXvec", "CausalMaskedDiffWithDiT"))
    with pytest.raises(ModelDirError, match="CausalMaskedDiffWithDiT"):
        read_config(broken)

"""Which CosyVoice a folder holds: a folder that is none, or holds another family's yaml, is refused
saying what was found; --check names the family's missing files and tells v1's variants apart (from
the path as given); a Fun-CosyVoice3 folder with spk2info.pt offers its speakers."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cosybatch.cosyvoice.model import read_config
from cosybatch.cosyvoice.weights import ModelDirError
from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions, check_setup
from cosybatch.errors import UsageError
from cosybatch.plan import Unit


def test_folders_that_are_no_cosyvoice_are_refused_with_what_was_found(cosyvoice_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelDirError, match=r"no CosyVoice yaml .*not a CosyVoice model folder"):
        read_config(empty)

    text = (cosyvoice_dir / "cosyvoice2.yaml").read_text()
    # A CosyVoice3 yaml under CosyVoice2's name: the classes say what it is.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "cosyvoice2.yaml").write_text(
        text.replace("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.CosyVoice3LM")
        .replace("cosyvoice.flow.flow.CausalMaskedDiffWithXvec", "cosyvoice.flow.flow.CausalMaskedDiffWithDiT")
        .replace("cosyvoice.hifigan.generator.HiFTGenerator", "cosyvoice.hifigan.generator.CausalHiFTGenerator"))
    with pytest.raises(ModelDirError) as err:
        read_config(wrong)
    message = str(err.value)
    assert "not a CosyVoice2-0.5B model" in message and "llm builds CosyVoice3LM (expected Qwen2LM)" in message
    assert "Fun-CosyVoice3-0.5B's classes" in message and "cosyvoice3.yaml" in message

    two = tmp_path / "two"
    two.mkdir()
    (two / "cosyvoice2.yaml").write_text(text)
    (two / "cosyvoice3.yaml").write_text(text)
    with pytest.raises(ModelDirError, match=r"holds cosyvoice2\.yaml and cosyvoice3\.yaml"):
        read_config(two)


def test_check_names_the_missing_files_of_the_family(cosyvoice_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(cosyvoice_dir / "cosyvoice2.yaml", partial / "cosyvoice2.yaml")
    with pytest.raises(UsageError, match=r"missing llm\.pt, flow\.pt, .*speech_tokenizer_v2\.onnx.*CosyVoice2-0\.5B"):
        check_setup(partial, None, None, None)


def test_v1_check_tells_the_variants_apart(cosyvoice_v1_dir, cosyvoice_v1_instruct_dir):
    assert check_setup(cosyvoice_v1_instruct_dir, None, None, None, "Be calm.")["family"] == "CosyVoice-300M-Instruct"
    with pytest.raises(UsageError, match="CosyVoice-300M-SFT folder cannot follow instructions"):
        check_setup(cosyvoice_v1_dir, None, None, None, "Be calm.")
    with pytest.raises(UsageError, match="the ONNX export covers CosyVoice2's flow estimator only, not CosyVoice-300M"):
        check_setup(cosyvoice_v1_dir, None, None, None, flow_backend="onnx")


def test_v3_sft_speakers_when_the_folder_has_them(cosyvoice_v3_dir, cosyvoice_dir, tmp_path):
    """Whether official Fun-CosyVoice3 folders ship spk2info.pt is not known; one that does works."""
    folder = tmp_path / "Fun-CosyVoice3-0.5B-with-speakers"
    folder.mkdir()
    for entry in cosyvoice_v3_dir.iterdir():
        (folder / entry.name).symlink_to(entry)
    shutil.copy(cosyvoice_dir / "spk2info.pt", folder / "spk2info.pt")
    engine = open_engine("cosyvoice", "alice", EngineOptions(device="cpu", engine=CosyVoiceOptions(model=folder)))
    prepared = engine.prepare("Hello there.", "a", None)
    seg = prepared.pieces[0].payload
    assert seg.voice.key == "spk:alice" and not seg.lm_speech
    assert seg.prompt_text_tokens == tuple(engine.tokenizer.encode("You are a helpful assistant.<|endofprompt|>"))
    units = [Unit(0, 0, prepared.pieces[0].cost, "", seg)]
    audio = engine.synthesize(units).audio[0]
    assert audio.size > 0 and audio.size % 960 == 0 and np.isfinite(audio).all()


def test_variant_reads_the_path_as_given(tmp_path):
    from cosybatch.cosyvoice.family import V1, variant

    snapshot = tmp_path / "models--FunAudioLLM--CosyVoice-300M-Instruct" / "snapshots" / "4f1c2a"
    snapshot.mkdir(parents=True)
    assert variant(snapshot, V1) == "CosyVoice-300M-Instruct"  # a Hugging Face snapshot folder
    plain = tmp_path / "weights"
    plain.mkdir()
    link = tmp_path / "CosyVoice-300M-SFT"
    link.symlink_to(plain)
    assert variant(link, V1) == "CosyVoice-300M-SFT" and variant(plain, V1) == "CosyVoice-300M"

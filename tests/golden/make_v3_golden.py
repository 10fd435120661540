"""Record upstream Fun-CosyVoice3's outputs on a tiny v3 folder: the fixtures in ``tests/golden/v3/``.

The tests compare our v3 modules against these files without upstream installed. This script
writes a tiny folder with our writer (:mod:`cosybatch.cosyvoice.tiny.v3`, fixed seed), builds
upstream's own classes from its ``cosyvoice3.yaml`` with hyperpyyaml and loads ``llm.pt``,
``flow.pt`` and ``hift.pt`` into them strictly (as upstream's ``CosyVoice3`` does: that proves the
layout), then records what each stage gives for fixed inputs. ``tests/golden/v3/README.md`` says
what each file holds. One function per stage (``record_*``); add one to record more.

Upstream is FunAudioLLM/CosyVoice at commit ace7c47 (Apache-2.0); no wheel carries its v3 modules,
so it runs from a checkout, in its own venv that sees the project's packages (torch, transformers
4.52, onnx, tokenizers, and ``matcha`` from the cosyvoice2-eu wheel) but adds what upstream needs:

    python3.11 -m venv /work/golden-venv
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /work/golden-venv/lib/python3.11/site-packages/zz_cosybatch_venv.pth
    /work/golden-venv/bin/pip install "hyperpyyaml==1.2.3" "ruamel.yaml<0.19" "omegaconf==2.3.0" \\
        "x-transformers==2.11.24" scipy
    cd /work/main && OMP_NUM_THREADS=1 /work/golden-venv/bin/python tests/golden/make_v3_golden.py \\
        --upstream /work/upstream/CosyVoice

(About a minute on one CPU thread.) Imports upstream needs only for training or audio files
(torchaudio, which has no wheel for torch 2.13; whisper, which imports numba; matcha's utilities,
which import lightning and librosa) are replaced by empty modules first.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import json
import logging
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = HERE / "v3"
SEED = 0  # the tiny folder's seed
sys.path.insert(0, str(REPO))

from cosybatch.cosyvoice.tiny.v3 import folder_digests, write_model_dir  # noqa: E402

SYSTEM = "You are a helpful assistant.<|endofprompt|>"


# ------------------------------------------------------------------------------------------ upstream


def _empty_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:  # pydoc.locate (hyperpyyaml) walks attributes from the top package
        setattr(importlib.import_module(parent), child, module)
    return module


def import_upstream(checkout: Path) -> types.SimpleNamespace:
    """Upstream's modules from ``checkout``, with the import-only dependencies stubbed."""
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "whisper"):
        _empty_module(name)
    _empty_module("whisper.tokenizer", Tokenizer=object)
    _empty_module("matcha.utils")
    _empty_module("matcha.utils.pylogger", get_pylogger=logging.getLogger)

    def mel_spectrogram(*args, **kwargs):  # the yaml names it; nothing here calls it
        raise NotImplementedError("stub")

    _empty_module("matcha.utils.audio", mel_spectrogram=mel_spectrogram)
    sys.path.insert(0, str(checkout))
    import cosyvoice

    if not str(Path(cosyvoice.__file__).resolve()).startswith(str(checkout.resolve())):
        raise RuntimeError(f"imported cosyvoice from {cosyvoice.__file__}, not from {checkout}")
    from cosyvoice.cli.model import CosyVoice3Model
    from cosyvoice.hifigan import generator
    from hyperpyyaml import load_hyperpyyaml

    return types.SimpleNamespace(load_hyperpyyaml=load_hyperpyyaml, CosyVoice3Model=CosyVoice3Model,
                                 generator=generator)


def build_upstream(u: types.SimpleNamespace, folder: Path) -> tuple[object, dict, dict]:
    """(CosyVoice3Model holding the folder's weights, the yaml's objects, what was seen while
    building). Built as upstream's ``CosyVoice3.__init__`` does: one ``load_hyperpyyaml`` call
    (llm, flow, hift in file order, nothing between them), then ``CosyVoice3Model.load``
    (strict ``load_state_dict`` of each file, ``weights_only=True``)."""
    seen: dict = {}
    original = u.generator.SineGen2.__init__

    def spy(self, *args, **kwargs):
        # The global generator's state right before SineGen2 draws its tables.
        seen["rng_state_before_sinegen"] = torch.get_rng_state().clone()
        original(self, *args, **kwargs)

    u.generator.SineGen2.__init__ = spy
    try:
        with open(folder / "cosyvoice3.yaml") as f:
            configs = u.load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(folder / "CosyVoice-BlankEN")})
    finally:
        u.generator.SineGen2.__init__ = original
    model = u.CosyVoice3Model(configs["llm"], configs["flow"], configs["hift"], fp16=False)
    model.load(str(folder / "llm.pt"), str(folder / "flow.pt"), str(folder / "hift.pt"))
    return model, configs, seen


# ------------------------------------------------------------------------------------------ stages


def record_folder(folder: Path) -> dict:
    """Digests of every file of the tiny folder (tiny_v3.folder_digests)."""
    return {"seed": SEED, "files": folder_digests(folder)}


def record_tokenizer(configs: dict) -> dict:
    """Upstream CosyVoice3Tokenizer's ids for a few strings (the LM cases use these ids)."""
    tok = configs["get_tokenizer"]()
    strings = [SYSTEM, "Hello there [breath] world.", "<|endofprompt|>", "[laughter]<|endofsystem|>[AA1][zh]"]
    return {s: tok.encode(s, allowed_special=configs["allowed_special"]) for s in strings}


LM_CASES = [
    # (name, prompt text, text, prompt speech length); mixed lengths, with and without prompt speech.
    ("system_only", SYSTEM, "Hello world.", 0),
    ("zero_shot", SYSTEM + "This is the prompt.", "The quick brown fox jumps over the lazy dog.", 12),
    ("in_text", "", "<|endofprompt|>Short one.", 0),
    ("long", SYSTEM, "On 14 March 2023, at 06:15, the 3rd train to Leeds left platform 9 with 412 passengers.", 5),
    ("tiny_text", SYSTEM + "Prompt words here.", "Hi.", 30),
]


def record_lm(model, configs: dict) -> list[dict]:
    """Greedy tokens of upstream's ``CosyVoice3LM.inference`` (its own loop, one utterance at a
    time), with the sampler replaced by argmax; also what ``llm_job`` passes on."""
    tok = configs["get_tokenizer"]()
    llm = model.llm
    llm.sampling = lambda scores, decoded, k: int(scores.argmax().item())
    rng = np.random.default_rng(1234)
    cases = []
    for name, prompt_text, text, n_speech in LM_CASES:
        p_ids = tok.encode(prompt_text, allowed_special="all") if prompt_text else []
        t_ids = tok.encode(text, allowed_special="all")
        speech = rng.integers(0, 6561, n_speech).tolist()
        tokens = list(llm.inference(
            text=torch.tensor([t_ids], dtype=torch.int32), text_len=torch.tensor([len(t_ids)], dtype=torch.int32),
            prompt_text=torch.tensor([p_ids], dtype=torch.int32).reshape(1, -1),
            prompt_text_len=torch.tensor([len(p_ids)], dtype=torch.int32),
            prompt_speech_token=torch.tensor([speech], dtype=torch.int32).reshape(1, -1),
            prompt_speech_token_len=torch.tensor([n_speech], dtype=torch.int32),
            embedding=torch.zeros(0, 192),
        ))
        stop = _stop_token(llm, p_ids, t_ids, speech, tokens)
        cases.append({"name": name, "prompt_text": p_ids, "text": t_ids, "prompt_speech": speech,
                      "min_len": int(len(t_ids) * 2), "max_len": int(len(t_ids) * 20),
                      "tokens": [int(t) for t in tokens], "stop_token": stop,
                      "finished": _llm_job(model, tokens)})
    return cases


def _stop_token(llm, p_ids, t_ids, speech, tokens) -> int | None:
    """The id upstream's loop stopped on (None: it ran to max_len), by one more full forward."""
    if len(tokens) >= len(t_ids) * 20:
        return None
    sos, task = llm.speech_embedding.weight[llm.sos], llm.speech_embedding.weight[llm.task_id]
    text = llm.llm.model.model.embed_tokens(torch.tensor(p_ids + t_ids, dtype=torch.long))
    speech_emb = llm.speech_embedding(torch.tensor(speech + tokens, dtype=torch.long))
    seq = torch.cat([sos[None], text, task[None], speech_emb])
    with torch.inference_mode():
        hidden = llm.llm.model(inputs_embeds=seq[None], output_hidden_states=True).hidden_states[-1]
        logp = llm.llm_decoder(hidden[0, -1]).log_softmax(-1)
        if len(tokens) < int(len(t_ids) * 2):
            logp[llm.speech_token_size] = -float("inf")
        return int(logp.argmax())


def _llm_job(model, tokens: list[int], uuid: str = "golden") -> list[int]:
    """``CosyVoice3Model.llm_job`` over a fixed token stream (its LM replaced by one that yields
    ``tokens``): the silence filter exactly as upstream applies it."""
    real = model.llm

    class Replay:
        def inference(self, **kwargs):
            yield from tokens

    model.llm = Replay()
    model.tts_speech_token_dict[uuid] = []
    try:
        empty = torch.zeros(1, 0, dtype=torch.int32)
        model.llm_job(empty, empty, empty, torch.zeros(0, 192), uuid)
        return [int(t) for t in model.tts_speech_token_dict.pop(uuid)]
    finally:
        model.llm = real
        model.llm_end_dict.pop(uuid, None)


def record_silence_filter(model) -> list[dict]:
    """``llm_job``'s output for token streams that exercise its silent-token rule."""
    silent = sorted(model.silent_tokens)
    streams = [
        [5, 1, 1, 1, 1, 1, 1, 1, 7],  # one silent id, 7 in a row
        [1, 2, 28, 29, 55, 248, 494, 2241, 9, 2242, 2322, 2323, 1, 2, 28, 29],  # a mix of silent ids
        [3, 4, 5],  # no silence
        [1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 1],  # runs of exactly 5, then 6
        [],
    ]
    return [{"silent_tokens": silent, "input": s, "output": _llm_job(model, s)} for s in streams]


FLOW_CASES = [(20, 0), (28, 6)]  # (tokens, prompt tokens)


def record_flow_hift(model, seen: dict) -> dict[str, torch.Tensor]:
    """The flow's mel and the HiFT's waveform (tests/golden/v3/REQUESTS.md, from the flow/HiFT
    helper), plus the HiFT's random tables as drawn at construction."""
    g = torch.Generator().manual_seed(4321)
    out: dict[str, torch.Tensor] = {}
    for k, (t, p) in enumerate(FLOW_CASES):
        token = torch.randint(0, 6561, (1, t), generator=g, dtype=torch.int32)
        prompt_token = torch.randint(0, 6561, (1, p), generator=g, dtype=torch.int32)
        prompt_feat = torch.randn(1, 2 * p, 80, generator=g) * 2 - 5
        embedding = torch.randn(1, 192, generator=g)
        mel, _ = model.flow.inference(
            token=token, token_len=torch.tensor([t], dtype=torch.int32), prompt_token=prompt_token,
            prompt_token_len=torch.tensor([p], dtype=torch.int32), prompt_feat=prompt_feat,
            prompt_feat_len=torch.tensor([2 * p], dtype=torch.int32), embedding=embedding,
            streaming=False, finalize=True)
        out |= {f"flow.case{k}.token": token, f"flow.case{k}.prompt_token": prompt_token,
                f"flow.case{k}.prompt_feat": prompt_feat, f"flow.case{k}.embedding": embedding,
                f"flow.case{k}.mel": mel.clone()}
    source = model.hift.m_source
    out["hift.rand_ini"] = source.l_sin_gen.rand_ini.clone()
    out["hift.sine_waves_head"] = source.l_sin_gen.sine_waves[:, :4096].clone()
    out["hift.uv_head"] = source.uv[:, :4096].clone()
    out["hift.rng_state_before_sinegen"] = seen["rng_state_before_sinegen"]
    for k in range(len(FLOW_CASES)):
        mel = out[f"flow.case{k}.mel"]
        speech, s = model.hift.inference(speech_feat=mel, finalize=True)
        out |= {f"hift.case{k}.mel": mel, f"hift.case{k}.speech": speech.clone(), f"hift.case{k}.source": s.clone()}
    # The CFM's noise table is torch.manual_seed(0); torch.randn(1, 80, 15000): say so if not.
    torch.manual_seed(0)
    if not torch.equal(model.flow.decoder.rand_noise, torch.randn(1, 80, 50 * 300)):
        raise AssertionError("upstream's CFM noise is no longer manual_seed(0) + randn(1, 80, 15000)")
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def record_real_hift_tables(u: types.SimpleNamespace, checkout: Path) -> dict[str, torch.Tensor]:
    """The HiFT's random tables at Fun-CosyVoice3-0.5B's real sizes (no weights needed: they are
    drawn at construction). Built from upstream's recipe yaml (examples/libritts/cosyvoice3), cut
    before its training sections, without the LM (as upstream's own ``__main__`` blocks do) and
    with the DiT and look-ahead layer shrunk: both are built before the CFM reseeds, so their size
    changes no draw after it."""
    text = (checkout / "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml").read_text(encoding="utf-8")
    text = text.split("# gan related module")[0]
    for real, small in (("channels: 1024", "channels: 32"), ("dim: 1024", "dim: 64"), ("depth: 22", "depth: 1"),
                        ("heads: 16", "heads: 2")):
        if real not in text:
            raise AssertionError(f"upstream's recipe yaml changed: no {real!r}")
        text = text.replace(real, small)
    seen: dict = {}
    original = u.generator.SineGen2.__init__

    def spy(self, *args, **kwargs):
        seen["state"] = torch.get_rng_state().clone()
        original(self, *args, **kwargs)

    u.generator.SineGen2.__init__ = spy
    try:
        configs = u.load_hyperpyyaml(text, overrides={"llm": None})
    finally:
        u.generator.SineGen2.__init__ = original
    source = configs["hift"].m_source
    return {"hift_real.rng_state_before_sinegen": seen["state"],
            "hift_real.rand_ini": source.l_sin_gen.rand_ini.clone(),
            "hift_real.sine_waves_head": source.l_sin_gen.sine_waves[:, :1024].clone(),
            "hift_real.uv_head": source.uv[:, :1024].clone()}


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, required=True, help="a FunAudioLLM/CosyVoice checkout")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    u = import_upstream(args.upstream)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_dir(Path(tmp) / "tiny_v3", seed=SEED)
        lm = {"folder": record_folder(folder)}
        model, configs, seen = build_upstream(u, folder)
        lm["tokenizer"] = record_tokenizer(configs)
        lm["lm_cases"] = record_lm(model, configs)
        lm["silence_filter"] = record_silence_filter(model)
        flow_hift = record_flow_hift(model, seen)
    del model, configs
    flow_hift |= record_real_hift_tables(u, args.upstream)
    (args.out / "lm.json").write_text(json.dumps(lm, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    torch.save(flow_hift, args.out / "flow_hift.pt")
    for path in sorted(args.out.iterdir()):
        print(f"{path.stat().st_size:>9}  {hashlib.sha256(path.read_bytes()).hexdigest()[:12]}  {path}")


if __name__ == "__main__":
    main()

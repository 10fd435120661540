"""CosyVoice2 end to end (LM -> flow -> HiFT): cosybatch's batched engine against upstream's
per-utterance path, on the same random weights, in one run, printed as real-time factors and ratios.

Upstream's path is what ``CosyVoice2Model.tts`` does for one utterance (non-streaming): its
``Qwen2LM.inference`` (transformers Qwen2 with a KV cache, repetition-aware sampling in Python),
then ``flow.inference`` and ``hift.inference``. Random weights never emit the stop token, so both
sides have it disabled and generate exactly 20 speech tokens per text token (upstream's maximum),
which fixes the work per item. The text frontend is left out on both sides (same cost).

    python benchmarks/cosyvoice_e2e.py                                  # CPU, tiny weights
    python benchmarks/cosyvoice_e2e.py --size real --device cuda --items 64 --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import upstream  # noqa: E402

from cosybatch.cosyvoice.tiny import write_model_dir  # noqa: E402
from cosybatch.engines import EngineOptions, VoiceRequest, open_engine  # noqa: E402
from cosybatch.engines.cosyvoice import CosyVoiceOptions, Segment  # noqa: E402
from cosybatch.plan import Unit  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def upstream_lm(model_dir: Path, hidden: int, device: str):
    upstream.load()
    from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM
    from cosyvoice.utils.common import ras_sampling

    def sampling(scores, decoded, k):
        return ras_sampling(scores, decoded, k, top_p=0.8, top_k=25, win_size=10, tau_r=0.1)

    lm = Qwen2LM(llm_input_size=hidden, llm_output_size=hidden, speech_token_size=6561, sampling=sampling,
                 llm=Qwen2Encoder(str(model_dir / "CosyVoice-BlankEN")), length_normalized_loss=True,
                 lsm_weight=0, mix_ratio=[5, 15])
    lm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    with torch.no_grad():
        lm.llm_decoder.bias[6561:] = -1e4
    return lm.to(device).eval()


def run_upstream(lm, flow, hift, segments: list[Segment], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for seg in segments:
            text = torch.tensor([seg.text_tokens], dtype=torch.int32, device=device)
            empty = torch.zeros(1, 0, dtype=torch.int32, device=device)
            zero = torch.tensor([0], device=device)
            tokens = list(lm.inference(text=text, text_len=torch.tensor([text.size(1)], device=device),
                                       prompt_text=empty, prompt_text_len=zero, prompt_speech_token=empty,
                                       prompt_speech_token_len=zero, embedding=seg.voice.embedding[None].to(device)))
            mel, _ = flow.inference(
                token=torch.tensor([tokens], device=device), token_len=torch.tensor([len(tokens)], device=device),
                prompt_token=empty, prompt_token_len=torch.tensor([0], device=device),
                prompt_feat=torch.zeros(1, 0, 80, device=device), prompt_feat_len=torch.tensor([0], device=device),
                embedding=seg.voice.embedding[None].to(device), streaming=False, finalize=True)
            hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=device))
    sync(device)
    return time.perf_counter() - start


def run_ours(engine, segments: list[Segment], batch: int) -> float:
    order = sorted(range(len(segments)), key=lambda i: len(segments[i].text_tokens))
    sync(engine.device)
    start = time.perf_counter()
    for s in range(0, len(order), batch):
        chunk = [segments[i] for i in order[s : s + batch]]
        engine.synthesize([Unit(k, 0, 1, "", seg) for k, seg in enumerate(chunk)])
    sync(engine.device)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--items", type=int, default=None, help="utterances (default 8 on CPU, 64 on GPU)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8 on CPU, 1,8,32 on GPU)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    n_items = args.items or (64 if cuda else 8)
    sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if cuda else "1,8")).split(",")]
    if not cuda:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", size=args.size)
        engine = open_engine("cosyvoice", None, EngineOptions(device=args.device, threads=1, engine=CosyVoiceOptions(
            model=model_dir, speaker="alice")))
        with torch.no_grad():
            engine.lm.llm_decoder.bias[6561:] = -1e4  # fixed work: no stop token, 20 tokens per text token
        up_lm = upstream_lm(model_dir, engine.lm.config.hidden_size, args.device)
        up_flow, up_hift = upstream.token2wav_models(model_dir, args.device)
        gen = torch.Generator().manual_seed(0)
        voice = engine._voice(VoiceRequest("alice", None, None, True))
        # 4 to 10 text tokens -> 80 to 200 speech tokens -> 3.2 to 8 s of audio per item.
        segments = [Segment(tuple(torch.randint(0, 900, (int(torch.randint(4, 11, (1,), generator=gen)),),
                                                generator=gen).tolist()), voice, (), i) for i in range(n_items)]
        audio_s = sum(20 * len(s.text_tokens) * 2 * 480 for s in segments) / 24000
        run_ours(engine, segments[:2], 2)  # warm-up
        run_upstream(up_lm, up_flow, up_hift, segments[:1], args.device)
        times: dict[str, list[float]] = {"upstream per utterance": []} | {f"cosybatch batch {b}": [] for b in sizes}
        for _ in range(args.rounds):
            times["upstream per utterance"].append(run_upstream(up_lm, up_flow, up_hift, segments, args.device))
            for b in sizes:
                times[f"cosybatch batch {b}"].append(run_ours(engine, segments, b))
    base = statistics.median(times["upstream per utterance"])
    print(f"{n_items} items, {audio_s:.1f} s of audio, {args.size} weights, {args.device}, "
          f"threads={torch.get_num_threads()}")
    print(f"{'path':<26} {'RTF':>8} {'speed-up':>9}")
    for name, values in times.items():
        wall = statistics.median(values)
        print(f"{name:<26} {wall / audio_s:>8.4f} {base / wall:>8.2f}x")


if __name__ == "__main__":
    main()

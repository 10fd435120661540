"""CosyVoice2 token -> waveform throughput: our batched flow + HiFT against upstream's per-item loop.

Both run the same random weights (real CosyVoice2-0.5B sizes by default) on the same items of mixed
lengths, in one process, alternating, and print audio-seconds per wall-second and the ratio of each
of our batch sizes to upstream's one-utterance-at-a-time path (``CosyVoice2Model.token2wav``:
``flow.inference`` then ``hift.inference`` per item). Upstream's module code comes from PyPI:
``pip install --no-deps cosyvoice2-eu==0.2.8`` (see tests/upstream.py).

    python benchmarks/token2wav.py                         # CPU: 8 items, batch 1 and 8, one torch thread
    python benchmarks/token2wav.py --device cuda --items 64 --batch-sizes 1,8,32
    python benchmarks/token2wav.py --size tiny             # quick smoke run

The paths take turns within every round (the order rotating); the table gives medians over rounds.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Report, alternate, cli, parse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import upstream  # noqa: E402

from cosybatch.cosyvoice.flow.cfm import FlowInput  # noqa: E402
from cosybatch.cosyvoice.pipeline import Token2Wav  # noqa: E402
from cosybatch.cosyvoice.tiny import write_model_dir  # noqa: E402


def make_items(n: int, seed: int) -> list[FlowInput]:
    """Mixed lengths, 1 to 6 s of speech (25 to 150 tokens), a third with a 3 s prompt."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        tokens = int(torch.randint(25, 151, (1,), generator=gen))
        prompt = 75 if i % 3 == 0 else 0
        items.append(
            FlowInput(
                tokens=torch.randint(0, 6561, (tokens,), generator=gen),
                embedding=torch.randn(192, generator=gen),
                prompt_tokens=torch.randint(0, 6561, (prompt,), generator=gen) if prompt else None,
                prompt_mel=torch.randn(2 * prompt, 80, generator=gen) if prompt else None,
            )
        )
    return items


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_upstream(flow, hift, items: list[FlowInput], device: torch.device) -> float:
    """Seconds for upstream's per-item path over all items."""
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for item in items:
            mel = upstream.flow_inference(flow, item, device)
            hift.inference(speech_feat=mel[None], cache_source=torch.zeros(1, 1, 0, device=device))
    sync(device)
    return time.perf_counter() - start


def run_ours(t2w: Token2Wav, items: list[FlowInput], batch: int) -> float:
    # Sorted by length, as cosybatch's planner buckets them, then cut into batches.
    order = sorted(range(len(items)), key=lambda i: len(items[i].tokens))
    sync(t2w.device)
    start = time.perf_counter()
    for s in range(0, len(order), batch):
        chunk = [items[i] for i in order[s : s + batch]]
        t2w(chunk, seeds=list(range(len(chunk))))
    sync(t2w.device)
    return time.perf_counter() - start


def main() -> None:
    ap = cli(__doc__, rounds=1, device="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=("tiny", "real"), default="real", help="random weights of this size")
    ap.add_argument("--items", type=int, default=None, help="utterances per round (default 8 on CPU, 64 on GPU)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8 on CPU, 1,8,32 on GPU)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="our path's precision")
    args = parse(ap)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    n_items = args.items or (64 if device.type == "cuda" else 8)
    sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if device.type == "cuda" else "1,8")).split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", size=args.size, llm=False)
        t2w = Token2Wav(model_dir, device=device, precision=args.precision)
        up_flow, up_hift = upstream.token2wav_models(model_dir, device)
        items = make_items(n_items, seed=1)
        audio_s = sum(2 * len(it.tokens) * t2w.samples_per_frame for it in items) / t2w.sample_rate
        # Warm-up (kernels, allocator) on two items, excluded from the timings.
        run_ours(t2w, items[:2], 2)
        run_upstream(up_flow, up_hift, items[:1], device)

        def rate(seconds: float) -> dict:
            return {"seconds": seconds, "audio_s_per_s": audio_s / seconds}

        paths = {"upstream per item": lambda rnd: rate(run_upstream(up_flow, up_hift, items, device))}
        for b in sizes:
            paths[f"cosybatch batch {b}"] = lambda rnd, b=b: rate(run_ours(t2w, items, b))
        runs = alternate(paths, args.rounds, baseline="upstream per item")
    result = {"benchmark": "token2wav", "items": n_items, "audio_s": round(audio_s, 2), "size": args.size,
              "device": str(device), "precision": args.precision, "threads": torch.get_num_threads(),
              **runs.as_dict()}

    def show() -> None:
        print(f"{n_items} items, {audio_s:.1f} s of audio, {args.size} weights, {device}, {args.precision}, "
              f"threads={torch.get_num_threads()}")
        runs.table([("audio-s/s", "audio_s_per_s", ".2f"), ("min..max", "audio_s_per_s", ".2f", "range"),
                    ("vs upstream", "audio_s_per_s", ".2f", "ratio")], first="path")

    Report(args.json, "token2wav").emit(result, show)


if __name__ == "__main__":
    main()

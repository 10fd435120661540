"""CosyVoice2 end to end (LM -> flow -> HiFT) on the same random weights, side by side in one run:
cosybatch's engine at its defaults, cosybatch as of an earlier commit (``--baseline``, by default
the last commit before the slot pool, whose CPU default ran one segment per batch), and upstream's
per-utterance loop (``CosyVoice2Model.tts``, non-streaming: ``Qwen2LM.inference``, then
``flow.inference`` and ``hift.inference``).

Each path runs in its own process (the baseline's from ``git archive`` of that commit), loads the
model untimed, then synthesises the same segments; with ``--rounds N`` the paths alternate, so a
busy machine slows them alike. Random weights never emit the stop token, so it is kept off on
every path and each segment makes 20 speech tokens per text token; segments have 3 to 15 text
tokens (2.4 to 12 s of audio). The text frontend is left out everywhere (same cost).

    python benchmarks/cosyvoice_e2e.py --size real --items 24            # CPU, the issue's setup
    python benchmarks/cosyvoice_e2e.py --size tiny --items 8             # a quick look
    python benchmarks/cosyvoice_e2e.py --device cuda --size real --items 256 --paths ours,upstream
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import ROOT, Report, alternate, cli, parse, table

# A plain checkout (the GPU machine has cosybatch installed nowhere): this tree's package first, or
# the baseline's tree for the baseline path's child (main() names it in COSYBATCH_E2E_TREE).
sys.path.insert(0, os.environ.get("COSYBATCH_E2E_TREE") or str(ROOT))
BASELINE = "5acef70"  # the last commit before the slot pool


def segments_spec(n: int, longest: int = 15) -> list[list[int]]:
    """n segments of 3 to ``longest`` random text token ids (seeded: the same every run)."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(900) for _ in range(rng.randint(3, longest))] for _ in range(n)]


def _counts(engine) -> dict:
    """The LM pool's counters summed over the engine's calls so far ({} on a cosybatch without them)."""
    totals = getattr(getattr(engine, "pipeline", None), "totals", None)
    return dict(totals.as_dict()) if totals is not None and hasattr(totals, "as_dict") else {}


def _capture_ahead(engine, texts: list) -> int:
    """Capture the LM's CUDA graphs for every decode shape these segments can reach, so that the
    timed part replays only (warm-up, outside the timing). Returns the graphs captured."""
    pool = getattr(engine.lm, "_pool", None)
    if pool is None or not getattr(pool, "use_graphs", False) or not hasattr(pool, "capture_ahead"):
        return 0
    # A segment's positions: its prompt (text, control ids) and 20 speech tokens per text token.
    longest = max(21 * len(t) for t in texts) + 16
    keys = [k for k in pool.graph_keys() if k[1] - 256 < longest]
    return pool.capture_ahead(keys).graphs


def worker(args) -> None:
    """Load one path's model, then time it on the segments; print one JSON line."""
    try:
        from cosybatch.gpu import configure_allocator  # the production allocator, before torch loads
    except ImportError:  # the baseline path, before cosybatch.gpu existed
        configure_note = "cosybatch.gpu missing: torch's default allocator"
    else:
        configure_note = configure_allocator()
    import contextlib

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import cosybatch
    from cosybatch.cosyvoice.pipeline import Segment
    from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
    from cosybatch.engines.cosyvoice import CosyVoiceOptions
    from cosybatch.plan import Unit

    device = args.device
    if device == "cpu":
        torch.set_num_threads(1)
    texts = json.loads(args.segments)
    extra = {}  # options the baseline may not know are passed only when set
    if args.lm_slots:
        extra["lm_slots"] = args.lm_slots
    if args.no_cuda_graphs:
        extra["cuda_graphs"] = False
    if args.flow_backend != "torch":
        extra["flow_backend"] = args.flow_backend
    allocator = torch.cuda.get_allocator_backend() if device == "cuda" else None
    engine = open_engine("cosyvoice", None, EngineOptions(device=device, threads=1, engine=CosyVoiceOptions(
        model=Path(args.model), speaker="alice", precision=args.precision, **extra)))
    with torch.no_grad():
        engine.lm.llm_decoder.bias[6561:] = -1e4
    voice = engine._voice(VoiceRequest("alice", None, None, True))
    segments = [Segment(tuple(t), voice, (), i) for i, t in enumerate(texts)]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def stage_sync():
        # Per-stage timing syncs the whole device, which would serialise two workers' stages: with
        # more than one worker only the wall time (and the LM's token count) is measured.
        if args.workers == 1:
            sync()

    lm = {"seconds": 0.0, "tokens": 0, "slot_steps": 0, "live_slot_steps": 0}
    stage_s = {"flow": 0.0, "hift": 0.0}
    # The engine calls decode() where it has one (the slot pool), else generate().
    lm_method = "decode" if hasattr(engine.lm, "decode") else "generate"
    original = getattr(engine.lm, lm_method)

    if args.lm_attention == "math":  # the LM's attention forced onto the math kernel (the "unfused" figure)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attention():
            return sdpa_kernel([SDPBackend.MATH])
    else:
        attention = contextlib.nullcontext

    def timed_lm(*a, **k):
        stage_sync()
        t = time.perf_counter()
        with attention():
            out = original(*a, **k)
        stage_sync()
        lm["seconds"] += time.perf_counter() - t
        tokens, stats = out if lm_method == "decode" else (out, getattr(engine.lm, "last_stats", None))
        lm["tokens"] += sum(len(x) for x in tokens)
        if stats is not None:
            lm["slot_steps"] += stats.slot_steps
            lm["live_slot_steps"] += stats.live_slot_steps
        return out

    def timed(stage, fn):
        def wrapper(*a, **k):
            stage_sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            stage_sync()
            stage_s[stage] += time.perf_counter() - t
            return out
        return wrapper

    if args.worker == "upstream":
        run = upstream_runner(engine, Path(args.model), device)
    else:
        size = engine.batch_defaults()[0]
        # As the planner would: segments sorted by cost, cut into batches of the engine's default size.
        order = sorted(range(len(segments)), key=lambda i: -len(segments[i].text_tokens))

        def run(segs):
            ordered = [segs[i] for i in order if i < len(segs)]
            # Two workers (as `cosybatch run --workers 2` on a GPU) share the engine: smaller batches,
            # so that one's flow and vocoder can overlap the other's decoding.
            step = size if args.workers == 1 else max(1, -(-len(ordered) // (2 * args.workers)))
            chunks = [ordered[s : s + step] for s in range(0, len(ordered), step)]

            def one(chunk):
                engine.synthesize([Unit(k, 0, 1, "", seg) for k, seg in enumerate(chunk)])

            if args.workers == 1:
                for chunk in chunks:
                    one(chunk)
            else:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(args.workers) as pool:
                    list(pool.map(one, chunks))

    setattr(engine.lm, lm_method, timed_lm)
    run(segments[:2])  # warm-up
    graphs_ahead = 0
    if args.worker == "ours":
        with attention():
            graphs_ahead = _capture_ahead(engine, texts)
    sync()
    lm.update(seconds=0.0, tokens=0, slot_steps=0, live_slot_steps=0)
    counts_before = _counts(engine)
    engine.t2w.mels = timed("flow", engine.t2w.mels)
    engine.t2w.vocode = timed("hift", engine.t2w.vocode)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    run(segments)
    sync()
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    # The driver's count (CUDA graph memory included, which torch's counters may miss) with the run's
    # memory still held: the pool, the KV cache and the graphs.
    used = (lambda f, t: int(t - f))(*torch.cuda.mem_get_info()) if device == "cuda" else None
    live = lm["live_slot_steps"] / lm["slot_steps"] if lm["slot_steps"] else None
    after = _counts(engine)
    counts = {k: after[k] - counts_before.get(k, 0) for k in ("steps", "graphs", "graph_replays", "eager_steps",
                                                             "capture_failures", "host_syncs") if k in after}
    pool_info = getattr(engine, "pool_info", None) or {}
    print(json.dumps({"path": args.worker, "wall": wall, "cosybatch": str(Path(cosybatch.__file__).parent),
                      "lm_seconds": lm["seconds"], "lm_tokens": lm["tokens"], "live_fraction": live,
                      "flow_seconds": stage_s["flow"], "hift_seconds": stage_s["hift"],
                      "peak_bytes": peak, "device_used_bytes": used, "allocator": allocator,
                      "configure_note": configure_note, "workers": args.workers,
                      "graphs_captured_in_warm_up": graphs_ahead,
                      "timed_lm_pool": counts, "graph_room_bytes": pool_info.get("graph_room_bytes"),
                      "stage_streams": getattr(getattr(engine, "pipeline", None), "streams", None) is not None
                      and engine.pipeline.streams.enabled}))


def upstream_runner(engine, model_dir: Path, device: str):
    import torch
    import upstream

    upstream.load()
    from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM
    from cosyvoice.utils.common import ras_sampling

    def sampling(scores, decoded, k):
        return ras_sampling(scores, decoded, k, top_p=0.8, top_k=25, win_size=10, tau_r=0.1)

    hidden = engine.lm.config.hidden_size
    lm = Qwen2LM(llm_input_size=hidden, llm_output_size=hidden, speech_token_size=6561, sampling=sampling,
                 llm=Qwen2Encoder(str(model_dir / "CosyVoice-BlankEN")), length_normalized_loss=True,
                 lsm_weight=0, mix_ratio=[5, 15])
    lm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    with torch.no_grad():
        lm.llm_decoder.bias[6561:] = -1e4
    lm = lm.to(device).eval()
    flow, hift = upstream.token2wav_models(model_dir, device)

    def run(segs):
        with torch.inference_mode():
            for seg in segs:
                text = torch.tensor([seg.text_tokens], dtype=torch.int32, device=device)
                empty = torch.zeros(1, 0, dtype=torch.int32, device=device)
                zero = torch.tensor([0], device=device)
                embedding = seg.voice.embedding[None].to(device)
                tokens = list(lm.inference(text=text, text_len=torch.tensor([text.size(1)], device=device),
                                           prompt_text=empty, prompt_text_len=zero, prompt_speech_token=empty,
                                           prompt_speech_token_len=zero, embedding=embedding))
                mel, _ = flow.inference(
                    token=torch.tensor([tokens], device=device), token_len=torch.tensor([len(tokens)], device=device),
                    prompt_token=empty, prompt_token_len=zero, prompt_feat=torch.zeros(1, 0, 80, device=device),
                    prompt_feat_len=zero, embedding=embedding, streaming=False, finalize=True)
                hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=device))

    return run


def baseline_tree(ref: str, into: Path) -> Path:
    """The package as of ``ref``, unpacked from git (the working tree is not touched)."""
    archive = into / "baseline.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref, "cosybatch"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "baseline", filter="data")
    return into / "baseline"


def main() -> None:
    ap = cli(__doc__, rounds=1, device="cpu")
    ap.add_argument("--size", choices=("tiny", "real"), default="real", help="random weights of this size")
    ap.add_argument("--items", type=int, default=24, help="segments per round")
    ap.add_argument("--paths", default="ours,baseline,upstream", help="comma-separated paths to time")
    ap.add_argument("--baseline", default=BASELINE, help="git commit of the baseline path")
    ap.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16")
    ap.add_argument("--lm-slots", type=int, default=None, help="decode slots (default: the engine's)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="ours: the LM decodes eagerly")
    ap.add_argument("--flow-backend", default="torch", help="ours: torch, onnx or tensorrt (the engine option)")
    ap.add_argument("--workers", type=int, default=1, help="ours: threads sharing the engine (as run --workers)")
    ap.add_argument("--lm-attention", choices=("default", "math"), default="default",
                    help="ours: math forces the LM's attention onto SDPA's math kernel (for comparison)")
    ap.add_argument("--worker", choices=("ours", "baseline", "upstream"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--segments", help=argparse.SUPPRESS)
    args = parse(ap)
    if args.worker:
        worker(args)
        return

    from cosybatch.cosyvoice.tiny import write_model_dir

    texts = segments_spec(args.items)
    audio_s = sum(20 * len(t) * 2 * 480 for t in texts) / 24000
    paths = args.paths.split(",")
    stages: dict[str, list[dict]] = {}  # seconds in each stage, per round (not for upstream)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "model", size=args.size)
        old = baseline_tree(args.baseline, Path(tmp)) if "baseline" in paths else None

        def path_run(path: str):
            def once(rnd: int) -> dict:
                env = dict(os.environ)
                if path == "baseline":
                    env["PYTHONPATH"] = str(old) + os.pathsep + env.get("PYTHONPATH", "")
                    env["COSYBATCH_E2E_TREE"] = str(old)
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", path, "--model", str(model), "--device", args.device,
                     "--precision", args.precision, "--segments", json.dumps(texts),
                     *(["--lm-slots", str(args.lm_slots)] if args.lm_slots and path == "ours" else []),
                     *(["--no-cuda-graphs"] if args.no_cuda_graphs and path == "ours" else []),
                     *(["--flow-backend", args.flow_backend] if args.flow_backend != "torch" and path == "ours"
                       else [])],
                    capture_output=True, text=True, env=env, check=False)
                if proc.returncode != 0:
                    raise SystemExit(f"{path} failed:\n{proc.stderr[-3000:]}")
                line = json.loads(proc.stdout.strip().splitlines()[-1])
                expected = old if path == "baseline" else ROOT
                if not line["cosybatch"].startswith(str(expected)):
                    raise SystemExit(f"{path} imported cosybatch from {line['cosybatch']}, not {expected}")
                stages.setdefault(path, []).append({k: round(line[k], 1) for k in ("lm_seconds", "flow_seconds",
                                                                                  "hift_seconds")})
                return {"wall_s": line["wall"]}
            return once

        runs = alternate({p: path_run(p) for p in paths}, args.rounds, baseline="ours" if "ours" in paths else None)
    walls = {p: runs.median(p, "wall_s") for p in paths}
    result = {"size": args.size, "device": args.device, "items": args.items, "audio_s": round(audio_s, 1),
              "precision": args.precision, "flow_backend": args.flow_backend, "baseline": args.baseline,
              "rounds": args.rounds,
              "paths": {p: {"wall_s": round(w, 2), "audio_s_per_s": round(audio_s / w, 3), "rtf": round(w / audio_s, 4),
                            "wall_range_s": [round(min(runs.values(p, "wall_s")), 2),
                                             round(max(runs.values(p, "wall_s")), 2)],
                            "stages_per_round": stages.get(p) if p != "upstream" else None}
                        for p, w in walls.items()}}
    if "ours" in walls:
        result["ours_vs"] = {p: round(runs.ratio(p, "wall_s"), 2) for p in paths if p != "ours"}

    def show() -> None:
        print(f"{args.items} segments, {audio_s:.1f} s of audio, {args.size} weights, {args.device}, {args.precision}")
        table(["path", "wall s", "min..max", "audio-s/s", "RTF"],
              [[p, f"{w:.1f}", runs.cell(p, "wall_s", ".1f", "range"), f"{audio_s / w:.3f}", f"{w / audio_s:.4f}"]
               for p, w in walls.items()])
        for p, ratio in result.get("ours_vs", {}).items():
            print(f"ours is {ratio}x {p}")

    Report(args.json, "cosyvoice_e2e").emit(result, show)


if __name__ == "__main__":
    main()

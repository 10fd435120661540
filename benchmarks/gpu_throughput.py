"""CosyVoice2 throughput on one GPU at real size (random weights): one prepared run for a lent GPU.

Runs from a plain checkout (cosybatch need not be installed) on the GPU image: torch, numpy,
onnxruntime (CPU build), transformers; no soundfile, no faster-whisper. Every child process calls
cosybatch's ``configure_allocator`` before torch loads (cudaMallocAsync, as ``cosybatch run``),
unless its row asks for the native allocator. The rows of the plan, in order:

  graphs        first, a correctness check: greedy LM tokens with CUDA graphs equal the eager ones
                (12 mixed-length rows through 4 slots: steps replayed, rows admitted mid-run, the
                pool shrinking), in bf16 and fp32; graphs captured and replayed, eager steps, the
                driver's bytes for the graphs; and the LM's decode under
                ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``: whether a fused kernel
                takes its attention (it raises if none does) and gives the same tokens
  ours          cosybatch on --items segments per configuration (precision, decode slots, CUDA
                graphs, allocator, the LM's attention kernel, flow backend, two workers sharing
                the engine as ``run --workers 2``: stage streams and the capture gate; wall time
                only, as per-stage timing would serialise them): end-to-end RTF, LM
                tokens/s, live slot fraction, the timed part's graph replays / eager steps /
                captures (warm-up captures every graph the segments reach, untimed), peak memory
  upstream      upstream's per-utterance loop on --upstream-items segments (skipped, with the
                reason, where its packages are missing, as on the GPU image)
  asr           Whisper tiny.en-sized on the GPU, transformers' WhisperForConditionalGeneration
                with RANDOM weights (the cost shape only), two ways per batch size, seconds per
                audio second: "batches", free decoding (log-mel of 30 s windows, greedy decode of
                3 tokens per audio second: the transcription `--qc asr` falls back to) and
                "scoring", what `--qc asr` does for every clip now (the encoder at the clip's own
                length, the text teacher-forced in one pass against the audio and a silent window)

The plan runs in order until the deadline (--budget seconds, model writing included); rows not
reached, or not possible here, are listed under "skipped" with the reason. Segments are drawn as in
cosyvoice_e2e.py (3 to 15 text tokens, 20 speech tokens per text token, the stop token kept off).
The JSON (--json: a file, or a folder to write gpu_throughput.json in) is rewritten after every row.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_throughput.py --json $OUT/gpu.json   # an H200: <= 8 min
    python benchmarks/gpu_throughput.py --dry-run --json /tmp/gpu                   # CPU, tiny: the paths

The last stdout line is every figure as one JSON object (errors cut short; the file has more).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# A plain checkout: this tree's cosybatch (the GPU machine has it installed nowhere).
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(HERE))

from common import Report, cli, parse  # noqa: E402  (the standard library only)
from cosyvoice_e2e import segments_spec  # noqa: E402

from cosybatch.gpu import ENV, configure_allocator  # noqa: E402  (never imports torch)


def ours(precision: str = "bf16", slots: int = 64, graphs: bool = True, **more) -> dict:
    return {"kind": "ours", "precision": precision, "slots": slots, "cuda_graphs": graphs, **more}


# Most telling first: production defaults, then what each change buys.
PLAN = [
    ours(),
    {"kind": "upstream"},
    ours(workers=2),
    ours(allocator="native"),
    ours(graphs=False),
    ours(lm_attention="math"),
    {"kind": "asr"},
    ours("fp32"),
    ours(slots=128),
    ours(slots=32),
    ours("fp32", graphs=False),
    ours(flow_backend="tensorrt"),
]
DRY_PLAN = [
    ours("fp32", 4),
    {"kind": "upstream"},
    ours("fp32", 4, workers=2),
    ours("fp32", 2, False),
    {"kind": "asr"},
    ours("fp32", 4, allocator="native"),
    ours("fp32", 4, flow_backend="tensorrt"),
]
ROW_MIN_S = {"cuda": 45.0, "cpu": 5.0}  # a row is not started with less than this left


def row_name(row: dict) -> str:
    if row["kind"] != "ours":
        return row["kind"]
    parts = [row["precision"], f"{row['slots']} slots", "graphs" if row["cuda_graphs"] else "eager"]
    parts += [f"{k}={row[k]}" for k in ("allocator", "lm_attention", "flow_backend", "workers") if k in row]
    return "ours " + " ".join(parts)


# -- child processes ------------------------------------------------------------------------------
def graph_check(model: Path, device: str) -> dict:
    """Greedy tokens with and without CUDA graphs, per precision, and the fused-attention check."""
    note = configure_allocator()
    import random

    import torch

    from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling
    from cosybatch.cosyvoice.lm.v2 import load_llm

    if device == "cpu":
        torch.set_num_threads(1)  # a dry run beside other work: more threads than free cores crawl
    rng = random.Random(3)
    texts = [[rng.randrange(1000) for _ in range(rng.randint(2, 16))] for _ in range(12 if device == "cuda" else 6)]
    out: dict = {"allocator": torch.cuda.get_allocator_backend() if device == "cuda" else None,
                 "configure_note": note}
    precisions = (("bf16", torch.bfloat16), ("fp32", torch.float32)) if device == "cuda" else (("fp32", torch.float32),)

    def free_bytes() -> int:
        if device != "cuda":
            return 0
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])

    for name, dtype in precisions:
        lm = load_llm(model, device, dtype)
        with torch.no_grad():
            lm.llm_decoder.bias[6561:] = -1e4
        runs = {}
        for graphs in (False, True):
            reqs = [LMRequest(text=t, seed=i) for i, t in enumerate(texts)]
            free = free_bytes()
            tokens, stats = lm.decode(reqs, Sampling(greedy=True), slots=4, cuda_graphs=graphs)
            runs[graphs] = (tokens, stats, free - free_bytes())
        tokens, stats, graph_bytes = runs[True]
        row = {"identical": tokens == runs[False][0], "tokens": sum(len(t) for t in tokens),
               "graphs_captured": stats.graphs, "graph_replays": getattr(stats, "graph_replays", None),
               "eager_steps": getattr(stats, "eager_steps", None),
               "capture_failures": getattr(stats, "capture_failures", None), "steps": stats.steps,
               "graph_device_bytes": graph_bytes if device == "cuda" else None}
        if device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            reqs = [LMRequest(text=t, seed=i) for i, t in enumerate(texts)]
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                    fused, _ = lm.decode(reqs, Sampling(greedy=True), slots=4, cuda_graphs=False)
                row["fused_attention"] = {"raised": False, "identical": fused == runs[False][0]}
            except RuntimeError as exc:
                row["fused_attention"] = {"raised": True, "error": str(exc)[-400:]}
        else:
            row["fused_attention"] = {"skipped": "the fused kernels are CUDA's"}
        out[name] = row
        del lm
    return out


def asr_worker(device: str, tiny: bool, clips: int) -> dict:
    """Batched Whisper tiny.en-sized encoder + greedy decode, RANDOM weights: the cost shape."""
    configure_allocator()
    import torch

    try:
        from transformers import WhisperConfig, WhisperForConditionalGeneration
    except ImportError as exc:
        return {"skipped": f"transformers (Whisper) cannot be imported: {exc}"}
    if device == "cpu":
        torch.set_num_threads(1)
    dims = (dict(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128) if tiny else
            dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                 decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536))
    config = WhisperConfig(vocab_size=51864, num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=50257, pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
                           **dims)
    torch.manual_seed(0)
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = WhisperForConditionalGeneration(config).eval().to(device=device, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    # Clip lengths as the TTS segments' audio (0.8 s per text token: 2.4 to 12 s), longest first.
    seconds = sorted((0.8 * len(t) for t in segments_spec(clips)), reverse=True)
    sr, window, hop = 16000, 400, 160
    hann = torch.hann_window(window, device=device)
    filters = torch.rand(80, window // 2 + 1, device=device)  # a mel filterbank's shape; values immaterial
    prefix = 4  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>: decode steps too

    def log_mel(wave):
        spec = torch.stft(wave, window, hop, window=hann, return_complex=True)[..., :-1].abs() ** 2
        mel = (filters @ spec).clamp(min=1e-10).log10()
        mel = torch.maximum(mel, mel.amax(dim=(1, 2), keepdim=True) - 8.0)
        return ((mel + 4.0) / 4.0).to(dtype)

    def new_cache():
        """An empty self- and cross-attention cache (transformers >= 4.42); None before that."""
        try:
            from transformers.cache_utils import DynamicCache, EncoderDecoderCache

            return EncoderDecoderCache(DynamicCache(), DynamicCache())
        except Exception:  # another transformers' signature: the model makes its own cache
            return None

    @torch.inference_mode()
    def transcribe(batch_seconds: list[float]) -> int:
        b = len(batch_seconds)
        wave = torch.zeros(b, 30 * sr, device=device)  # each clip padded to Whisper's 30 s window
        for i, s in enumerate(batch_seconds):
            wave[i, : int(s * sr)] = torch.randn(int(s * sr), device=device) * 0.1
        features = log_mel(wave)  # (b, 80, 3000)
        encoded = model.model.encoder(features).last_hidden_state
        steps = prefix + math.ceil(3 * max(batch_seconds))  # the batch decodes to its longest transcript
        ids = torch.full((b, 1), config.decoder_start_token_id, device=device)
        past = new_cache()
        for _ in range(steps):
            out = model(encoder_outputs=(encoded,), decoder_input_ids=ids[:, -1:], past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            ids = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        ids.cpu()  # the transcript's ids to the host (a sync, as a real run has)
        return b * steps

    encoder = model.model.encoder
    takes = inspect.signature(encoder.layers[0].forward).parameters

    def encode(features):
        """The encoder at the features' own length (as CTranslate2 runs it for `--qc asr`): the
        convolutions, the first n positions' embeddings, the layers. transformers' own forward
        insists on 3000 frames, so its steps are taken here one by one."""
        x = torch.nn.functional.gelu(encoder.conv1(features))
        x = torch.nn.functional.gelu(encoder.conv2(x)).transpose(1, 2)
        x = x + encoder.embed_positions.weight[: x.shape[1]]
        extra = {name: None for name in ("attention_mask", "layer_head_mask") if name in takes}
        for layer in encoder.layers:
            out = layer(x, **extra)
            x = out[0] if isinstance(out, tuple) else out
        return encoder.layer_norm(x)

    silent_cache: dict[int, object] = {}

    def token_logprobs(ids, encoded):
        hidden = model.model.decoder(input_ids=ids, encoder_hidden_states=encoded).last_hidden_state
        logp = torch.log_softmax(model.proj_out(hidden[:, :-1]).float(), dim=-1)
        return logp.gather(-1, ids[:, 1:, None])[..., 0]

    @torch.inference_mode()
    def score(batch_seconds: list[float]) -> int:
        """`--qc asr`'s scoring of a batch of clips of like length (sorted, so the batch's longest
        sets its window): each padded to a multiple of 0.5 s (0.5 s at least), the encoder at that
        length, the clip's text (prefix + 3 tokens per audio second) teacher-forced through the
        decoder in one pass, and again against a silent window of the same length (encoded once
        per length, then kept): no decoding loop."""
        b = len(batch_seconds)
        padded = max(0.5, math.ceil(max(batch_seconds) / 0.5) * 0.5)
        wave = torch.zeros(b, int(padded * sr), device=device)
        for i, s in enumerate(batch_seconds):
            wave[i, : int(s * sr)] = torch.randn(int(s * sr), device=device) * 0.1
        encoded = encode(log_mel(wave))
        if padded not in silent_cache:
            silent_cache[padded] = encode(log_mel(torch.zeros(1, int(padded * sr), device=device)))
        tokens = prefix + math.ceil(3 * max(batch_seconds))
        ids = torch.randint(0, 50000, (b, tokens), device=device)
        gain = token_logprobs(ids, encoded) - token_logprobs(ids, silent_cache[padded].expand(b, -1, -1))
        gain.sum(dim=1).cpu()  # the scores to the host (a sync, as a real run has)
        return b * tokens

    shape = "a shrunken config (dry run)" if tiny else "tiny.en-sized config"
    result: dict = {"weights": f"RANDOM weights, {shape}: the cost shape only, no transcripts",
                    "parameters": params, "dtype": str(dtype).replace("torch.", ""), "clips": clips,
                    "audio_s": round(sum(seconds), 1), "tokens_per_audio_s": 3, "batches": {}, "scoring": {}}
    for way, run, into in (("transcribe", transcribe, result["batches"]), ("score", score, result["scoring"])):
        for size in ((2,) if tiny else (16, 64)):
            run(seconds[:size])  # warm-up (kernels, cuBLAS handles), untimed
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = sum(run(seconds[i : i + size]) for i in range(0, len(seconds), size))
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            into[str(size)] = {"wall_s": round(wall, 3), "s_per_audio_s": round(wall / sum(seconds), 5),
                               f"{'decode' if way == 'transcribe' else 'scored'}_tokens_per_s": round(tokens / wall, 1)}
    for size, scored in result["scoring"].items():
        scored["vs_transcribe"] = round(scored["wall_s"] / result["batches"][size]["wall_s"], 4)
    if device == "cuda":
        result["peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return result


def run_child(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), check=False,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    seconds = round(time.monotonic() - start, 1)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "seconds": seconds}
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no JSON line on stdout: {proc.stdout[-500:]!r} {proc.stderr[-1000:]}", "seconds": seconds}
    out["child_seconds"] = seconds
    return out


def worker_cmd(path: str, model: Path, device: str, texts: list, row: dict) -> list[str]:
    cmd = [sys.executable, str(HERE / "cosyvoice_e2e.py"), "--worker", path, "--model", str(model),
           "--device", device, "--precision", row.get("precision", "fp32"), "--segments", json.dumps(texts)]
    if row.get("slots"):
        cmd += ["--lm-slots", str(row["slots"])]
    if not row.get("cuda_graphs", True):
        cmd += ["--no-cuda-graphs"]
    if row.get("flow_backend", "torch") != "torch":
        cmd += ["--flow-backend", row["flow_backend"]]
    if row.get("lm_attention", "default") != "default":
        cmd += ["--lm-attention", row["lm_attention"]]
    if row.get("workers", 1) != 1:
        cmd += ["--workers", str(row["workers"])]
    return cmd


def child_env(row: dict) -> dict:
    env = dict(os.environ)
    if row.get("allocator") == "native":
        env[ENV] = "backend:native"  # the child's configure_allocator keeps it (with a note)
    return env


def upstream_missing() -> str | None:
    """Why upstream's loop cannot run here (its packages), or None: tried in a child process."""
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "import upstream; upstream.load()")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ROOT / "tests")], capture_output=True,
                          text=True, timeout=120, check=False)
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return "upstream CosyVoice's packages are missing: " + (lines[-1] if lines else f"exit {proc.returncode}")


def skip_reason(row: dict, device: str) -> str | None:
    """Why a row cannot run on this machine (before any time is spent on it), or None."""
    if row.get("allocator") == "native" and device != "cuda":
        return "the native/cudaMallocAsync choice is CUDA's"
    if row.get("flow_backend") == "tensorrt":
        if device != "cuda":
            return "TensorRT needs CUDA"
        try:
            import onnxruntime as ort
        except ImportError as exc:
            return f"onnxruntime cannot be imported: {exc}"
        if "TensorrtExecutionProvider" not in ort.get_available_providers():
            return (f"this onnxruntime ({ort.__version__}) has no TensorRT provider (the image's is the CPU "
                    "build)")
    if row["kind"] == "upstream":
        return upstream_missing()
    return None


# -- the figures --------------------------------------------------------------------------------
# Left out of the printed summary (in the row's name, or text): the JSON file has them.
NOT_PRINTED = ("kind", "path", "precision", "slots", "cuda_graphs", "cosybatch", "configure_note",
               "error", "lm_attention", "flow_backend", "workers")


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def short(row: dict) -> dict:
    """A row for the printed summary: figures only (4 significant digits), an error cut short."""
    out = {k: _rounded(v) for k, v in row.items() if k not in NOT_PRINTED and v is not None}
    if "error" in row:
        out["error"] = " | ".join(str(row["error"]).strip().splitlines()[-3:])[-300:]
    return out


def line_for(row: dict) -> str:
    name = row["row"]
    if "error" in row:
        return f"{name}: ERROR {short(row)['error']}"
    if row["kind"] == "asr":
        per = " ".join(f"B{b}={v['s_per_audio_s']}s/audio-s" for b, v in row.get("batches", {}).items())
        scored = " ".join(f"B{b}={v['s_per_audio_s']}s/audio-s ({v['vs_transcribe']}x)"
                          for b, v in row.get("scoring", {}).items())
        return f"asr ({row.get('weights', '')[:40]}): transcribe {per}; score {scored}"
    if row["kind"] == "upstream":
        return f"upstream: rtf={row.get('rtf')} wall={row.get('wall', 0):.1f}s"
    gib = (row.get("peak_bytes") or 0) / 2**30
    used = (row.get("device_used_bytes") or 0) / 2**30
    counts = row.get("timed_lm_pool") or {}
    live = row.get("live_fraction")
    return (f"{name}: rtf={row.get('rtf')} lm_tok/s={row.get('lm_tokens_per_s')} "
            f"live={None if live is None else round(live, 3)} replays={counts.get('graph_replays')} "
            f"eager={counts.get('eager_steps')} captured={counts.get('graphs')} "
            f"fails={counts.get('capture_failures')} peak={gib:.2f}GiB used={used:.2f}GiB "
            f"alloc={row.get('allocator')} x_upstream={row.get('speedup_vs_upstream')}")


def main() -> None:
    ap = cli(__doc__, helps={"json": "a .json file, or a folder to write gpu_throughput.json in; rewritten after "
                                     "every row (alone: no file, the last stdout line still has every figure)"})
    ap.add_argument("--items", type=int, default=128, help="segments per row of ours")
    ap.add_argument("--upstream-items", type=int, default=12, help="segments of the upstream row")
    ap.add_argument("--asr-clips", type=int, default=128, help="clips of the asr row")
    ap.add_argument("--budget", type=float, default=470, help="seconds for everything, model writing included")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny weights, 4 short segments, the plan's code paths")
    ap.add_argument("--graph-check", nargs=2, metavar=("MODEL", "DEVICE"), help=argparse.SUPPRESS)
    ap.add_argument("--asr-worker", nargs=3, metavar=("DEVICE", "TINY", "CLIPS"), help=argparse.SUPPRESS)
    args = parse(ap)
    if args.graph_check:
        print(json.dumps(graph_check(Path(args.graph_check[0]), args.graph_check[1])))
        return
    if args.asr_worker:
        device, tiny, clips = args.asr_worker
        print(json.dumps(asr_worker(device, tiny == "1", int(clips))))
        return
    deadline = time.monotonic() + args.budget
    note = configure_allocator()  # children inherit it; set before anything here loads torch
    device, size, plan = "cuda", "real", PLAN
    if args.dry_run:
        device, size, plan = "cpu", "tiny", DRY_PLAN
        args.items, args.upstream_items, args.asr_clips = 4, 2, 4
    from cosybatch.cosyvoice.tiny import write_model_dir

    # Segments decode to the length cap (20 speech tokens per text token): the dry run keeps them short.
    texts = segments_spec(args.items, longest=8 if args.dry_run else 15)
    up_texts = texts[: args.upstream_items]

    def audio_s(t):
        return sum(20 * len(x) * 2 * 480 for x in t) / 24000

    result: dict = {"device": device, "size": size, "items": args.items, "audio_s": round(audio_s(texts), 1),
                    "configure_note": note, "budget_s": args.budget, "runs": [], "skipped": []}
    if device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
    report = Report(args.json, "gpu_throughput", count_writes=True)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        model = write_model_dir(Path(tmp) / "model", size=size)
        result["model_write_s"] = round(time.monotonic() - t, 1)
        check = run_child([sys.executable, __file__, "--graph-check", str(model), device],
                          min(180.0, deadline - time.monotonic()))
        result["graphs"] = check
        report.save(result)
        print("graphs", json.dumps(short(check)), flush=True)
        upstream_rtf = None
        for row in plan:
            name = row_name(row)
            left = deadline - time.monotonic()
            reason = skip_reason(row, device)
            if reason is None and left < ROW_MIN_S[device]:
                reason = f"not reached: {left:.0f} s of the budget left"
            if reason is not None:
                result["skipped"].append({"row": name, "reason": reason})
                report.save(result)
                print(f"{name}: skipped ({reason[:200]})", flush=True)
                continue
            timeout = left - 5
            if row["kind"] == "asr":
                out = run_child([sys.executable, __file__, "--asr-worker", device, "1" if args.dry_run else "0",
                                 str(args.asr_clips)], timeout)
                if "skipped" in out:
                    result["skipped"].append({"row": name, "reason": out["skipped"]})
                    report.save(result)
                    print(f"{name}: skipped ({out['skipped']})", flush=True)
                    continue
            else:
                segs = up_texts if row["kind"] == "upstream" else texts
                path = "upstream" if row["kind"] == "upstream" else "ours"
                out = run_child(worker_cmd(path, model, device, segs, row), timeout, child_env(row))
                where = out.get("cosybatch")
                if where is not None and not Path(where).resolve().is_relative_to(ROOT):
                    out["error"] = f"the worker imported cosybatch from {where}, not from this checkout ({ROOT})"
                if "wall" in out and "error" not in out:
                    out["rtf"] = round(out["wall"] / audio_s(segs), 4)
                    if path == "upstream":
                        upstream_rtf = out["rtf"]
                    else:
                        # With two workers the LM's seconds are not synchronised (nor meaningful).
                        lm_s = out.get("lm_seconds") if out.get("workers", 1) == 1 else None
                        out["lm_tokens_per_s"] = round(out["lm_tokens"] / lm_s, 1) if lm_s else None
                        if upstream_rtf:
                            out["speedup_vs_upstream"] = round(upstream_rtf / out["rtf"], 2)
            out = {**row, "row": name, **out}
            result["runs"].append(out)
            report.save(result)
            print(line_for(out), flush=True)
    result["seconds"] = round(args.budget - (deadline - time.monotonic()), 1)
    report.save(result)
    summary = {k: v for k, v in result.items() if k not in ("runs", "graphs", "configure_note")}
    summary["graphs"] = short(result["graphs"])
    summary["runs"] = [short(r) for r in result["runs"]]
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()

"""Tiny random-weight stand-ins for the parts of a CosyVoice2-0.5B model directory that are not
PyTorch checkpoints: the two ONNX front-end models and the ``CosyVoice-BlankEN/`` Qwen2 folder.

They keep the real files' call signatures (input/output names, dtypes, shapes, token rates) so the
loading and batching code can be tested without the 1 GB download. Every writer is deterministic:
same arguments, same bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..frontend.text import QWEN2_SPLIT_PATTERN
from ..frontend.text import UPSTREAM_EXTRA_SPECIALS as _UPSTREAM_SPECIALS

OPSET = 17
SPEAKER_DIM = 192  # campplus embedding size
FBANK_BINS = 80  # kaldi fbank bins campplus reads
MEL_BINS = 128  # whisper log-mel bins the speech tokenizer reads
FRAMES_PER_TOKEN = 4  # 100 mel frames/s -> 25 tokens/s
SPEECH_VOCAB = 6561  # 3**8 FSQ codes; an id is (code_a * 81 + code_b)
_CODE_SIDE = 81  # 81 * 81 == 6561

# Special tokens the real Qwen2 tokenizer_config.json declares, in id order after the BPE vocab.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Tokens upstream's QwenTokenizer adds when it loads BlankEN (the two <|im_*|> ones already exist).
UPSTREAM_EXTRA_SPECIALS = tuple(t for t in _UPSTREAM_SPECIALS if t not in QWEN_SPECIALS)
QWEN_SPLIT_PATTERN = QWEN2_SPLIT_PATTERN

# The repository's examples/ (cosybatch/cosyvoice/tiny/assets.py -> 3 folders up): the BPE, and so
# the tiny folders' token ids and the recorded golden digests, depend on finding this file.
_SENTENCES = Path(__file__).resolve().parents[3] / "examples" / "sentences.txt"

# Extra training text for the tiny BPE: digits, punctuation, contractions and less common words.
_EXTRA_TEXT = """\
On 14 March 2023, at 06:15, the 3rd train to Leeds left platform 9 with 412 passengers; 27 of them had no ticket.
Call 555-0199 or write to 221B Baker Street, London NW1 6XE. Prices rose 4.5% (from $1,250 to $1,306.25).
"Don't panic," she said. "We've got 10 minutes, maybe 12." He'd already left; they're late, aren't they?
Question: what's 7 x 8? Answer: 56! And 144 / 12 = 12, while 2^10 = 1024 & 3 + 4 = 7.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Zebras, yaks, quails and jaguars wandered through the exhibit; a vexed zookeeper quickly fixed the gate.
E-mail me at hello@example.com before 5 p.m. on Wed., Jan. 8th -- or text #42 to 80808.
Temperatures fell to -3 degrees overnight, then climbed to 18 by noon: a swing of 21 degrees in 9 hours.
I'm sure you'll love it; I've read it twice. It's the 1st edition, printed in 1951, page 300 of 1,000.
Bring: (a) a torch, (b) two spare batteries, [c] a map, {d} a whistle... and don't forget the snacks!
Chapter IV opens in a foggy harbour town where the lighthouse, the bakery and the old post office stand.
Physics, chemistry, biology, geography, history, music, mathematics and philosophy are all on the syllabus.
Version 2.0.1 fixed bug #3172; version 2.1 adds 64-bit support, UTF-8 filenames and a dark theme.
Wow -- that's amazing! Really? Yes, really. Hmm, well, perhaps. Oh no... not again; please, not again.
Every Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday in January, February, March,
April, May, June, July, August, September, October, November and December, the market opens at 8:00.
Quietly, the jazz quartet improvised a rhythm; the audience hummed, clapped and whistled in approval.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, thirty, hundred, thousand.
She asked, 'Whose umbrella is this?' -- it was Jack's, of course, the yellow one with 16 spokes.
Knights, gnomes, psychologists and wrights rarely write about rhythm, though they might whistle a tune.
The recipe needs 250 g of flour, 2 eggs, 125 ml of milk, 1/2 tsp of salt and 3 tbsp of melted butter.
Scientists measured 0.0042 mm of growth per day; over 365 days that adds up to about 1.53 mm.
Visit https://www.example.org/docs?page=7&lang=en for details, or see section 5.3, figure 12(b).
"""


# ---------------------------------------------------------------------------- ONNX models


def _save_onnx(model, path: str | Path) -> Path:
    import onnx

    onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def _initializer(name: str, array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def write_campplus_onnx(path: str | Path, seed: int = 0) -> Path:
    """Write a stand-in for ``campplus.onnx``: ``input`` float32 [batch, frames, 80] -> ``output`` [batch, 192].

    Each frame goes through a seeded random projection and a tanh, then the frames are averaged; the
    non-linearity before the mean keeps the embedding input-dependent even though upstream's frontend
    subtracts the per-bin mean over time first.
    """
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((FBANK_BINS, SPEAKER_DIM)) / math.sqrt(FBANK_BINS)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(SPEAKER_DIM)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["input", "proj_weight"], ["projected"]),
        helper.make_node("Add", ["projected", "proj_bias"], ["shifted"]),
        helper.make_node("Tanh", ["shifted"], ["activated"]),
        helper.make_node("ReduceMean", ["activated"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("Mul", ["pooled", "out_scale"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "frames", FBANK_BINS])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", SPEAKER_DIM])],
        initializer=[
            _initializer("proj_weight", weight),
            _initializer("proj_bias", bias),
            _initializer("out_scale", np.array(10.0, dtype=np.float32)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="cosybatch")
    model.ir_version = 8  # readable by onnxruntime >= 1.13
    return _save_onnx(model, path)


def write_speech_tokenizer_onnx(path: str | Path, seed: int = 0, frames_per_token: int = FRAMES_PER_TOKEN,
                                code_side: int = _CODE_SIDE, rank: int = 2) -> Path:
    """Write a stand-in for a speech tokenizer (``speech_tokenizer_v2.onnx`` by default).

    Inputs ``feats`` float32 [1, 128, frames] and ``feats_length`` int32 [1]; output ``indices`` int64
    [1, ceil(feats_length / frames_per_token)] (rank 3, [1, 1, n], as v1's real tokenizer gives)
    with ids in [0, code_side ** 2). Every ``frames_per_token`` frames (zero-padded at the end) are
    stacked and projected twice onto ``code_side`` codes; the id is ``argmax_a * code_side + argmax_b``.
    v2 and v3: 4 frames (25 Hz), 81 codes (6561 ids). v1: 2 frames (50 Hz), 64 codes (4096 ids), rank 3.
    """
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    stacked = MEL_BINS * frames_per_token
    weight = (rng.standard_normal((stacked, 2 * code_side)) / math.sqrt(stacked)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(2 * code_side)).astype(np.float32)

    def const(name: str, values: list[int]):
        return _initializer(name, np.array(values, dtype=np.int64))

    kept = "indices" if rank == 2 else "kept"
    nodes = [
        # [1, 128, T] -> [1, T, 128], then pad T up to a multiple of the stride.
        helper.make_node("Transpose", ["feats"], ["frames_first"], perm=[0, 2, 1]),
        helper.make_node("Shape", ["frames_first"], ["frame_count"], start=1, end=2),
        helper.make_node("Sub", ["stride", "frame_count"], ["short_by"]),
        helper.make_node("Mod", ["short_by", "stride"], ["pad_end"]),
        helper.make_node("Concat", ["pads_head", "pad_end", "zero"], ["pads"], axis=0),
        helper.make_node("Pad", ["frames_first", "pads"], ["padded"], mode="constant"),
        # [1, T', 128] -> [1, T'/stride, 128 * stride] -> two sets of code_side scores per token.
        helper.make_node("Reshape", ["padded", "stack_shape"], ["stacked"]),
        helper.make_node("MatMul", ["stacked", "code_weight"], ["scores_raw"]),
        helper.make_node("Add", ["scores_raw", "code_bias"], ["scores"]),
        helper.make_node("Split", ["scores", "halves"], ["scores_a", "scores_b"], axis=2),
        helper.make_node("ArgMax", ["scores_a"], ["code_a"], axis=2, keepdims=0),
        helper.make_node("ArgMax", ["scores_b"], ["code_b"], axis=2, keepdims=0),
        helper.make_node("Mul", ["code_a", "side"], ["code_a_scaled"]),
        helper.make_node("Add", ["code_a_scaled", "code_b"], ["all_indices"]),
        # Keep ceil(feats_length / stride) tokens, as the real model does for a padded batch.
        helper.make_node("Cast", ["feats_length"], ["length64"], to=TensorProto.INT64),
        helper.make_node("Add", ["length64", "stride_less_one"], ["length_up"]),
        helper.make_node("Div", ["length_up", "stride"], ["token_count"]),
        helper.make_node("Slice", ["all_indices", "zero", "token_count", "one"], [kept]),
    ]
    if rank == 3:
        nodes.append(helper.make_node("Unsqueeze", [kept, "one"], ["indices"]))
    out_shape = [1, "tokens"] if rank == 2 else [1, 1, "tokens"]
    graph = helper.make_graph(
        nodes,
        f"tiny_speech_tokenizer_rank{rank}",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, MEL_BINS, "frames"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, out_shape)],
        initializer=[
            _initializer("code_weight", weight),
            _initializer("code_bias", bias),
            const("zero", [0]),
            const("one", [1]),
            const("stride_less_one", [frames_per_token - 1]),
            const("stride", [frames_per_token]),
            const("side", [code_side]),
            const("halves", [code_side, code_side]),
            const("pads_head", [0, 0, 0, 0]),  # begins of (batch, time, mel), end of batch
            const("stack_shape", [0, -1, stacked]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="cosybatch")
    model.ir_version = 8  # readable by onnxruntime >= 1.13
    return _save_onnx(model, path)


# ---------------------------------------------------------------------------- BlankEN (Qwen2)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes, in GPT-2/Qwen2 vocab order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return list(symbols.values())


def training_text() -> list[str]:
    """Lines the tiny BPE is trained on: ``examples/sentences.txt`` (when present) plus built-in text."""
    lines: list[str] = []
    if _SENTENCES.is_file():
        lines += [line for line in _SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines += [line for line in _EXTRA_TEXT.splitlines() if line.strip()]
    return lines


def train_byte_bpe(lines: Iterable[str], vocab_size: int = 1000) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a Qwen2-style byte-level BPE; returns (vocab, merges) with the 256 byte symbols first."""
    try:
        from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("building the tiny BlankEN tokenizer needs the 'tokenizers' package") from exc

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(lines), trainer=trainer)
    raw_merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in raw_merges]
    # Renumber: bytes in the canonical order, then one id per merge in merge order.
    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    for left, right in merges:
        if left not in vocab or right not in vocab:
            raise AssertionError(f"merge ({left!r}, {right!r}) uses an unknown symbol")
        vocab.setdefault(left + right, len(vocab))
    if len(vocab) != tokenizer.get_vocab_size():
        raise AssertionError(f"renumbered vocab has {len(vocab)} entries, trainer had {tokenizer.get_vocab_size()}")
    return vocab, merges


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (float32 only): u64 LE header size, JSON header, raw LE data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for data in blobs:
            handle.write(data)


def _qwen2_weights(
    rng: np.random.Generator,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
) -> dict[str, np.ndarray]:
    head_dim = hidden_size // num_heads
    kv_dim = head_dim * num_kv_heads

    def normal(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.05 * rng.standard_normal(hidden_size)).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden_size)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(hidden_size, hidden_size),
            p + "self_attn.q_proj.bias": normal(hidden_size),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden_size),
            p + "self_attn.k_proj.bias": normal(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden_size),
            p + "self_attn.v_proj.bias": normal(kv_dim),
            p + "self_attn.o_proj.weight": normal(hidden_size, hidden_size),
            p + "mlp.gate_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": normal(hidden_size, intermediate_size),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        }
    weights["model.norm.weight"] = norm()
    return weights


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_blank_en(
    folder: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    bpe_vocab_size: int = 1000,
) -> Path:
    """Write a tiny ``CosyVoice-BlankEN/``: Qwen2 config, byte-level BPE tokenizer and random weights.

    Files: config.json, generation_config.json, vocab.json, merges.txt, tokenizer_config.json and
    model.safetensors (tied embeddings, so no lm_head.weight). The BPE ids come first, then
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; ``vocab_size`` is rounded up to a multiple of
    64 that also covers the tokens upstream's QwenTokenizer adds at load time.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    vocab, merges = train_byte_bpe(training_text(), bpe_vocab_size)
    special_ids = {token: len(vocab) + i for i, token in enumerate(QWEN_SPECIALS)}
    eos_id = special_ids["<|endoftext|>"]
    needed = len(vocab) + len(QWEN_SPECIALS) + len(UPSTREAM_EXTRA_SPECIALS)
    vocab_size = -(-needed // 64) * 64

    _write_json(folder / "vocab.json", vocab)
    merges_text = "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in merges)
    (folder / "merges.txt").write_text(merges_text, encoding="utf-8")
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in special_ids.items()
    }
    _write_json(
        folder / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    _write_json(
        folder / "config.json",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "hidden_act": "silu",
            "hidden_size": hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": intermediate_size,
            "max_position_embeddings": 32768,
            "max_window_layers": num_layers,
            "model_type": "qwen2",
            "num_attention_heads": num_heads,
            "num_hidden_layers": num_layers,
            "num_key_value_heads": num_kv_heads,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab_size,
        },
    )
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": eos_id, "do_sample": False, "eos_token_id": eos_id, "max_new_tokens": 2048},
    )
    weights = _qwen2_weights(
        np.random.default_rng(seed), vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size
    )
    _write_safetensors(folder / "model.safetensors", weights)
    return folder

"""The edit that makes a Piper ONNX graph batchable and reproducible (see engine.py's notes): the
frame-count tensor exposed as an output, each noise op replaced by a slice of a new input, and
optionally its 1-D convolutions run as 2-D ones.

The patched graph is cached (``$XDG_CACHE_HOME/cosybatch/piper-patched/KEY-DIGEST.onnx``, KEY
hashing the voice's bytes, the conv2d setting and this module's source, so an edit here
invalidates it): patching needs the onnx package, whose import alone is 0.1-0.8 s, and the patch
itself 0.1-0.3 s, paid by every process that opened a voice. What the engine needs to know of the
patch (PatchedGraph's fields) travels in the patched model's own metadata, so a cached graph needs
no onnx at all. Where the cache folder is unusable the graph is patched in memory, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...cache import cache_root, cached_file, file_sha256
from ...errors import VoiceError

log = logging.getLogger("cosybatch")

CACHE_FOLDER = "piper-patched"
METADATA_KEY = "cosybatch.patch"  # the model's metadata entry holding PatchedGraph's fields as JSON


@dataclass(frozen=True)
class PatchedGraph:
    model_bytes: bytes
    length_output: str  # frames per item, int64 [B]
    noise_inputs: tuple[str, ...]  # each [B, C, T]; sliced in-graph to the shape the op wanted
    noise_on_frames: tuple[bool, ...]  # True: time axis is output frames; False: phoneme ids
    # True: the voice's `scales` [3] input is replaced by SCALES_INPUT [B, 3], one (noise_scale,
    # length_scale, noise_w) per item; False: the model reads its scales another way (one per batch).
    per_item_scales: bool = False

    def fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "model_bytes"}

    @classmethod
    def from_metadata(cls, model_bytes: bytes, metadata: dict) -> PatchedGraph:
        """The graph of ``model_bytes``, its fields read from its metadata (an onnxruntime
        session's ``get_modelmeta().custom_metadata_map``), as patch_graph wrote them."""
        if METADATA_KEY not in metadata:
            raise VoiceError(f"this graph carries no {METADATA_KEY!r} metadata: it was not patched by cosybatch")
        f = json.loads(metadata[METADATA_KEY])
        return cls(model_bytes, f["length_output"], tuple(f["noise_inputs"]), tuple(f["noise_on_frames"]),
                   bool(f["per_item_scales"]))


SCALES_INPUT = "cosybatch_scales"
_SOURCE_SHA256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def patched_bytes(model_file: Path, conv2d: bool = False, folder: Path | None = None) -> tuple[bytes, str | None]:
    """The bytes of ``model_file``'s patched graph (PatchedGraph.from_metadata reads its fields),
    from the cache, built there once, and its cache name (KEY-DIGEST); patched in memory, with no
    name, where the cache folder is unusable."""
    folder = Path(folder) if folder is not None else cache_root() / CACHE_FOLDER
    key = _key(file_sha256(model_file)["sha256"], bool(conv2d), _SOURCE_SHA256)

    def build(tmp: Path) -> None:
        tmp.write_bytes(patch_graph(model_file.read_bytes(), conv2d).model_bytes)

    try:
        path = cached_file(folder, key, build)
        return path.read_bytes(), path.stem
    except OSError as exc:
        log.info("the patched-graph cache folder %s is not usable (%s); patching %s in memory",
                 folder, exc, model_file.name)
        return patch_graph(model_file.read_bytes(), conv2d).model_bytes, None


def cpu_optimized(model_bytes: bytes, name: str, folder: Path | None = None) -> str | bytes:
    """For a CPU session: the path of the patched graph as onnxruntime's CPU provider optimizes it
    at its EXTENDED level (fusions; not the hardware-specific layout of the ALL level, which each
    session still applies), cached per patched graph (``name``) and onnxruntime version. A session
    at the ALL level opens it in 0.28 s instead of 0.6 s (this voice, 2-core machine), with the
    same kernels, so the same audio (benchmarks/same_output.py). ``model_bytes`` itself where the
    cache is unusable."""
    import onnxruntime as ort

    folder = Path(folder) if folder is not None else cache_root() / CACHE_FOLDER
    key = _key(name, ort.__version__, "CPUExecutionProvider", "extended")

    def build(tmp: Path) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(tmp)
        ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])

    try:
        return str(cached_file(folder, key, build))
    except OSError as exc:
        log.info("the patched-graph cache folder %s is not usable (%s)", folder, exc)
        return model_bytes


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def patch_graph(model_bytes: bytes, conv2d: bool = False) -> PatchedGraph:
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    if conv2d:
        convs_as_2d(graph)
    producer = {out: node for node in graph.node for out in node.output}

    length_node = None
    for node in graph.node:
        if node.op_type != "Cast":
            continue
        clip = producer.get(node.input[0])
        reduce = producer.get(clip.input[0]) if clip is not None and clip.op_type == "Clip" else None
        ceil = producer.get(reduce.input[0]) if reduce is not None and reduce.op_type == "ReduceSum" else None
        if ceil is not None and ceil.op_type == "Ceil":
            length_node = node
            break
    if length_node is None:
        raise VoiceError("this Piper model has no Ceil->ReduceSum->Clip->Cast frame-count pattern; "
                         "cosybatch cannot trim its batched output exactly")
    length_output = length_node.output[0]
    graph.output.append(helper.make_tensor_value_info(length_output, TensorProto.INT64, None))
    per_item_scales = scales_per_item(graph)

    def ancestors(name: str) -> set[str]:
        seen, stack = set(), [name]
        while stack:
            node = producer.get(stack.pop())
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            stack.extend(node.input)
        return seen

    before_length = ancestors(length_output)
    noise_inputs, on_frames = [], []
    nodes = list(graph.node)
    for node in nodes:
        if node.op_type not in ("RandomNormalLike", "RandomNormal"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "RandomNormal" or attrs.get("mean", 0.0) != 0.0 or attrs.get("scale", 1.0) != 1.0:
            raise VoiceError("unexpected noise op in this Piper model; only RandomNormalLike(0, 1) is supported")
        k = len(noise_inputs)
        name = f"cosybatch_noise_{k}"
        dims = ["batch", f"channels_{k}", f"time_{k}"]
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        starts = helper.make_node("Constant", [], [f"{name}_starts"],
                                  value=helper.make_tensor(f"{name}_zeros", TensorProto.INT64, [3], [0, 0, 0]))
        shape = helper.make_node("Shape", [node.input[0]], [f"{name}_shape"])
        sliced = helper.make_node("Slice", [name, f"{name}_starts", f"{name}_shape"], [node.output[0]])
        at = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, new in enumerate((starts, shape, sliced)):
            graph.node.insert(at + offset, new)
        # Expose the wanted shape so a probe run can learn the channel count.
        graph.output.append(helper.make_tensor_value_info(f"{name}_shape", TensorProto.INT64, [3]))
        noise_inputs.append(name)
        on_frames.append(node.name not in before_length)
    fields = PatchedGraph(b"", length_output, tuple(noise_inputs), tuple(on_frames), per_item_scales).fields()
    model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=json.dumps(fields)))
    return PatchedGraph(model.SerializeToString(), **fields)


def scales_per_item(graph) -> bool:
    """Let each item of a batch have its own scales: every `Gather(scales, k)` (a scalar that
    multiplies the prior noise, the durations or the duration noise, each a [B, C, T] tensor)
    becomes `Reshape(Gather(cosybatch_scales, k, axis=1), [-1, 1, 1])`, item i's own value
    broadcast over its rows. Returns False, changing nothing, where the voice reads `scales`
    otherwise (its scales then stay one per batch)."""
    from onnx import TensorProto, helper

    inputs = [i for i in graph.input if i.name == "scales"]
    users = [n for n in graph.node if "scales" in n.input]
    constants = {n.output[0] for n in graph.node if n.op_type == "Constant"} | {i.name for i in graph.initializer}
    if len(inputs) != 1 or not users or any(n.op_type != "Gather" or n.input[0] != "scales"
                                            or n.input[1] not in constants for n in users):
        return False
    replaced = {n.output[0] for n in users}
    for info in [v for v in graph.value_info if v.name in replaced]:  # scalars no more
        graph.value_info.remove(info)
    shape = f"{SCALES_INPUT}_item_shape"
    graph.initializer.append(helper.make_tensor(shape, TensorProto.INT64, [3], [-1, 1, 1]))
    for node in users:
        at = list(graph.node).index(node)
        picked = f"{node.output[0]}__per_item"
        gather = helper.make_node("Gather", [SCALES_INPUT, node.input[1]], [picked], axis=1,
                                  name=f"{node.name}__per_item")
        reshape = helper.make_node("Reshape", [picked, shape], [node.output[0]], name=f"{node.name}__broadcast")
        graph.node.remove(node)
        graph.node.insert(at, gather)
        graph.node.insert(at + 1, reshape)
    graph.input.remove(inputs[0])
    graph.input.append(helper.make_tensor_value_info(SCALES_INPUT, TensorProto.FLOAT, ["batch", 3]))
    return True


def convs_as_2d(graph) -> int:
    """Rewrite every 1-D Conv/ConvTranspose as a 2-D one over a height-1 image.

    onnxruntime's CPU provider runs 1-D convolutions through im2col + GEMM but has faster
    blocked (NCHWc) kernels for 2-D ones; on the VITS decoder this is ~1.2x faster on CPU for
    the same arithmetic (outputs agree to ~3e-5). Returns how many nodes were rewritten.
    """
    from onnx import helper, numpy_helper

    weights = {init.name: init for init in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    axis = "cosybatch_axis_2"
    rewritten = []
    count = 0
    for node in graph.node:
        is_conv = node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1
        weight = weights.get(node.input[1]) if is_conv else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        auto_pad = attrs.get("auto_pad", b"NOTSET")
        if weight is None or len(weight.dims) != 3 or uses[weight.name] != 1 or auto_pad not in (b"NOTSET", "NOTSET"):
            rewritten.append(node)
            continue
        w = numpy_helper.to_array(weight)
        weight.CopyFrom(numpy_helper.from_array(w[:, :, None, :], weight.name))
        for name, value in list(attrs.items()):
            if name in ("kernel_shape", "strides", "dilations", "output_padding"):
                attrs[name] = [1, *list(value)]
            elif name == "pads":
                attrs[name] = [0, value[0], 0, value[1]]
        x4, y4 = f"{node.output[0]}__in4d", f"{node.output[0]}__out4d"
        rewritten.append(helper.make_node("Unsqueeze", [node.input[0], axis], [x4]))
        rewritten.append(helper.make_node(node.op_type, [x4, *node.input[1:]], [y4], name=node.name, **attrs))
        rewritten.append(helper.make_node("Squeeze", [y4, axis], [node.output[0]]))
        count += 1
    if count:
        graph.initializer.append(numpy_helper.from_array(np.array([2], dtype=np.int64), axis))
        del graph.node[:]
        graph.node.extend(rewritten)
    return count

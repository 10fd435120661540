"""Two-stage Piper synthesis: the voice graph cut at the alignment, the decoder batched by real frames.

A VITS voice spends most of its time (about 70% on CPU) in the flow and the decoder, whose cost
follows each item's predicted frame count, while the planner can only sort by phoneme count. So the
patched graph (see `graph.patch_graph`) is cut in memory where the durations appear - the Ceil
of the duration predictor's output, the node the frame-count pattern starts from:

- stage 1: text encoder + duration predictor. Inputs as the whole graph; outputs the per-phoneme
  frame counts and every other tensor the rest of the graph reads from this side of the cut (for
  Piper voices: the prior's mean and log-scale and the text mask, all on the phoneme axis), plus
  the frame count per item.
- stage 2: the expansion by durations, the noise, the flow and the decoder. Inputs: those tensors,
  `scales` (the noise scale) and the frame-axis noise input; outputs the audio and the frame counts.

Stage 1 runs on the planner's batch; its rows are then sorted by real frame count and cut into the
fewest groups whose padding efficiency (real / computed frames) is at least a target, and stage 2
runs once per group. An item's stage-2 inputs are its own stage-1 rows trimmed to its phoneme count
and zero-padded to its group's (zero is what the encoder leaves in padding, because its outputs are
masked), so the audio does not depend on which group an item lands in. The frame-axis noise is drawn
from the same per-item stream as the one-graph path (`engine.PiperEngine._noise`), exactly the
item's frame count long: it is the same audio, within float rounding of differently shaped batches.

Nothing here names a node of a particular export: the cut is found from the graph's structure, so
it works for any Piper model the one-graph path accepts (including a quantised copy of one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import VoiceError

DEFAULT_MIN_EFFICIENCY = 0.95


@dataclass(frozen=True)
class SplitGraph:
    stage1: bytes
    stage2: bytes
    durations: str  # frames per phoneme, float [B, 1, T]: the cut
    carried: tuple[str, ...]  # stage-1 outputs = stage-2 inputs besides the graph inputs below
    stage1_inputs: tuple[str, ...]
    stage2_inputs: tuple[str, ...]  # graph inputs stage 2 reads directly (scales, sid, frame noise)
    length_output: str  # frames per item, int64 [B]; an output of both stages


def split_graph(model_bytes: bytes, length_output: str) -> SplitGraph:
    """Cut a patched Piper graph (noise as inputs, frame counts as an output) at the durations."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    graph_inputs = {i.name for i in graph.input}
    initializers = {i.name for i in graph.initializer}

    # The frame-count pattern Ceil -> ReduceSum -> Clip -> Cast: its Ceil is where durations appear.
    node = producer[length_output]
    while node.op_type != "Ceil":
        node = producer.get(node.input[0])
        if node is None:
            raise VoiceError("the frame-count tensor does not come from a Ceil; cannot split this Piper model")
    durations = node.output[0]

    consumers: dict[str, list] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    # Stage 2: everything downstream of the durations that the audio needs.
    downstream: set[int] = set()
    stack = [durations]
    while stack:
        for n in consumers.get(stack.pop(), []):
            if id(n) not in downstream:
                downstream.add(id(n))
                stack.extend(n.output)

    def ancestors(names, stop=frozenset()) -> list:
        seen: dict[int, object] = {}
        stack = list(names)
        while stack:
            name = stack.pop()
            if name in stop:
                continue
            n = producer.get(name)
            if n is None or id(n) in seen:
                continue
            seen[id(n)] = n
            stack.extend(n.input)
        return [n for n in graph.node if id(n) in seen]  # graph order is a topological order

    # Tensors computed from initializers and per-batch settings only (scales, speaker id) are
    # recomputed in stage 2 rather than carried: they have no phoneme axis to regroup along.
    per_text = {"input", "input_lengths"} | {i for i in graph_inputs if i.startswith("cosybatch_noise_")}
    memo: dict[str, bool] = {}

    def recomputable(name: str) -> bool:
        if name in memo:
            return memo[name]
        if not name or name in initializers:
            result = True
        elif name in graph_inputs:
            result = name not in per_text
        else:
            n = producer.get(name)
            result = n is not None and all(recomputable(i) for i in n.input)
        memo[name] = result
        return result

    stage2_nodes = [n for n in ancestors(["output", length_output], stop={durations}) if id(n) in downstream]
    inside = {out for n in stage2_nodes for out in n.output}
    carried, copied = [durations], []
    for n in stage2_nodes:
        for name in n.input:
            if not name or name in inside or name in initializers or name in carried or name in copied:
                continue
            if name in ("input", "input_lengths"):
                raise VoiceError(f"the decoder side of this Piper model reads {name!r} itself; "
                                 "it cannot run in two stages (use two_stage=false)")
            if name in graph_inputs or recomputable(name):
                copied.append(name)  # the frame-axis noise, or computed again from scales / sid
            else:
                carried.append(name)
    stage2_nodes = ancestors(copied) + stage2_nodes

    def value_info(name: str, known: dict):
        return known.get(name) or helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in list(inferred.graph.value_info) + list(graph.input) + list(graph.output)}

    def sub_model(nodes, inputs, outputs) -> bytes:
        used = {name for n in nodes for name in n.input}
        inits = [i for i in graph.initializer if i.name in used]
        sub = helper.make_graph(list(nodes), graph.name, [value_info(i, types) for i in inputs],
                                [value_info(o, types) for o in outputs], inits)
        out = helper.make_model(sub, opset_imports=model.opset_import, ir_version=model.ir_version)
        return out.SerializeToString()

    stage1_nodes = ancestors([*carried, length_output])
    used1 = {name for n in stage1_nodes for name in n.input}
    stage1_inputs = tuple(i.name for i in graph.input if i.name in used1)
    stage1 = sub_model(stage1_nodes, stage1_inputs, [*carried, length_output])
    used2 = {name for n in stage2_nodes for name in n.input}
    stage2_inputs = tuple(i.name for i in graph.input if i.name in used2)
    stage2 = sub_model(stage2_nodes, [*carried, *stage2_inputs], ["output", length_output])
    return SplitGraph(stage1, stage2, durations, tuple(carried), stage1_inputs, stage2_inputs, length_output)


def group_by_frames(frames: Sequence[int], min_efficiency: float = DEFAULT_MIN_EFFICIENCY) -> list[list[int]]:
    """Indices of `frames` cut into the fewest groups whose padding efficiency - real frames over
    len x longest - is each at least `min_efficiency`; among those, the fewest padded frames.
    Groups are runs of the items sorted by frame count (longest first), so an optimal cut is a
    dynamic programme over where the runs end. min_efficiency 0 keeps the batch whole."""
    order = sorted(range(len(frames)), key=lambda i: (-frames[i], i))
    f = [int(frames[i]) for i in order]
    n = len(f)
    prefix = np.concatenate([[0], np.cumsum(f)])
    inf = (n + 1, 0)
    best = [inf] * (n + 1)  # best[j]: (groups, padded frames) for the first j sorted items
    best[0] = (0, 0)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is sorted items i..j-1, longest f[i]
            padded = (j - i) * f[i]
            if (prefix[j] - prefix[i]) < min_efficiency * padded:
                continue
            cand = (best[i][0] + 1, best[i][1] + padded)
            if cand < best[j]:
                best[j], cut[j] = cand, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


class TwoStage:
    """The two stage sessions of one voice, made with the same providers and options as the
    one-graph session they are derived from.

    `probe_feeds(lengths, width)` returns stage-1 feeds for a dummy batch. Two probes of different
    shapes tell, for every carried tensor, which axis is the batch and which the phoneme axis, and
    what it holds past an item's end (zero for a float export; a quantised copy may differ)."""

    def __init__(self, session, model_bytes: bytes, length_output: str, probe_feeds):
        import onnxruntime as ort

        self.split = split_graph(model_bytes, length_output)
        options = session.get_session_options()
        providers = session.get_providers()
        provider_options = session.get_provider_options()
        opts = [provider_options.get(p, {}) for p in providers]
        self.stage1 = ort.InferenceSession(self.split.stage1, options, providers=providers, provider_options=opts)
        self.stage2 = ort.InferenceSession(self.split.stage2, options, providers=providers, provider_options=opts)
        self._outputs1 = [*self.split.carried, self.split.length_output]
        small, _ = self.align(probe_feeds([5, 5], 5), axes=False)
        large, _ = self.align(probe_feeds([9, 6, 9], 9), axes=False)
        self.axes: dict[str, tuple[int, int]] = {}  # carried tensor -> (batch axis, phoneme axis)
        self.pad_values: dict[str, float] = {}  # carried tensor -> its value past an item's end
        for name in self.split.carried:
            a, b = small[name].shape, large[name].shape
            batch = [k for k in range(len(a)) if (a[k], b[k]) == (2, 3)]
            phoneme = [k for k in range(len(a)) if (a[k], b[k]) == (5, 9)]
            if len(batch) != 1 or len(phoneme) != 1 or any(
                    a[k] != b[k] for k in range(len(a)) if k not in (batch[0], phoneme[0])):
                raise VoiceError(f"stage-1 tensor {name} {a} / {b}: not [batch, ..., phonemes, ...]; "
                                 "two-stage synthesis cannot regroup this model (use two_stage=false)")
            self.axes[name] = (batch[0], phoneme[0])
            padding = np.unique(np.moveaxis(large[name], (batch[0], phoneme[0]), (0, -1))[1, ..., 6:])
            if len(padding) != 1:
                raise VoiceError(f"stage-1 tensor {name} is not constant past an item's end; "
                                 "two-stage synthesis cannot regroup this model (use two_stage=false)")
            self.pad_values[name] = padding[0]

    def align(self, feeds: dict, axes: bool = True) -> tuple[dict, np.ndarray]:
        """Stage 1 on a batch: the carried tensors by name, each with its batch axis first and its
        phoneme axis last, and the frame count per item."""
        values = self.stage1.run(self._outputs1, {k: v for k, v in feeds.items() if k in self.split.stage1_inputs})
        carried = dict(zip(self.split.carried, values[:-1], strict=True))
        if axes:
            carried = {k: np.moveaxis(v, self.axes[k], (0, -1)) for k, v in carried.items()}
        return carried, values[-1].reshape(-1)

    def decode(self, carried: dict, rows: Sequence[int], lengths: Sequence[int], direct: dict,
               pad_multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Stage 2 on `rows` of a stage-1 batch (from `align`): each row trimmed to its phoneme
        count and padded to the group's with what stage 1 leaves in padding. `direct` holds the
        graph inputs stage 2 reads, already per group. Returns audio [len(rows), samples] and the
        frame count per row."""
        width = max(int(lengths[r]) for r in rows)
        width = -(-width // pad_multiple) * pad_multiple
        feeds = dict(direct)
        for name, value in carried.items():
            group = np.full((len(rows), *value.shape[1:-1], width), self.pad_values[name], dtype=value.dtype)
            for g, r in enumerate(rows):
                n = int(lengths[r])
                group[g, ..., :n] = value[r, ..., :n]
            feeds[name] = np.ascontiguousarray(np.moveaxis(group, (0, -1), self.axes[name]))
        audio, frames = self.stage2.run(["output", self.split.length_output], feeds)
        return audio.reshape(len(rows), -1), frames.reshape(-1)

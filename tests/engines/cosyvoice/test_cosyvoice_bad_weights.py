"""A model folder whose weights hold NaN or infinity is refused when it loads, naming the file and
the tensor; such a folder would otherwise synthesise silence, a constant or no tokens at all
(issue 23, case 5)."""

from __future__ import annotations

import shutil

import pytest
import torch

from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.cosyvoice.engine import CosyVoiceOptions
from cosybatch.errors import UsageError


def poison(model_dir, name: str, value: float) -> str:
    """One value of one floating tensor of `name` set to `value`; returns that tensor's name."""
    path = model_dir / name
    state = torch.load(path, map_location="cpu", weights_only=True)
    key = [k for k, t in state.items() if t.is_floating_point()][-1]
    state[key].view(-1)[0] = value
    torch.save(state, path)
    return key


@pytest.mark.parametrize("family", ["cosyvoice_v1_dir", "cosyvoice_dir", "cosyvoice_v3_dir"])
@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_non_finite_weights_are_refused_naming_file_and_tensor(request, family, name, tmp_path):
    model = tmp_path / request.getfixturevalue(family).name
    shutil.copytree(request.getfixturevalue(family), model)
    key = poison(model, name, float("nan") if name != "hift.pt" else float("inf"))
    with pytest.raises(UsageError) as err:
        open_engine("cosyvoice", None, EngineOptions(device="cpu", engine=CosyVoiceOptions(model=model)))
    message = str(err.value)
    assert name in message and repr(key) in message and "non-finite" in message, message

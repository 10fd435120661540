"""Random weights at a sensible scale for the tiny folders, and the weight-norm layout of a saved HiFT."""

from __future__ import annotations

import math

import torch

# Convolutions that upstream wraps in weight norm; the official hift.pt stores them as weight_g/weight_v.
_WEIGHT_NORMED = ("conv_pre.", "ups.", "resblocks.", "conv_post.", "f0_predictor.condnet.")


def randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights at a sensible scale: 1/sqrt(fan-in) for matrices, small noise around norms."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:]) if not name.startswith("ups.") else p.shape[0] * p.shape[2]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif name.endswith("alpha") or ("norm" in name and name.endswith("weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def weight_norm_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store weight-normed convs as (weight_g, weight_v), the official hift.pt layout."""
    out = {}
    for key, value in state.items():
        hift_key = key.removeprefix("source_")
        if key.endswith(".weight") and value.dim() == 3 and hift_key.startswith(_WEIGHT_NORMED):
            base = key[: -len("weight")]
            out[base + "weight_g"] = value.norm(dim=(1, 2), keepdim=True)
            out[base + "weight_v"] = value.clone()
        else:
            out[key] = value.clone()
    return out


# What `short=True` gives the stop id's logit: its weight row zeroed and this bias. The random
# decoder's other logits have a standard deviation of about 1 over 4,096 (v1) or 6,561 (v2) ids,
# a log-sum-exp of about 9, so once a row reaches its minimum length the stop id is drawn about two
# times in three at each step, and rows end a few tokens after their minimum, each at its own step.
SHORT_STOP_BIAS = 10.0


def stop_soon(state: dict[str, torch.Tensor], stop_id: int) -> None:
    """Make ``llm_decoder``'s ``stop_id`` likely (see SHORT_STOP_BIAS), in place."""
    state["llm_decoder.weight"][stop_id].zero_()
    state["llm_decoder.bias"][stop_id] = SHORT_STOP_BIAS

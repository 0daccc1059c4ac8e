"""Linear layers through weights prepacked for oneDNN, on the CPU in float32.

A CPU matmul of few rows (a decode step's, one token per row) spends much of its time packing the weight into the
layout the GEMM kernel reads, again at every call; inductor packs weights once when it freezes a graph, which
needs weights that never change. `prepacked_linears(model, rows)` packs the weight of every linear layer of `model`
(`torch.nn.Linear`, and transformers' `Conv1D`, GPT-2's projections) once, for the duration of a `with` block (a
generation, between two policy updates), and routes the layers' forwards through the packed copies; on leaving, the
layers are as they were and the copies are freed.

The packed layers call `ppo_services::prepacked_linear`, an op of this module over oneDNN's
`mkldnn::_linear_pointwise`, so that torch.compile keeps it as one opaque call: inductor lowers
`mkldnn::_linear_pointwise` itself only for weights that are constants of a frozen graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from transformers.pytorch_utils import Conv1D

log = logging.getLogger(__name__)

_LIB = torch.library.Library("ppo_services", "DEF")
_LIB.define("prepacked_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")


def _prepacked_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


# CompositeExplicitAutograd: the packed weight is an MkldnnCPU tensor, so a "CPU" kernel would not be found
_LIB.impl("prepacked_linear", _prepacked_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("ppo_services::prepacked_linear")
def _prepacked_linear_fake(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether passes on `device` computing in `dtype` can use prepacked weights: float32 on a CPU with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepacks_passes(key: str, enabled: bool, device: torch.device, dtype: torch.dtype, passes: str) -> bool:
    """Whether a service's no-grad `passes` (named for the log) compute through prepacked weights: its setting `key`
    (`enabled`) on, and a device and dtype that can (`can_prepack`). Logs it when they do. Eager or compiled alike:
    a compiled pass keeps the packed op as one call between its fused kernels, and dynamo keeps one graph for the
    packed layers beside the one for the plain layers that passes with gradients (training) use."""
    on = enabled and can_prepack(device, dtype)
    if on:
        log.info("%s=true: %s passes compute through linear weights prepacked for oneDNN", key, passes)
    return on


@contextlib.contextmanager
def prepacked_linears(model: torch.nn.Module, rows: int, enabled: bool = True) -> Iterator[int]:
    """Within the block, every `torch.nn.Linear` and transformers `Conv1D` of `model` (the classes themselves, not
    subclasses such as adapters' wrappers, whose inner layer is packed instead) with a float32 CPU weight computes
    through a copy of its weight packed for `rows` rows of input (any row count works; `rows` tunes the layout).
    Yields how many layers were packed. Call it without grad: the packed op has no backward. The packed copies hold
    one more copy of those weights until the block ends; weights changed within the block would not be seen. With
    `enabled` false the block runs on the layers as they are (yields 0)."""
    packed: list[torch.nn.Module] = []
    try:
        for module in model.modules() if enabled else ():
            w = _out_by_in_weight(module)
            if w is None or w.dtype != torch.float32 or w.device.type != "cpu" or "forward" in module.__dict__:
                continue
            weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
            bias = None if module.bias is None else module.bias.detach()

            # weight and bias keyword-only: a caller's stray positional argument fails instead of replacing them
            def forward(x: torch.Tensor, *, weight: torch.Tensor = weight,
                        bias: torch.Tensor | None = bias) -> torch.Tensor:
                return torch.ops.ppo_services.prepacked_linear(x, weight, bias)

            module.forward = forward
            packed.append(module)
        yield len(packed)
    finally:
        for module in packed:
            del module.forward


def _out_by_in_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The [out, in] weight of a layer computing x @ W.T + b, as oneDNN's linear takes it: a `torch.nn.Linear`'s own,
    a `Conv1D`'s transposed (it stores [in, out] and computes x @ W + b); None for any other module."""
    if type(module) is torch.nn.Linear:
        return module.weight
    if type(module) is Conv1D:
        return module.weight.t()
    return None


class KeptPacking:
    """`prepacked_linears(model, rows)` held across calls, for a model whose weights change seldom (a critic between
    Trains) or never (a reward model): `pack()` routes its linear layers through packed copies of their weights and
    leaves them so until `release()`, which must come before the weights change or a pass needs gradients (the packed
    op has no backward); the next `pack()` packs the weights as they are then. With `enabled` false both do
    nothing."""

    def __init__(self, model: torch.nn.Module, rows: int, enabled: bool):
        self.model, self.rows, self.enabled = model, rows, enabled
        self._held: contextlib.ExitStack | None = None

    def pack(self) -> None:
        if self.enabled and self._held is None:
            held = contextlib.ExitStack()
            held.enter_context(prepacked_linears(self.model, self.rows))
            self._held = held

    def release(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.close()

    @contextlib.contextmanager
    def packed(self) -> Iterator[None]:
        """pack() for the block, release() after it (a compiled pass's warm-up on the packed layers)."""
        self.pack()
        try:
            yield
        finally:
            self.release()

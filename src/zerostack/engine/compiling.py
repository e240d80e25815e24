"""``engine.compile()``: torch.compile per block, the way torchtitan compiles a transformer.

A model's blocks are the layers of a list (an ``nn.ModuleList``, an ``nn.Sequential``, a pipeline
stage) whose class the list holds twice or more and that hold parameters (the reference GPT's
``blocks``, a Hugging Face model's ``layers``, a pipeline stage's transformer blocks). Each is
compiled on its own (``nn.Module.compile``), so what zerostack does between blocks stays outside
the graphs, and blocks of one kind share their graphs: a parameter is an input of the graph, not
a constant of it. A model without such a list is compiled whole.

At ZeRO stages 0-2 nothing of zerostack runs inside a block's forward: the gradient hooks fire
after autograd has accumulated each gradient, outside the compiled backward. At stage 3 each
module that owns parameters gathers them in hooks of its own, inside the block: dynamo breaks
the graph at each gather (the compiled pieces between them are still compiled, the gathers run
eagerly, and the result is the eager one); the report counts the graphs so that is visible.

:class:`CompileReport` says what was compiled and counts the graphs the backend was handed (each
recompilation counts one more), for the tests and for a user asking why a step got slow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger("zerostack")


@dataclass
class CompileReport:
    """What :func:`compile_blocks` compiled, and the graphs compiled since."""

    mode: str  # "per block" or "whole model"
    backend: str
    blocks: list[str] = field(default_factory=list)  # qualified names of the compiled blocks
    kinds: list[str] = field(default_factory=list)  # their classes, once each
    graphs: int = 0  # graphs handed to the backend so far, recompilations included

    def describe(self) -> str:
        if self.mode == "whole model":
            return f"compiled the whole model with {self.backend} (no repeated blocks found)"
        kinds = ", ".join(self.kinds)
        return f"compiled {len(self.blocks)} blocks ({kinds}) one by one with {self.backend}"


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` for the blocks of ``module``: in each outermost list of layers (the
    children named 0, 1, ... of a module: an ``nn.ModuleList``, an ``nn.Sequential``, a pipeline
    stage's layers), the layers holding parameters whose class appears twice or more in it."""
    out: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, m in module.named_modules():
        children = [(n, c) for n, c in m.named_children() if n.isdigit()]  # its list
        if not children:
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        count: dict[type, int] = {}
        for _, c in children:
            count[type(c)] = count.get(type(c), 0) + 1
        found = [
            (n, c) for n, c in children if count[type(c)] >= 2 and any(True for _ in c.parameters())
        ]
        if found:
            prefix = f"{name}." if name else ""
            out += [(prefix + n, c) for n, c in found]
            taken += [prefix + n for n, _ in found]
    return out


def compile_blocks(
    module: nn.Module, backend="inductor", compile_kwargs: dict | None = None
) -> CompileReport:
    """Compile ``module``'s blocks one by one (or the whole module without blocks) with
    ``torch.compile(backend=backend, **compile_kwargs)``, in place; returns the report."""
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        raise ValueError("compile_kwargs: give the backend as backend=, not in compile_kwargs")
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    blocks = find_blocks(module)
    report = CompileReport("per block" if blocks else "whole model", name)

    def counted(gm, example_inputs):
        report.graphs += 1
        return inner(gm, example_inputs)

    for block_name, block in blocks:
        block.compile(backend=counted, **kwargs)
        report.blocks.append(block_name)
        if type(block).__name__ not in report.kinds:
            report.kinds.append(type(block).__name__)
    if not blocks:
        module.compile(backend=counted, **kwargs)
    return report


def compile_engine(
    engine,
    backend="inductor",
    compile_kwargs: dict | None = None,
    schedule=None,
    compiled_autograd_enabled: bool = False,
) -> None:
    """``engine.compile()``, with DeepSpeed's arguments: :func:`compile_blocks` on the engine's
    module, its report kept as ``engine.compile_report``. DeepCompile's pass ``schedule`` and
    compiled autograd are refused."""
    if schedule is not None:
        raise ValueError(
            "engine.compile(schedule=...): a DeepCompile pass schedule; zerostack has no "
            "DeepCompile passes (it compiles each block with torch.compile)"
        )
    if compiled_autograd_enabled:
        raise ValueError(
            "engine.compile(compiled_autograd_enabled=True): compiled autograd would trace "
            "ZeRO's gradient hooks, which post collectives, into the backward graph"
        )
    if engine.compile_report is not None:
        raise RuntimeError("engine.compile(): the engine is compiled already")
    engine.compile_report = compile_blocks(engine.module, backend, compile_kwargs)
    if engine.topology.global_rank == 0:
        log.info("engine.compile: %s", engine.compile_report.describe())

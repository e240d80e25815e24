"""Random layer-wise token dropping (random-LTD, arXiv 2211.11586), DeepSpeed's data routing.

Chosen layers of a model (its transformer blocks) each see a random subset of the sequence's
tokens while training; the tokens a layer does not see pass it unchanged. The subset grows on a
schedule from ``min_value`` tokens to the whole sequence (``max_value``), so early steps cost
less. DeepSpeed's config block ``data_efficiency.data_routing.random_ltd`` and its functions::

    engine, *_ = deepspeed.initialize(model=model, config=cfg)   # random_ltd enabled
    engine = convert_to_random_ltd(engine, Block)   # each Block wrapped in RandomLayerTokenDrop
    engine.random_ltd_scheduler.get_current_seq()   # tokens kept now
    torch.save(save_without_random_ltd(engine), path)   # the state dict without the wrappers

What a wrapped layer does, as DeepSpeed's, in plain torch instead of its CUDA kernels:

- in training, when fewer tokens are kept than the sequence holds, the first wrapped layer
  samples, for every wrapped layer and every sample, ``reserved`` distinct positions uniformly
  (``torch.multinomial`` over ones, sorted so the order of the tokens is kept; the default
  generator, as DeepSpeed's); every wrapped layer reads its own row of that draw;
- the layer runs on the gathered tokens; its output is written back at those positions into a
  copy of its input, the rest of which passes through. Autograd of ``gather`` and ``scatter``
  gives the gradient DeepSpeed's kernels give: the layer's path at the kept positions, the
  identity at the others;
- the attention mask named ``model_mask_name`` follows: a decoder's is cut to its first
  ``reserved`` rows and columns (a causal mask of the kept, ordered tokens), an encoder's
  (``model_type: encoder``, a mask required) is gathered at the kept rows and columns;
- in evaluation, or once the whole sequence is kept, the layer runs on every token.

Unlike DeepSpeed's wrapper, arguments the model passes the layer by position (Hugging Face's
GPT-2 passes its mask so) are bound to the layer's own parameter names, so the mask is found
either way; DeepSpeed's wrapper takes only the hidden states by position.
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict

import torch
from torch import nn

# DeepSpeed's names of the schedule's state (scripts read ``scheduler.state[...]``)
MAX, MIN, CURRENT = "max_value", "min_value", "current_value"
CONSUMED, STEP = "consumed_layer_tokens", "current_steps"
SAMPLES, MASK = "sample_idx", "attention_mask"
WRAPPED = "random_ltd_layer"  # the wrapped layer's name inside its wrapper


class RandomLTDScheduler:
    """How many tokens each wrapped layer keeps, step by step (DeepSpeed's, same state keys):
    ``fixed_linear`` from ``min_value`` to ``max_value`` over ``require_steps`` steps, rounded
    down to a multiple of ``seq_per_step``; and the layer-tokens consumed so far (the global
    batch times the tokens every layer saw, counted once per step)."""

    def __init__(self, config: dict) -> None:
        self.model_layer_num = config["total_layer_num"]
        self.random_ltd_layer_num = config["random_ltd_layer_num"]
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = config["global_batch_size"]
        if config["layer_token_lr_schedule"]["enabled"]:
            raise NotImplementedError("random_ltd.layer_token_lr_schedule (DeepSpeed: not yet)")
        self.state: dict = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        s = self.config_schedule
        self.state.update({MIN: s[MIN], MAX: s[MAX], CURRENT: s[MIN]})
        self.state["schedule_config"] = s["schedule_config"]
        self.state["schedule_type"] = s["schedule_type"]
        self.state[CONSUMED], self.state[STEP] = 0, -1

    def get_value(self, global_steps: int) -> int:
        """The tokens kept at ``global_steps`` (``fixed_linear``: root degree 1)."""
        if self.state["schedule_type"] != "fixed_linear":
            raise RuntimeError("Unsupported random LTD schedule type")
        cfg, lo, hi = self.state["schedule_config"], self.state[MIN], self.state[MAX]
        frac = float(global_steps) / cfg["require_steps"]
        seq = math.floor(frac * (hi - lo) + lo)
        seq -= seq % cfg["seq_per_step"]
        return min(seq, hi)

    def get_total_layer_tokens(self, train_iters: int) -> int:
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[CONSUMED]

    def get_current_seq(self) -> int:
        return self.state[CURRENT]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[CURRENT] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        """At a training forward of step ``global_steps``: the kept length (until it reaches
        ``max_value``), and the step's layer-tokens counted once."""
        if self.state[CURRENT] < self.state[MAX]:
            self.state[CURRENT] = self.get_value(global_steps)
        if global_steps != self.state[STEP]:
            kept = self.state[CURRENT] * self.random_ltd_layer_num
            whole = self.state[MAX] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state[CONSUMED] += self.global_batch_size * (kept + whole)
            self.state[STEP] = global_steps

    def state_dict(self) -> dict:
        return {k: self.state[k] for k in (CONSUMED, STEP, CURRENT, MIN, MAX)}

    def load_state_dict(self, state_dict: dict) -> None:
        for k in (CONSUMED, STEP, CURRENT, MIN, MAX):
            self.state[k] = state_dict[k]


def sample_tokens(
    reserved: int, seq: int, batch: int, layers: int, device, mask=None, encoder: bool = False
):
    """DeepSpeed's ``gpt_sample_tokens`` / ``bert_sample_tokens``: ``(indices, mask)``, the
    indices ``[layers, batch, reserved]`` (int32, sorted along the last dimension) and the mask
    for the kept tokens: a decoder's cut to ``[..., :reserved, :reserved]``, an encoder's a list
    (one per layer) of the mask gathered at each sample's kept rows and columns."""
    if encoder and mask is None:
        raise ValueError("random-LTD: model_type encoder needs the attention mask")
    draw = torch.multinomial(torch.ones((layers * batch, seq), device=device), reserved)
    indices = draw.reshape(layers, batch, reserved).sort(dim=-1).values.to(torch.int32)
    if not encoder:
        return indices, (mask[:, :, :reserved, :reserved] if mask is not None else None)
    long = indices.long()
    per_layer = []
    for layer in long:
        rows = [mask[i : i + 1, :, kept][:, :, :, kept] for i, kept in enumerate(layer)]
        per_layer.append(torch.cat(rows, dim=0))
    return indices, per_layer


def _index(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool):
    """``(dim, index)`` for ``gather``/``scatter`` of the kept tokens of ``hidden``
    (``[batch, seq, h]`` when ``batch_first``, else ``[seq, batch, h]``)."""
    idx = indices.long() if batch_first else indices.long().t()
    return (1 if batch_first else 0), idx.unsqueeze(-1).expand(*idx.shape, hidden.shape[-1])


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens of ``hidden`` (``indices``: ``[batch, reserved]``), in order."""
    dim, index = _index(hidden, indices, batch_first)
    return torch.gather(hidden, dim, index)


def scatter_tokens(
    hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor, batch_first: bool
) -> torch.Tensor:
    """A copy of ``hidden`` with ``part`` written at the kept positions."""
    dim, index = _index(hidden, indices, batch_first)
    return torch.scatter(hidden, dim, index, part)


class RandomLayerTokenDrop(nn.Module):
    """A layer that, once set up (:meth:`init_config`), runs on a random subset of the tokens
    while training (see the module). ``random_ltd_layer``: the wrapped layer."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler = None
        self.reserved_length, self.curr_seq, self.max_length = -1, -1, None
        self.batch_first = False
        self._signature = None

    def init_config(self, config: dict, scheduler: RandomLTDScheduler, layer_id: int) -> None:
        """Set up as wrapped layer ``layer_id`` of the model (DeepSpeed's keys in ``config``)."""
        order, kind = config["hidden_state_order"], config["model_type"]
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise NotImplementedError(f"random-LTD: hidden_state_order {order!r}")
        if kind not in ("encoder", "decoder"):
            raise NotImplementedError(f"random-LTD: model_type {kind!r}")
        self.random_ltd_scheduler, self.random_ltd_layer_id = scheduler, layer_id
        self.max_length = scheduler.state[MAX]
        self.mask_name = config["model_mask_name"]
        self.micro_bs = config["micro_batch_size"]
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.batch_first, self.model_type = order == "batch_seq_dim", kind

    def _named(self, hidden, args: tuple, kwargs: dict) -> dict:
        """The call's arguments after the hidden states, by the layer's parameter names (those
        passed by position bound to theirs), so the mask can be found and replaced."""
        if not args:
            return dict(kwargs)
        if self._signature is None:
            self._signature = inspect.signature(self.random_ltd_layer.forward)
        params = self._signature.parameters.values()
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            raise TypeError(
                "random-LTD: a layer taking *args gets the hidden states by position "
                "and the rest by keyword"
            )
        bound = self._signature.bind(hidden, *args, **kwargs).arguments
        bound.pop(next(iter(bound)))  # the hidden states
        named = {}
        for name, value in bound.items():  # **kwargs the layer collects come back as themselves
            collects = self._signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD
            named.update(value if collects else {name: value})
        return named

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        sched = self.random_ltd_scheduler
        if sched is not None:
            self.reserved_length = sched.get_current_seq()
            self.curr_seq = hidden_states.shape[1 if self.batch_first else 0]
        if not (self.training and sched is not None and self.reserved_length < self.curr_seq):
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        named = self._named(hidden_states, args, kwargs)
        if self.random_ltd_layer_id == 0:
            batch = hidden_states.shape[0 if self.batch_first else 1]
            mask = named.get(self.mask_name) if self.mask_name is not None else None
            indices, part_mask = sample_tokens(
                self.reserved_length,
                self.curr_seq,
                batch,
                self.random_ltd_num_layer,
                hidden_states.device,
                mask,
                encoder=self.model_type == "encoder",
            )
            sched.state[SAMPLES], sched.state[MASK] = indices, part_mask
        indices, part_mask = sched.state[SAMPLES], sched.state[MASK]
        mine = indices[self.random_ltd_layer_id]
        if self.mask_name is not None:
            encoder = self.model_type == "encoder"
            named[self.mask_name] = part_mask[self.random_ltd_layer_id] if encoder else part_mask
        part = gather_tokens(hidden_states, mine, self.batch_first)
        out = self.random_ltd_layer(part, **named)
        first_out = out[0] if isinstance(out, tuple) else out
        if not isinstance(first_out, torch.Tensor):
            raise NotImplementedError("random-LTD: the layer must return a tensor or a tuple")
        merged = scatter_tokens(hidden_states, first_out, mine, self.batch_first)
        return (merged, *out[1:]) if isinstance(out, tuple) else merged


def convert_to_random_ltd(model, convert_type: type):
    """DeepSpeed's: every ``convert_type`` layer of the engine's module (or of ``model``)
    wrapped in :class:`RandomLayerTokenDrop`, then ``model.random_ltd_initialize()`` (the
    engine sets up the layers its config names). Returns ``model``."""
    inner = model.module if hasattr(model, "module") else model
    for name, module in list(inner.named_modules()):
        if name and isinstance(module, convert_type):
            parent, _, leaf = name.rpartition(".")
            setattr(
                inner.get_submodule(parent) if parent else inner, leaf, RandomLayerTokenDrop(module)
            )
    model.random_ltd_initialize()
    return model


def initialize_layers(module: nn.Module, config: dict, scheduler: RandomLTDScheduler) -> int:
    """Set up the wrapped layers the config's ``random_ltd_layer_id`` names, as DeepSpeed
    matches them: in module order, a wrapper whose name contains the next id (as text) takes
    it. Raises unless ``random_ltd_layer_num`` layers were set up."""
    queue = sorted(config["random_ltd_layer_id"])
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and queue and str(queue[0]) in name:
            layer.init_config(config, scheduler, count)
            queue.pop(0)
            count += 1
    if config["random_ltd_layer_num"] != count:
        raise ValueError(
            f"random_ltd_layer_num {config['random_ltd_layer_num']} must be equivalent to the "
            f"len of random_ltd_layer_id {count}"
        )
    return count


def remove_random_ltd_state_dict(state_dict: dict) -> OrderedDict:
    """``state_dict`` with the wrappers' ``.random_ltd_layer`` taken out of every key."""
    return OrderedDict((k.replace(f".{WRAPPED}", ""), v) for k, v in state_dict.items())


def save_without_random_ltd(model) -> OrderedDict:
    """DeepSpeed's: the module's state dict under the names it had before the wrappers."""
    inner = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(inner.state_dict())

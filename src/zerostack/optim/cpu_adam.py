"""CPUAdam: Adam/AdamW on CPU tensors with ``DeepSpeedCPUAdam``'s API, on torch's kernel.

The step runs torch's fused CPU Adam kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``):
one vectorised pass per tensor, multi-threaded (``torch.set_num_threads``), that updates param,
exp_avg and exp_avg_sq in place. For 50M fp32 parameters on this project's 2-core machine it
takes ~49 ms at one thread: ~7x faster than torch's default AdamW, within ~6% of DeepSpeed's C++
cpu_adam and of an AVX-512 C++ kernel written for the comparison (~46 ms); at two threads the
three are within the noise (``benchmarks/cpu_adam.py``). That gap does not pay for a C++
extension (a compiler at run time, a build on first use), so there is none. What torch's
optimizers lack, CPUAdam adds:

- ``bias_correction=False`` (DeepSpeed's switch): the same kernel, handed a step count so large
  that ``1 - beta**step`` is exactly 1.0 in double, so the bias corrections are exact no-ops
  (``x / 1.0 == x``) and the update is ``lr * m / (sqrt(v) + eps)``.
- ``step(copy_to={param: bf16_tensor})``: the updated values are also written to a low-precision
  copy in the same ``step`` call (one ``copy_`` per tensor after the kernel; for 50M parameters
  it adds about half the cost of the step, a read of the fp32 values and a write of the copy).

    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward()
    opt.step(copy_to={master: bf16_param})   # or plain opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

__all__ = ["CPUAdam"]

# A step count with beta**step == 0.0 in double for every beta in [0, 1) (even 1 - 2**-53), so
# the kernel's bias corrections are exactly 1.0. A power of two, exact in float32 and int64 (the
# kernel has read the step as either, depending on the torch version).
_NO_BIAS_CORRECTION_STEP = 2.0**62


class CPUAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``) or AdamW over CPU params, in place.

    Arguments are DeepSpeed's ``DeepSpeedCPUAdam``'s; ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``bias_correction`` and ``adamw_mode`` may also be set per param group.
    ``adamw_mode=True`` decays the weights decoupled from the gradient (``torch.optim.AdamW``);
    ``False`` adds ``weight_decay * param`` to the gradient (``torch.optim.Adam``). Per param the
    state is torch's: ``step`` (a float32 scalar tensor), ``exp_avg``, ``exp_avg_sq``, so
    state dicts load across CPUAdam, ``torch.optim.Adam`` and ``torch.optim.AdamW``.

    Params are fp32, bf16 or fp16 on the CPU; gradients of another floating dtype are cast. A
    16-bit param (DeepSpeed's ``*_master_weights_and_grads``) keeps fp32 moments with
    ``fp32_optimizer_states`` (the default, DeepSpeed's): the step runs in fp32 on a copy and
    the result is rounded into the param; without it the moments are in the param's dtype and
    the kernel steps the 16-bit tensors (it computes in fp32 and rounds each). Params whose
    ``grad`` is None are skipped: they get no update and no state. ``amsgrad`` is not supported.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
            adamw_mode=adamw_mode,
        )
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"CPUAdam param group {len(self.param_groups) - 1}"
        try:
            _check_group(group, where)
        except ValueError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # A state dict saved by torch's Adam/AdamW lacks our keys: take them from the defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        copy_to: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> float | None:
        """One Adam step over every param that has a gradient.

        ``copy_to`` maps a param to a tensor of the same shape (typically bf16 or fp16, on the
        CPU) that receives the param's updated value, right after the update. Params without a
        gradient are neither updated nor copied.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if copy_to:
            _check_copy_to(copy_to, self.param_groups)
        for i, group in enumerate(self.param_groups):
            self._step_group(group, f"CPUAdam param group {i}", copy_to or {})
        return loss

    def _step_group(self, group: dict, where: str, copy_to: Mapping) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps, dsts, write_back = [], [], [], [], [], [], []
        for j, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            grad = p.grad
            if not p.is_cpu:  # as DeepSpeedCPUAdam: its kernel walks host memory
                raise ValueError(
                    f"{where}, param {j}: CPUAdam steps host tensors, this one is on "
                    f"{p.device}; offload the optimizer (offload_optimizer device cpu)"
                )
            if grad.is_sparse:
                raise ValueError(f"{where}, param {j}: CPUAdam does not support sparse gradients")
            state = self.state[p]
            wide = p.dtype != torch.float32 and self.fp32_optimizer_states  # fp32 moments
            if not state:
                moments = torch.float32 if wide else p.dtype
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros(p.shape, dtype=moments, device=p.device)
            else:  # maybe loaded from DeepSpeedCPUAdam (an int step) or torch (strided moments)
                if not torch.is_tensor(state["step"]):
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = state[key].contiguous()
            # The kernel walks raw memory: every operand contiguous and in one dtype (fp32, or
            # the 16-bit param's with 16-bit moments)
            work = p.float() if wide else p if p.is_contiguous() else p.contiguous()
            if work is not p:
                write_back.append((p, work))
            params.append(work)
            grads.append(grad.to(work.dtype).contiguous())
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            dsts.append(copy_to.get(p))
        if not params:
            return
        torch._foreach_add_(steps, 1)
        if not group["bias_correction"]:
            steps = [torch.tensor(_NO_BIAS_CORRECTION_STEP)] * len(params)
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        kwargs = dict(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            amsgrad=False,
            maximize=False,
        )
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, **kwargs)
        # One parallel region per tensor, as in the kernel. Chunking the kernel and the copy so the
        # copy reads from cache saved ~10% on an idle machine but multiplies the OpenMP barriers,
        # and with the cores shared (other ranks, data loaders) each barrier can wait out a
        # scheduler slice: 30x slower steps, measured.
        copies = [(d, p) for d, p in zip(dsts, params, strict=True) if d is not None]
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [p for _, p in copies])
        for p, work in write_back:
            p.copy_(work)


def _check_group(group: dict, where: str) -> None:
    if group["amsgrad"]:
        raise ValueError(f"{where}: amsgrad=True is not supported by CPUAdam")
    beta1, beta2 = group["betas"]
    for k, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{where}: betas[{k}] = {beta} is not in [0, 1)")
    for key in ("lr", "eps", "weight_decay"):
        if float(group[key]) < 0.0:
            raise ValueError(f"{where}: {key} = {group[key]} is negative")
    for j, p in enumerate(group["params"]):
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"{where}, param {j}: dtype {p.dtype}; CPUAdam steps fp32, bf16 or fp16 params"
            )
        if p.device.type != "cpu":
            raise ValueError(f"{where}, param {j}: on {p.device}; CPUAdam steps CPU params only")


def _check_copy_to(copy_to: Mapping, groups: list[dict]) -> None:
    where = {id(p): (i, j) for i, g in enumerate(groups) for j, p in enumerate(g["params"])}
    strangers = [tuple(k.shape) for k in copy_to if id(k) not in where]
    if strangers:
        raise ValueError(
            f"copy_to has {len(strangers)} key(s) that are not params of this optimizer "
            f"(shapes {strangers[:4]}); keys must be the param tensors themselves"
        )
    for p, dst in copy_to.items():
        if dst.shape != p.shape or dst.device.type != "cpu" or not dst.is_floating_point():
            i, j = where[id(p)]
            raise ValueError(
                f"CPUAdam param group {i}, param {j}: copy_to target must be a floating-point "
                f"CPU tensor of shape {tuple(p.shape)}, got {dst.dtype} of shape "
                f"{tuple(dst.shape)} on {dst.device}"
            )

"""DeepSpeed's memory-estimate helpers, with their signatures and table, and zerostack's figures.

``estimate_zero2_model_states_mem_needs_all_live(model, ...)`` / ``..._all_cold(total_params,
...)`` and the ``zero3`` pair print what one rank (per GPU) and one node (per CPU) hold for fp16
Adam training under each offload option, as zerostack lays the model states out
(:func:`~.memory.model_states`); they also return the rows.
"""

from __future__ import annotations

from .memory import GIB, Layout, model_states
from .report import count_parameters


def _ds_table(title: str, rows: list[tuple[int, int, str]]) -> None:
    print(title)
    print("  per CPU  |  per GPU |   Options")
    for cpu, gpu, options in rows:
        print(f" {cpu / GIB:7.2f}GB | {gpu / GIB:6.2f}GB | {options}")


def _hw(num_gpus_per_node: int, num_nodes: int) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node."


def _fp16_states(total_params: int, world: int, stage: int, offload: str, param: str = "none"):
    layout = Layout(
        dp=world, stage=stage, precision="fp16", offload_optimizer=offload, offload_param=param
    )
    return model_states(total_params, layout)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """DeepSpeed's table for ZeRO-2 (fp16 Adam), with zerostack's figures: per GPU the device
    model states of one rank, per CPU (one node) its ranks' host model states times
    ``additional_buffer_factor``."""
    world = num_gpus_per_node * num_nodes
    rows = []
    for offload in ("cpu", "none"):
        st = _fp16_states(int(total_params), world, 2, offload)
        cpu = sum(st.host.values()) * num_gpus_per_node * additional_buffer_factor
        rows.append((int(cpu), st.device, f"offload_optimizer={offload:4}"))
    _ds_table(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"{_hw(num_gpus_per_node, num_nodes)}\n"
        f"SW: Model with {int(total_params / 1e6)}M total params.",
        rows,
    )
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """As :func:`estimate_zero2_model_states_mem_needs_all_cold`, counting ``model``'s
    parameters (shared ones once)."""
    trained, frozen, _ = count_parameters(model)
    return estimate_zero2_model_states_mem_needs_all_cold(
        trained + frozen, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    additional_buffer_factor=1.5,
):
    """DeepSpeed's table for ZeRO-3 (fp16 Adam), with zerostack's figures: per GPU one rank's
    device model states plus the largest layer gathered (fp16), per CPU (one node) its ranks'
    host model states times ``additional_buffer_factor``. The ``zero_init`` rows differ in
    where the whole model is built: without ``zero.Init`` each rank first holds it whole on
    the CPU (fp32)."""
    world = num_gpus_per_node * num_nodes
    rows = []
    for offload, param in (("cpu", "cpu"), ("cpu", "none"), ("none", "none")):
        st = _fp16_states(int(total_params), world, 3, offload, param)
        gpu = st.device + 2 * int(largest_layer_params)
        for zero_init in (True, False):
            host = sum(st.host.values()) * num_gpus_per_node
            if not zero_init:  # built whole, fp32, on each rank before sharding
                host = max(host, 4 * int(total_params) * num_gpus_per_node)
            cpu = int(host * additional_buffer_factor)
            options = f"offload_param={param:4}, offload_optimizer={offload:4}, "
            rows.append((cpu, gpu, options + f"zero_init={int(zero_init)}"))
    _ds_table(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"{_hw(num_gpus_per_node, num_nodes)}\n"
        f"SW: Model with {int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params.",
        rows,
    )
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """As :func:`estimate_zero3_model_states_mem_needs_all_cold`, from ``model``."""
    trained, frozen, largest = count_parameters(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        trained + frozen, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )

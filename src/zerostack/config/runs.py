"""What a long run reports and keeps: the monitor, flops profiler and comms logger blocks,
``watchdog``, ``checkpoint`` and ``loss_spike``; and DeepSpeed-Chat's ``hybrid_engine``."""

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    model_validator,
)

from .base import Int, NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, _fail, _Model


class MonitorConfig(_Model):
    """The ``tensorboard`` and ``csv_monitor`` blocks: write the training metrics (see
    :mod:`zerostack.monitor`) under ``<output_path>/<job_name>/`` on global rank 0."""

    enabled: bool = False
    """Write training metrics."""
    output_path: str = ""
    """Directory for the output ("" means the current directory)."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory / run name under output_path."""


class WandbConfig(_Model):
    """The ``wandb`` block (DeepSpeed's keys): log the training metrics to a Weights & Biases
    run (``WANDB_MODE=offline`` keeps it on disk)."""

    enabled: bool = False
    """Log to Weights & Biases (needs the wandb package)."""
    group: str | None = None
    """The run's group."""
    team: str | None = None
    """The run's entity (team or user)."""
    project: str = "deepspeed"
    """The run's project."""


class FlopsProfilerConfig(_Model):
    """The ``flops_profiler`` block (DeepSpeed's keys and defaults): profile one step's forward
    with :class:`zerostack.profiling.FlopsProfiler` and print it."""

    enabled: bool = False
    """Profile the forward of step ``profile_step`` and print the profile."""
    recompute_fwd_factor: NonNegFloat = 0.0
    """Share of the forward recomputed in backward (1.0: full activation checkpointing); a
    step's flops are (3 + this) x the forward's."""
    profile_step: NonNegInt = 1
    """The global step to profile (later steps time better: the first ones warm up)."""
    module_depth: Annotated[Int, Field(ge=-1)] = -1
    """Deepest module level in the aggregated profile (-1: every level)."""
    top_modules: PositiveInt = 1
    """Module types listed per level in the aggregated profile."""
    detailed: bool = True
    """Also print the module tree with each module's figures."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout (None: stdout)."""


class CommsLoggerConfig(_Model):
    """The ``comms_logger`` block (DeepSpeed's keys and defaults): summarise every collective by
    op and message size, with latency and bandwidth, printed by
    :func:`zerostack.comm.log_summary` on rank 0."""

    enabled: bool = False
    """Record the collectives (the engine's and zerostack.comm's)."""
    verbose: bool = False
    """Also print each collective as it completes (rank 0)."""
    prof_all: bool = True
    """Record every op; false: only those named in prof_ops."""
    debug: bool = False
    """Name each row with where the op ran too (its grid axis, or the calling function)."""
    prof_ops: list[str] = Field(default_factory=list)
    """Ops recorded when prof_all is false (e.g. ["all_reduce", "all_gather"])."""


class HybridEngineConfig(_Model):
    """The ``hybrid_engine`` block (DeepSpeed-Chat's RLHF; DeepSpeed's keys and defaults): with
    ``enabled``, the module's ``generate`` runs with every stage-3 parameter gathered once for
    the whole generation (DeepSpeed's gather of all layers), not module by module at each
    token. DeepSpeed's inference kernels, CUDA graphs and KV-cache settings make it faster,
    not different: zerostack has none, and they take no effect here."""

    enabled: bool = False
    """Gather the model once around ``generate``."""
    max_out_tokens: PositiveInt = 512
    """DeepSpeed's inference workspace size: no effect (no inference kernels)."""
    inference_tp_size: PositiveInt = 1
    """Tensor parallelism for generation only: 1 (more is refused)."""
    release_inference_cache: bool = False
    """No effect (no inference cache)."""
    pin_parameters: bool = True
    """No effect (no inference containers to pin)."""
    tp_gather_partition_size: PositiveInt = 8
    """No effect (the whole model is gathered at once)."""
    enable_cuda_graph: bool = False
    """No effect (no CUDA graphs)."""

    @model_validator(mode="after")
    def _checks(self) -> "HybridEngineConfig":
        if self.enabled and self.inference_tp_size > 1:
            _fail(
                "splits the model for generation only; zerostack generates with the training "
                "layout (set 1, or tensor_parallel.autotp_size for training too)",
                "inference_tp_size",
            )
        return self


# --- top level ------------------------------------------------------------------------------


_KIND_NAMES: dict[Any, str] = {
    object: "any value",
    dict: "a JSON object",
    bool: "true or false",
    str: "a string",
    (int, float): "a number",
}


def _is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    if kind is not bool and isinstance(value, bool):  # JSON true is not a number
        return kind is object
    return isinstance(value, kind)


class WatchdogConfig(_Model):
    """The ``watchdog`` block (zerostack's): a rank that stops answering, or ranks waiting in
    different collectives, end the job within ``timeout`` seconds with a report naming who
    stopped where (:mod:`zerostack.watchdog`)."""

    enabled: bool = True
    """Run the watchdog on every rank of a world larger than one."""
    timeout: PositiveFloat | None = None
    """Seconds without a heartbeat, or in one collective, before the job ends (default: 120, or
    the process group's timeout from ``init_distributed(timeout=...)`` when shorter)."""
    interval: PositiveFloat | None = None
    """Seconds between heartbeats and checks (default: timeout / 4, at most 10)."""
    history: PositiveInt = 16
    """Collectives each rank lists in its report."""


class ParallelWriteConfig(_Model):
    """``checkpoint.parallel_write`` (DeepSpeed's; no effect: every rank writes its own file)."""

    pipeline_stage: bool = False
    """DeepSpeed: each pipeline stage writes its own layers' files."""


class CheckpointConfig(_Model):
    """The ``checkpoint`` block: DeepSpeed's I/O options (accepted, no effect) and zerostack's
    automatic checkpoints (:mod:`zerostack.checkpoint.checkpointer`, and
    :mod:`~zerostack.checkpoint.async_save` for the writes in the background)."""

    save_dir: str | None = None
    """Folder of the automatic checkpoints (``auto_resume``, ``save_interval``)."""
    auto_resume: bool = False
    """At ``initialize``, load ``latest`` from ``save_dir`` when there is one (the engine's
    loader continues at the next unseen sample), e.g. after torchrun restarted the job."""
    save_interval: NonNegInt = 0
    """Save to ``save_dir`` every this many optimizer steps, inside ``step()`` (0: never)."""
    keep_last: NonNegInt = 0
    """Keep only the newest this many ``global_step<N>`` tags in ``save_dir`` (0: all); the tag
    ``latest`` names is never removed."""
    async_save: bool = False
    """``save_checkpoint`` (and the automatic saves) copy the state to host memory and write it
    in the background; ``latest`` moves once every rank's files are written and verified."""
    tag_validation: Annotated[
        Literal["Ignore", "Warn", "Fail"],
        BeforeValidator(lambda v: v.capitalize() if isinstance(v, str) else v),
    ] = "Warn"
    """DeepSpeed's check that every rank saves the same tag (no effect)."""
    load_universal: bool = False
    """DeepSpeed's universal-checkpoint load: ``load_checkpoint(dir)`` takes the tag
    ``latest_universal`` names where there is one (``ds_to_universal``'s output, or ``zerostack
    convert --to deepspeed --universal``'s). Every checkpoint loads on any layout either way."""
    use_node_local_storage: bool = False
    """DeepSpeed's node-local checkpoint folders (no effect)."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """DeepSpeed's parallel write options (no effect)."""
    writer: dict[str, Any] | None = None
    """DeepSpeed's checkpoint writer block (no effect: safetensors, one file per rank)."""
    deepspeed_files: bool | None = None
    """Beside zerostack's files, write DeepSpeed's in each tag folder (the model-states and
    ``*_optim_states.pt`` files, ``zero_to_fp32.py`` in the save folder), which DeepSpeed 0.19's
    ``load_checkpoint``, its ``zero_to_fp32.py`` and Lightning's converter read. None: yes under
    ``deepspeed.initialize`` (zerostack's facade) where the run's layout allows it (else one
    warning at its first save says why not), no under ``zerostack.initialize``; true where the
    layout does not allow it (tp/sp, pp other than at ZeRO-1 or with tied layers, ep other
    than at ZeRO 1-2, round_robin_gradients, elastic_checkpoint, async_save) is refused."""
    pickled_client_state: bool = False
    """``save_checkpoint(client_state=...)`` values that are neither JSON nor tensors (objects
    among a Lightning module's hyper-parameters, say) are pickled into their own file, its
    sha256 in the manifest, and loads unpickle them; false: such a value is refused naming its
    key, and a checkpoint holding them does not load. Unpickling runs code from the file: turn
    it on only for checkpoints you wrote."""

    @model_validator(mode="after")
    def _needs_dir(self) -> "CheckpointConfig":
        if (self.auto_resume or self.save_interval) and not self.save_dir:
            _fail("needed by auto_resume and save_interval", "save_dir")
        return self


class LossSpikeConfig(_Model):
    """The ``loss_spike`` block (zerostack's): when a step's loss stays above ``factor`` times the
    median of the last ``window`` steps' for ``patience`` steps in a row, the engine reloads the
    last checkpoint in ``checkpoint.save_dir`` and goes on with the data after the spike, so the
    window that caused it is skipped (:mod:`zerostack.checkpoint.loss_spike`)."""

    factor: NonNegFloat = 0.0
    """How many times the running median a loss must exceed to count (0: off; above 1 when on).
    A loss that is NaN or infinite always counts."""
    window: PositiveInt = 20
    """Steps in the running median; no loss counts until the window is full."""
    patience: PositiveInt = 1
    """Steps in a row above the bound before rolling back (no automatic save in between)."""
    max_rollbacks: NonNegInt = 3
    """Rollbacks in one run before a spike raises instead (the data is not the cause)."""

    @model_validator(mode="after")
    def _above_one(self) -> "LossSpikeConfig":
        if 0 < self.factor <= 1:
            _fail(f"must be above 1, or 0 for off (got {self.factor:g})", "factor")
        return self

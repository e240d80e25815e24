"""zerostack as a Lightning strategy: ``Trainer(strategy="zerostack_stage_3")``, CPU or GPU.

Importing this module registers the strategy names with Lightning (``lightning>=2.6``, the
``lightning`` extra), as DeepSpeed's are registered::

    import zerostack.integrations.lightning  # noqa: F401  (registers the names)

    trainer = L.Trainer(strategy="zerostack_stage_3", accelerator="cpu", devices=2,
                        accumulate_grad_batches=2, precision="bf16-mixed")
    trainer.fit(module, loader)
    trainer.fit(module, loader, ckpt_path="checkpoints/last.ckpt")   # resumes exactly

or ``strategy=ZeroStackStrategy(stage=3, config={...})`` with any zerostack/DeepSpeed config.

What it does as Lightning's own ``DeepSpeedStrategy`` does: one engine from
``zerostack.initialize`` over the module and the optimizer of ``configure_optimizers`` (or the
config's ``optimizer`` block); the engine accumulates (``accumulate_grad_batches`` becomes
``gradient_accumulation_steps``) and clips (``gradient_clip_val`` becomes ``gradient_clipping``,
by norm); Lightning steps the scheduler; ``precision`` becomes the config's ``bf16``/``fp16``
block; the module is built inside ``zero.Init`` at stage 3 (``configure_model``); a checkpoint
is a folder (``<path>/checkpoint``, zerostack's sharded format, loadable on any layout) with
Lightning's loop, callback and scheduler state as its ``client_state``.

Where it differs, on purpose:

- **CPU too**: gloo on CPU, NCCL on GPU (DeepSpeed's strategy refuses CPUs).
- **The gradient is the mean over the accumulation window.** Lightning divides the loss by
  ``accumulate_grad_batches`` before ``backward``; DeepSpeed's engine divides it again, so under
  ``DeepSpeedStrategy`` an SGD step with accumulation 2 is half as long as DDP's. This strategy
  passes ``scale_wrt_gas=False``: the step equals DDP's and single-process training's.
- **Settings that contradict each other are refused**, naming both (a config's
  ``gradient_accumulation_steps`` against the Trainer's, a ``bf16`` block against
  ``precision="32-true"``), where DeepSpeed's strategy lets one silently win.
- **Evaluation outside ``fit``** (``trainer.test(module, ckpt_path=...)`` in a fresh process)
  runs the whole module on every rank, as DDP does, with the checkpoint's weights read by
  :func:`zerostack.checkpoint.full_state_dict`; after ``fit`` the training engine evaluates.
  Evaluation loops run under ``torch.no_grad`` instead of ``inference_mode`` (Lightning does the
  same for FSDP): parameters gathered for an evaluation step must stay usable by training.
- Lightning values the JSON + safetensors format cannot hold (objects among the
  hyper-parameters) are refused at save naming their key, unless the config's
  ``checkpoint.pickled_client_state`` is true.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.plugins.precision.deepspeed import _PRECISION_INPUT
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig

import zerostack

from ..comm.process import init_distributed
from ..world import shutdown
from .lightning_config import engine_config, strategy_config

__all__ = ["ZeroStackPrecision", "ZeroStackStrategy"]

PRECISIONS = get_args(_PRECISION_INPUT)  # what Lightning's DeepSpeed precision takes
TAG = "checkpoint"  # the folder inside a Lightning checkpoint path, as DeepSpeed's strategy has it


class ZeroStackPrecision(DeepSpeedPrecision):
    """Lightning's DeepSpeed precision plugin (``*-true`` casts the module, floating-point inputs
    are cast to the precision's dtype, the engine steps and clips; the config's ``bf16``/``fp16``
    block keeps fp32 masters), but for one thing: backward does not divide the loss by the
    accumulation steps again."""

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        # Lightning has divided the loss by accumulate_grad_batches already
        model.trainer.strategy.engine.backward(tensor, *args, scale_wrt_gas=False, **kwargs)


class ZeroStackStrategy(DDPStrategy):
    """ZeRO stages 0-3 (with CPU/NVMe offload and everything else the config says) under
    Lightning's Trainer; see the module's docstring.

    ``config``: a zerostack/DeepSpeed config dict or JSON path (batch keys come from the
    Trainer). ``stage``, ``offload_optimizer``, ``offload_parameters``: shorthands for its
    ``zero_optimization`` block (given both ways, they must agree).
    ``exclude_frozen_parameters``: checkpoints leave out parameters with
    ``requires_grad=False``.
    """

    strategy_name = "zerostack"

    def __init__(
        self,
        stage: int | None = None,
        *,
        config: dict | str | os.PathLike | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        exclude_frozen_parameters: bool = False,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.config = strategy_config(config, stage, offload_optimizer, offload_parameters)
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine = None

    # ------------------------------------------------------------------ what Lightning asks
    @property
    def engine(self):
        """The zerostack engine (after ``setup`` in ``fit``), else None."""
        return self._engine

    @property
    def stage(self) -> int:
        return self.config["zero_optimization"]["stage"]

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning picks its own plugin from the precision flag (DeepSpeed's only for
        # DeepSpeedStrategy): take its precision, run it through the engine
        if plugin is None or isinstance(plugin, ZeroStackPrecision):
            self._precision_plugin = plugin
            return
        if type(plugin) is Precision:
            self._precision_plugin = ZeroStackPrecision("32-true")
        elif isinstance(plugin, MixedPrecision | HalfPrecision):
            self._precision_plugin = ZeroStackPrecision(plugin.precision)
        else:
            raise ValueError(
                f"ZeroStackStrategy: the precision plugin {type(plugin).__name__} is not "
                f"supported; pass precision= one of {', '.join(PRECISIONS)}"
            )

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to read its checkpoint into

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        env = self.cluster_environment
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            RANK=str(self.global_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
        )
        init_distributed(  # timeout None: on NCCL the config's watchdog bound and a minute
            self._process_group_backend,
            timeout=self._timeout,
            config=self.config,
            init_method="env://",
            rank=self.global_rank,
            world_size=self.world_size,
            auto_mpi_discovery=False,
        )
        atexit.unregister(_shut_down_at_exit)  # once, however many Trainers
        atexit.register(_shut_down_at_exit)

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False  # see the module's docstring
        if trainer.state.fn == TrainerFn.FITTING:
            self._start_engine(trainer)
        elif self._engine is not None and self._engine.module is self.lightning_module:
            self.model = self._engine  # after fit: the training engine evaluates
        else:
            self.model_to_device()
        self.setup_precision_plugin()
        self.barrier()

    def _start_engine(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        config = self.engine_config(trainer)
        optimizer, scheduler = None, None
        if "optimizer" not in config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError(
                    f"ZeroStackStrategy: configure_optimizers returned {len(optimizers)} "
                    f"optimizers and {len(schedulers)} schedulers; the engine steps one of each"
                )
            optimizer, scheduler = optimizers[0], (schedulers[0] if schedulers else None)
        engine, engine_optimizer, _, _ = zerostack.initialize(
            model=module,
            optimizer=optimizer,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=config,
            dist_init_required=False,
        )
        configs = [scheduler] if scheduler is not None else []
        if engine.lr_scheduler is not None:  # the config's scheduler block: Lightning steps it
            configs = [LRSchedulerConfig(engine.lr_scheduler, interval="step")]
            engine.lr_scheduler = None
        self._engine = engine
        self.model = engine
        self.optimizers = [engine_optimizer]
        self.lr_scheduler_configs = configs

    def engine_config(self, trainer: pl.Trainer) -> dict:
        """The config ``initialize`` gets: this strategy's, with the Trainer's accumulation,
        clipping, micro-batch and precision filled in (a contradiction is refused)."""
        return engine_config(self.config, trainer, self.precision_plugin.precision)

    @contextlib.contextmanager
    def model_sharded_context(self):
        """Stage 3 in ``fit``: ``configure_model`` builds each layer already sharded."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        with zerostack.zero.Init(enabled=self.stage == 3 and fitting, config=self.config):
            yield

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer) -> dict:
        return {}  # the engine's checkpoint holds it, sharded

    def lightning_module_state_dict(self) -> dict:
        return {}  # the engine's checkpoint holds the weights, sharded

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A folder at ``filepath``: the engine's sharded checkpoint (tag ``checkpoint``), with
        Lightning's state (loops, callbacks, schedulers, hyper-parameters) as its client
        state."""
        if storage_options is not None:
            raise TypeError("ZeroStackStrategy.save_checkpoint: storage_options is not supported")
        if self._engine is None:
            raise RuntimeError("ZeroStackStrategy.save_checkpoint: no engine (save during fit)")
        filepath = self.broadcast(str(filepath))
        client = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        self._engine.save_checkpoint(
            filepath,
            tag=TAG,
            client_state=client,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
        )

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if not os.path.isdir(os.path.join(path, TAG)):
            raise FileNotFoundError(
                f"{path}: not a ZeroStackStrategy checkpoint (a folder with {TAG}/ inside)"
            )
        pickled = self.config.get("checkpoint", {}).get("pickled_client_state", False)
        module = self.lightning_module
        if self._engine is not None and self.model is self._engine:
            fitting = module.trainer.state.fn == TrainerFn.FITTING
            _, client = self._engine.load_checkpoint(
                path,
                tag=TAG,
                load_optimizer_states=fitting,
                load_lr_scheduler_states=False,  # Lightning restores its schedulers
                load_module_strict=module.strict_loading,
            )
            return client
        from ..checkpoint import full_state_dict, read_client_state

        client = read_client_state(path, tag=TAG, pickled=pickled)
        return {**client, "state_dict": full_state_dict(path, tag=TAG)}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._engine is not None and self.model is self._engine:
            return  # load_checkpoint has put the weights into the engine
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine has loaded it

    def teardown(self) -> None:
        # keep the module where the engine put it: after fit, test() evaluates with the engine
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, registry) -> None:
        names = {
            "zerostack": dict(stage=2),
            "zerostack_stage_0": dict(stage=0),
            "zerostack_stage_1": dict(stage=1),
            "zerostack_stage_2": dict(stage=2),
            "zerostack_stage_2_offload": dict(stage=2, offload_optimizer=True),
            "zerostack_stage_3": dict(stage=3),
            "zerostack_stage_3_offload": dict(
                stage=3, offload_optimizer=True, offload_parameters=True
            ),
        }
        for name, kwargs in names.items():
            what = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            registry.register(name, cls, description=f"zerostack ({what})", **kwargs)


def _shut_down_at_exit() -> None:
    """A Lightning script ends without tearing the process groups down, and a gloo group left to
    interpreter exit can abort the process after a clean run ("terminate called without an
    active exception", seen with ``self.all_gather``): :func:`zerostack.shutdown` at exit, as
    the runner does. Not after an uncaught exception: the peers may never arrive."""
    if getattr(sys, "last_value", None) is None:
        shutdown()


ZeroStackStrategy.register_strategies(StrategyRegistry)

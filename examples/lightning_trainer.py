"""A LightningModule trained with ZeRO: zerostack's own strategy, or Lightning's DeepSpeed one.

    # zerostack's strategy (CPU or GPU), 2 ranks:
    torchrun --nproc_per_node 2 examples/lightning_trainer.py --strategy zerostack_stage_3
    # a script written for DeepSpeed (strategy="deepspeed_stage_3"), run on zerostack unchanged:
    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/lightning_trainer.py \
        --strategy deepspeed_stage_3

A tiny next-token model built in ``configure_model`` (so ZeRO-3 builds it sharded), random
tokens, AdamW or SGD with a step schedule, ``accumulate_grad_batches``; with ``--save DIR``,
``ModelCheckpoint`` saves at the end of every epoch, ``--resume PATH`` continues from one, and
``--validate PATH`` only evaluates one (a fresh process), ``--weights FILE`` (a DeepSpeed
strategy) saves the weights the run ended with. After ``fit``, ``trainer.validate``
gives the validation loss. Rank 0 prints ``RESULT`` and a JSON object: the loss of each
micro-batch (the mean over the ranks), the validation loss and the step reached.
"""

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="zerostack_stage_3")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--epoch_steps", type=int, default=2, help="optimizer steps per epoch")
parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
parser.add_argument("--precision", default="32-true")
parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=)")
parser.add_argument("--save", help="ModelCheckpoint's folder (a checkpoint each epoch)")
parser.add_argument("--resume", help="fit from this checkpoint")
parser.add_argument("--validate", help="only validate this checkpoint")
parser.add_argument("--weights", help="after fit, rank 0 saves the whole weights here (torch)")
args = parser.parse_args()

if args.strategy.startswith("zerostack"):
    import zerostack.integrations.lightning  # noqa: F401  (registers the strategy names)
elif args.strategy.startswith("deepspeed") and not torch.cuda.is_available():
    # CPU only: Lightning's DeepSpeedStrategy refuses CPUs and checks CUDA device indices
    # (DeepSpeed itself runs there with DS_ACCELERATOR=cpu); let it through for this example
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    from lightning.pytorch.accelerators import CPUAccelerator

    lightning_deepspeed.CUDAAccelerator = (lightning_deepspeed.CUDAAccelerator, CPUAccelerator)
    lightning_deepspeed._validate_device_index_selection = lambda devices: None
    lightning_deepspeed.DeepSpeedStrategy.root_device = property(  # its device_rank
        lambda self: torch.device("cpu", self.local_rank)
    )

VOCAB, SEQ, WIDTH = 64, 16, 32


class TinyLM(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(0)  # the same weights on every rank and under every strategy
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, WIDTH),
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.GELU(),
            nn.Linear(2 * WIDTH, VOCAB),
        )

    def _loss(self, batch) -> torch.Tensor:
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(self.all_gather(loss.detach()).float().mean().item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g))


per_epoch = args.epoch_steps * args.accumulate * args.batch * args.devices
train = DataLoader(tokens(per_epoch, 1), batch_size=args.batch)
val = DataLoader(tokens(4 * args.devices, 2), batch_size=2)
callbacks = []
if args.save:
    callbacks.append(ModelCheckpoint(dirpath=args.save, every_n_epochs=1, save_top_k=-1))
trainer = L.Trainer(
    strategy=args.strategy,
    accelerator="cuda" if torch.cuda.is_available() else "cpu",
    devices=args.devices,
    max_epochs=args.epochs,
    accumulate_grad_batches=args.accumulate,
    precision=args.precision,
    gradient_clip_val=args.clip,
    callbacks=callbacks,
    logger=False,
    enable_checkpointing=bool(args.save),
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = TinyLM(args.optimizer)
if args.validate:
    result = {"val_loss": trainer.validate(model, val, ckpt_path=args.validate)[0]["val_loss"]}
else:
    trainer.fit(model, train, ckpt_path=args.resume)
    val_loss = trainer.validate(model, val)[0]["val_loss"]
    result = {"losses": model.losses, "val_loss": val_loss, "step": trainer.global_step}
    if args.weights:  # the weights the run ended with, whole (gathered at ZeRO-3)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            if trainer.is_global_zero:
                whole = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
                torch.save(whole, args.weights)
if trainer.is_global_zero:
    print("RESULT " + json.dumps(result), flush=True)

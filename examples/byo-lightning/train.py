"""A Lightning module relayed by kaggle-relay. The lines marked `# relay` are all it adds.
`--logger tensorboard,wandb`: Lightning's own loggers, one run each across the relay (docs/tracking.md)."""
import argparse

import lightning.pytorch as pl
import torch
from torch import nn

import relay
from relay.lightning import RelayLightningCallback


class Regressor(pl.LightningModule):
    def __init__(self, session, lr: float = 3e-3):
        super().__init__()
        self.session, self.lr = session, lr
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(1024, 32, generator=g)
        self.y = torch.sin(self.x @ torch.randn(32, 1, generator=g))
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        steps = self.session.total_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        dataset = torch.utils.data.TensorDataset(self.x, self.y)
        # relay: the batches of the remaining steps, in an order derived from the step
        sampler = self.session.batch_sampler(len(dataset), batch_size=16)
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)


def make_loggers(kinds: str, session) -> list:
    loggers = []
    if "tensorboard" in kinds:  # relay: into the session's TensorBoard folder, carried across sessions
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(session.tensorboard_dir), name="", version=""))
    if "wandb" in kinds:  # the relay's W&B run (resumed by id in every session) when the spec turns it on
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(project="byo-lightning"))
    return loggers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logger", default="none", help="tensorboard, wandb or both (comma-separated); none")
    args = ap.parse_args()
    session = relay.open_session(total_steps=300)  # relay
    module = Regressor(session)
    callback = RelayLightningCallback(session)  # relay
    ckpt_path = callback.restore()  # relay
    trainer = pl.Trainer(max_steps=session.total_steps, callbacks=[callback], enable_checkpointing=False,
                         logger=make_loggers(args.logger, session) or False, log_every_n_steps=10,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="auto",
                         devices=1, num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=ckpt_path)  # relay: ckpt_path
    session.close()  # relay


if __name__ == "__main__":
    main()

"""The plain PyTorch loop of examples/byo-plain, data-parallel: one process per GPU (or per CPU process).

With `session.devices: 2` in the spec, `relay train` runs this script once per rank with the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `relay.open_session()` joins the process
group (gloo on CPU, nccl on CUDA). The script wraps its model in torch's DistributedDataParallel as any DDP
script does; the lines marked `# relay` are all the relay adds. `--batch` is the effective batch of an
optimizer step: each rank gets its equal slice from `session.batches`, so 1 or 2 processes train on the same
samples per step. Also runs as `torchrun --nproc-per-node 2 train.py` or `python train.py` by hand.
"""
import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import relay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16, help="effective batch, over all processes")
    ap.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler on CUDA")
    args = ap.parse_args()

    session = relay.open_session(total_steps=args.steps)  # relay: joins the ranks; seeds torch, numpy, random
    steps = session.total_steps
    device = session.device  # relay: cuda:LOCAL_RANK, cuda or cpu
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g)
    y = torch.sin(x @ torch.randn(32, 1, generator=g)) + 0.1 * torch.randn(1024, 1, generator=g)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(128, 1)).to(device)
    if session.world_size > 1:  # gradients averaged over the ranks by DDP's hooks, as usual
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and device.type == "cuda")

    session.register(model=model, optimizer=opt, scheduler=sched, scaler=scaler)  # relay: saves model.module
    session.restore()  # relay: every rank's own RNG
    for idx in session.batches(len(x), args.batch):  # relay: this rank's slice of the step, until all stop
        xb, yb = x[idx].to(device), y[idx].to(device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=scaler.is_enabled()):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        session.step_done(loss=loss.detach())  # relay: the mean loss over the ranks is logged
    if session.step == steps:
        with torch.no_grad():
            model.eval()
            session.log("eval", loss=nn.functional.mse_loss(model(x.to(device)), y.to(device)).item())
    session.close()  # relay: rank 0 writes the checkpoint, progress.json and export/


if __name__ == "__main__":
    main()

"""A plain PyTorch loop, relayed by kaggle-relay. The lines marked `# relay` are all it adds.

Runs as is on a laptop (`python train.py`, a workdir ./relay-run, no deadline), under `relay train spec.yaml`
and in a Kaggle session kernel: the relay passes the workdir, deadline, step cap and checkpoint mounts.
"""
import argparse

import torch
from torch import nn

import relay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler on CUDA")
    args = ap.parse_args()

    session = relay.open_session(total_steps=args.steps)  # relay: also seeds torch, numpy, random
    steps = session.total_steps
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g)
    y = torch.sin(x @ torch.randn(32, 1, generator=g)) + 0.1 * torch.randn(1024, 1, generator=g)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(128, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    scaler = torch.amp.GradScaler(device, enabled=args.amp and device == "cuda")

    session.register(model=model, optimizer=opt, scheduler=sched, scaler=scaler)  # relay
    session.restore()  # relay
    for idx in session.batches(len(x), args.batch):  # relay: this step's samples, until it must stop
        xb, yb = x[idx].to(device), y[idx].to(device)
        with torch.autocast(device, dtype=torch.float16, enabled=scaler.is_enabled()):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        session.step_done(loss=loss.detach())  # relay
    if session.step == steps:
        with torch.no_grad():
            model.eval()
            session.log("eval", loss=nn.functional.mse_loss(model(x.to(device)), y.to(device)).item())
    session.close()  # relay


if __name__ == "__main__":
    main()

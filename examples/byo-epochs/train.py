"""An epoch loop over a DataLoader of a map-style Dataset (a torchvision-style dataset: __len__, __getitem__ one
sample at a time), relayed by kaggle-relay: the worked conversion of docs/your-code.md ("An epoch loop"). The
lines marked `# relay` are what it adds or changes; the loop, the eval at each epoch's end and the print stay.

The original:
    train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=True, collate_fn=collate)
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            ...
        test(model, test_loader, epoch)
"""
import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import relay  # relay


class Shapes(Dataset):
    """A map-style dataset: a 1x12x12 image (a bright square somewhere, noise elsewhere) and its label, the
    square's quadrant; what MNIST or any torchvision dataset is to a DataLoader, made here, offline."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(4, (n,), generator=g)
        self.images = 0.3 * torch.randn(n, 1, 12, 12, generator=g)
        for i, label in enumerate(self.labels.tolist()):
            r, c = 6 * (label // 2) + 1, 6 * (label % 2) + 1
            self.images[i, 0, r:r + 4, c:c + 4] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


def collate(samples):
    """A list of (image, label) samples into one batch: what DataLoader's default collate does for these, written
    out where a dataset needs its own (padding, dicts)."""
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor(labels)


def test(model, loader, epoch: int) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
    accuracy = correct / len(loader.dataset)
    print(f"epoch {epoch}: test accuracy {accuracy:.3f}")
    return accuracy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()

    train_set, test_set = Shapes(250, seed=0), Shapes(100, seed=1)  # 250 / 16: a last batch of 10
    # relay: the run's length in steps: len(train_loader) per epoch (drop_last=False keeps the last, smaller batch)
    session = relay.open_session(total_steps=args.epochs * math.ceil(len(train_set) / args.batch))
    model = nn.Sequential(nn.Flatten(), nn.Linear(144, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # relay: was DataLoader(train_set, batch_size=args.batch, shuffle=True, collate_fn=collate); each iteration is
    # the rest of the current epoch, in an order that is a function of the step
    train_loader = session.dataloader(train_set, args.batch, drop_last=False, collate_fn=collate)
    test_loader = DataLoader(test_set, batch_size=50, collate_fn=collate,
                             generator=torch.Generator().manual_seed(0))  # relay: its seed not from the global RNG
    session.register(model=model, optimizer=opt)  # relay
    session.restore()  # relay

    for epoch in range(session.epoch, args.epochs):  # relay: from the restored step's epoch (was range(args.epochs))
        if session.should_stop():  # relay: a session ends at an epoch's end
            break
        model.train()
        for x, y in train_loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step_done(loss=loss.detach())  # relay
        if not session.epoch_end:  # relay: the session stopped inside the epoch
            break
        session.log("eval", accuracy=test(model, test_loader, epoch))  # relay: was test(model, test_loader, epoch)
    session.close()  # relay


if __name__ == "__main__":
    main()

"""Collaborative filtering (seed 000): truncated SVD, item-KNN and ALS on a float32 CSR ratings matrix.

None of the three is gradient descent, so all are `fit` stages (relay.kernel.session.stages): the recipe does each
step and keeps everything it learns in the model's buffers, which the runtime checkpoints like any weights.
SVD is one step, the item-KNN similarity one step, each ALS iteration one step (users then items solved in
closed form), so a session can end between any two iterations and the next one resumes with the same factor
matrices. The spec's `optim.max_steps` is 2 + the ALS iterations (the seed: 2 + 5).

Seed settings: usecols + int32/float32 read straight into CSR, the user cap by seeded sampling (5000), SVD
with 30 components, item-KNN with 15 neighbours whose similarity is accumulated in batches of 500 users (on
the GPU only when users x items is under 10M elements), ALS with 30 factors. Evaluation: RMSE on held-out
ratings and precision@10 (held-out ratings >= 4 as the relevant items) for the model of the current stage,
and the process's peak RSS.
"""
from __future__ import annotations

import json
import logging
import resource
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from relay.kernel.recipes import recsys_data
from relay.kernel.recipes.base import Recipe
from relay.kernel.recipes.recsys_data import CSR
from relay.kernel.session.stages import Stage
from relay.shared.errors import InputError
from relay.shared.params import RecsysParams

log = logging.getLogger(__name__)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class RecsysModel(nn.Module):
    """Everything the fits learn, as buffers: checkpointed, hashed (weights_sha256) and exported like weights."""

    def __init__(self, n_users: int, n_items: int, p: RecsysParams):
        super().__init__()
        k, f, n = min(p.svd_components, n_users, n_items), p.als_factors, min(p.knn_neighbors, n_items - 1)
        for name, shape, dtype in [("user_ids", (n_users,), torch.int64), ("item_ids", (n_items,), torch.int64),
                                   ("user_mean", (n_users,), torch.float32),
                                   ("svd_user", (n_users, k), torch.float32), ("svd_item", (n_items, k), torch.float32),
                                   ("knn_index", (n_items, n), torch.int64), ("knn_sim", (n_items, n), torch.float32)]:
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))
        # ALS starts from small random factors (the runtime seeds torch before build_model).
        self.register_buffer("als_user", 0.1 * torch.randn(n_users, f))
        self.register_buffer("als_item", 0.1 * torch.randn(n_items, f))


class RecsysRecipe(Recipe):
    name = "recsys"
    Params = RecsysParams
    metric = "rmse"
    metric_mode = "min"
    params: RecsysParams

    # -------------------------------------------------------------------------------------------------- data
    def prepare(self) -> None:
        p = self.params
        path = self.data_dir / p.ratings_file
        frame = recsys_data.read_ratings(path)
        rng = np.random.default_rng(p.sample_seed)
        users = np.unique(frame["userId"].to_numpy())
        if p.max_users is not None and len(users) > p.max_users:  # the seed's user cap, by seeded sampling
            keep = rng.choice(users, p.max_users, replace=False)
            frame = frame[np.isin(frame["userId"].to_numpy(), keep)]
            log.info("user cap: %d of %d users sampled", p.max_users, len(users))
        user_ids, u = np.unique(frame["userId"].to_numpy(), return_inverse=True)
        item_ids, i = np.unique(frame["movieId"].to_numpy(), return_inverse=True)
        key = u.astype(np.int64) * len(item_ids) + i
        _, first, counts = np.unique(key, return_index=True, return_counts=True)
        if (counts > 1).any():
            dup = np.flatnonzero(key == key[first[counts > 1][0]])
            raise InputError(f"{path}: line {int(frame.index[dup[1]]) + 2}: user {user_ids[u[dup[1]]]} rated movie "
                             f"{item_ids[i[dup[1]]]} again (first on line {int(frame.index[dup[0]]) + 2})")
        rating = frame["rating"].to_numpy(np.float32)
        held = rng.random(len(rating)) < p.eval_fraction
        held[np.unique(u, return_index=True)[1]] = False  # every user keeps a training rating
        trained_items = np.zeros(len(item_ids), dtype=bool)
        trained_items[i[~held]] = True
        test = held & trained_items[i]  # items never seen in training cannot be scored
        train = ~held
        if test.sum() == 0:
            raise InputError(f"{path}: {len(rating)} ratings leave an empty held-out split (eval_fraction "
                             f"{p.eval_fraction}); add ratings or raise params.eval_fraction")
        shape = (len(user_ids), len(item_ids))
        self.user_ids, self.item_ids = user_ids, item_ids
        self.train = CSR.from_coo(u[train], i[train], rating[train], shape)
        self.train_by_item = self.train.transpose()
        self.train_keys = self.train.keys()
        counts_u = np.diff(self.train.indptr)
        self.user_mean = (np.add.reduceat(self.train.data, self.train.indptr[:-1]) / counts_u).astype(np.float32)
        self.residual = self.train.data - np.repeat(self.user_mean, counts_u)  # ratings minus the user's mean
        self.residual_by_item = CSR.from_coo(self.train.indices.astype(np.int64), self.train.row_ids(),
                                             self.residual, (shape[1], shape[0])).data
        self.test_u, self.test_i, self.test_r = u[test].astype(np.int64), i[test].astype(np.int64), rating[test]
        self.precision_users = np.sort(rng.permutation(np.unique(self.test_u))[: p.eval_users])
        self.active = "svd"
        log.info("ratings: %d train, %d held out, %d users x %d items; CSR %.1f MB; peak RSS %.0f MB",
                 self.train.nnz, len(self.test_r), *shape, self.train.nbytes / 2**20, peak_rss_mb())

    def train_dataset(self) -> Dataset:  # the runtime lays out steps over it; fit stages read the CSR instead
        return TensorDataset(torch.from_numpy(self.train.row_ids()), torch.from_numpy(self.train.indices.astype(np.int64)))

    def eval_dataset(self) -> Dataset:
        return TensorDataset(torch.from_numpy(self.test_u), torch.from_numpy(self.test_i), torch.from_numpy(self.test_r))

    def collate(self, items):
        columns = list(zip(*items))
        batch = {"user": torch.stack(columns[0]), "item": torch.stack(columns[1])}
        if len(columns) > 2:
            batch["rating"] = torch.stack(columns[2])
        return batch

    def build_model(self) -> nn.Module:
        model = RecsysModel(len(self.user_ids), len(self.item_ids), self.params)
        model.user_ids.copy_(torch.from_numpy(self.user_ids.astype(np.int64)))
        model.item_ids.copy_(torch.from_numpy(self.item_ids.astype(np.int64)))
        model.user_mean.copy_(torch.from_numpy(self.user_mean))
        return model

    def loss(self, model, batch):  # every stage is a fit stage
        raise NotImplementedError("recsys trains by fit_step only")

    # ----------------------------------------------------------------------------------------------- stages
    def stages(self) -> list[Stage]:
        return [Stage("svd", 1, fit=True), Stage("knn", 1, fit=True), Stage("als", fit=True)]

    def begin_stage(self, model: nn.Module, stage: Stage) -> None:
        self.active = stage.name

    def fit_step(self, model: nn.Module, stage: Stage, step: int) -> float:
        with torch.autocast(model.user_mean.device.type, enabled=False):
            {"svd": self._fit_svd, "knn": self._fit_knn, "als": self._als_iteration}[stage.name](model)
            return self._train_rmse(model)

    def _residual_matrix(self, device, transpose: bool = False) -> torch.Tensor:
        m = self.train_by_item if transpose else self.train
        values = self.residual_by_item if transpose else self.residual
        with warnings.catch_warnings():  # "sparse CSR support is in beta": matmul with a dense matrix is all we use
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(torch.from_numpy(m.indptr), torch.from_numpy(m.indices.astype(np.int64)),
                                           torch.from_numpy(values), m.shape, device=device)

    def _fit_svd(self, model: RecsysModel) -> None:
        """Randomised truncated SVD (Halko et al.) of the mean-centred ratings, seeded by the run seed."""
        device, k = model.svd_user.device, model.svd_user.shape[1]
        x, xt = self._residual_matrix(device), self._residual_matrix(device, transpose=True)
        width = min(k + 10, *self.train.shape)
        g = torch.Generator().manual_seed(self.seed)
        q = torch.linalg.qr(x @ torch.randn(self.train.shape[1], width, generator=g).to(device)).Q
        for _ in range(4):  # power iterations sharpen the spectrum
            q = torch.linalg.qr(x @ torch.linalg.qr(xt @ q).Q).Q
        u_small, s, vt = torch.linalg.svd((xt @ q).T, full_matrices=False)
        model.svd_user.copy_((q @ u_small[:, :k]) * s[:k])
        model.svd_item.copy_(vt[:k].T)

    def _fit_knn(self, model: RecsysModel) -> None:
        """Cosine similarity of item columns, accumulated over batches of users; top-n neighbours per item."""
        p, (n_users, n_items) = self.params, self.train.shape
        on_gpu = model.knn_sim.device.type == "cuda" and n_users * n_items < p.gpu_max_elements
        device = model.knn_sim.device if on_gpu else torch.device("cpu")
        sim = torch.zeros(n_items, n_items, device=device)
        for start in range(0, n_users, p.knn_user_batch):
            dense = self._dense_rows(start, min(start + p.knn_user_batch, n_users), device)
            sim.addmm_(dense.T, dense)
        norms = sim.diagonal().clamp(min=1e-12).sqrt()
        sim /= norms[:, None] * norms[None, :]
        sim.fill_diagonal_(-float("inf"))
        top = sim.topk(model.knn_index.shape[1], dim=1)
        model.knn_sim.copy_(top.values.clamp(min=0.0))  # negative correlations do not vote
        model.knn_index.copy_(top.indices)
        del sim

    def _dense_rows(self, start: int, end: int, device, values: np.ndarray | None = None) -> torch.Tensor:
        lo, hi = self.train.indptr[start], self.train.indptr[end]
        rows = torch.from_numpy(self.train.row_ids()[lo:hi] - start)
        cols = torch.from_numpy(self.train.indices[lo:hi].astype(np.int64))
        dense = torch.zeros(end - start, self.train.shape[1])
        dense[rows, cols] = torch.from_numpy((self.residual if values is None else values)[lo:hi])
        return dense.to(device)

    def _als_iteration(self, model: RecsysModel) -> None:
        self._solve(model.als_user, model.als_item, self.train, self.residual)
        self._solve(model.als_item, model.als_user, self.train_by_item, self.residual_by_item)

    def _solve(self, target: torch.Tensor, fixed: torch.Tensor, m: CSR, values: np.ndarray) -> None:
        """Each row of `target`: argmin sum (r - <x, y_j>)^2 + reg n |x|^2 over its n rated j (ALS-WR's weighted
        regularisation: rows with many ratings are not shrunk more than rows with few), in chunks of rows."""
        f, device = fixed.shape[1], fixed.device
        # A row with no ratings (an item only in the held-out split) gets reg * I, not a singular 0: its factors are 0.
        counts = torch.from_numpy(np.diff(m.indptr).astype(np.float32)).clamp(min=1.0).to(device)
        eye = torch.eye(f, device=device)
        row = 0
        while row < m.shape[0]:
            end = int(np.searchsorted(m.indptr, m.indptr[row] + self.params.als_chunk_nnz, side="right")) - 1
            end = max(end, row + 1)
            lo, hi = m.indptr[row], m.indptr[end]
            local = torch.from_numpy(m.row_ids()[lo:hi] - row).to(device) if hi > lo else None
            a = (self.params.als_reg * counts[row:end, None, None]) * eye
            b = torch.zeros(end - row, f, device=device)
            if local is not None:
                y = fixed[torch.from_numpy(m.indices[lo:hi].astype(np.int64)).to(device)]
                a.index_add_(0, local, y[:, :, None] * y[:, None, :])
                b.index_add_(0, local, y * torch.from_numpy(values[lo:hi]).to(device)[:, None])
            target[row:end] = torch.linalg.solve(a, b)
            row = end

    # --------------------------------------------------------------------------------------------- predict
    def predict_pairs(self, model: RecsysModel, users: torch.Tensor, items: torch.Tensor, stage: str) -> torch.Tensor:
        base = model.user_mean[users]
        if stage == "svd":
            return base + (model.svd_user[users] * model.svd_item[items]).sum(-1)
        if stage == "als":
            return base + (model.als_user[users] * model.als_item[items]).sum(-1)
        neighbours, sims = model.knn_index[items], model.knn_sim[items]  # (P, n)
        keys = (users[:, None] * self.train.shape[1] + neighbours).cpu().numpy()
        pos = np.searchsorted(self.train_keys, keys).clip(max=len(self.train_keys) - 1)
        found = torch.from_numpy(self.train_keys[pos] == keys).to(users.device)
        resid = torch.from_numpy(self.residual[pos]).to(users.device) * found
        weights = sims * found
        return base + (weights * resid).sum(-1) / (weights.sum(-1) + self.params.knn_shrinkage + 1e-6)

    def _train_rmse(self, model: RecsysModel) -> float:
        device = model.user_mean.device
        se = 0.0
        for lo in range(0, self.train.nnz, 200_000):
            hi = min(lo + 200_000, self.train.nnz)
            users = torch.from_numpy(self.train.row_ids()[lo:hi]).to(device)
            items = torch.from_numpy(self.train.indices[lo:hi].astype(np.int64)).to(device)
            truth = torch.from_numpy(self.train.data[lo:hi]).to(device)
            se += float(((self.predict_pairs(model, users, items, self.active) - truth) ** 2).sum())
        return (se / self.train.nnz) ** 0.5

    def _precision_at_k(self, model: RecsysModel) -> float:
        p, device = self.params, model.user_mean.device
        hits, counted = 0, 0
        relevant = self.test_r >= p.relevant_rating
        for start in range(0, len(self.precision_users), p.knn_user_batch):
            users = self.precision_users[start: start + p.knn_user_batch]
            scores = self._user_scores(model, users, device).cpu()
            for row, u in enumerate(users):
                rated = self.train.indices[self.train.indptr[u]: self.train.indptr[u + 1]]
                scores[row, torch.from_numpy(rated.astype(np.int64))] = -float("inf")
                liked = set(self.test_i[(self.test_u == u) & relevant].tolist())
                if liked:
                    top = scores[row].topk(min(p.precision_k, scores.shape[1])).indices.tolist()
                    hits += len(liked.intersection(top))
                    counted += 1
        return hits / (counted * p.precision_k) if counted else float("nan")

    def _user_scores(self, model: RecsysModel, users: np.ndarray, device) -> torch.Tensor:
        """Predicted ratings of every item for a batch of users (rows), by the active stage's model."""
        idx = torch.from_numpy(users.astype(np.int64)).to(device)
        base = model.user_mean[idx][:, None]
        if self.active in ("svd", "als"):
            left, right = (model.svd_user, model.svd_item) if self.active == "svd" else (model.als_user, model.als_item)
            return base + left[idx] @ right.T
        # item-KNN: sparse neighbour matrix W (item -> its neighbours), weighted mean of the user's residuals
        n_items, n = model.knn_index.shape
        rows = torch.arange(n_items, device=device).repeat_interleave(n)
        w = torch.sparse_coo_tensor(torch.stack([rows, model.knn_index.reshape(-1)]), model.knn_sim.reshape(-1),
                                    (n_items, n_items), check_invariants=False)  # in range: built from topk
        resid, mask = torch.zeros(len(users), n_items, device=device), torch.zeros(len(users), n_items, device=device)
        for row, u in enumerate(users):
            lo, hi = self.train.indptr[u], self.train.indptr[u + 1]
            cols = torch.from_numpy(self.train.indices[lo:hi].astype(np.int64)).to(device)
            resid[row, cols] = torch.from_numpy(self.residual[lo:hi]).to(device)
            mask[row, cols] = 1.0
        num, den = torch.sparse.mm(w, resid.T).T, torch.sparse.mm(w, mask.T).T
        return base + num / (den + self.params.knn_shrinkage + 1e-6)

    def evaluate(self, model: nn.Module, batches: Iterable) -> dict[str, float]:
        with torch.autocast(model.user_mean.device.type, enabled=False):
            se, n = 0.0, 0
            for b in batches:
                se += float(((self.predict_pairs(model, b["user"], b["item"], self.active) - b["rating"]) ** 2).sum())
                n += len(b["rating"])
            rmse = (se / n) ** 0.5
            baseline = float(np.sqrt(np.mean((self.user_mean[self.test_u] - self.test_r) ** 2)))
            return {"loss": se / n, "rmse": rmse, f"rmse_{self.active}": rmse, "rmse_user_mean": baseline,
                    f"precision_at_{self.params.precision_k}": self._precision_at_k(model), "peak_rss_mb": peak_rss_mb()}

    def export(self, model: nn.Module, out_dir: Path) -> None:
        from safetensors.torch import save_model

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, str(out_dir / "model.safetensors"))
        config = {"recipe": self.name, "params": self.params.model_dump(), "n_users": len(self.user_ids),
                  "n_items": len(self.item_ids)}
        (out_dir / "config.json").write_text(json.dumps(config, indent=1))


def load_exported(out_dir: Path) -> RecsysModel:
    from safetensors.torch import load_model

    config = json.loads((Path(out_dir) / "config.json").read_text())
    model = RecsysModel(config["n_users"], config["n_items"], RecsysParams(**config["params"]))
    load_model(model, str(Path(out_dir) / "model.safetensors"))
    return model

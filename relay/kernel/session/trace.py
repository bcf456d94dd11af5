"""Per-step fingerprints that let `relay verify-resume` say WHY a split run left the straight one.

Under `relay verify-resume` (env RELAY_TRACE names a file) the Session API appends one JSON line per step:
digests of every registered object's state (whole, and field by field: `optimizer.param_groups[0].lr`) and of
the RNGs at the step's start, of the batch indices the step trained on as they were drawn (session.batches, or
each step that session.batch_sampler yields to a DataLoader, or the batches an HF Trainer's own loaders draw
over its train set, in the order drawn, so a loader that fetches ahead still pairs each step with its own batch;
unknown, and never compared, when the script draws its batches otherwise), the loss, whether the step was the
first after a resume, where the script made a DataLoader iterator without generator= (it draws its seed from the
global RNG), and, once per session, the objects in the script's frame that have a state_dict but were not
registered. Nothing is recorded otherwise. `diagnose` compares two traces and names the first step and what
differed there.
"""
from __future__ import annotations

import hashlib
import json
from collections import deque
from pathlib import Path
from typing import Any, Optional
from relay.shared import environment
from relay.shared.environment import SessionEnvironment

ENV = environment.TRACE


def digest(value: Any) -> str:
    """A stable fingerprint of nested state: dicts, lists, tensors (bytes, dtype, shape), numpy arrays, scalars."""
    h = hashlib.sha1()
    _feed(h, value)
    return h.hexdigest()[:16]


def _feed(h, value: Any) -> None:
    import numpy as np
    import torch

    if isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"[{len(value)}".encode())
        for item in value:
            _feed(h, item)
    elif torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray):
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    else:
        h.update(repr(value).encode())


# a trainer's checkpoint file packed as a registered object's state (Accelerate's save_state, HF's checkpoint-N)
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".json", ".bin", ".ckpt", ".pkl")


def is_packed_file(key: Any, value: Any) -> bool:
    import torch

    return (isinstance(key, str) and key.endswith(_FILE_SUFFIXES) and torch.is_tensor(value)
            and value.dtype == torch.uint8)


def decode_packed(name: str, data) -> Any:
    """A packed file's content, compared by value (a tensor file byte for byte would hide which tensor); the
    bytes themselves when it does not open as its suffix says."""
    import io
    import pickle

    import torch

    raw = data.numpy().tobytes()
    try:
        if name.endswith(".safetensors"):
            from safetensors.torch import load

            return load(raw)
        if name.endswith(".json"):
            return json.loads(raw)
        # the user's own trainer wrote these files in this very verification: trusted, and RNG files hold numpy
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        except Exception:  # noqa: BLE001 - a .pkl written by pickle itself
            if name.endswith(".pkl"):
                return pickle.loads(raw)
            raise
    except Exception:  # noqa: BLE001
        return data


def field_digests(value: Any, path: str = "", out: Optional[dict] = None) -> dict:
    """{field path: digest} of each leaf of a state (`param_groups[0].lr`, `state.0.exp_avg`); a packed trainer
    file is opened, so a field inside it is named (`random_states_0.pkl.step`)."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            where = f"{path}.{key}" if path else str(key)
            item = value[key]
            field_digests(decode_packed(key, item) if is_packed_file(key, item) else item, where, out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (dict, list, tuple)) for v in value):
        for i, item in enumerate(value):
            field_digests(item, f"{path}[{i}]", out)
    else:
        out[path] = digest(value)
    return out


class StepTrace:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._start: dict = {}
        self._direct: Optional[tuple[int, str]] = None  # (step, digest) of session.batch_indices' last call
        self._drawn: deque = deque()  # digests of the steps a batch_sampler yielded, not yet trained
        self._resumed = False
        self._session = None  # set by restore(): its first step's state is taken again at its first draw
        self._restored: Optional[dict] = None  # digests as restore() left them, when a draw took them again
        self._watched = None  # a trainer's train set (HF's Trainer makes its loaders): its draws are the steps'
        self._per_step, self._group, self._seen, self._iterator = 1, [], 0, None  # batches of the step in hand
        self._unregistered: Optional[dict] = None
        self._loaders: list = []  # where the step made DataLoader iterators that draw from the global RNG

    @classmethod
    def from_env(cls) -> Optional["StepTrace"]:
        path = SessionEnvironment.read().trace
        if not path:
            return None
        trace = cls(path)
        _watch_loaders(trace)
        return trace

    def loader_iter(self, where: str) -> None:
        self._loaders.append(where)

    def start(self, session, resumed: bool) -> None:
        """After restore(): the state the session's first step starts from, taken again when that step draws its
        batch (what the script did between restore() and its first step, a seed or a value set, is then in it)."""
        self._resumed = resumed
        self._capture(session)
        self._session = session

    def _first_draw(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            restored = {"objects": self._start["objects"], "rng": self._start["rng"]}
            self._capture(session)
            if restored != {"objects": self._start["objects"], "rng": self._start["rng"]}:
                self._restored = restored

    def batch(self, indices, step: int) -> None:
        """session.batch_indices: step `step`'s batch, drawn when the loop is at that step."""
        self._first_draw()
        self._direct = (step, digest([int(i) for i in indices]))

    def drawn(self, indices, first_draw: bool = True) -> None:
        """A step's batch as a batch_sampler yields it to its DataLoader: the steps train on them in this order."""
        if first_draw:
            self._first_draw()
        self._drawn.append(digest([int(i) for i in indices]))

    def new_stream(self) -> None:
        """A new iterator of a batch_sampler: what an earlier one drew and no step trained on is not trained on."""
        self._drawn.clear()
        self._group, self._seen = [], 0

    def watch_dataset(self, dataset, per_step: int) -> None:
        """A train set whose DataLoaders a trainer makes itself (HF's Trainer, skip_first_batches on a resume):
        each `per_step` batches its iterators draw are a step's (a step short of them at an epoch's end stays
        unknown). The state is not taken again at their first draw: the trainer puts its own RNG back then."""
        self._watched, self._per_step, self._group, self._seen = dataset, max(1, int(per_step)), [], 0

    def _micro_drawn(self, iterator: object, index) -> None:
        if iterator is not self._iterator:  # a new iterator (a new epoch, a resume's skipping one)
            self._iterator = iterator
            self.new_stream()
        self._group += [int(i) for i in (index if isinstance(index, (list, tuple)) else [index])]
        self._seen += 1
        if self._seen == self._per_step:
            group, self._group, self._seen = self._group, [], 0
            self.drawn(group, first_draw=False)

    def _step_batch(self, step: int) -> Optional[str]:
        if self._drawn:
            return self._drawn.popleft()
        if self._direct is not None and self._direct[0] == step:
            return self._direct[1]
        return None  # not drawn through the session: unknown, never compared

    def step_done(self, session, loss: Any, frame) -> None:
        """One line for the step just done (session.step before the increment), then the next step's start."""
        if self._unregistered is None:
            self._unregistered = _unregistered(session, frame)
        record = {"step": session.step, "resumed": self._resumed, **self._start,
                  "batch": self._step_batch(session.step), "loss": None if loss is None else float(loss)}
        if self._restored is not None:  # the script changed state after restore(), before this step
            record["restored"], self._restored = self._restored, None
        self._session = None
        if self._unregistered:
            record["unregistered"] = self._unregistered
            self._unregistered = {}
        if self._loaders:
            record["loaders"], self._loaders = self._loaders, []
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._resumed = False
        self._capture(session)

    def _capture(self, session) -> None:
        from relay.kernel.session.api_distributed import unwrap
        from relay.kernel.session.rng import rng_state

        states = {n: unwrap(o).state_dict() for n, o in session.objects.items()}
        self._start = {"objects": {n: digest(s) for n, s in states.items()},
                       "fields": {n: field_digests(s) for n, s in states.items()},
                       "rng": digest(rng_state(session._device()))}


def _watch_loaders(trace: StepTrace) -> None:
    """Tell `trace` of each DataLoader iterator made without generator=: `DataLoader.__iter__` then draws the
    iterator's base seed (and a shuffling sampler its order) from the global RNG, so a resumed session that
    makes one where the uninterrupted run did not draws other numbers. Patched under verify-resume only."""
    import os
    import sys

    import torch
    import torch.utils.data as tud

    real = getattr(tud.DataLoader.__iter__, "_relay_real", tud.DataLoader.__iter__)
    # the script's line that iterates it: the first frame outside torch and the relay (an integration's loop)
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def __iter__(loader):
        if loader.generator is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(skip):
                frame = frame.f_back
            trace.loader_iter(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?")
        return real(loader)

    __iter__._relay_real = real
    tud.DataLoader.__iter__ = __iter__

    # the batches of the train set a trainer iterates itself (StepTrace.watch_dataset), as its iterators draw them
    base = tud.dataloader._BaseDataLoaderIter
    real_next = getattr(base._next_index, "_relay_real", base._next_index)

    def _next_index(iterator):
        index = real_next(iterator)
        if trace._watched is not None and iterator._dataset is trace._watched:
            trace._micro_drawn(iterator.__dict__.setdefault("_relay_stream", object()), index)  # not id(): reused
        return index

    _next_index._relay_real = real_next
    base._next_index = _next_index


def _loader_steps(records: dict, upto: int) -> dict:
    """{step: [where ...]} of the DataLoader iterators without generator= made up to step `upto`."""
    return {s: r["loaders"] for s, r in records.items() if s <= upto and r.get("loaders")}


def _loader_cause(a: dict, b: dict, step: int) -> Optional[str]:
    """Why the runs part at `step` when, up to it, one run made DataLoader iterators drawing from the global RNG
    at a step where the other did not (a resumed session iterates its loader anew; a session that ends after
    making one does not take it along), else None."""
    straight, split = _loader_steps(a, step), _loader_steps(b, step)
    parted = sorted(s for s in set(straight) | set(split) if len(straight.get(s, ())) != len(split.get(s, ())))
    if not parted:
        return None
    first = parted[0]
    more, fewer = ("split", "straight") if len(split.get(first, ())) > len(straight.get(first, ())) else \
        ("straight", "split")
    at = (split if more == "split" else straight)[first][0]
    return (f"{at} iterates a DataLoader without generator=: each new iterator draws its base seed from the global"
            f" RNG (torch.empty((), dtype=torch.int64).random_()), and a shuffling sampler its order too; the"
            f" {more} run made one at step {first} where the {fewer} run did not, so their RNG and data order went"
            " different ways. Give the DataLoader generator=torch.Generator().manual_seed(seed + epoch), made"
            " anew each epoch, or take the batches from session.batches / session.batch_sampler.")


def _unregistered(session, frame) -> dict:
    """{name: type} of the objects with state in the script's frame that the session does not save."""
    import torch

    if frame is None or str(frame.f_globals.get("__name__", "")).startswith("relay."):
        return {}  # called from a relay integration (HF, Lightning): the trainer owns the objects
    covered = {id(o) for o in session.objects.values()}
    for obj in session.objects.values():
        if isinstance(obj, torch.nn.Module):
            covered |= {id(m) for m in obj.modules()}
    found = {}
    for name, value in {**frame.f_globals, **frame.f_locals}.items():
        if isinstance(value, type) or id(value) in covered or value is session or name.startswith("__"):
            continue
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            found[name] = type(value).__name__
    return found


def read(path: Path) -> dict:
    """step -> record; a step trained again after a kill keeps its last record (the lineage that went on)."""
    records = {}
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                records[r["step"]] = r
    return records


def diagnose(straight: Path, split: Path) -> Optional[str]:
    """The first step at which the split run leaves the straight one, what differed there, and the likely
    cause in words; None when the traces agree (or the script does not use the Session API)."""
    a, b = read(straight), read(split)
    unregistered = {}
    for r in (*a.values(), *b.values()):
        unregistered.update(r.get("unregistered") or {})
    hint = (f" Objects with state in the script that the session does not save: "
            f"{', '.join(f'{n} ({t})' for n, t in sorted(unregistered.items()))}: register them"
            f" (session.register({', '.join(f'{n}={n}' for n in sorted(unregistered))}))." if unregistered else "")
    for step in sorted(set(a) & set(b)):
        ra, rb = a[step], b[step]
        where = f"step {step} ({'the first after a resume' if rb.get('resumed') else 'inside a session'})"
        objects = sorted(n for n in ra["objects"] if ra["objects"][n] != rb["objects"].get(n))
        # a batch is compared only when both runs drew it through the session: an unknown one is not a difference
        batch_known = ra.get("batch") is not None and rb.get("batch") is not None
        batch_differs = batch_known and ra["batch"] != rb["batch"]
        if objects or ra["rng"] != rb["rng"] or batch_differs or ra["loss"] != rb["loss"]:
            loader = _loader_cause(a, b, step)
            if loader:  # the runs part here, and the split run's fresh iterators drew from the global RNG
                return f"{where}: {loader}" + hint
        differ = "differs" if len(objects) == 1 else "differ"
        named = ", ".join(_named(n, ra, rb) for n in objects)
        restored = rb.get("restored") or {"objects": rb["objects"], "rng": rb["rng"]}  # as restore() left them
        if objects and rb.get("resumed") and all(restored["objects"].get(n) == ra["objects"][n] for n in objects):
            return (f"{where}: {named} {differ} at the step's start, although restore() brought back the straight"
                    f" run's: the script changes {'it' if len(objects) == 1 else 'them'} after restore(), before"
                    " its first step, where the uninterrupted run did not: set it before restore() (restore() then"
                    " brings back the saved value), or only on a fresh run (when restore() returns 0)." + hint)
        if ra["rng"] != rb["rng"] and rb.get("resumed") and restored["rng"] == ra["rng"]:
            head = (f"{where}: the RNG state at the step's start differs, although restore() brought back the"
                    " straight run's: the script")
            if rb["rng"] == a.get(0, {}).get("rng"):  # the state the straight run's first step began from: a seed
                return (f"{head} seeds (torch.manual_seed, set_seed) after restore(), before its first step. Seed"
                        " before restore() (it replaces the RNGs of a resumed session), or not at all (open_session()"
                        " seeds from the spec's seed)." + hint)
            return (f"{head} draws random numbers after restore(), before its first step: a prefetched batch (drawn"
                    " ahead of the loop, so a resumed session draws one the uninterrupted run never did) or another"
                    " draw the uninterrupted run made only once. Draw each step's data inside the step, or derive it"
                    " from session.batches." + hint)
        if objects and rb.get("resumed"):
            return (f"{where}: the restored {named} {differ} from the straight run's: a state_dict /"
                    " load_state_dict pair that does not carry all of the object's state." + hint)
        if objects:
            return (f"{where}: {named} {differ} at the step's start although step {step - 1} began"
                    f" equal: the update of step {step - 1} differed, or the script changed it outside the step"
                    " (after restore(), before its first step), so something that shapes it was not carried"
                    " across the resume (an unregistered scheduler, scaler or EMA, a value set after restore())."
                    + hint)
        if ra["rng"] != rb["rng"]:
            return (f"{where}: the RNG state at the step's start differs: the script draws random numbers"
                    " outside its steps (before restore(), or ahead of the step)." + hint)
        if batch_differs:
            return f"{where}: the batch indices differ: the data order is not a function of the step." + hint
        if ra["loss"] != rb["loss"]:
            same = "state, RNG and batch indices" if batch_known else "state and RNG"
            return (f"{where}: the same {same} gave a different loss ({ra['loss']} vs"
                    f" {rb['loss']}): the batch itself differs. The script draws from the global RNG outside"
                    " the step: a prefetched batch, drawn before the save and lost with the session; draw each"
                    " step's data inside the step, or derive it from session.batches." + hint)
    return None


def _named(name: str, ra: dict, rb: dict, shown: int = 3) -> str:
    """`optimizer (param_groups[0].lr)`: an object and the first fields of it that differ, when recorded."""
    fa, fb = (r.get("fields", {}).get(name) or {} for r in (ra, rb))
    paths = sorted(p for p in set(fa) | set(fb) if fa.get(p) != fb.get(p))
    if not paths:
        return name
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return f"{name} ({', '.join(paths[:shown])}{more})"

"""Checkpoints: everything a rank needs to continue a run bit for bit, written so a crash never leaves
one that looks complete.

Layout, under the run's checkpoint folder (`checkpoint_dir`, default `<run dir>/checkpoints`):

    step-00000030/             state after 30 steps (steps 0..29 done)
        .metadata, *.distcp    model + optimizer through torch.distributed.checkpoint (sharded for FSDP)
        rank-R.pt              rank R's own state: RNG states, the strategy's counters, the emulated
                               straggler's generator (torch.save of plain tensors and numbers)
        server-I.pt            parameter server I's shard, optimizer, version and per-worker clocks
        manifest.json          written last: step, experiment digest, every file's size and sha256,
                               and a MAC of all that under the run's checkpoint key

Every rank writes into `step-N.partial/`; rank 0 writes the manifest once every rank (and server)
is done and renames the folder into place: a folder named `step-N` is always complete (POSIX
rename is atomic), a `.partial` one is ignored. A checkpoint of another experiment, or one whose
files do not match its manifest, is refused with one line (CheckpointError).

The manifest cannot vouch for the folder it sits in: whoever can replace `.metadata` (which
torch.distributed.checkpoint unpickles) can rewrite its size and sha256 too. So the manifest is
signed (HMAC-SHA256) with a key that lives outside the folder: the store's secret, derived per run
(`run_key`), handed to the ranks in memory. A checkpoint whose MAC does not match, written by
another store or before checkpoints were signed, is refused before anything in it is unpickled.

The data order needs no saving: step k's batch is a function of (seed, k) (runtime/data.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddlscope.specs import ConfigError, Experiment

MANIFEST = "manifest.json"
FORMAT = 2  # 2: the manifest carries a MAC (format 1 checkpoints are unsigned and refused)
KEEP = 2  # complete checkpoints kept; older ones are removed once a newer one is in place


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: foreign, corrupt or incomplete (one line)."""


def experiment_digest(exp: Experiment) -> str:
    """What a checkpoint must agree with to be resumed: the experiment, but for fields that do not
    change the training (its name, where things are written, the fault and restart knobs)."""
    exclude = {"name": True, "checkpoint_dir": True, "save_model_path": True, "checkpoint_every": True,
               "checkpoint_every_s": True, "trace_steps": True,
               "cluster": {"faults", "max_restarts", "hang_timeout_s", "node_rank", "rdzv_endpoint"}}
    same = exp.model_dump(mode="json", exclude=exclude)
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]


def run_key(store_secret: bytes, run_uuid: str) -> bytes:
    """The key a run's checkpoints are signed with: one per run, so a checkpoint of one run does not
    pass for another's, from the store's secret (Store.checkpoint_secret)."""
    return hmac.new(store_secret, f"ddlscope checkpoint key of run {run_uuid}".encode(), hashlib.sha256).digest()


def _mac(key: bytes, manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "mac"}
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def checkpoint_root(exp: Experiment, run_dir: Path) -> Path:
    """Where a run's checkpoints go: the experiment's checkpoint_dir, or the run's own folder."""
    return Path(exp.checkpoint_dir) if exp.checkpoint_dir else run_dir / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}.partial"


# ---------------------------------------------------------------------------- per-rank state
def rng_state() -> dict[str, Any]:
    """Every random generator a rank draws from (python, torch CPU, CUDA when present)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": (version, list(internal), gauss), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_atomically(path: Path, obj: Any) -> None:
    """torch.save to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_trusted(path: Path) -> Any:
    """Our own rank/server state: tensors, numbers, lists and dicts only (weights_only, no pickle code)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # a truncated or foreign file: refuse it in one line
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}): "
                              "remove the checkpoint folder to start over") from None


# ---------------------------------------------------------------------------- model + optimizer
def save_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                     process_group: Any = None) -> None:
    """Model and optimizer through torch.distributed.checkpoint: each rank writes its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder),
             process_group=process_group)


def load_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                     process_group: Any = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder), process_group=process_group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ---------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def seal(root: Path, step: int, exp: Experiment, key: bytes) -> Path:
    """Rank 0, once every rank's files are in `step-N.partial`: write the manifest signed with `key`,
    rename into place, drop checkpoints older than the newest KEEP."""
    folder = partial_dir(root, step)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file()}
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "experiment": experiment_digest(exp), "files": files}
    manifest["mac"] = _mac(key, manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    final = step_dir(root, step)
    if final.exists():  # a restarted attempt saving the same step again: the new one wins
        shutil.rmtree(final)
    os.replace(folder, final)
    for old in complete_steps(root)[:-KEEP]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return final


def complete_steps(root: Path) -> list[int]:
    """Steps of the checkpoints in place (sealed folders), oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for path in root.glob("step-*"):
        if path.is_dir() and not path.name.endswith(".partial") and (path / MANIFEST).is_file():
            try:
                steps.append(int(path.name.removeprefix("step-")))
            except ValueError:
                continue
    return sorted(steps)


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    step: int  # steps done: training continues at this step


def latest_checkpoint(root: Path, exp: Experiment, *, key: bytes | None = None,
                      verify_files: bool = True) -> Checkpoint | None:
    """The newest complete checkpoint under `root`, checked against this experiment, its manifest and,
    with `key`, the manifest's MAC; None when there is none yet. Nothing in the folder is unpickled here.

    `key` None skips the MAC: only for a caller that reads nothing but weights_only files (the parameter
    servers' own state) and whose workers check it anyway before anything is unpickled."""
    steps = complete_steps(root)
    if not steps:
        return None
    folder = step_dir(root, steps[-1])
    manifest = read_manifest(folder)
    if key is not None and not hmac.compare_digest(str(manifest.get("mac", "")), _mac(key, manifest)):
        raise CheckpointError(f"checkpoint {folder}: its manifest is not signed by this store for this run (changed "
                              "since it was written, or written elsewhere); refusing to load it (docs/reliability.md)")
    if manifest["experiment"] != experiment_digest(exp):
        raise CheckpointError(f"checkpoint {folder} belongs to another experiment (digest {manifest['experiment']}, "
                              f"this one {experiment_digest(exp)}): point checkpoint_dir elsewhere")
    if verify_files:
        for name, expected in manifest["files"].items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
                raise CheckpointError(f"checkpoint {folder}: {name} does not match its manifest (corrupt or changed); "
                                      "remove the folder to fall back to an older one")
    return Checkpoint(folder, manifest["step"])


def read_manifest(folder: Path) -> dict[str, Any]:
    """A checkpoint's manifest, its shape checked (a hand-edited one is refused in one line)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {folder}: unreadable manifest ({exc}); remove the folder") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {folder}: manifest is a JSON {type(manifest).__name__}, not an object; "
                              "remove the folder")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {folder}: format {manifest.get('format')!r}, this ddlscope reads {FORMAT} "
                              "(signed manifests)")
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint {folder}: manifest {problem}; remove the folder")
    return manifest


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    step, files = manifest.get("step"), manifest.get("files")
    if type(step) is not int or step < 0:
        return f"step is {step!r}, not a whole number >= 0"
    if not isinstance(manifest.get("experiment"), str):
        return f"experiment is {manifest.get('experiment')!r}, not a digest"
    if not isinstance(files, dict):
        return f"files is a {type(files).__name__}, not a mapping of file names"
    for name, entry in files.items():
        if "/" in name or name in (".", "..") or not isinstance(entry, dict) \
                or type(entry.get("bytes")) is not int or not isinstance(entry.get("sha256"), str):
            return f"entry {name!r} is not a file name with its bytes and sha256"
    return None


# ---------------------------------------------------------------------------- the training loop's side
class Checkpointer:
    """When to checkpoint, and saving and restoring one rank's part (workers; servers: runtime/ps_server.py).

    `every_steps` and `every_s` are the experiment's `checkpoint_every` and `checkpoint_every_s`; a
    time-based checkpoint is agreed by all workers (one one-element all-reduce per step, only when
    `every_s` is set), since their clocks differ. `final`: also checkpoint after the last step (when
    the user named `checkpoint_dir`). `key`: the run's checkpoint key (run_key); the ranks of node 0
    have it, those of other nodes (no store there) get b"" and trust the manifest rank 0 verified.
    """

    def __init__(self, root: Path, exp: Experiment, rank: int, device: torch.device, group: Any = None,
                 final: bool = False, key: bytes = b""):
        self.root, self.exp, self.rank, self.device, self.group = root, exp, rank, device, group
        self.key = key
        self.every_steps, self.every_s = exp.checkpoint_every, exp.checkpoint_every_s
        self.final = final
        self._last_s = time.monotonic()

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_s or self.final)

    def due(self, steps_done: int) -> bool:
        """Whether to checkpoint now, after `steps_done` steps (every worker gets the same answer)."""
        last = steps_done == self.exp.workload.steps
        if last:
            return self.final
        if self.every_steps and steps_done % self.every_steps == 0:
            return True
        if not self.every_s:
            return False
        import torch.distributed as dist

        flag = torch.tensor([float(time.monotonic() - self._last_s >= self.every_s)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def save(self, steps_done: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             rank_state: dict[str, Any]) -> Path | None:
        """Write this rank's part of the checkpoint after `steps_done` steps; rank 0 seals it.
        Returns the sealed folder on rank 0, None elsewhere."""
        folder = partial_dir(self.root, steps_done)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / f"rank-{self.rank}.pt", {"step": steps_done, **rank_state})
        # dcp.save ends with a collective: when it returns on rank 0, every worker's files are written.
        # Servers wrote theirs before answering the step just finished.
        save_model_state(model, optimizer, folder, self.group)
        self._last_s = time.monotonic()
        return seal(self.root, steps_done, self.exp, self.key) if self.rank == 0 else None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
        """Load the newest checkpoint into the model and optimizer: (steps done, this rank's own state);
        (0, {}) when there is none."""
        found = self._verified_latest()
        if found is None:
            return 0, {}
        rank_path = found.folder / f"rank-{self.rank}.pt"
        if not rank_path.is_file():
            raise CheckpointError(f"checkpoint {found.folder} has no state for rank {self.rank}: "
                                  "was it written with another world size?")
        load_model_state(model, optimizer, found.folder, self.group)
        self._last_s = time.monotonic()
        return found.step, load_trusted(rank_path)


    def _verified_latest(self) -> Checkpoint | None:
        """The newest checkpoint, its MAC checked before dcp.load unpickles its `.metadata`: here with the
        key, and on a rank without one (another node) by holding the same manifest as rank 0, which
        checked it (sha256 of the manifest's bytes, broadcast as a tensor: no pickle)."""
        import torch.distributed as dist

        if self.rank == 0 and not self.key:
            raise CheckpointError("rank 0 has no checkpoint key: cannot verify or sign checkpoints")
        found = latest_checkpoint(self.root, self.exp, key=self.key or None)
        mine = hashlib.sha256((found.folder / MANIFEST).read_bytes()).digest() if found else bytes(32)
        if not dist.is_initialized():
            return found
        agreed = torch.tensor(list(mine), dtype=torch.uint8, device=self.device)
        dist.broadcast(agreed, src=0, group=self.group)
        if bytes(agreed.tolist()) != mine:
            where = found.folder if found else self.root
            raise CheckpointError(f"rank {self.rank}: checkpoint {where} is not the one rank 0 verified "
                                  "(changed, or another folder); refusing to load it")
        return found


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """A hash of a full (unsharded) state dict: names, dtypes, shapes and bytes, in name order, so it
    does not depend on how the model was sharded, wrapped or saved."""
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()

"""`ddlscope.attach`: ddlscope's per-rank, per-step measurements inside a training loop it did not write.

    meter = ddlscope.attach(model, optimizer, run="my-job")
    for x, y in loader:
        with meter.step(samples=len(x)) as step:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step.loss = loss

From hooks on the model and the optimizer each step is split into the phases `ddlscope run` records,
contiguous, so they add up to the step's wall time:

    data         from the previous step's end to the model's forward (the loader's wait is here)
    forward      the model's forward and the loss, to the first gradient of the model's output
    backward     to the end of autograd's backward pass
    synchronize  from there to `optimizer.step` (a DDP reducer still waiting, gradient clipping)
    optimizer    `optimizer.step` to the end of the `with` block (zero_grad included)

Communication is timed where it is issued: a DDP model's gradient buckets through a timing comm hook
(torch's default all-reduce inside), an FSDP2 model's all-gathers and reduce-scatters through
FSDP's custom-collective hooks; bytes and overlap are accounted by strategies/comm.py as for
ddlscope's own runs. Memory by category is measured on the second step, model FLOPs on the first
step of each new input shape (FlopCounterMode over the step itself; that step is slower).

The rows go to the same per-rank files `ddlscope run` writes. Under `ddlscope launch` the launcher
owns the store (runtime/script.py); under plain `torchrun` or `python`, rank 0 creates the run at
the first step and ingests every rank's file when the job closes the meter (or exits); a job killed
before that is recovered by the next ddlscope command, as any run whose launcher died.
Nothing is written before the first step, so a script that fails earlier leaves no run behind.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddlscope.runtime.heartbeat import Heartbeat
from ddlscope.runtime.instrument import (
    ActivationMeter, gradient_bytes, optimizer_state_bytes, parameter_bytes, peak_process_bytes)
from ddlscope.runtime.rows import RowWriter, done_pids, leave_done_marker, rank_file, run_dir_for
from ddlscope.runtime.sinks import SinkChoice, Sinks, choose_sinks, run_label
from ddlscope.runtime.timer import PhaseTimer, step_phases
from ddlscope.runtime.trace import StepTracer, traces_dir_for
from ddlscope.specs import ConfigError
from ddlscope.store import DEFAULT_DB
from ddlscope.workloads.model_table import flat_tensors
from ddlscope.strategies.base import AttachedCommStats
from ddlscope.strategies.comm import CommRecorder

clock = time.perf_counter

# Set by `ddlscope launch` (runtime/script.py) in every rank it starts.
RUN_DIR_ENV = "DDLSCOPE_RUN_DIR"
RUN_NAME_ENV = "DDLSCOPE_RUN_NAME"
TRACE_STEPS_ENV = "DDLSCOPE_TRACE_STEPS"
# The store a job outside `ddlscope launch` writes to (default: store.DEFAULT_DB).
DB_ENV = "DDLSCOPE_DB"
ATTACHED_EVENT = "attached"  # the first record of every attached rank's file: what the job is
MEMORY_STEP = 1  # the first step pays one-off costs (DDP's bucket rebuild, lazy state)
MAX_COUNTED_SHAPES = 8  # FLOPs are counted on the first step of each new input shape, up to this many
CLOSE_WAIT_S = 120.0
UNKNOWN_STEPS = 1 << 62  # an attached loop's length is its own: the tracer only needs it to be long  # rank 0 waits this long at close for the other ranks' files
# Set by `ddlscope launch --log` in its ranks: the launcher feeds the sinks, so `attach(log=...)` leaves them to it.
LAUNCHER_LOGS_ENV = "DDLSCOPE_LAUNCHER_LOGS"


class AttachError(ConfigError):
    """A misuse of the attach API: one line, as every user error."""


_current: "Meter | None" = None
_current_lock = threading.Lock()


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, *, run: str | None = None,
           db: str | os.PathLike[str] | None = None, log: str | None = None,
           log_dir: str | os.PathLike[str] | None = None, trace_steps: int | None = None) -> "Meter":
    """Measure `model` and `optimizer` in the caller's own loop; mark each step with `meter.step()`.

    `run`: the run's name (default: the script's file name). `db`: the store for a job not started by
    `ddlscope launch` (default: $DDLSCOPE_DB, else the store's default in the working folder). Call it after
    `torch.distributed.init_process_group` and after wrapping the model (DDP, `fully_shard`), once per
    process. `log`: sinks rank 0 also writes each step to, "tensorboard,mlflow,wandb" or some of them
    (runtime/sinks.py), under `log_dir` (default: ddlscope-logs beside the store). `trace_steps`: profile
    steps 1..N with torch.profiler, for `ddlscope trace RUN` (default: $DDLSCOPE_TRACE_STEPS, which
    `ddlscope launch --trace` sets, else none).
    """
    global _current
    if not isinstance(model, nn.Module):
        raise AttachError(f"ddlscope.attach: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AttachError(f"ddlscope.attach: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    with _current_lock:
        if _current is not None and not _current.closed:
            raise AttachError("ddlscope.attach was called twice in this process: attach once, after wrapping the "
                              "model, and reuse the meter it returned")
        steps = trace_steps if trace_steps is not None else int(os.environ.get(TRACE_STEPS_ENV, "0") or 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise AttachError(f"ddlscope.attach: trace_steps = {steps!r}: must be an integer >= 0")
        _current = Meter(model, optimizer, run_name=run, db=Path(db) if db is not None else None, log=log,
                         log_dir=log_dir, trace_steps=steps)
    atexit.register(_close_at_exit, _current)
    return _current


def _close_at_exit(meter: "Meter") -> None:
    """At interpreter exit: the job ended well unless an exception ended it (Python keeps the uncaught
    one in sys.last_value for exit handlers)."""
    exc = getattr(sys, "last_value", None)
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        meter.close()
    else:
        meter.close("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", f"{type(exc).__name__}: {exc}")


def current_meter() -> "Meter | None":
    """The meter `attach` returned in this process, if any (the launcher closes it after the script)."""
    return _current


class Step:
    """What the `with meter.step()` block may tell the meter: `loss` (a float or a scalar tensor)."""

    def __init__(self, samples: int | None):
        self.samples = samples
        self.loss: float | Tensor | None = None


class Meter:
    """One process's measurements of an attached job (see the module's docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, run_name: str | None, db: Path | None,
                 log: str | None = None, log_dir: str | os.PathLike[str] | None = None, trace_steps: int = 0):
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = _rank_and_world()
        self.device = _device_of(model)
        self.run_name = run_name or os.environ.get(RUN_NAME_ENV) or Path(sys.argv[0] or "job").stem or "job"
        self.store_path = (db or Path(os.environ.get(DB_ENV, str(DEFAULT_DB)))).resolve()
        self.launched_dir = Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None
        self._sink_choice: SinkChoice | None = choose_sinks(log, log_dir, self.store_path, "ddlscope.attach: log",
                                                            "ddlscope.attach: log_dir")
        self._sinks: Sinks | None = None  # rank 0's, opened at the first step
        self.log_places: dict[str, str] = {}  # sink -> where it wrote
        self.closed = False
        self.comm = CommRecorder(ranks=self.world)
        self.strategy, self._comm_note, self._comm_stats = _instrument_communication(model, self.comm)
        self._timer = PhaseTimer(self.device, lambda _name: _NO_LABEL)
        self._phase: str | None = None  # the phase open now, inside a step
        self._phase_cpu_s = 0.0
        self._forward_end_s = float("-inf")
        self._output_loss: Tensor | None = None  # a model that computes its loss returns it (transformers)
        self._step: Step | None = None
        self._step_index = 0
        self._previous_end_s: float | None = None
        self._start_s = 0.0
        self._activations = ActivationMeter(model)
        self._memory: dict[str, int] = {}
        self._counted_shapes: set[tuple[Any, ...]] = set()
        self._counter: Any = None
        self._writer: RowWriter | None = None
        self._trace_steps = trace_steps
        self._tracer: StepTracer | None = None
        self._label: Any = None  # the open phase's profiler range, while a step is traced
        self._step_thread = threading.get_ident()
        self._heartbeat: Heartbeat | None = None
        self._run_id: int | None = None  # the store's id, when this process created the run
        self._run_dir: Path | None = None
        self._hooks = [model.register_forward_pre_hook(self._before_forward),
                       model.register_forward_hook(self._after_forward),
                       optimizer.register_step_pre_hook(self._before_optimizer)]

    # --- the user's calls -------------------------------------------------------------------------

    @contextmanager
    def step(self, samples: int | None = None) -> Iterator[Step]:
        """One optimizer step of the caller's loop. `samples`: this rank's samples in it."""
        if self.closed:
            raise AttachError("ddlscope: meter.step() after the meter was closed")
        if self._step is not None:
            raise AttachError("ddlscope: meter.step() inside another step: steps do not nest")
        self._open_files()
        now = clock()
        begin_s = self._previous_end_s if self._previous_end_s is not None else now
        if self._step_index == 0:
            self._start_s = begin_s
        step = self._step = Step(samples)
        assert self._tracer is not None
        self._tracer.before_step(self._step_index)
        self._step_thread = threading.get_ident()
        self._timer.start(begin_s)
        self._enter_phase("data")
        if self._heartbeat is not None:
            self._heartbeat.beat(step=self._step_index, phase="data")
        measuring = self._step_index == MEMORY_STEP
        try:
            if measuring:
                with self._activations.measure():
                    yield step
                self._memory["activations"] = self._activations.bytes
                self._memory["activations_peak"] = self._activations.peak_bytes
                self._memory["optimizer"] = optimizer_state_bytes(self.optimizer)
            else:
                yield step
        finally:
            self._finish_counting()
            if self._phase is not None:
                self._timer.close_phase(self._phase, self._phase_cpu_s)
            self._close_label()
            self._phase, self._step = None, None
            self._tracer.after_step(self._step_index)
        self._write_step(step)
        self._previous_end_s = self._timer.end_s
        self._step_index += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time that belongs to no step (evaluation, a checkpoint): not counted in the next step's data."""
        yield
        self._previous_end_s = None if self._previous_end_s is None else clock()

    def close(self, status: str = "finished", error: str | None = None) -> None:
        """Write the run's last records; rank 0 of a job outside `ddlscope launch` stores every rank's rows."""
        if self.closed:
            return
        self.closed = True
        for hook in self._hooks:
            hook.remove()
        self.comm.settle()  # before the interpreter finalizes: see CommRecorder.settle
        if self._writer is None:  # no step was taken: nothing was written, nothing to store
            return
        self._memory.setdefault("parameters", parameter_bytes(self.model))
        self._memory.update(peak_process_bytes(self.device))
        self._writer.write("memory", bytes=self._memory)
        if self._tracer is not None:
            self._tracer.finish()
        if self._sinks is not None:
            for note in self._sinks.close(status):
                print(f"ddlscope: {note}", file=sys.stderr)
        if error:
            self._writer.event("error", error)
        self._writer.event("train_end", f"train_s={(self._previous_end_s or clock()) - self._start_s:.3f}")
        self._writer.close()
        if self._heartbeat is not None:
            self._heartbeat.close()
        assert self._run_dir is not None
        leave_done_marker(self._run_dir, self.rank, os.getpid())
        if self._run_id is not None:
            _store_rows(self.store_path, self._run_id, self._run_dir, self.world, status, error)

    # --- the files and the run --------------------------------------------------------------------

    def _open_files(self) -> None:
        """At the first step: the run's folder (the launcher's, or one rank 0 creates with the run) and
        this rank's row file, headed by what the job is."""
        if self._writer is not None:
            return
        if self.launched_dir is not None:
            self._run_dir = self.launched_dir
            self._heartbeat = Heartbeat(self._run_dir, self.rank)
        else:
            self._run_dir, self._run_id = self._agree_on_run()
        self._writer = RowWriter(rank_file(self._run_dir, self.rank), self.rank)
        self._tracer = StepTracer(self._trace_steps, UNKNOWN_STEPS, traces_dir_for(self._run_dir), self.rank,
                                  self.device, self._writer)
        self._writer.event(ATTACHED_EVENT, json.dumps(self.description(), sort_keys=True))
        if self._comm_note:
            self._writer.event("comm_unrecorded", self._comm_note)
        self._memory["parameters"] = parameter_bytes(self.model)
        self._open_sinks()

    def _open_sinks(self) -> None:
        """Rank 0's sinks (`attach(log=...)`), unless `ddlscope launch --log` feeds them from its side."""
        if self._sink_choice is None or self.rank != 0 or (self.launched_dir and os.environ.get(LAUNCHER_LOGS_ENV)):
            return
        assert self._run_dir is not None
        self._sinks = self._sink_choice.open(run_label(self.run_name, self._run_dir.name), self.description(),
                                             batch_ranks=self.world)
        self.log_places = self._sinks.places
        self._writer.tee = self._sinks.record  # every record from now on (steps, flops, memory): a queue put each
        # Exit handlers run last-registered first: close before the sinks' libraries close themselves.
        atexit.register(_close_at_exit, self)

    def description(self) -> dict[str, Any]:
        """The job as the store's run row holds it (the `attached` record; see `run_from_attached`)."""
        return {"name": self.run_name, "model": _model_class(self.model).__name__, "strategy": self.strategy,
                "world_size": self.world, "device": str(self.device),
                "backend": dist.get_backend() if dist.is_initialized() else "none",
                "parameters": _parameters(self.model),
                "optimizer": type(self.optimizer).__name__, "script": sys.argv[0], "args": sys.argv[1:],
                "host": os.uname().nodename, "pid": os.getpid()}

    def _agree_on_run(self) -> tuple[Path, int | None]:
        """Rank 0 creates the run in the store; the others learn its folder through torch.distributed's
        own key-value store (no tensors, so it works on every backend)."""
        if self.rank == 0:
            run_uuid = uuid.uuid4().hex
            run_id = create_attached_run(self.store_path, run_uuid, self.description())
        else:
            run_uuid, run_id = "", None
        if self.world > 1:
            kv = dist.distributed_c10d._get_default_store()
            if self.rank == 0:
                kv.set("ddlscope/attached_run", run_uuid)
            else:
                run_uuid = kv.get("ddlscope/attached_run").decode()
        run_dir = run_dir_for(self.store_path, run_uuid)
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir, run_id

    # --- the hooks --------------------------------------------------------------------------------

    def _enter_phase(self, name: str) -> None:
        """Close the open phase now and open `name` (phases are contiguous)."""
        if self._phase is not None and self._phase != name:
            self._timer.close_phase(self._phase, self._phase_cpu_s)
        elif self._phase == name:
            return
        self._phase, self._phase_cpu_s = name, time.thread_time()
        self._open_label(name)
        if self._heartbeat is not None:
            self._heartbeat.beat(phase=name)

    def _open_label(self, name: str) -> None:
        """A profiler range for the phase of a traced step (`ddlscope.forward`, ...), as `ddlscope run`
        labels its phases; only on the thread that opened the step, since a range closes where it opened
        (a GPU's backward runs on autograd's own thread)."""
        self._close_label()
        if self._tracer is not None and threading.get_ident() == self._step_thread:
            label = self._tracer.phase(name)
            label.__enter__()
            self._label = label

    def _close_label(self) -> None:
        if self._label is not None and threading.get_ident() == self._step_thread:
            label, self._label = self._label, None
            label.__exit__(None, None, None)

    def _before_forward(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._step is None or not torch.is_grad_enabled():
            return  # outside a step (evaluation), or a no-grad forward inside one: not the training step's
        self._start_counting(args)
        self._enter_phase("forward")

    def _after_forward(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        if self._step is None or not torch.is_grad_enabled():
            return
        self._output_loss = _loss_in(output)
        for tensor in flat_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_gradient)

    def _on_output_gradient(self, grad: Tensor) -> None:
        """Backward reached the model's output: forward (and the loss) ended; autograd ends the pass
        with the callback queued here."""
        if self._step is not None and self._phase == "forward":
            self._enter_phase("backward")
            # Communication blocked before this moment counts as forward's: a wrapper's own output hooks
            # (FSDP2's all-gathers for backward) may run before this one, inside the forward phase.
            self._forward_end_s = self._timer.end_s
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        if self._step is None or self._phase != "backward":
            return
        if self._step_index == MEMORY_STEP:
            self._memory["gradients"] = gradient_bytes(self.model)
        self._enter_phase("synchronize")

    def _before_optimizer(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._step is not None:
            self._enter_phase("optimizer")

    # --- FLOPs --------------------------------------------------------------------------------------

    def _start_counting(self, args: tuple[Any, ...]) -> None:
        """Count the FLOPs of this step when its input shape is new (FlopCounterMode over forward and
        backward; attention through the math kernel on CPU, which FlopCounterMode counts)."""
        if self._counter is not None or len(self._counted_shapes) >= MAX_COUNTED_SHAPES:
            return
        shape = tuple(tuple(t.shape) for t in flat_tensors(args))
        if shape in self._counted_shapes:
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._counted_shapes.add(shape)
        self._counter = _Counting(FlopCounterMode(display=False), self.device, shape)
        self._counter.__enter__()

    def _finish_counting(self) -> None:
        if self._counter is None:
            return
        counting, self._counter = self._counter, None
        counting.__exit__(None, None, None)
        assert self._writer is not None
        self._writer.event("flops", _flops_message(counting, self._step_index, self._step, self.device))

    # --- the row --------------------------------------------------------------------------------------

    def _write_step(self, step: Step) -> None:
        assert self._writer is not None
        timer = self._timer
        comm = self._comm_stats(timer.backward_end_s if timer.entries["backward"] else timer.end_s,
                                self._forward_end_s)
        self._writer.write(
            "step", step=self._step_index, t_s=timer.step_start_s - self._start_s, **step_phases(timer, comm),
            comm_s=comm.total_s, compute_cpu_s=timer.compute_cpu_s,
            samples=step.samples if step.samples is not None else 0,
            loss=_float(step.loss if step.loss is not None else self._output_loss), bytes_sent=comm.bytes_sent)
        self._output_loss = None


# --- what the model is, and its communication ------------------------------------------------------

def _instrument_communication(model: nn.Module, recorder: CommRecorder) -> tuple[str, str, AttachedCommStats]:
    """The strategy the model's wrapper is (the store's `strategy`: the registered strategy whose
    runtime class claims the wrapper, the one-process baseline for a bare model in one process), a
    note when its communication cannot be timed, and the step's communication stats."""
    from ddlscope.specs import STRATEGY_SPECS, is_baseline
    from ddlscope.strategies import RUNTIMES

    for name, spec_class in STRATEGY_SPECS.items():
        runtime = RUNTIMES.find(spec_class)
        if runtime is not None and "wraps" in vars(runtime) and runtime.wraps(model):
            stats, note = runtime.time_attached(model, recorder)
            return name, note, stats
    untimed: AttachedCommStats = lambda backward_end_s, _forward_end_s: recorder.pop(backward_end_s)  # noqa: E731
    if _rank_and_world()[1] == 1:
        return next(name for name in STRATEGY_SPECS.names() if is_baseline(name)), "", untimed
    return OWN_STRATEGY, ("the model has no DDP or FSDP2 wrapper: collectives the loop issues itself are not "
                          "timed (they count in the phase they happen in)"), untimed


OWN_STRATEGY = "own"  # an attached model in several processes that no registered strategy's wrapper holds


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise AttachError(f"ddlscope.attach: WORLD_SIZE is {world} but no process group exists yet: call "
                          "torch.distributed.init_process_group before attach")
    return 0, 1


def _model_class(model: nn.Module) -> type:
    """The user's model class, under DDP's wrapper or FSDP2's (which subclasses it as FSDP<Name>)."""
    from torch.distributed.fsdp import FSDPModule

    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    return next(c for c in type(inner).__mro__ if not issubclass(c, FSDPModule))


def _parameters(model: nn.Module) -> int:
    """The model's parameters, whole (a sharded parameter counts its global size)."""
    return sum(p.numel() for p in model.parameters())


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        return local.device
    return torch.device("cpu")


def _loss_in(output: Any) -> Tensor | None:
    """The loss a model's output carries (a transformers ModelOutput's, a dict's "loss"), if any."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


def _float(value: float | Tensor | None) -> float:
    if value is None:
        return math.nan
    return float(value.detach().item()) if isinstance(value, Tensor) else float(value)


class _NoLabel:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LABEL = _NoLabel()


class _Counting:
    """FlopCounterMode over one step, attention through the math kernel on CPU."""

    def __init__(self, counter: Any, device: torch.device, shape: tuple[Any, ...]):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.counter, self.shape = counter, shape
        self._kernel = sdpa_kernel(SDPBackend.MATH) if device.type == "cpu" else None

    def __enter__(self) -> None:
        if self._kernel is not None:
            self._kernel.__enter__()
        self.counter.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.counter.__exit__(*exc)
        if self._kernel is not None:
            self._kernel.__exit__(*exc)


def _flops_message(counting: _Counting, step_index: int, step: Step | None, device: torch.device) -> str:
    from ddlscope.runtime.flops import StepFlops, flops_message

    flops = int(counting.counter.get_total_flops())
    samples = step.samples if step is not None and step.samples is not None else 0
    peak, source = _peak_flops(str(device), torch.get_num_threads())
    shape = ";".join("x".join(str(d) for d in s) for s in counting.shape)
    return flops_message(StepFlops(flops, flops, samples, str(device)), peak, source) + \
        f" counted_at_step={step_index} input_shape={shape or 'none'}"


@functools.lru_cache(maxsize=None)
def _peak_flops(device: str, threads: int) -> tuple[float, str]:
    """The peak MFU divides by, measured once per device and thread count (a matmul benchmark)."""
    from ddlscope.runtime.flops import peak_flops

    return peak_flops(torch.device(device), threads)


# --- the store, for a job outside `ddlscope launch` --------------------------------------------------

def run_from_attached(description: dict[str, Any]) -> dict[str, Any]:
    """The store's run fields for an attached job, from its `attached` record (the launcher and a
    self-storing rank 0 build the run row the same way)."""
    config = {"name": description["name"], "seed": 0,
              "workload": {"name": "attached", "model": description["model"],
                           "parameters": description["parameters"], "optimizer": description["optimizer"],
                           "script": description["script"], "args": description["args"]},
              "strategy": {"name": description["strategy"]},
              "cluster": {"world_size": description["world_size"], "nnodes": 1, "backend": description["backend"],
                          "device": description["device"]}}
    return {"name": description["name"], "workload": f"attached:{description['model']}",
            "strategy": description["strategy"], "world_size": description["world_size"], "config": config,
            "seed": 0}


def create_attached_run(store_path: Path, run_uuid: str, description: dict[str, Any],
                        launched_by: str = "the job itself") -> int:
    """The attached job's run in the store, `running`, owned by this process (recovered if it dies)."""
    from ddlscope.runtime.launcher import code_version, environment
    from ddlscope.store import Store

    fields = run_from_attached(description)
    fields["config"]["workload"]["launched_by"] = launched_by
    with Store(store_path) as store:
        run_id = store.create_run(uuid=run_uuid, code_version=code_version(),
                                  environment={**environment(), "ranks": description["world_size"],
                                               "extra_ranks": 0, "attached": True}, **fields)
        store.mark_running(run_id)
    return run_id


def _store_rows(store_path: Path, run_id: int, run_dir: Path, world: int, status: str, error: str | None) -> None:
    """Rank 0, at close: wait (bounded) for every rank's done marker, ingest all files, mark the run."""
    from ddlscope.runtime.rows import ingest_run_dir
    from ddlscope.store import Store

    deadline = time.monotonic() + CLOSE_WAIT_S
    while len(done_pids(run_dir)) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    missing = world - len(done_pids(run_dir))
    if missing and status == "finished":
        status, error = "failed", f"{missing} rank(s) did not close their meter within {CLOSE_WAIT_S:.0f} s"
    with Store(store_path) as store:
        ingest_run_dir(store, run_id, run_dir, serial=True)
        store.mark_done(run_id, status, error)

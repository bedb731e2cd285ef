"""What every command module shares, defined once: the consoles, the --db and --json options, the
one-line user-error path, and the helpers more than one command group needs.

Command modules import from here and never from each other.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from ddlscope.specs import ConfigError
from ddlscope.store import BUSY_TIMEOUT_ENV, DEFAULT_DB, OutputError, Store, StoreError, file_kind, is_busy

__all__ = ["DEFAULT_DB", "DbOption", "JsonOption", "RunArg", "UserError", "check_local_ranks", "check_output_folder",
           "check_not_special", "check_run_outputs", "cluster_from_text", "console", "db_option", "err_console", "has_control_characters", "one_line",
           "json_option", "max_ranks_per_node", "open_store", "print_error", "progress_phase", "require_store", "run_app",
           "check_run_ref", "run_ref_callback",
           "wide_when_piped"]

# The CLI's two consoles: results on stdout, notes and errors on stderr. No emoji codes: a model named
# hf:llama printed as "hf:llama: ..." would otherwise show a llama.
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


# ---------------------------------------------------------------------------- shared options
def db_option(help: str = "SQLite store holding runs and their rows.") -> Any:
    """The --db option; a command says in `help` what it reads or keeps there."""
    return typer.Option("--db", help=help)


def json_option(help: str = "Print one JSON object.") -> Any:
    """The --json flag; a command may say in `help` what the object holds."""
    return typer.Option("--json", help=help)


DbOption = Annotated[Path, db_option()]
JsonOption = Annotated[bool, json_option()]


def check_run_ref(ref: str, named: str = "RUN") -> str:
    """A RUN argument the store can look up: refused when empty (it matched the newest unnamed run), when its
    digits are not 0-9 ('²' is a digit to Python, not to int()), or an id past what SQLite stores."""
    if not ref.strip():
        raise UserError(f"{named} = {ref!r}: empty; give a run id, uuid (prefix) or name (see `ddlscope runs`)")
    if ref.isdigit() and not (ref.isascii() and int(ref) <= MAX_RUN_ID):
        why = "past the largest id a store holds (2**63 - 1)" if ref.isascii() else "not a run id (digits 0-9)"
        raise UserError(f"{named} = {ref!r}: {why}; give a run id, uuid (prefix) or name (see `ddlscope runs`)")
    return ref


def run_ref_callback(param: typer.CallbackParam, value: Any) -> Any:
    """typer's callback for RUN arguments and options (one, or a list): each through check_run_ref."""
    named = param.opts[0] if param.param_type_name == "option" else "RUN"
    if isinstance(value, (list, tuple)):
        return [check_run_ref(v, named) for v in value]
    return value if value is None else check_run_ref(value, named)


MAX_RUN_ID = 2**63 - 1  # SQLite's largest INTEGER
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="Run id, uuid (prefix) or name.", callback=run_ref_callback)]


# ---------------------------------------------------------------------------- user errors
class UserError(Exception):
    """Bad input from the user: one line on stderr, exit status 2."""


def require_store(db: Path) -> None:
    """Refuse a missing store: reading commands must not create an empty one from a typo in --db."""
    if not db.exists():
        raise UserError(f"no store at {db} (run `ddlscope run` first, or pass --db)")


def open_store(db: Path) -> Store:
    """The existing store at `db`, after recovering the runs whose launcher died (runtime/recovery.py):
    their rank files ingested and their status made failed or interrupted, one note line each on stderr."""
    from ddlscope.runtime.recovery import recover_orphaned_runs

    require_store(db)
    store = Store(db)
    try:
        for recovered in recover_orphaned_runs(store, db):
            err_console.print(f"note: {recovered.note()}", markup=False, highlight=False, soft_wrap=True)
    except StoreError as exc:  # a read-only store can still be read
        err_console.print(f"note: runs whose launcher died were not recovered: {exc}", markup=False,
                          highlight=False, soft_wrap=True)
    except BaseException:
        store.close()
        raise
    return store


def print_error(message: str) -> None:
    """One line on stderr; markup off, so that brackets in a user's value print as typed, and a line break
    (or other control character) in a user's key or value shown escaped, as \\n, so that it stays one line."""
    err_console.print(f"error: {one_line(message)}", markup=False, highlight=False, soft_wrap=True)


def check_utf8_arguments(app: typer.Typer, args: list[str]) -> None:
    """Refuse an argument that is not UTF-8 (Python holds its bytes as lone surrogates), naming its option:
    the store, reports and the terminal take UTF-8 text, and every write of one failed with a traceback, some
    after the store was created."""
    for i, arg in enumerate(args):
        if not any("\udc80" <= c <= "\udcff" for c in arg):
            continue
        shown = repr(arg.encode("utf-8", "surrogateescape"))[1:]
        option, sep, _ = arg.partition("=")
        if arg.startswith("-") and sep:
            named = option
        elif i and args[i - 1].startswith("-") and _takes_value(app, args[0], args[i - 1]):
            named = args[i - 1]
        else:
            named = _first_argument(app, args[0]) if i else "COMMAND"
        raise UserError(f"{named} = {shown}: not UTF-8 text; give it in UTF-8 (the store, reports and terminals "
                        "hold UTF-8)")


def _params(app: typer.Typer, command: str) -> list[Any]:
    """The click parameters of `command` as typer declares it (none for an unknown command)."""
    import typer.main

    group = typer.main.get_command(app)
    commands = getattr(group, "commands", None)
    return list(getattr(commands.get(command) if commands is not None else group, "params", []))


def _takes_value(app: typer.Typer, command: str, option: str) -> bool:
    """Whether `option` of `command` takes a value (is not a flag)."""
    for param in _params(app, command):
        if option in (*param.opts, *param.secondary_opts):
            return not getattr(param, "is_flag", False)
    return True


def _first_argument(app: typer.Typer, command: str) -> str:
    """How `command`'s help names its first positional argument (RUN, CONFIG, ...)."""
    for param in _params(app, command):
        if getattr(param, "param_type_name", "") == "argument":
            return str(param.metavar or param.name.upper())
    return "argument"


def one_line(text: str) -> str:
    """`text` with each control character written as its escape (a newline as \\n)."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def run_app(app: typer.Typer, argv: list[str] | None) -> int:
    """Run the typer app; user errors become one line on stderr and exit status 2, never a traceback."""
    from typer.exceptions import TyperException

    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        check_utf8_arguments(app, args)
        result = app(args=args, standalone_mode=False, prog_name="ddlscope")
    except (ConfigError, StoreError, UserError, OutputError) as exc:
        print_error(str(exc))
        return 2
    except sqlite3.OperationalError as exc:
        if not is_busy(exc):
            raise
        # A read that began while another process wrote through a rollback journal (a large ingest,
        # Store._bulk_load) and outlasted sqlite's busy timeout: writes retry (Store._retrying), reads
        # do not, so that nothing waits long on a store that stays locked.
        print_error(f"the store stayed locked by another process past sqlite's busy timeout ({exc}): a large run "
                    f"being ingested, or another writer; try again when it is done, or raise {BUSY_TIMEOUT_ENV}")
        return 2
    except TyperException as exc:  # usage errors: bad option, wrong type, missing argument
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print_error(" ".join(message.split()))
        return getattr(exc, "exit_code", 2) or 2
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        err_console.print("aborted")
        return 130
    return result if isinstance(result, int) else 0


# ---------------------------------------------------------------------------- output
@contextmanager
def wide_when_piped(width: int) -> Iterator[Console]:
    """The stdout console, `width` columns wide while stdout is not a terminal: a wide table piped to a
    file or a program then keeps one line per row instead of wrapping at 80. A terminal keeps its width."""
    if console.is_terminal:
        yield console
        return
    saved = console._width  # rich has no public way back to "width from COLUMNS or the terminal"
    console.width = width
    try:
        yield console
    finally:
        console._width = saved


# ---------------------------------------------------------------------------- clusters and calibrations
def cluster_from_text(text: str, calibration: Optional[Path], db: Path) -> Any:
    """A catalogue cluster, or `local:1xN` from this machine's calibration (predict, plan and advise)."""
    from ddlscope.predict.catalogue import LOCAL, cluster_name, parse_cluster

    from ddlscope.calibrate.profile import this_machine_profile

    if cluster_name(str(text)) == LOCAL:
        return parse_cluster(str(text), local_profile=this_machine_profile(calibration, db))
    return parse_cluster(str(text))


# ---------------------------------------------------------------------------- checks before anything starts
# Ranks one node may start: a few per core (the studies oversubscribe up to this), and the open files a
# launcher's rank needs (pipes, logs, row files, sockets); past either the run fails only once it has started.
RANKS_PER_CORE = 8
MIN_RANKS_PER_NODE = 64
FILES_PER_RANK = 16


def max_ranks_per_node() -> tuple[int, str]:
    """How many ranks this machine may start, and what sets that bound (for the message)."""
    import os

    cores = os.cpu_count() or 1
    by_cores = max(MIN_RANKS_PER_NODE, RANKS_PER_CORE * cores)
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = -1
    if soft > 0 and soft // FILES_PER_RANK < by_cores:
        return soft // FILES_PER_RANK, (f"the open-file limit {soft} allows {soft // FILES_PER_RANK} "
                                        f"({FILES_PER_RANK} files per rank); raise it with `ulimit -n`")
    return by_cores, f"{RANKS_PER_CORE} per core on {cores} cores, and never fewer than {MIN_RANKS_PER_NODE}"


def check_local_ranks(exp: Any) -> None:
    """Refuse more ranks on this node than it can start (a world size of 10000 on one machine)."""
    ranks = exp.cluster.procs_per_node + (exp.strategy.extra_ranks() if exp.cluster.node_rank == 0 else 0)
    limit, why = max_ranks_per_node()
    if ranks > limit:
        raise UserError(f"cluster.world_size = {exp.cluster.world_size}: {ranks} ranks on this node, more than "
                        f"{limit} ({why}); use fewer ranks, or spread them over nodes (--nnodes, `ddlscope slurm`)")


def check_output_folder(path: Path, what: str) -> None:
    """Refuse a file to write whose folder is missing, or that is a folder or another file that is not a
    regular file (a device such as /dev/null, a FIFO: writing would replace it), before any work is done."""
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file name, e.g. {path / 'out'}")
    check_not_special(path, what)
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UserError(f"{what} {path}: folder {folder} does not exist (create it first)")


def check_not_special(path: Path, what: str) -> None:
    """Refuse an existing output that is not a regular file: writing would replace a device or a FIFO."""
    if path.exists() and not path.is_file():
        raise UserError(f"{what} {path} is a {file_kind(path.stat().st_mode)}, not a regular file: give a file "
                        "name to write")


def check_run_outputs(exp: Any) -> None:
    """What a run needs of this machine, checked before it starts rather than found by its ranks: the folders
    of save_model_path and checkpoint_dir exist and can be written, the GPU a CUDA backend or device names is
    there, and the data cache (DDLSCOPE_CACHE_DIR) is a folder."""
    if exp.save_model_path:
        path = Path(exp.save_model_path)
        check_output_folder(path, "save_model_path =")
        _check_writable(path.resolve().parent, f"save_model_path = {path}")
    if exp.checkpoint_dir:
        folder = Path(exp.checkpoint_dir)
        if folder.exists() and not folder.is_dir():
            raise UserError(f"checkpoint_dir = {folder}: is a file; give a folder")
        if not folder.resolve().parent.is_dir():
            raise UserError(f"checkpoint_dir = {folder}: folder {folder.resolve().parent} does not exist "
                            "(create it first)")
        _check_writable(folder.resolve() if folder.is_dir() else folder.resolve().parent, f"checkpoint_dir = {folder}")
    check_devices(exp)
    check_cache_dir()


def _check_writable(folder: Path, what: str) -> None:
    # os.access, not a probe file: it writes nothing, and answers a read-only mount for root too (EROFS).
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{what}: folder {folder} cannot be written (read-only); give a folder you can write")


def check_devices(exp: Any) -> None:
    """Refuse a CUDA backend or device where torch finds no GPU: every rank failed on it after the launch.
    Asked at the time of the run (not in the spec), so the same config runs unchanged where CUDA is."""
    cluster = exp.cluster
    wanted = [f"cluster.{field} = {value!r}" for field, value, cuda in
              (("backend", cluster.backend, "nccl"), ("device", cluster.device, "cuda")) if value == cuda]
    if not wanted:
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{wanted[0]}: needs a CUDA GPU, and torch finds none here (torch.cuda.is_available() is "
                        "False); use 'auto' (gloo on the CPU without a GPU)")


def check_cache_dir() -> None:
    """The data cache's folder, when the environment names one, must be a folder: a file failed in every rank
    that built a cached data set."""
    from ddlscope.workloads.vision import CACHE_DIR_ENV

    value = os.environ.get(CACHE_DIR_ENV)
    if value and Path(value).exists() and not Path(value).is_dir():
        raise UserError(f"{CACHE_DIR_ENV} = {value}: is a file; give a folder for the data cache, or unset it")


def has_control_characters(text: str) -> bool:
    """True when `text` holds a newline, tab or other control character (a script line of its own)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


# ---------------------------------------------------------------------------- progress
# What a progress display says after rank 0 records one of these events (runtime/launcher.PROGRESS_EVENTS).
PHASE_OF_EVENT = {"started": "starting ranks", "train_start": "training", "checkpoint": "training",
                  "train_end": "finishing"}


def progress_phase(row: dict[str, Any], total_steps: int | None = None) -> str | None:
    """The phase a launcher's progress row shows (runtime/launcher.start_progress): a step means training
    (evaluating and saving after the last one), an event its phase, the launcher's own phase as it is;
    None for an evaluation, which changes no phase."""
    kind = row.get("kind")
    if kind == "phase":
        return str(row["phase"])
    if kind == "event":
        return PHASE_OF_EVENT.get(str(row.get("event")), "training")
    if kind == "step":
        last = total_steps is not None and row["step"] + 1 >= total_steps
        return "evaluating, saving" if last else "training"
    return None


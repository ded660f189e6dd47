"""How a worker process starts and what it must undo: fork or spawn, and the function it runs.

On CPU the workers are forked, not spawned (see `choose_start_method`): they inherit the parent's
imported torch instead of importing it again, and exit without a second interpreter teardown.
For `spawn`, the function travels by value (cloudpickle), and `__main__` is hidden while the
children start, so functions from notebooks and programs read from stdin work.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing import forkserver
from typing import Any

from ..core.signals import set_handler
from ..core.stack import on_fresh_stack
from ..observe.timeline import froze_objects
from . import records
from .failures import restart_note


def entrypoint(payload: bytes, forked: bool = False, announce: bool = True) -> Any:
    # Runs in each worker; the agent wraps it in `record`, which writes the traceback to the
    # error file it reads, so the parent learns *why* a rank failed, not only its exit code.
    # `announce`: rank 0 prints why a restart happened (False: the function says it itself).
    import pickle

    if forked:
        _like_a_spawned_worker()
    records.arm()
    if announce and os.environ.get("RANK") == "0" and (note := restart_note()):
        print(f"ddpkit: {note}", file=sys.stderr, flush=True)
    fn, args, kwargs = pickle.loads(payload)
    try:
        # A forked worker starts at its parent's depth (see core/stack.py); a spawned one at the foot.
        result = on_fresh_stack(fn, *args, **kwargs) if forked else fn(*args, **kwargs)
        records.mark_done()
        return result
    finally:
        if not forked:
            # A spawned worker ends with a full interpreter teardown, whose garbage collection
            # walks every object torch and its compiler created: about a second. The worker is
            # done with them. (A forked one leaves with os._exit and skips the teardown.)
            gc.freeze()


def _interrupted(signum: int, frame: Any) -> None:
    """SIGINT in a worker: KeyboardInterrupt, as in any Python process, once. Ctrl-C in a
    terminal reaches the workers and the agent, which then stops them with the same signal: a
    second KeyboardInterrupt, raised while the first one unwinds (in a `finally`, a generator
    being closed), would print a traceback of its own. The second one ends the process, killed
    by SIGINT.

    The handler stays in place between the two: switching to SIG_DFL on the first would let a
    second SIGINT that arrives while the switch is made be reported by Python as "Signal 2
    ignored due to race condition" (bpo-43406), a traceback of its own in the run's output."""
    if not _interrupted_once:
        _interrupted_once.append(signum)
        raise KeyboardInterrupt
    sys.stdout.flush()
    set_handler(signal.SIGINT, signal.SIG_DFL)  # (a SIGINT held meanwhile ends the process here)
    signal.raise_signal(signal.SIGINT)


_interrupted_once: list[int] = []  # the first SIGINT's number, once it was turned into KeyboardInterrupt


def _like_a_spawned_worker() -> None:
    """Undo what a forked worker inherits and a spawned one would not have."""
    # The agent turns SIGTERM (and SIGINT, SIGHUP, SIGQUIT) into a Python exception in its own
    # process before it forks. A worker it stops must die at once, as a spawned one does: the
    # exception would only be raised when a blocking call returns to Python (the agent waits
    # 30 s, then SIGKILLs), and the unwinding worker would leave a traceback that reads like a
    # cause of the failure rather than a consequence.
    # The launcher watches SIGCHLD for its workers' exit statuses (records.ExitWatch); this
    # process's own children are none of its business.
    set_handler(signal.SIGCHLD, signal.SIG_DFL)
    _interrupted_once.clear()
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            set_handler(sig, _interrupted if sig == signal.SIGINT else signal.SIG_DFL)
    # A spawned worker's torch reads OMP_NUM_THREADS when it is imported; this one's was
    # imported by the parent, with the parent's count (all cores: oversubscription).
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    # NumPy's global stream would otherwise be the parent's, the same on every rank; a
    # spawned worker seeds it from the OS. (Python's `random` reseeds itself after a fork.)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def choose_start_method(device_type: str) -> str:
    """'fork' where forking this process is safe, else 'spawn' ('forkserver' or 'spawn' where
    DDPKIT_START_METHOD asks for it).

    A spawned worker starts a fresh interpreter and imports torch again (over a second on a
    small machine, more than the training of a small job) and at exit tears that interpreter
    down again. A forked one inherits the imports and leaves with `os._exit`: the whole
    `ddpkit train` of 10 epochs of digits on 2 CPU processes went from 8.0 s to 5.7 s (medians
    on 2 cores, `python -m benchmarks startup` measures it).
    Forking is unsafe after CUDA was initialized, from a process that already runs a process
    group or other Python threads, off Linux, and with a GNU OpenMP thread pool that cannot be
    released first: choosing 'fork' releases it (see `_release_openmp`). Python threads started
    with `_thread` rather than `threading` count too (`threading.active_count()` does not see
    them; every Python thread has a frame in `sys._current_frames()`): pytest-xdist's workers
    run one, and a process forked from there crashed collecting garbage.
    'forkserver' (Linux): the workers are forked from a fresh process that imported torch and
    its compiler once for the job (`own_fork_server`): a spawned worker's fresh state without
    each worker's imports (`plan.verify` starts its measured runs so).
    """
    asked = os.environ.get("DDPKIT_START_METHOD")
    if asked == "forkserver" and sys.platform == "linux" and hasattr(forkserver.ForkServer, "_stop"):
        return "forkserver"
    if asked == "spawn" or device_type != "cpu" or sys.platform != "linux":
        return "spawn"
    if threading.current_thread() is not threading.main_thread():
        return "spawn"
    if threading.active_count() > 1 or len(sys._current_frames()) > 1:
        return "spawn"
    torch, tdist = sys.modules.get("torch"), sys.modules.get("torch.distributed")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        return "spawn"
    return "fork" if _release_openmp() else "spawn"


def _release_openmp() -> bool:
    """Stop this thread's GNU OpenMP worker threads, so that a forked child starts its own.

    After any multi-threaded torch op, libgomp keeps a pool of threads and a forked child
    inherits the pool's bookkeeping but not its threads: its first parallel op waits for them
    forever. `omp_pause_resource_all` (OpenMP 5.0) releases the pool; the parent's next
    parallel op makes a new one. LLVM's and Intel's OpenMP handle fork themselves. False
    (spawn instead) if libgomp is loaded and the pool cannot be released.
    """
    try:
        with open("/proc/self/maps") as f:  # address, perms, offset, dev, inode, path
            paths = {fields[5].strip() for fields in (line.split(maxsplit=5) for line in f) if len(fields) == 6}
        libs = [path for path in paths if os.path.basename(path).startswith("libgomp")]
    except OSError:
        return False
    for path in libs:
        try:
            # RTLD_NOLOAD: the library torch already loaded, never a second copy
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            if lib.omp_pause_resource_all(2) != 0:  # 2: omp_pause_hard
                return False
        except (OSError, AttributeError):  # gone, or a libgomp older than GCC 9
            return False
    return True


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Keep the parent's objects out of the forked workers' garbage collections.

    A forked worker inherits every object of the parent (torch alone makes some 170 000);
    each full collection in the worker would walk them all, and touching them copies their
    memory pages. Frozen objects are skipped: importing torch's compiler in a worker (which
    the first optimizer does) runs about 0.3 s faster. The parent's objects thaw afterwards
    (unless the caller froze some itself: those stay as they were).
    """
    if froze_objects() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# What a forked worker would import first thing, each time: torch's compiler, which every
# torch.optim optimizer imports when it is made (0.7-0.9 s, some 800 modules with SymPy).
WORKER_IMPORTS: tuple[str, ...] = ("torch._dynamo",)

_preload: threading.Thread | None = None  # importing while the agent starts; forks wait for it
_hooked = False
_held: list[int] = []  # signals that arrived while a fork waited for the preload or ran (see _join_for_fork)
_saved: list[tuple[int, Any]] = []  # the agent's handlers while a fork holds its signals
# The signals torch's agent turns into its SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_AGENT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


@contextlib.contextmanager
def preloaded(modules: Sequence[str]) -> Iterator[None]:
    """Import `modules` in a thread while the agent starts the workers; a fork waits for it.

    Between the launch and the fork of the workers the launching process mostly waits: the
    c10d rendezvous sleeps a random 0-0.3 s on its first round, and on several machines it
    waits for the other nodes. Imports done in that time are inherited by every forked worker
    instead of being done there, after the fork (in every worker at once, on every core). The
    thread is joined before any fork of this process (`os.register_at_fork`), so no worker
    starts with an import half done, and at the latest when the block ends. An import that
    fails here is left to the worker, which meets the same error where it would have anyway.

    A block that ends in an exception (a Ctrl-C, a SIGTERM, an error) does not wait for the
    thread, a daemon. A Ctrl-C that lands in the main thread between importlib's taking of its
    global lock and the `try` that gives it back (`_get_module_lock`: the main thread imports
    too as the launch starts) leaves that lock held: the thread then waits for it forever, and
    an interrupted `ddpkit train` hung there, the agent's signal handled, no worker started.
    """
    global _preload, _hooked
    if not modules:
        yield
        return
    if not _hooked:
        os.register_at_fork(before=_join_for_fork, after_in_parent=_deliver_held, after_in_child=_in_child)
        _hooked = True
    _preload = threading.Thread(target=_import_all, args=(tuple(modules),), name="ddpkit-preload", daemon=True)
    _preload.start()
    yield  # (an interrupt or an error: not waited for; a later fork of this process still waits)
    thread = _preload
    if thread is not None:  # no fork came: nothing can inherit a half-done import now
        thread.join()
        _preload = None
        gc.freeze()


def _import_all(modules: tuple[str, ...]) -> None:
    enabled = gc.isenabled()
    gc.disable()  # what is imported stays; collections would walk it for nothing
    try:
        for name in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    finally:
        if enabled:
            gc.enable()


def _join_for_fork() -> None:
    """Before a fork: wait until the preload thread has ended. The imported objects are then
    frozen: the forked workers' collections leave them alone, as they leave the rest of the
    launching process's objects (see gc_frozen).

    A signal that arrives meanwhile (Ctrl-C, a scheduler's SIGTERM), or during the fork itself,
    must neither end the wait (a worker forked in the middle of an import would wait for its
    lock forever) nor be lost (an exception raised in a fork hook is printed and dropped): from
    here until the fork is done the agent's signals are only noted, and `_deliver_held` sends
    them again once it is. This hook runs before the other modules' (before-fork hooks run last
    registered first) and `_deliver_held` after theirs.

    A signal Python noted just before the swap runs the agent's handler in this hook all the
    same: its exception is caught, the swap made again, and its signal held with the others
    (`_set_through_signals`); should one escape elsewhere in the hook, the wait still happens
    and `signals_never_dropped` sends it again. Handlers set in C (`getsignal` gives None)
    raise nothing in Python and are left alone."""
    global _preload
    came: list[int] = []  # signals whose handler raised here, before its swap
    try:
        if threading.current_thread() is threading.main_thread() and not _saved:  # where Python runs handlers
            for sig in _AGENT_SIGNALS:
                handler = signal.getsignal(sig)
                if handler is not None and handler is not _hold:
                    _saved.append((sig, handler))  # noted first: an exception after it loses nothing
                    _set_through_signals(sig, _hold, came)
    finally:
        thread = _preload
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # (the agent's signals are only held now: nothing raises here)
            _preload = None
            gc.freeze()
        _held.extend(came)  # sent once the fork is done


def _hold(signum: int, frame: Any) -> None:
    _held.append(signum)


def _signal_of(exc: BaseException) -> int | None:
    """The signal whose handler raised `exc`: torch's agent's exception carries it (`sigval`),
    ddpkit's `Interrupted` too (`signum`), Python's own SIGINT handler raises KeyboardInterrupt;
    None for any other exception."""
    for name in ("sigval", "signum"):
        value = getattr(exc, name, None)
        if isinstance(value, int):
            return int(value)
    return int(signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else None


def _restore_handlers() -> None:
    """The handlers `_join_for_fork` replaced, back, on the main thread (the one that replaced
    them, and the only one that may): each one even where a signal that came meanwhile raises
    from its handler here, that signal sent again (`_send_again`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    came: list[int] = []
    while _saved:
        _set_through_signals(*_saved[-1], came)
        _saved.pop()
    _send_again(came)


def _set_through_signals(sig: int, handler: Any, came: list[int]) -> None:
    """`set_handler(sig, handler)`, made again where a signal's handler raised first (Python
    runs the handlers of signals that have arrived before it changes one); those signals go
    into `came`. Any other exception is raised."""
    while True:
        try:
            set_handler(sig, handler)
            return
        except BaseException as err:  # noqa: BLE001 - the handler of a signal that came meanwhile
            signum = _signal_of(err)
            if signum is None:
                raise
            came.append(signum)


def _in_child() -> None:
    try:
        _restore_handlers()
    finally:
        _held.clear()  # the parent's: it sends them again itself


def _deliver_held() -> None:
    """After a fork, in the parent: the handlers back, and the signals held while it waited and
    forked sent again a moment later (`_send_again`)."""
    try:
        _restore_handlers()
    finally:
        if _held and threading.current_thread() is threading.main_thread():
            signums, _held[:] = list(_held), []
            _send_again(signums)


def _send_again(signums: Sequence[int]) -> None:
    """Send `signums` to this process again a moment later, from a thread, so that their
    handlers run in the launching process's own code (the agent then stops the workers it
    started, as for a signal at any other time), not in a fork hook."""
    if not signums:
        return
    pid = os.getpid()

    def send() -> None:
        time.sleep(0.05)
        for signum in signums:
            os.kill(pid, signum)

    threading.Thread(target=send, name="ddpkit-held-signals", daemon=True).start()


@contextlib.contextmanager
def signals_never_dropped(raised_by_handler: type[BaseException]) -> Iterator[None]:
    """While the agent runs: a signal whose handler raised where Python cannot raise, and so
    printed and dropped the exception ("Exception ignored in ..."), is sent again.

    The agent's handlers raise `raised_by_handler`; before the agent starts, ddpkit's CLI has
    SIGTERM and SIGHUP raise `Interrupted`, and SIGINT's default handler raises
    KeyboardInterrupt. Python runs a handler at the next instruction of the main thread,
    wherever that is: a fork hook (logging's, or another module's that runs before
    `_join_for_fork`), a `__del__`, a weakref callback. There the exception goes to
    `sys.unraisablehook`, and the launch went on as if no Ctrl-C or SIGTERM had come. Here
    that hook sends the signal again: at once where a fork holds the agent's signals (with
    them, once it is done), else a moment later (`_send_again`), and its handler runs in the
    launch's own code. Other exceptions, and those of forked workers, go to the hook that was
    there before."""
    pid = os.getpid()
    previous = sys.unraisablehook
    active = True

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        signum = _signal_of(exc) if isinstance(exc, (KeyboardInterrupt, raised_by_handler)) else None
        if signum is None or not active or os.getpid() != pid:
            previous(unraisable)
        elif _saved:  # inside a fork's window: held with the others, sent once the fork is done
            _held.append(signum)
        else:
            _send_again([signum])

    sys.unraisablehook = hook
    try:
        yield
    finally:
        active = False  # (a hook installed over this one may put it back later: it hands on)
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


@contextlib.contextmanager
def own_fork_server() -> Iterator[None]:
    """The job's own fork server: Python's one fork server per process is stopped before the
    job (one left running would hand the workers the environment it started with: an earlier
    job's records folder) and after it, so that the job's first worker starts one with the
    job's environment. It imports the preloaded modules once, for all the job's workers. Its
    workers are its children, not the launcher's: `records.ExitWatch` sees no exit status and
    no stopped worker of theirs (the agent still reports how each ended)."""
    forkserver._forkserver._stop()  # (CPython's own, which its tests use: there since 3.8)
    try:
        yield
    finally:
        forkserver._forkserver._stop()


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """Hide `__main__`'s file and module name from `spawn` while the workers start.

    `spawn` re-runs the parent's main script (or module) in every child. That fails where there
    is no file (`python -` sets '<stdin>') and re-runs unguarded top-level code (a script with
    no `if __name__ == "__main__":`). The function and its arguments travel by value, so the
    children need nothing from `__main__`. Notebooks have neither attribute to hide.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    if "__file__" in saved:
        del main.__file__
    if "__spec__" in saved:
        main.__spec__ = None
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)

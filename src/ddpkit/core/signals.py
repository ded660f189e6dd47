"""Signal handlers replaced without losing a signal to CPython's race.

`signal.signal` first runs the handlers of signals that have arrived, then installs the new
disposition. A signal that arrives between the two is noted for the old Python handler. When
the new disposition is SIG_DFL or SIG_IGN, Python then finds no handler to run and prints
"Signal N ignored due to race condition" (bpo-43406): a traceback in a run's output, for a
Ctrl-C or SIGTERM that neither ended the process nor was quietly ignored.

`set_handler` closes that window for signals taken on the calling thread. It first gives the
operating system the new disposition directly, so the signal can no longer be noted for
Python; only then does it change Python's own table, whose check of arrived signals runs the
old handler for any that came before. (A signal whose C handler is running on another thread
at that very instant can still be noted late: under a stress of thousands of signals a second,
a few in 10^5 switches, against some in 10^3 without.)
"""

from __future__ import annotations

import ctypes
import signal
from typing import Any

_PLAIN = {signal.SIG_DFL: 0, signal.SIG_IGN: 1}  # their values in <signal.h>


def set_handler(sig: int, handler: Any) -> Any:
    """`signal.signal(sig, handler)` without the race above. Returns the previous handler."""
    if handler in _PLAIN and _libc_signal is not None:
        _libc_signal(int(sig), _PLAIN[handler])
    return signal.signal(sig, handler)


def _find_libc_signal() -> Any:
    try:
        fn = ctypes.CDLL(None).signal
    except (OSError, AttributeError):  # no C library to ask (not a POSIX system)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    return fn


_libc_signal = _find_libc_signal()

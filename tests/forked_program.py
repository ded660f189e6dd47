"""A program for tests/test_cli_server.py: `python -m tests.forked_program CASE [ARG]` does one
thing a command may do on its way out, so that the same command line run forked from the tests'
command server and run as a fresh interpreter can be compared."""

import atexit
import concurrent.futures
import os
import signal
import sys
import tempfile
import threading
import time

case, arg = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
if case == "where":  # what `python -m` gives the program: argv, working directory, path, environment, stdin
    seen = [sys.argv[1:], os.path.basename(sys.argv[0]), __name__, os.getcwd(), sys.path[0]]
    seen += [os.environ.get("DDPKIT_TEST_WORD"), tempfile.gettempdir(), sys.stdin.read()]
    print(repr(seen))
elif case == "path":  # where PYTHONPATH's folders come on the path, and a module found there
    import own_module

    print(sys.path[:3], own_module.WHERE)
elif case == "exit":
    print("leaving")
    sys.exit(int(arg) if arg.isdigit() else arg)
elif case == "raise":
    raise RuntimeError(arg)
elif case == "interrupt":
    raise KeyboardInterrupt
elif case == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
elif case == "late":  # a thread that outlives the main one, and an atexit handler, both still heard
    atexit.register(lambda: print("at exit in", os.path.basename(sys.modules["__main__"].__file__)))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    print("main done", end="\r\n")
    pool = concurrent.futures.ThreadPoolExecutor(1)  # left open: its idle worker woken at the end
    pool.submit(lambda: (time.sleep(0.1), print("pooled")))
    sys.stderr.write("bar\rbar\r")
elif case == "hangup":  # ignored where it was started from, or not
    os.kill(os.getpid(), signal.SIGHUP)
    print("still here")
elif case == "numpy":  # a new process's own draw
    import numpy

    print(numpy.random.rand())
elif case == "sleep":
    print("sleeping", flush=True)
    time.sleep(float(arg))

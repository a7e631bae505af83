"""Entry of a worker rank the driver started itself (``python -m hybridserve.parallel.worker``).

Builds the same :class:`LLMEngine` as the driver from the arguments in
``$HYBRIDSERVE_TP_ENGINE_ARGS`` on the rank in ``$RANK``; the engine's
:meth:`TensorParallel.attach` then serves the driver's steps and exits.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys


def _die_with_driver() -> None:
    # Linux: the kernel kills this worker when the driver process dies, however it dies.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    driver = os.environ.get("HYBRIDSERVE_TP_DRIVER_PID")
    if driver and os.getppid() != int(driver):  # the driver died before prctl
        os._exit(1)


def main() -> None:
    from hybridserve.parallel.launcher import ARGS_ENV

    _die_with_driver()
    # Ctrl-C reaches the terminal's whole process group: the driver decides, then tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("HYBRIDSERVE_TP_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s rank{os.environ.get('RANK')} %(name)s: %(message)s")
    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine

    args = EngineArgs(**json.loads(os.environ[ARGS_ENV]))
    LLMEngine(args)  # a worker's engine never returns: it serves steps, then exits
    sys.exit(1)  # unreachable unless the engine was not tensor-parallel


if __name__ == "__main__":
    main()

"""Entry point of one rank started by ``procs.run_torch_workers``.

Forms the process group (gloo on CPU, nccl when CUDA is present), calls
the target, writes its JSON result, then shuts down cleanly: barrier and
``destroy_process_group`` (gloo ranks that skip this sometimes abort at exit), and
leaves with ``os._exit``: the interpreter's own teardown, after the group is gone, can
still end in ``std::terminate`` from a gloo thread (seen once in CI as exit -6 after a
clean result), which is not the target's outcome.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch.distributed as dist

from marind.distributed import init_distributed, shutdown_distributed


def main() -> None:
    """``worker_main TARGET ARGS_JSON RESULT_JSON``: join the group, run the target, write its result."""
    target, args_path, result_path = sys.argv[1:4]
    module_name, func_name = target.split(":")
    kwargs = json.loads(open(args_path).read())
    init_distributed()
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        result = func(**kwargs)
        with open(result_path, "w") as fh:
            json.dump(result, fh)
    finally:
        if dist.is_initialized():
            shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

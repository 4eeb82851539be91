"""torchrun for single-node jobs, with its rendezvous store listening on the loopback address only.

    python -m align_pipeline.launch._agent <torchrun arguments>

torchrun's static rendezvous starts a ``TCPStore`` server that listens on every interface, whatever
``--master-addr`` says; on one node nothing outside the machine needs it. This shim binds the store's socket to
``--master-addr`` (127.0.0.1) first and hands it to a multi-tenant ``TCPStore``; torchrun's own (multi-tenant)
store on that port then reuses this server. It then runs torchrun's ``main`` with the same arguments.
``--master-port 0`` binds a port the kernel picks, at once (no window in which another process can take a port
chosen earlier), and hands torchrun that port. Not meant to be run by hand: :func:`align_pipeline.launch.torchrun.build_command` uses it when ``nnodes == 1``.
"""

from __future__ import annotations

import datetime
import socket
import sys


def _option(args: list[str], name: str) -> str:
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise SystemExit(f"align_pipeline.launch._agent: {name} is required")


def _with_option(args: list[str], name: str, value: str) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        if arg == name:
            out[i + 1] = value
            return out
        if arg.startswith(name + "="):
            out[i] = f"{name}={value}"
            return out
    raise SystemExit(f"align_pipeline.launch._agent: {name} is required")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    host, port = _option(args, "--master-addr"), int(_option(args, "--master-port"))
    from torch.distributed import TCPStore
    from torch.distributed.run import main as torchrun_main

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    if port == 0:
        port = listener.getsockname()[1]
        args = _with_option(args, "--master-port", str(port))
    listener.listen(4096)
    store = TCPStore(host, port, None, True, datetime.timedelta(seconds=900), wait_for_workers=False,
                     multi_tenant=True, master_listen_fd=listener.detach())  # fmt: skip  (the store owns the fd)
    try:
        torchrun_main(args)
    finally:
        del store


if __name__ == "__main__":
    main()

# kcoral-cpu.tac: run a CPU compile node with twistd.  It needs no GPU: its
# workers compile CUDA C with nvcc (builtin.compile_cuda_binary) for the
# target a GPU node reports, and run CPU-only Python.
#
#     twistd -ny kcoral-cpu.tac          (foreground)
#     twistd -y kcoral-cpu.tac           (daemon; logs to twistd.log)
#
# For a GPU node, use kcoral-gpu.tac instead.  Edit the values below; every
# ServerConfig field not named keeps its default (docs/configuration.md
# lists them all).  Environment variables and command-line flags of
# `kcoral server` do not apply here: this file is the whole configuration.

from pathlib import Path

from twisted.application import service

from kcoral.config import ServerConfig
from kcoral.server.service import makeService
from kcoral.server.cli.tap import endpoint_description

HOST = "127.0.0.1"
PORT = 8000

config = ServerConfig(
    device="cpu",
    # One worker per core is a good start: nvcc is CPU-bound.
    num_workers=16,
    max_requests_per_worker=1,
    sandbox="bubblewrap",
    log_dir=Path("logs"),
    # twistd's own log already shows every event (on the terminal with -n,
    # in twistd.log otherwise); a console mirror would print each twice.
    log_console=False,
    # Behind HAProxy (contrib/haproxy/kcoral.cfg): at a stop, /health answers
    # 503 for 10 s while every request is still served, then the port closes.
    lame_duck_seconds=10.0,
    disk_cache_capacity_mbytes=16384,
)

endpoint = endpoint_description(HOST, PORT)

application = service.Application("kcoral")
makeService(config, endpoint).setServiceParent(application)

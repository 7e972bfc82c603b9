# kcoral-gpu.tac: run a GPU node (runs and times programs) with twistd.
#
#     twistd -ny kcoral-gpu.tac          (foreground)
#     twistd -y kcoral-gpu.tac           (daemon; logs to twistd.log)
#
# For a node without a GPU that compiles CUDA C for GPU nodes, use
# kcoral-cpu.tac instead.  Edit the values below; every ServerConfig field
# not named keeps its default (docs/configuration.md lists them all).
# Environment variables and command-line flags of `kcoral server` do not
# apply here: this file is the whole configuration.

from pathlib import Path

from twisted.application import service

from kcoral.config import ServerConfig
from kcoral.server.service import makeService
from kcoral.server.cli.tap import endpoint_description

HOST = "127.0.0.1"
PORT = 8000

config = ServerConfig(
    device="gpu",
    gpus=(0,),
    workers_per_gpu=8,
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

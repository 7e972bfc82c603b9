# kcoral-gateway.tac: run `kcoral gateway` with twistd (docs/gateway.md).
#
#     twistd -r asyncio -ny kcoral-gateway.tac      (foreground)
#     twistd -r asyncio -y kcoral-gateway.tac       (daemon; logs to twistd.log)
#
# `-r asyncio` runs nats-py on the reactor's own loop, as `kcoral gateway`
# does; without it the gateway still works, with a thread between the
# reactor and NATS (slower: docs/gateway.md).
#
# Edit the values below; every GatewayConfig field not named keeps its
# default.  Flags of `kcoral gateway` do not apply here: this file is the
# whole configuration.

from pathlib import Path

from twisted.application import service

from kcoral.gateway.service import GatewayConfig, makeService
from kcoral.server.cli.tap import endpoint_description

HOST = "127.0.0.1"
PORT = 9000

config = GatewayConfig(
    nats_urls=["nats://127.0.0.1:4222"],
    credentials_file=Path("/etc/kcoral/gateway.creds.json"),
    endpoints=[endpoint_description(HOST, PORT)],
    # The URL nodes fetch blobs from and post results to.
    public_url=f"http://{HOST}:{PORT}",
    queue_size=1024,
    presence_timeout=3.0,
    preference_window=2.0,
)

application = service.Application("kcoral-gateway")
makeService(config).setServiceParent(application)

"""
A node that joins a gateway's pool (C{kcoral server --join}, issue 37).

The node connects out to NATS and to the gateway's HTTP(S) URL; nothing
connects in (its own HTTP server listens on loopback only).  One module a
job:

  - L{kcoral.server.join.options}: the join settings and the loopback check
    of the listening ports;
  - L{kcoral.server.join.transfer}: blob fetches (hash-checked, streamed
    into what the server's caches hold) and result posts (streamed from the
    worker's buffers) to the gateway, with the job's token;
  - L{kcoral.server.join.queue}: the job queue and the claims bucket over
    NATS (L{kcoral.gateway.natsbridge});
  - L{kcoral.server.join.pull}: the queue's JetStream pull requests, each
    job handed on as it arrives;
  - L{kcoral.server.join.runner}: one job from claim to posted result,
    through the server's execute pipeline in process
    (L{kcoral.server.http.app.KcoralAPI.execute_program});
  - L{kcoral.server.join.puller}: one job per free pool seat, claimed
    before it runs;
  - L{kcoral.server.join.presence}: the node's presence key, every second;
  - L{kcoral.server.join.service}: the child service that ties them to the
    server's life.

Layer rule: server code; imports L{kcoral.gateway.jobs} (the pool's schema)
and L{kcoral.gateway.natsbridge}, nothing else of the gateway.
"""

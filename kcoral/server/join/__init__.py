"""
A node that joins a gateway's pool (C{kcoral server --join}, issue 37).

The node connects out to NATS and to the gateway's HTTP(S) URL; nothing
connects in (its own HTTP server listens on loopback only).  One module a
job:

  - L{kcoral.server.join.options}: the join settings and the loopback check
    of the listening ports;
  - L{kcoral.server.join.local}: the node's own server over loopback HTTP
    (C{/health}, C{/execute}): a job runs through exactly the path a
    client's request takes;
  - L{kcoral.server.join.transfer}: blob fetches (hash-checked) and result
    posts to the gateway, with the job's token;
  - L{kcoral.server.join.queue}: the job queue and the claims bucket over
    NATS (L{kcoral.gateway.natsbridge});
  - L{kcoral.server.join.runner}: one job from claim to posted result;
  - L{kcoral.server.join.puller}: one job per free seat, claimed before it
    runs;
  - L{kcoral.server.join.presence}: the node's presence key, every second;
  - L{kcoral.server.join.service}: the child service that ties them to the
    server's life.

Layer rule: server code; imports L{kcoral.gateway.jobs} (the pool's schema)
and L{kcoral.gateway.natsbridge}, nothing else of the gateway.
"""

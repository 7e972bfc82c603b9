"""
C{kcoral gateway}: one client-facing URL for a pool of nodes that join over
NATS (issue 37).  L{kcoral.gateway.jobs} is the pool's schema,
L{kcoral.gateway.natsbridge} runs nats-py beside the reactor.
"""

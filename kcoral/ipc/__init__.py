"""
Moving bytes between the reactor process and a worker without copying them:
sealed shared-memory buffers and descriptor passing (C{shared}), the
progress board a worker posts on (C{board}) and the threads that write a
large upload into its memfd (C{blobsink}).

Layer rule: like C{kcoral.wire}, no Twisted and nothing from the server,
worker or client; unlike it, this room holds operating-system resources
(memfds, sockets, threads), so the pure protocol stays pure.
"""

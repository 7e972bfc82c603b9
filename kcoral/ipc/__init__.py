"""
Moving bytes between the reactor process and a worker without copying them:
sealed shared-memory buffers, descriptor passing and part sharing
(C{shared}), the control channel's blocking reads and writes (C{channel_io}),
the progress board a worker posts on (C{board}), the threads that write a
large upload into its memfd (C{blobsink}) and where a request body's blobs
go (C{uploads}: memory, spool files, memfds).

Layer rule: no Twisted and nothing from the server, worker or client; it
builds on C{kcoral.wire} (the one allowed direction: the wire names this
room's types only for a type checker).  Unlike the wire, this room holds
operating-system resources (memfds, sockets, mappings, files, threads), so
the pure protocol stays pure.
"""

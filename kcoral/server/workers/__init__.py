"""
The workers room: the processes that run programs, seen from the reactor.

C{pool} (seats, the waiting line, replacement), C{workerproc} (one worker
process's life: spawn or fork, ready, jobs, teardown, kill, and its
C{WorkerSettings}),
C{workerprotocol} (its descriptors and control channel), C{runningjob}
(one program on it), C{processes} (spawning, descriptors, the process
tree), C{template} (forking workers from a warm
template), C{compiles} (the parent's sandboxed compiles for the shared
cache), C{channelbudget} (what all workers may send at once) and
C{scratch} (the directory that holds every seat).
"""

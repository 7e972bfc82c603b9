"""
The sandbox room: how a worker or a compile is confined.

C{bubblewrap} (the L{ISandbox} seam, bubblewrap and the no-sandbox mode,
the seat layout and the start-up probe) and C{seccomp} (the system-call
filter bubblewrap loads).
"""

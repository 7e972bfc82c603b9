"""
The sandbox room: how a worker or a compile is confined.

C{interface} (the L{ISandbox} seam and L{SandboxError}), C{bubblewrap}
(L{BubblewrapSandbox}: the bwrap command lines and mount plan),
C{nosandbox} (L{NoSandbox}), C{seats} (a seat's workspace and reserved
layout on the host), C{probe} (the start-up probe and C{choose_sandbox}),
C{collect} (a helper process's bounded output, killed on a timeout) and
C{seccomp} (the system-call filter bubblewrap loads).
"""

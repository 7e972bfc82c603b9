"""
The HTTP room: everything between a client's socket and a worker's seat.

C{site} (the site: connection caps, bytes in flight), C{channel} (head and
body deadlines, lingering close), C{request} (body limits, streamed
multipart bodies, JSON error pages), C{component} (C{IKcoralRequest}, what
kcoral knows of a request), C{refusals} (the refusal reasons and error
bodies), C{accept} (running out of descriptors), C{app} (the Klein routes and
the request pipeline), C{auth} (bearer tokens) and C{streaming} (response
bodies made of sealed shared buffers).
"""

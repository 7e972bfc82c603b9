"""
The HTTP room: everything between a client's socket and a worker's seat.

C{site} (the request, channel and site classes that hold the hostile-input
limits), C{app} (the Klein routes and the request pipeline), C{auth} (bearer
tokens) and C{streaming} (response bodies made of sealed shared buffers).
"""

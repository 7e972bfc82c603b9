"""
The leases room: who may use a GPU, and when.

C{lease} (the per-GPU FIFO arbiter), C{broker} (one arbiter shared by
several front-end processes) and C{gpus} (which GPUs the server has, found
without CUDA).
"""

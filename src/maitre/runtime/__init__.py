"""Inside the training process: the loop, its process groups, state transfer, sampler, scaling.

Never imports :mod:`maitre.control`; it reaches the coordinator only through :mod:`maitre.wire`.
"""

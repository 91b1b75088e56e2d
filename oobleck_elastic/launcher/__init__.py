"""What `python -m oobleck_elastic.launch` runs once its flags are parsed (launch.py is the
CLI): one node, the oobleck agent with the oobleck rendezvous (node.py, what torchrun would run),
or a whole local job, N nodes started and watched from this process (local_job.py).

The top of the stack: it may import every layer, and nothing in the package imports it. This
file imports nothing, so the launcher can start a local job's node starter (node_starter.py)
before torch is imported.
"""

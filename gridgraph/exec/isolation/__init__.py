"""A worker's isolation from the programs it runs: one executor process per client session.

executor.py   starts, feeds and supervises a session's executor (the network process's
              side), and the executor's own loop
preload.py    what the executors' forkserver imports once (torch), so executors start warm
sandbox.py    what a taken-over executor can reach: seccomp, Landlock, no capabilities
cgroups.py    cgroups per executor: bounds on its threads and its memory
"""

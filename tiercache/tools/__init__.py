"""Tools built on the library, not part of it.

The command line, the demo's toy engine, the simulator and its workload, and a
reference transformer. No core module imports this package: ``import
tiercache.manager`` pulls in none of it.
"""

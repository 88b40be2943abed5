"""The stateful test workload (the study's stream-server) and its sidecar.

``heapsrv`` and ``sidecar`` run inside the workload container (stdlib + numpy); ``image`` builds that
container image offline; ``manage`` starts, reads and stops workloads through the node agents.
"""

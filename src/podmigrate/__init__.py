"""podmigrate: live migration of stateful containers and pods with CRIU.

The package is split by where code runs. Host side: ``cli``, ``client``, ``engine``, ``lab``
(except ``lab.init``), ``workload.manage``. Inside the lab, on the node image's own python3 and
so standard library only: ``agent``, ``runtime``, ``transport.registry``, ``routing``, ``lab.init``,
``workload.heapsrv`` and ``workload.sidecar``. ``docs/architecture.md`` draws the layers.
"""

__version__ = "0.1.0"

"""What the remote data plane's two ends share, and nothing else of either: the batch and fetch
frames (``frames``), shared-memory page alignment and population (``shmpages``), and the Unix
socket's buffer sizes (``sockets``). The server and the remote client both import this; neither
imports the other."""

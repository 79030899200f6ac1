"""The tier side of both modes: the chunk service the embedded data plane and the server's chunk
routes share (``service.ChunkService``, its sessions ``service.NamespaceChunks``)."""

from gateway.chunks.service import ChunkService, KeysUnavailable, NamespaceChunks

__all__ = ["ChunkService", "KeysUnavailable", "NamespaceChunks"]

"""The Merkle tree over the audit chain: RFC 9162 (Certificate Transparency 2.0) hashing.

Leaf ``i`` (0-based) is the row of ``seq = i + 1``; its data is the row's chain hash, 32 raw
bytes. With ``D[k1:k2]`` the leaves from k1 (inclusive) to k2 (exclusive), RFC 9162 section 2.1.1::

    MTH({})     = SHA-256()
    MTH({d0})   = SHA-256(0x00 || d0)
    MTH(D[0:n]) = SHA-256(0x01 || MTH(D[0:k]) || MTH(D[k:n]))  with k the largest power of 2 < n

``CompactRange`` keeps only the roots of the perfect subtrees along the right edge of the tree
(at most log2(n) hashes, one per set bit of n), so a checkpoint extends the previous one by the
new leaves alone. Consistency proofs (RFC 9162 section 2.1.4): ``consistency_proof`` is the
SUBPROOF algorithm of 2.1.4.1, ``verify_consistency`` the verification of 2.1.4.2. Inclusion
proofs (section 2.1.3): ``MerkleTree.inclusion_proof`` is PATH of 2.1.3.1 (many proofs over one
tree, each in O(log n)), ``verify_inclusion`` the verification of 2.1.3.2. Plain hashlib.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

__all__ = [
    "EMPTY_ROOT",
    "CompactRange",
    "MerkleTree",
    "consistency_proof",
    "leaf_hash",
    "node_hash",
    "root_of",
    "verify_consistency",
    "verify_inclusion",
]

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_of(leaves: Sequence[bytes]) -> bytes:
    """MTH over already-hashed leaves (``leaf_hash`` of each datum), by the definition."""
    n = len(leaves)
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return leaves[0]
    k = _split(n)
    return node_hash(root_of(leaves[:k]), root_of(leaves[k:]))


class CompactRange:
    """The right edge of a tree of ``size`` leaves: roots of its perfect subtrees, left to right.

    ``append`` is a binary counter: a new leaf merges with the equal-sized subtrees before it.
    """

    __slots__ = ("size", "_nodes")

    def __init__(self, size: int = 0, nodes: Iterable[bytes] = ()) -> None:
        self.size = size
        self._nodes = list(nodes)
        if len(self._nodes) != bin(size).count("1") or any(len(x) != 32 for x in self._nodes):
            raise ValueError("a compact range holds one 32-byte hash per set bit of its size")

    @property
    def nodes(self) -> list[bytes]:
        return list(self._nodes)

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash (``leaf_hash(data)``)."""
        node, size = leaf, self.size
        while size & 1:
            node = node_hash(self._nodes.pop(), node)
            size >>= 1
        self._nodes.append(node)
        self.size += 1

    def extend(self, leaves: Iterable[bytes]) -> None:
        for leaf in leaves:
            self.append(leaf)

    def root(self) -> bytes:
        if not self._nodes:
            return EMPTY_ROOT
        acc = self._nodes[-1]
        for node in reversed(self._nodes[:-1]):
            acc = node_hash(node, acc)
        return acc

    def copy(self) -> CompactRange:
        return CompactRange(self.size, self._nodes)


def consistency_proof(leaves: Sequence[bytes], m: int) -> list[bytes]:
    """PROOF(m, D[0:n]) of RFC 9162 section 2.1.4.1 over leaf hashes; 0 < m <= n."""
    n = len(leaves)
    if not 0 < m <= n:
        raise ValueError(f"a consistency proof needs 0 < m <= n (m={m}, n={n})")
    return _subproof(m, leaves, True)


def _subproof(m: int, leaves: Sequence[bytes], complete: bool) -> list[bytes]:
    n = len(leaves)
    if m == n:
        return [] if complete else [root_of(leaves)]
    k = _split(n)
    if m <= k:
        return _subproof(m, leaves[:k], complete) + [root_of(leaves[k:])]
    return _subproof(m - k, leaves[k:], False) + [root_of(leaves[:k])]


def verify_consistency(m: int, n: int, first_root: bytes, second_root: bytes, proof: Sequence[bytes]) -> bool:
    """RFC 9162 section 2.1.4.2: does a tree of ``n`` leaves with ``second_root`` extend the tree
    of ``m`` leaves with ``first_root``? (0 < m <= n; m == n needs an empty proof and equal roots.)"""
    if not 0 < m <= n:
        return False
    if m == n:
        return not proof and first_root == second_root
    path = list(proof)
    if m & (m - 1) == 0:  # m is a power of two: first_root is itself a node of the proof
        path.insert(0, first_root)
    if not path:
        return False
    fn, sn = m - 1, n - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn != 0 and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == first_root and sr == second_root


class MerkleTree:
    """A whole tree over leaf hashes, kept as packed levels of its perfect subtrees (about 64
    bytes a leaf), to answer many inclusion proofs."""

    def __init__(self, leaves: Iterable[bytes]) -> None:
        level = bytearray()
        for leaf in leaves:
            if len(leaf) != 32:
                raise ValueError("a leaf hash is 32 bytes")
            level += leaf
        self.size = len(level) // 32
        self._levels = [bytes(level)]
        while len(self._levels[-1]) >= 64:
            below = self._levels[-1]
            self._levels.append(b"".join(
                node_hash(below[i:i + 32], below[i + 32:i + 64]) for i in range(0, len(below) - 63, 64)
            ))
        self._edge: dict[tuple[int, int], bytes] = {}

    def _hash(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) for a range the RFC 9162 recursion visits: a perfect, aligned
        subtree, or one that ends at the tree's right edge."""
        width = end - start
        if width & (width - 1) == 0 and start % width == 0:
            j = width.bit_length() - 1
            i = (start >> j) * 32
            return self._levels[j][i:i + 32]
        got = self._edge.get((start, end))
        if got is None:
            k = _split(width)
            got = self._edge[(start, end)] = node_hash(self._hash(start, start + k), self._hash(start + k, end))
        return got

    def root(self) -> bytes:
        return EMPTY_ROOT if self.size == 0 else self._hash(0, self.size)

    def leaf(self, index: int) -> bytes:
        return self._levels[0][index * 32:index * 32 + 32]

    def inclusion_proof(self, index: int) -> list[bytes]:
        """PATH(index, D[0:size]) of RFC 9162 section 2.1.3.1, leaf first."""
        if not 0 <= index < self.size:
            raise ValueError(f"no leaf {index} in a tree of {self.size}")
        proof: list[bytes] = []
        start, end, m = 0, self.size, index
        while end - start > 1:
            k = _split(end - start)
            if m < k:
                proof.append(self._hash(start + k, end))
                end = start + k
            else:
                proof.append(self._hash(start, start + k))
                start, m = start + k, m - k
        proof.reverse()
        return proof


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> bool:
    """RFC 9162 section 2.1.3.2: is ``leaf`` (a leaf hash) leaf ``index`` of the tree of ``size``
    leaves whose root is ``root``?"""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn != 0 and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root

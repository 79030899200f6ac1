"""RFC 9162 Merkle hashing over the audit chain: known answers, the compact range against the
definition, and consistency proofs for every (m, n) up to 64, with tampered proofs refused."""

from __future__ import annotations

import hashlib

import pytest

from audit.merkle import (
    EMPTY_ROOT,
    CompactRange,
    consistency_proof,
    leaf_hash,
    node_hash,
    root_of,
    verify_consistency,
)

N = 64
LEAVES = [leaf_hash(hashlib.sha256(str(i).encode()).digest()) for i in range(N)]


def brute_root(leaves: list[bytes]) -> bytes:
    """The definition, written out a second way: split at the largest power of two below n."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + brute_root(leaves[:k]) + brute_root(leaves[k:])).digest()


def test_known_answers() -> None:
    # Certificate Transparency's reference vectors (the empty tree, and the 8 leaves of
    # RFC 6962 / trillian's merkle tests: leaf data "", 0x00, 0x10, 0x2021, 0x3031, 0x40414243,
    # 0x5051525354555657, 0x606162636465666768696a6b6c6d6e6f)
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    data = [bytes.fromhex(h) for h in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657",
                                       "606162636465666768696a6b6c6d6e6f")]
    leaves = [leaf_hash(d) for d in data]
    expected = {
        1: "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        2: "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        3: "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        4: "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        5: "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        6: "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        7: "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        8: "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    }
    for n, root in expected.items():
        assert root_of(leaves[:n]).hex() == root
        cr = CompactRange()
        cr.extend(leaves[:n])
        assert cr.root().hex() == root


def test_compact_range_matches_the_definition_at_every_size() -> None:
    cr = CompactRange()
    assert cr.root() == brute_root([])
    for n in range(1, N + 1):
        cr.append(LEAVES[n - 1])
        assert cr.root() == brute_root(LEAVES[:n]) == root_of(LEAVES[:n]), n
        again = CompactRange(cr.size, cr.nodes)  # round trip through its stored form
        assert again.root() == cr.root()
    with pytest.raises(ValueError):
        CompactRange(3, [LEAVES[0]])


def test_consistency_proofs_for_every_pair_up_to_64() -> None:
    roots = [brute_root(LEAVES[:n]) for n in range(N + 1)]
    for n in range(1, N + 1):
        for m in range(1, n + 1):
            proof = consistency_proof(LEAVES[:n], m)
            assert verify_consistency(m, n, roots[m], roots[n], proof), (m, n)
            if m == n:
                assert proof == []
                continue
            # negatives: another old root, another new root, a flipped or missing proof node
            assert not verify_consistency(m, n, roots[m - 1] if m > 1 else roots[n], roots[n], proof), (m, n)
            assert not verify_consistency(m, n, roots[m], node_hash(roots[n], roots[m]), proof), (m, n)
            for i in range(len(proof)):
                bad = list(proof)
                bad[i] = bytes([bad[i][0] ^ 1]) + bad[i][1:]
                assert not verify_consistency(m, n, roots[m], roots[n], bad), (m, n, i)
            assert not verify_consistency(m, n, roots[m], roots[n], proof[:-1]), (m, n)
            assert not verify_consistency(m, n, roots[m], roots[n], proof + [roots[0]]), (m, n)


def test_a_rewritten_prefix_is_inconsistent() -> None:
    rewritten = list(LEAVES)
    rewritten[5] = leaf_hash(b"edited")
    old = brute_root(LEAVES[:10])
    proof = consistency_proof(rewritten[:40], 10)
    assert not verify_consistency(10, 40, old, brute_root(rewritten[:40]), proof)
    assert not verify_consistency(0, 4, old, old, [])
    with pytest.raises(ValueError):
        consistency_proof(LEAVES[:4], 5)


def brute_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]) of RFC 9162 section 2.1.3.1, written out as the definition."""
    n = len(leaves)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return brute_path(m, leaves[:k]) + [brute_root(leaves[k:])]
    return brute_path(m - k, leaves[k:]) + [brute_root(leaves[:k])]


def test_inclusion_proofs_for_every_leaf_of_every_size() -> None:
    from audit.merkle import MerkleTree, verify_inclusion

    for n in range(1, N + 1):
        tree, root = MerkleTree(LEAVES[:n]), brute_root(LEAVES[:n])
        assert tree.root() == root
        for m in range(n):
            proof = tree.inclusion_proof(m)
            assert proof == brute_path(m, LEAVES[:n]), (m, n)
            assert verify_inclusion(m, n, LEAVES[m], proof, root)
            assert not verify_inclusion(m, n, LEAVES[(m + 1) % n], proof, root) or n == 1
            if proof:
                assert not verify_inclusion(m, n, LEAVES[m], proof[:-1], root)  # a hash short
                assert not verify_inclusion(m, n, LEAVES[m], [*proof[:-1], bytes(32)], root)  # one replaced
    assert not verify_inclusion(5, 5, LEAVES[0], [], LEAVES[0])  # no such leaf
    with pytest.raises(ValueError):
        MerkleTree(LEAVES[:3]).inclusion_proof(3)

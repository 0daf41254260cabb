"""Cross-rank matching: collective instances by (group, sequence number), P2P messages by
(source, destination, iteration, direction, microbatch, order among equal keys)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron.scan.keys import unique_rows
from megatron.scan.load import GlobalTrace
from megatron.scan.trace_format import FLAG_ASYNC, FLAG_BACKWARD


@dataclass(kw_only=True)
class Collectives:
    """One entry per collective instance; `row_instance[i]` is the instance of event row i (-1: none)."""

    row_instance: np.ndarray
    group: np.ndarray  # per instance: global group id
    seq: np.ndarray
    members: np.ndarray  # participants found
    expected: np.ndarray  # size of the group
    op_mismatch: np.ndarray  # bool: members disagree on the operation (desynchronized ranks)
    synchronous: np.ndarray  # bool: no member issued it async

    @property
    def complete(self) -> np.ndarray:
        return self.members == self.expected

    def __len__(self) -> int:
        return len(self.group)


@dataclass(kw_only=True)
class P2PLinks:
    send_rows: np.ndarray
    recv_rows: np.ndarray
    unmatched_sends: np.ndarray
    unmatched_recvs: np.ndarray

    def __len__(self) -> int:
        return len(self.send_rows)


def match_collectives(trace: GlobalTrace) -> Collectives:
    c = trace.columns
    rows = np.flatnonzero((c["group"] >= 0) & (c["seq"] >= 0))
    row_instance = np.full(len(trace), -1, dtype=np.int64)
    if len(rows) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Collectives(row_instance=row_instance, group=empty, seq=empty, members=empty, expected=empty,
                           op_mismatch=empty.astype(bool), synchronous=empty.astype(bool))
    # Instances numbered in (group, seq) order
    unique_keys, inverse = unique_rows(np.stack([c["group"][rows], c["seq"][rows]], axis=1))
    row_instance[rows] = inverse
    group, seq = unique_keys[:, 0], unique_keys[:, 1]
    members = np.bincount(inverse, minlength=len(unique_keys))
    sizes = np.array([len(g["ranks"]) for g in trace.groups], dtype=np.int64)
    expected = sizes[group]
    # Members that disagree on the operation: some member's name is not the one a member left written.
    names = c["name"][rows]
    one = np.empty(len(unique_keys), dtype=names.dtype)
    one[inverse] = names
    op_mismatch = np.bincount(inverse, weights=names != one[inverse], minlength=len(unique_keys)) > 0
    async_count = np.bincount(inverse, weights=(c["flags"][rows] & FLAG_ASYNC) > 0, minlength=len(unique_keys))
    return Collectives(row_instance=row_instance, group=group, seq=seq, members=members, expected=expected,
                       op_mismatch=op_mismatch, synchronous=async_count == 0)


def _keyed_rows(trace: GlobalTrace, name: str, sender_side: bool) -> tuple[np.ndarray, np.ndarray]:
    c = trace.columns
    rows = np.flatnonzero(c["name"] == trace.name_id(name)) if trace.name_id(name) >= 0 else np.zeros(0, np.int64)
    rank, peer = c["rank"][rows].astype(np.int64), c["peer"][rows].astype(np.int64)
    src, dst = (rank, peer) if sender_side else (peer, rank)
    direction = (c["flags"][rows] & FLAG_BACKWARD).astype(np.int64)
    keys = np.stack([src, dst, c["iteration"][rows].astype(np.int64), direction,
                     c["microbatch"][rows].astype(np.int64), c["start"][rows]], axis=1)
    # Order within equal (src, dst, iteration, direction, microbatch) by time: with virtual stages two
    # messages can share that key, and the earlier send always feeds the earlier receive.
    order = np.lexsort(keys.T[::-1])
    keys, rows = keys[order], rows[order]
    same = np.all(keys[1:, :5] == keys[:-1, :5], axis=1) if len(rows) > 1 else np.zeros(0, bool)
    starts = np.flatnonzero(np.concatenate([[True], ~same])) if len(rows) else np.zeros(0, np.int64)
    group_start = np.repeat(starts, np.diff(np.append(starts, len(rows))))
    occurrence = np.arange(len(rows)) - group_start
    return np.column_stack([keys[:, :5], occurrence]) if len(rows) else np.zeros((0, 6), np.int64), rows


def match_p2p(trace: GlobalTrace) -> P2PLinks:
    send_keys, send_rows = _keyed_rows(trace, "send", sender_side=True)
    recv_keys, recv_rows = _keyed_rows(trace, "recv", sender_side=False)
    if len(send_rows) == 0 or len(recv_rows) == 0:
        return P2PLinks(send_rows=np.zeros(0, np.int64), recv_rows=np.zeros(0, np.int64),
                        unmatched_sends=send_rows, unmatched_recvs=recv_rows)
    inverse = _row_ids(np.concatenate([send_keys, recv_keys]))
    send_id, recv_id = inverse[:len(send_rows)], inverse[len(send_rows):]
    slot = np.full(inverse.max() + 1, -1, dtype=np.int64)
    slot[send_id] = np.arange(len(send_rows))
    partner = slot[recv_id]
    matched = partner >= 0
    linked_sends = np.zeros(len(send_rows), dtype=bool)
    linked_sends[partner[matched]] = True
    return P2PLinks(send_rows=send_rows[partner[matched]], recv_rows=recv_rows[matched],
                    unmatched_sends=send_rows[~linked_sends], unmatched_recvs=recv_rows[~matched])


def _row_ids(keys: np.ndarray) -> np.ndarray:
    """Per row of `keys` [rows, columns], an id equal for equal rows (ranks of the distinct rows in
    lexicographic order, as np.unique(axis=0) numbers them): a lexsort of integer columns, where
    np.unique sorts the rows as opaque records, several times slower at millions of messages."""
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    new = np.concatenate([[True], (ordered[1:] != ordered[:-1]).any(axis=1)])
    ids = np.empty(len(keys), dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids

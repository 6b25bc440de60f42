"""A read's records as blocks: the steps of one request and optimizer with
the same tags, as arrays (`kerasdbg.records.CaptureBlock`).

Backend-neutral: each capture decodes a read into arrays of steps, and this
cuts them into blocks and the few steps that need a record of their own (a
histogram, no values).
"""

from __future__ import annotations

from typing import Callable, List

import numpy as np


def items_of(codes: np.ndarray, kept: np.ndarray, blockable: np.ndarray,
             block: Callable[[np.ndarray, int], object],
             record: Callable[[int], object]) -> list:
    """The items (blocks and records, in row order) of the rows of a read.

    Args:
        codes: per row, what it records (`Request.column_sets`): rows of a
            block share it.
        kept: the rows handed at all.
        blockable: the rows that may go in a block (the others get a record
            each).
        block: `block(rows, code)`: the block of these rows (an index array).
        record: `record(row)`: the record of one row.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.capture.blocks import items_of
        >>> items_of(np.array([1, 1, 2, 2, 2]), np.array([1, 0, 1, 1, 1], bool),
        ...          np.array([1, 1, 1, 0, 1], bool),
        ...          lambda rows, code: ("block", rows.tolist(), code),
        ...          lambda row: ("record", row))
        [('block', [0], 1), ('block', [2], 2), ('record', 3), ('block', [4], 2)]
    """
    rows = np.flatnonzero(kept)
    if not rows.size:
        return []
    key = np.where(blockable[rows], np.asarray(codes, np.int64)[rows],
                   -1 - np.arange(rows.size))  # a row of its own: a key of its own
    cuts = np.flatnonzero(key[1:] != key[:-1]) + 1
    out: List[object] = []
    for start, end in zip(np.concatenate([[0], cuts]).tolist(),
                          np.concatenate([cuts, [rows.size]]).tolist()):
        chosen = rows[start:end]
        if key[start] < 0:
            out.append(record(int(chosen[0])))
        else:
            out.append(block(chosen, int(codes[chosen[0]])))
    return out

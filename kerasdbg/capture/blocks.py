"""A read's records as blocks: the steps of one request and optimizer with
the same tags, as arrays (`kerasdbg.records.CaptureBlock`).

Backend-neutral: each capture decodes a read into arrays of steps, and this
cuts them into blocks and the few steps that need a record of their own (a
histogram, no values).
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

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


def parts(blocks: Sequence) -> List[Tuple[tuple, List[int], bool]]:
    """Consecutive blocks of a read, written in as few parts as their tags
    allow: `(tags, the blocks' positions, whether the part holds each of its
    blocks' steps once)`, in the order to write them.

    A read of a schedule alternates the layout of the every-step variant
    and the scheduled steps' full one: the same columns, the statistics the
    every-step variant does not take untagged (None) there. Their columns
    that every block names make one part over all their steps, and the
    columns only some blocks name one part per set of tags, over those
    blocks' steps. Each tag is then written in step order (a reader takes a
    step written again after a later one for a rollback). Blocks of other
    optimizers or widths, whose tags name a column differently or share a
    column between two sets, or with no column every block names, stay a
    part each.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.records import CaptureBlock
        >>> from kerasdbg.capture.blocks import parts
        >>> every = ("a/norm", None)
        >>> full = ("a/norm", "a/mean")
        >>> blocks = [CaptureBlock(np.arange(3), np.zeros((3, 2)), every),
        ...           CaptureBlock([3], np.zeros((1, 2)), full),
        ...           CaptureBlock([4, 5], np.zeros((2, 2)), every)]
        >>> parts(blocks)
        [(('a/norm', None), [0, 1, 2], True), ((None, 'a/mean'), [1], False)]
    """
    alone = [(block.tags, [i], True) for i, block in enumerate(blocks)]
    if len(blocks) < 2:
        return alone
    first = blocks[0]
    width = len(first.tags)
    if any(b.optimizer != first.optimizer or len(b.tags) != width for b in blocks):
        return alone
    distinct = list(dict.fromkeys(block.tags for block in blocks))
    if len(distinct) == 1:
        return [(first.tags, list(range(len(blocks))), True)]
    named: list = []
    common: list = []
    for column in zip(*distinct):
        names = set(column) - {None}
        if len(names) > 1:
            return alone
        named.append(next(iter(names), None))
        common.append(None not in column)
    extras = {tags: tuple(t if t is not None and not c else None for t, c in zip(tags, common))
              for tags in distinct}
    seen = np.zeros(width, bool)
    for extra in extras.values():
        mask = np.asarray([t is not None for t in extra], bool)
        if (seen & mask).any():
            return alone
        seen |= mask
    shared = tuple(n if c else None for n, c in zip(named, common))
    if all(t is None for t in shared):
        return alone  # no part would hold each step once, in step order
    out: List[Tuple[tuple, List[int], bool]] = [(shared, list(range(len(blocks))), True)]
    for tags in distinct:
        extra = extras[tags]
        if any(t is not None for t in extra):
            out.append((extra, [i for i, b in enumerate(blocks) if b.tags == tags], False))
    return out
